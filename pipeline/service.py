"""The set of served models and their lifecycle, independent of HTTP.

``start`` loads every model in configuration order and fails the start, having
closed what it loaded, if any model cannot be served. ``stop`` stops admitting,
drains what is in flight (bounded by ``drain_timeout_s``), fails what is left
and shuts the executors down: every admitted request gets exactly one answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Literal

from pipeline.clock import Clock, LoopClock, Timer
from pipeline.errors import NotFound
from pipeline.metrics import Metrics
from pipeline.model import RunnerFactory, ServedModel
from pipeline.runtime import OnnxRunner
from pipeline.settings import ServerSettings

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
        self.models: dict[str, ServedModel] = {}
        self.metrics = Metrics(lambda: [(n, m.batcher) for n, m in self.models.items()])
        self._runner_factory = runner_factory

    async def start(self) -> None:
        self.clock = self._given_clock or LoopClock(asyncio.get_running_loop())
        log.info(
            "loopserve: loading %d model(s) from %s",
            len(self.settings.models),
            self.settings.source,
        )
        try:
            for model_settings in self.settings.models:
                model = await ServedModel.load(
                    model_settings,
                    self.clock,
                    self.metrics.for_model(model_settings.name),
                    self._runner_factory,
                )
                self.models[model.name] = model
        except BaseException:
            await self.stop()
            raise
        self.state = "ready"
        log.info("loopserve: ready, serving %s", ", ".join(self.models))

    async def stop(self) -> None:
        self.state = "stopping"
        await asyncio.gather(
            *(m.close(self.settings.drain_timeout_s) for m in self.models.values())
        )
        self.state = "stopped"

    def get(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise NotFound(f"no model named {name!r}; GET /models lists the served models")
        return model

    @property
    def ready(self) -> bool:
        return self.state == "ready"


class _Unstarted:
    """The clock before the lifespan starts: there is no loop to read yet."""

    def now(self) -> float:
        raise RuntimeError("loopserve is not started: run the app's lifespan first")

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        raise RuntimeError("loopserve is not started: run the app's lifespan first")
