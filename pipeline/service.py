"""The set of served models and versions and their lifecycle, independent of HTTP.

``start`` loads the configured models and the repository's selected versions, and
fails the start, having closed what it loaded, if any cannot be served. ``load``
and ``unload`` change what is served at run time without dropping a request: new
versions load off the loop and become visible at once, in one assignment; versions
leaving stop being routed to first, then drain what they admitted, then close.
``stop`` drains everything (bounded by ``drain_timeout_s``) and fails what is left:
every admitted request gets exactly one answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pipeline import repository
from pipeline.clock import Clock, LoopClock, Timer
from pipeline.errors import BadRequest, NotFound, SettingsError
from pipeline.metrics import Metrics
from pipeline.model import RunnerFactory, ServedModel
from pipeline.runtime import OnnxRunner
from pipeline.settings import ModelSettings, ServerSettings

log = logging.getLogger(__name__)

State = Literal["starting", "ready", "stopping", "stopped"]


class Service:
    def __init__(
        self,
        settings: ServerSettings,
        clock: Clock | None = None,
        runner_factory: RunnerFactory = OnnxRunner,
    ) -> None:
        self.settings = settings
        self._given_clock = clock
        self.clock: Clock = _Unstarted()
        self.state: State = "starting"
        self.served: dict[str, dict[int, ServedModel]] = {}  # name -> version -> model
        self.metrics = Metrics(self._queues)
        self._runner_factory = runner_factory
        self._locks: dict[str, asyncio.Lock] = {}
        self._closing: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.clock = self._given_clock or LoopClock(asyncio.get_running_loop())
        log.info("loopserve: loading models from %s", self.settings.source)
        try:
            for model_settings in self.settings.models:
                self.served[model_settings.name] = {
                    model_settings.version: await self._open(model_settings)
                }
            if self.settings.repository is not None:
                entries = await asyncio.to_thread(repository.scan, self.settings.repository)
                for entry in entries:
                    if entry.name in self.served:
                        raise SettingsError(
                            f"models.{entry.name}: also in the repository "
                            f"{self.settings.repository}; serve it from one place"
                        )
                    self.served[entry.name] = {
                        v: await self._open(entry.settings(v)) for v in entry.selected
                    }
        except BaseException:
            await self.stop()
            raise
        self.state = "ready"
        log.info("loopserve: ready, serving %s", ", ".join(self.describe_names()))

    async def stop(self) -> None:
        self.state = "stopping"
        everything = [m for versions in self.served.values() for m in versions.values()]
        await asyncio.gather(
            *(m.close(self.settings.drain_timeout_s) for m in everything),
            *self._closing,
        )
        self.state = "stopped"

    # -- routing -----------------------------------------------------------------------

    def get(self, name: str, version: str | int | None = None) -> ServedModel:
        """The named model at ``version``, or its highest loaded version."""
        versions = self.served.get(name)
        if not versions:
            raise NotFound(f"no model named {name!r} is loaded; GET /models lists them")
        if version is None:
            return versions[max(versions)]
        number = repository.parse_version(str(version))
        model = versions.get(number)
        if model is None:
            raise NotFound(
                f"model {name!r} has no loaded version {number}; loaded: {sorted(versions)}"
            )
        return model

    def all_models(self) -> list[ServedModel]:
        return [m for name in sorted(self.served) for _, m in sorted(self.served[name].items())]

    def describe_names(self) -> list[str]:
        return [f"{m.name}@{m.settings.version}" for m in self.all_models()]

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    # -- the repository at run time --------------------------------------------------

    @property
    def repository(self) -> Path:
        if self.settings.repository is None:
            raise BadRequest("this server has no model repository ([server] repository)")
        return self.settings.repository

    async def load(self, name: str) -> list[int]:
        """(Re)load ``name`` from the repository: serve the versions its policy selects now."""
        folder = self.repository
        async with self._lock(name):
            entry = await asyncio.to_thread(repository.read_model, folder, name)
            if not entry.selected:
                raise BadRequest(f"model {name!r} has no version folder with a model.onnx")
            current = self.served.get(name, {})
            fresh: dict[int, ServedModel] = {}
            try:
                for version in entry.selected:
                    settings = entry.settings(version)
                    kept = current.get(version)
                    if kept is not None and kept.settings == settings:
                        fresh[version] = kept
                    else:
                        fresh[version] = await self._open(settings)
            except BaseException:
                for model in fresh.values():
                    if model not in current.values():
                        await model.close(0)
                raise
            self.served[name] = fresh  # one assignment: new requests see the new set
            self._retire([m for v, m in current.items() if fresh.get(v) is not m])
            log.info("loopserve: loaded %s versions %s", name, sorted(fresh))
            return sorted(fresh)

    async def index(self) -> list[dict[str, str]]:
        """Every model and version of the repository, and whether it is being served."""
        entries = await asyncio.to_thread(repository.scan, self.repository)
        rows: list[dict[str, str]] = []
        for entry in entries:
            loaded = self.served.get(entry.name, {})
            for version in entry.versions:
                state = "READY" if version in loaded else "UNAVAILABLE"
                row = {"name": entry.name, "version": str(version), "state": state}
                if state == "UNAVAILABLE":
                    row["reason"] = (
                        "not selected by the version policy"
                        if entry.name in self.served
                        else "unloaded"
                    )
                rows.append(row)
        return rows

    async def unload(self, name: str) -> None:
        """Stop routing to ``name``, then drain what it admitted, then free it."""
        async with self._lock(name):
            versions = self.served.pop(name, None)
            if versions is None:
                raise NotFound(f"no model named {name!r} is loaded")
            leaving = list(versions.values())
        await asyncio.gather(*(m.close(self.settings.drain_timeout_s) for m in leaving))
        log.info("loopserve: unloaded %s", name)

    # -- internals -----------------------------------------------------------------------

    async def _open(self, settings: ModelSettings) -> ServedModel:
        return await ServedModel.load(
            settings, self.clock, self.metrics.for_model(settings.name), self._runner_factory
        )

    def _retire(self, models: list[ServedModel]) -> None:
        """Drain and close models no longer routed to, without holding up the caller."""
        for model in models:
            task = asyncio.get_running_loop().create_task(
                model.close(self.settings.drain_timeout_s), name=f"loopserve-retire-{model.name}"
            )
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _queues(self) -> list[tuple[str, list[ServedModel]]]:
        return [(n, list(versions.values())) for n, versions in self.served.items()]


class _Unstarted:
    """The clock before the lifespan starts: there is no loop to read yet."""

    def now(self) -> float:
        raise RuntimeError("loopserve is not started: run the app's lifespan first")

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        raise RuntimeError("loopserve is not started: run the app's lifespan first")
