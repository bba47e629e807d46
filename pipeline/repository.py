"""The model repository, Triton's layout: ``<repo>/<model>/config.toml`` and
``<repo>/<model>/<version>/model.onnx``, with Triton's version policies.

Names and versions from requests are checked here before they touch the filesystem, and
nothing that resolves outside ``repo.resolve()`` is read. Each config goes through the
settings module's typed checks; its errors name the file and the field.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import BadRequest, NotFound, SettingsError
from pipeline.settings import ModelSettings, _model

MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.toml"
MAX_NAME_CHARS = 128  # well under any filesystem's name limit, so a name never fails a stat

POLICY_KEY = "version_policy"
POLICY_FORMS = "{ latest = N }, { specific = [1, 3] }, { all = true }"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
# Canonical only ("01" is not 1): one folder per version. 18 digits fit Triton's int64
# versions and stay far below int()'s digit limit.
_VERSION = re.compile(r"[1-9][0-9]{0,17}")
_LAYOUT_KEYS = frozenset({"name", "path", "version"})  # the folders say these, not config.toml
_CONFIG_KEYS = frozenset(f.name for f in dataclasses.fields(ModelSettings)) - _LAYOUT_KEYS

logger = logging.getLogger(__name__)


def valid_model_name(name: str) -> bool:
    return len(name) <= MAX_NAME_CHARS and _NAME.fullmatch(name) is not None


def model_dir(repo: Path, name: str) -> Path:
    """The folder of ``name`` in ``repo``; never a path outside the repository."""
    if not valid_model_name(name):
        raise BadRequest(
            f"model name {name!r} is not valid: letters, digits, '-' and '_', "
            f"starting with a letter or digit, at most {MAX_NAME_CHARS} characters"
        )
    folder = repo / name
    if not folder.is_dir():
        raise NotFound(f"model {name!r} is not in the repository")
    if not _inside(folder, repo):
        # The client learns only that the model is absent; the operator learns why.
        logger.warning("%s resolves outside the repository %s; refused", folder, repo)
        raise NotFound(f"model {name!r} is not in the repository")
    return folder


def parse_version(text: str) -> int:
    if _VERSION.fullmatch(text) is None:
        raise BadRequest(f"a model version is a positive integer such as 3, got {text!r}")
    return int(text)


@dataclass(frozen=True)
class RepositoryModel:
    name: str
    versions: tuple[int, ...]  # version folders that hold model.onnx, ascending
    selected: tuple[int, ...]  # what the version policy serves, ascending
    folder: Path
    config: ModelSettings  # config.toml, validated; settings() sets each version's path

    def settings(self, version: int) -> ModelSettings:
        if version not in self.versions:
            raise NotFound(f"model {self.name!r} has no version {version}")
        path = self.folder / str(version) / MODEL_FILE
        return dataclasses.replace(self.config, path=path, version=version)


def scan(repo: Path) -> list[RepositoryModel]:
    """Every model in ``repo``, sorted by name; a bad config stops the scan."""
    _check_repo(repo)
    models = []
    for entry in sorted(repo.iterdir(), key=lambda p: p.name):
        if not entry.is_dir():
            continue
        if not valid_model_name(entry.name):
            logger.warning("%s: not a valid model name; skipped", entry)
            continue
        try:
            folder = model_dir(repo, entry.name)
        except NotFound:
            continue  # model_dir logged why
        if not (folder / CONFIG_FILE).is_file():
            logger.warning("%s: no %s; skipped", folder, CONFIG_FILE)
            continue
        models.append(_read(repo, entry.name, folder))
    return models


def read_model(repo: Path, name: str) -> RepositoryModel:
    """One model, read from disk now, so a load request sees the files as they are."""
    _check_repo(repo)
    folder = model_dir(repo, name)
    if not (folder / CONFIG_FILE).is_file():
        raise NotFound(f"model {name!r} is not in the repository: its folder has no {CONFIG_FILE}")
    return _read(repo, name, folder)


def _check_repo(repo: Path) -> None:
    if not repo.is_dir():
        raise SettingsError(f"{repo}: the model repository folder does not exist")


def _inside(path: Path, repo: Path) -> bool:
    return path.resolve().is_relative_to(repo.resolve())


def _read(repo: Path, name: str, folder: Path) -> RepositoryModel:
    source = folder / CONFIG_FILE
    where = str(source)
    _refuse_outside(source, repo)
    try:
        table = tomllib.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{where}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{where}: not valid TOML: {exc}") from None
    for key in table:
        if key in _LAYOUT_KEYS:
            raise SettingsError(
                f"{where}: {key}: set by the repository layout "
                f"(<repo>/<model>/<version>/{MODEL_FILE}), not by {CONFIG_FILE}"
            )
        if key not in _CONFIG_KEYS and key != POLICY_KEY:
            expected = ", ".join(sorted(_CONFIG_KEYS | {POLICY_KEY}))
            raise SettingsError(f"{where}: {key}: unknown setting; expected one of {expected}")
    policy = table.pop(POLICY_KEY, {"latest": 1})
    config = _config(where, name, folder, table)
    versions = _versions(repo, folder)
    selected = _select(where, policy, versions)
    return RepositoryModel(name, versions, selected, folder, config)


def _config(where: str, name: str, folder: Path, table: dict[str, Any]) -> ModelSettings:
    # _model wants a path; this placeholder is replaced per version by settings(). Relative
    # paths (labels) resolve against the model folder.
    try:
        return _model(name, {**table, "path": MODEL_FILE}, folder)
    except SettingsError as exc:
        # _model says "models.<name>.<field>: ..."; here the file is the context.
        message = str(exc).removeprefix(f"models.{name}.").removeprefix(f"models.{name}: ")
        raise SettingsError(f"{where}: {message}") from None


def _versions(repo: Path, folder: Path) -> tuple[int, ...]:
    found = []
    for entry in folder.iterdir():
        if _VERSION.fullmatch(entry.name) is None or not entry.is_dir():
            continue  # not a version folder, as in Triton
        model_file = entry / MODEL_FILE
        if not model_file.is_file():
            logger.warning("%s: no %s; version ignored", entry, MODEL_FILE)
            continue
        _refuse_outside(model_file, repo)
        found.append(int(entry.name))
    return tuple(sorted(found))


def _refuse_outside(path: Path, repo: Path) -> None:
    if not _inside(path, repo):
        raise SettingsError(
            f"{path}: resolves outside the repository {repo}; keep models inside the repository"
        )


def _select(where: str, policy: Any, versions: tuple[int, ...]) -> tuple[int, ...]:
    if not isinstance(policy, dict) or len(policy) != 1:
        raise SettingsError(f"{where}: {POLICY_KEY}: must be one of {POLICY_FORMS}, got {policy!r}")
    ((kind, value),) = policy.items()
    field = f"{where}: {POLICY_KEY}.{kind}"
    if kind == "latest":
        if not _positive_int(value):
            raise SettingsError(f"{field}: must be an integer >= 1, got {value!r}")
        return versions[-value:]
    if kind == "specific":
        if not isinstance(value, list) or not value or not all(_positive_int(v) for v in value):
            raise SettingsError(
                f"{field}: must be a non-empty list of integers >= 1, got {value!r}"
            )
        missing = sorted(set(value) - set(versions))
        if missing:
            raise SettingsError(
                f"{field}: no <version>/{MODEL_FILE} for version(s) {missing}; "
                f"present: {list(versions)}"
            )
        return tuple(sorted(set(value)))
    if kind == "all":
        if value is not True:
            raise SettingsError(f"{field}: must be true, got {value!r}")
        return versions
    raise SettingsError(f"{where}: {POLICY_KEY}: must be one of {POLICY_FORMS}, got {policy!r}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
