"""One served model: its servable, its instances, its batcher, and the request flow.

``predict`` is DESIGN.md steps 1-8 for one request, transport-agnostic: parse
(4xx before anything is queued), admit (503 over the backlog limit), preprocess
off the loop, queue, await the answer (504 at the deadline, skipped if the
caller leaves), postprocess. Loading is blocking work and runs in a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from pipeline.batcher import Arrival, Batcher, Ticket
from pipeline.clock import Clock
from pipeline.errors import BadRequest, ClientGone, LoopserveError, UnsupportedMediaType
from pipeline.metrics import ModelMetrics
from pipeline.runtime import Arrays, Instance, OnnxRunner, Runner
from pipeline.servable import Servable, create_servable
from pipeline.settings import ModelSettings

log = logging.getLogger(__name__)

RunnerFactory = Callable[[ModelSettings, int], Runner]


class Watch(Protocol):
    """Set by the transport: ``on_gone`` is called if the request's client leaves."""

    on_gone: Callable[[], object] | None


def _fail_all(tickets: list[Ticket]) -> None:
    gone = ClientGone("the client disconnected")
    for ticket in tickets:
        ticket.fail(gone)


class ServedModel:
    def __init__(
        self,
        settings: ModelSettings,
        runners: Sequence[Runner],
        servable: Servable[Any],
        clock: Clock,
        metrics: ModelMetrics,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self.servable = servable
        self.signature = runners[0].signature
        self.providers = tuple(runners[0].providers)
        self.metrics = metrics
        self._clock = clock
        self.batcher = Batcher(
            settings.name,
            [Instance(r, f"loopserve-{settings.name}-{i}") for i, r in enumerate(runners)],
            max_batch_size=settings.max_batch_size,
            max_delay_ms=settings.max_delay_ms,
            max_queue=settings.max_queue,
            clock=clock,
            observer=metrics,
        )

    @classmethod
    async def load(
        cls,
        settings: ModelSettings,
        clock: Clock,
        metrics: ModelMetrics,
        runner_factory: RunnerFactory = OnnxRunner,
    ) -> ServedModel:
        """Create the instances (in a thread: sessions take a while) and start batching."""
        runners, servable = await asyncio.to_thread(cls._open, settings, runner_factory)
        model = cls(settings, runners, servable, clock, metrics)
        model.batcher.start()
        return model

    @staticmethod
    def _open(
        settings: ModelSettings, runner_factory: RunnerFactory
    ) -> tuple[list[Runner], Servable[Any]]:
        runners = [runner_factory(settings, i) for i in range(settings.instances)]
        signature = runners[0].signature
        if settings.max_batch_size > 1 and not signature.batchable:
            raise ValueError(
                f"models.{settings.name}.max_batch_size: the model's first dimension is fixed, "
                "so it cannot batch; set max_batch_size = 1 or export it with a dynamic batch"
            )
        return runners, create_servable(settings, signature)

    def arrival(self) -> Arrival:
        """Call when a request for this model starts; the batcher will wait for it."""
        return self.batcher.arrival()

    def deadline(self, timeout_s: float | None) -> float:
        """The request's deadline: the configured timeout, or less if the client asks."""
        limit = self.settings.timeout_s
        if timeout_s is not None:
            if not timeout_s > 0:
                raise BadRequest(f"timeout_s must be a positive number of seconds, got {timeout_s}")
            limit = min(limit, timeout_s)
        return self._clock.now() + limit

    async def predict(
        self,
        body: bytes,
        content_type: str,
        deadline: float,
        arrival: Arrival,
        watch: Watch | None = None,
        priority: int = 0,
    ) -> object:
        """Answer one request; ``watch`` calls back if the caller disconnects."""
        started = self._clock.now()
        try:
            try:
                self._check_content_type(content_type)
                parsed = self.servable.parse(body, content_type)
                ticket = self.batcher.admit(deadline, priority)
                if watch is not None:
                    watch.on_gone = lambda: ticket.fail(ClientGone("the client disconnected"))
                try:
                    if self.servable.offload:
                        inputs = await asyncio.to_thread(self.servable.preprocess, parsed)
                    else:
                        inputs = self.servable.preprocess(parsed)
                    self.batcher.enqueue(ticket, inputs)
                except BaseException:
                    ticket.future.cancel()  # never queued: release the admission
                    raise
            finally:
                arrival.done()
            outputs = await ticket.future
            if self.servable.offload:
                result = await asyncio.to_thread(self.servable.postprocess, outputs)
            else:
                result = self.servable.postprocess(outputs)
        except LoopserveError as exc:
            self.metrics.reject(exc.reason)
            raise
        self.metrics.observe_latency(self._clock.now() - started)
        return result

    async def infer(
        self,
        items: list[Arrays],
        deadline: float,
        arrival: Arrival,
        watch: Watch | None = None,
        priority: int = 0,
    ) -> list[Arrays]:
        """Answer a request of ready model inputs, one item each: all batch with others."""
        started = self._clock.now()
        try:
            try:
                tickets = self.batcher.admit_many(len(items), deadline, priority)
                if watch is not None:
                    watch.on_gone = partial(_fail_all, tickets)
                try:
                    for ticket, inputs in zip(tickets, items, strict=True):
                        self.batcher.enqueue(ticket, inputs)
                except BaseException:
                    for ticket in tickets:
                        if ticket.inputs is None:
                            ticket.future.cancel()  # never queued: release the admission
                    raise
            finally:
                arrival.done()
            answers = await asyncio.gather(*(t.future for t in tickets), return_exceptions=True)
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
        except LoopserveError as exc:
            self.metrics.reject(exc.reason)
            raise
        self.metrics.observe_latency(self._clock.now() - started)
        return answers  # type: ignore[return-value]  # no exceptions left in it

    def _check_content_type(self, content_type: str) -> None:
        if content_type not in self.servable.content_types:
            accepted = ", ".join(sorted(t for t in self.servable.content_types if t))
            raise UnsupportedMediaType(
                f"content type {content_type or '(none)'!r} is not accepted by model "
                f"{self.name}; send one of: {accepted}"
            )

    def describe(self) -> dict[str, object]:
        s = self.settings
        return {
            "name": self.name,
            "version": s.version,
            "servable": s.servable,
            "path": str(s.path),
            "providers": list(self.providers),
            "instances": s.instances,
            "max_batch_size": s.max_batch_size,
            "max_delay_ms": s.max_delay_ms,
            "max_queue": s.max_queue,
            "timeout_s": s.timeout_s,
            "intra_op_threads": s.intra_op_threads,
            "intra_op_spinning": s.intra_op_spinning,
            "max_body_bytes": s.max_body_bytes,
            "signature": self.signature.describe(),
            "api": self.servable.describe(),
            "backlog": self.batcher.backlog,
            "in_flight": self.batcher.outstanding,
        }

    async def close(self, drain_timeout_s: float) -> None:
        await self.batcher.close(drain_timeout_s)
