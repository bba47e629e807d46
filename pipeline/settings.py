"""Typed, validated configuration: frozen dataclasses built from one TOML file.

The only place that reads the environment: ``LOOPSERVE_CONFIG`` names the TOML
file; without it the demo set (``demo.toml`` beside this package) is served.
Every error names the field and the value, and stops the start.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeline.errors import SettingsError

ENV_CONFIG = "LOOPSERVE_CONFIG"
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "demo.toml"
KNOWN_PROVIDERS = ("auto", "CUDAExecutionProvider", "CPUExecutionProvider")


@dataclass(frozen=True)
class ModelSettings:
    name: str
    path: Path
    servable: str | None = None  # a folder of models/; None serves the ONNX file's raw tensors
    instances: int = 1
    max_batch_size: int = 32
    max_delay_ms: float = 1.0
    max_queue: int = 512
    timeout_s: float = 30.0
    providers: tuple[str, ...] = ("auto",)
    intra_op_threads: int = 1
    intra_op_spinning: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    labels: Path | None = None  # a classifier's class names, one per line (servable option)
    priority_levels: int = 2  # V2 `priority`: 1 is served first; 0/absent = the last level
    slots: int = 0  # data slots: requests held from preprocessing to reply; 0 = 2 x max_batch_size
    max_slot_bytes: int = 64 * 1024 * 1024  # what one slot may hold, for variable-shape inputs
    preprocess_workers: int = 0  # processes running the servable's preprocess; 0 = a thread
    max_image_pixels: int = 40_000_000  # image servables: bigger is refused (413) from the header
    content_types: tuple[str, ...] = ()  # accepted request types; () = what the servable takes
    version: int = 1  # the model repository's version folder this was loaded from

    def __post_init__(self) -> None:
        where = f"models.{self.name}"
        if not self.name.replace("_", "").replace("-", "").isalnum():
            raise SettingsError(f"{where}: a model name is letters, digits, '-' and '_'")
        _at_least(where, "instances", self.instances, 1)
        _at_least(where, "max_batch_size", self.max_batch_size, 1)
        _at_least(where, "max_queue", self.max_queue, 1)
        _at_least(where, "intra_op_threads", self.intra_op_threads, 0)
        _at_least(where, "max_body_bytes", self.max_body_bytes, 1)
        _at_least(where, "version", self.version, 1)
        _at_least(where, "priority_levels", self.priority_levels, 1)
        _at_least(where, "slots", self.slots, 0)
        _at_least(where, "max_slot_bytes", self.max_slot_bytes, 1)
        _at_least(where, "preprocess_workers", self.preprocess_workers, 0)
        _at_least(where, "max_image_pixels", self.max_image_pixels, 1)
        if self.preprocess_workers and self.servable is None:
            raise SettingsError(
                f"{where}.preprocess_workers: raw tensor models have no preprocessing to "
                "run in workers; set it on a servable"
            )

        if not 0 <= self.max_delay_ms <= 10_000:
            raise SettingsError(
                f"{where}.max_delay_ms: must be in [0, 10000], got {self.max_delay_ms}"
            )
        if not 0 < self.timeout_s <= 3600:
            raise SettingsError(f"{where}.timeout_s: must be in (0, 3600], got {self.timeout_s}")
        if not self.providers:
            raise SettingsError(f"{where}.providers: must name at least one provider")
        for provider in self.providers:
            if provider not in KNOWN_PROVIDERS:
                raise SettingsError(
                    f"{where}.providers: unknown provider {provider!r}, "
                    f"expected one of {', '.join(KNOWN_PROVIDERS)}"
                )

    @property
    def slot_count(self) -> int:
        return self.slots or 2 * self.max_batch_size


@dataclass(frozen=True)
class ServerSettings:
    models: tuple[ModelSettings, ...] = ()
    drain_timeout_s: float = 10.0
    repository: Path | None = None  # a model repository folder (see pipeline.repository)
    source: str = field(default="(in code)", compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.drain_timeout_s <= 600:
            raise SettingsError(
                f"server.drain_timeout_s: must be in [0, 600], got {self.drain_timeout_s}"
            )
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise SettingsError(f"models: duplicate model names in {names}")
        if not self.models and self.repository is None:
            raise SettingsError(
                "models: the configuration serves no model; add a [models.<name>] table "
                "or [server] repository = <folder>"
            )


def _at_least(where: str, name: str, value: int, low: int) -> None:
    if value < low:
        raise SettingsError(f"{where}.{name}: must be >= {low}, got {value}")


def load_settings(path: str | Path | None = None) -> ServerSettings:
    """Read the TOML named by ``path``, else ``$LOOPSERVE_CONFIG``, else the demo set."""
    chosen = Path(path or os.environ.get(ENV_CONFIG) or DEMO_CONFIG)
    try:
        raw = tomllib.loads(chosen.read_text())
    except FileNotFoundError:
        raise SettingsError(f"{ENV_CONFIG}: no such configuration file: {chosen}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{chosen}: not valid TOML: {exc}") from None
    return settings_from_dict(raw, base=chosen.resolve().parent, source=str(chosen))


def settings_from_dict(raw: dict[str, Any], base: Path, source: str = "(dict)") -> ServerSettings:
    """Build settings from parsed TOML; relative model paths are relative to ``base``."""
    _only_keys("", raw, {"server", "models"})
    server = raw.get("server", {})
    _only_keys("server", server, {"drain_timeout_s", "repository"})
    models_raw = raw.get("models", {})
    if not isinstance(models_raw, dict):
        raise SettingsError("models: must be a table of [models.<name>] tables")
    models = tuple(_model(name, table, base) for name, table in models_raw.items())
    drain = _typed("server", "drain_timeout_s", server.get("drain_timeout_s", 10.0), float)
    repository = None
    if "repository" in server:
        folder = Path(_typed("server", "repository", server["repository"], str))
        repository = folder if folder.is_absolute() else base / folder
    return ServerSettings(
        models=models, drain_timeout_s=drain, repository=repository, source=source
    )


def _model(name: str, table: Any, base: Path) -> ModelSettings:
    where = f"models.{name}"
    if not isinstance(table, dict):
        raise SettingsError(f"{where}: must be a table")
    allowed = {f.name for f in fields(ModelSettings)} - {"name"}
    _only_keys(where, table, allowed)
    if "path" not in table:
        raise SettingsError(f"{where}.path: missing; name the model's ONNX file")
    kwargs: dict[str, Any] = {"name": name}
    for f in fields(ModelSettings):
        if f.name == "name" or f.name not in table:
            continue
        value = table[f.name]
        if f.name in ("path", "labels"):
            path = Path(_typed(where, f.name, value, str))
            kwargs[f.name] = path if path.is_absolute() else (base / path)
        elif f.name in ("providers", "content_types"):
            if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
                raise SettingsError(f"{where}.{f.name}: must be a list of strings, got {value!r}")
            kwargs[f.name] = (
                tuple(v.lower() for v in value) if f.name == "content_types" else tuple(value)
            )
        elif f.name == "servable":
            kwargs["servable"] = _typed(where, "servable", value, str)
        else:
            kind = type(getattr(_DEFAULTS, f.name))
            kwargs[f.name] = _typed(where, f.name, value, kind)
    return ModelSettings(**kwargs)


_DEFAULTS = ModelSettings(name="defaults", path=Path("."))


def _typed(where: str, name: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and kind is not bool:
        raise SettingsError(f"{where}.{name}: must be {kind.__name__}, got {value!r}")
    if not isinstance(value, kind):
        raise SettingsError(f"{where}.{name}: must be {kind.__name__}, got {value!r}")
    return value


def _only_keys(where: str, table: Any, allowed: set[str]) -> None:
    if not isinstance(table, dict):
        raise SettingsError(f"{where or 'configuration'}: must be a table")
    for key in table:
        if key not in allowed:
            prefix = f"{where}." if where else ""
            raise SettingsError(
                f"{prefix}{key}: unknown setting; expected one of {', '.join(sorted(allowed))}"
            )
