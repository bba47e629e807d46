"""One served model: its servable, instances, batcher, slots, and the request flow.

``predict`` is DESIGN.md steps 1-8 for one request, transport-agnostic: parse
(4xx before anything is queued), admit (503 over the backlog limit), take a data
slot (waiting counts toward the backlog and the deadline), preprocess into it off
the loop (a thread, or worker processes writing to shared memory), queue, await
the answer (504 at the deadline, skipped if the caller leaves), postprocess,
reply, and only then free the slot. Loading is blocking work and runs in a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pipeline.batcher import Arrival, Batcher, Ticket
from pipeline.clock import Clock
from pipeline.errors import BadRequest, ClientGone, LoopserveError, UnsupportedMediaType
from pipeline.metrics import ModelMetrics
from pipeline.runtime import Arrays, Instance, OnnxRunner, Runner
from pipeline.servable import Servable, create_servable, is_tiled
from pipeline.settings import ModelSettings
from pipeline.slots import Slot, SlotPool

if TYPE_CHECKING:
    from pipeline.workers import PreprocessPool

log = logging.getLogger(__name__)

RunnerFactory = Callable[[ModelSettings, int], Runner]


class Watch(Protocol):
    """Set by the transport: ``on_gone`` is called if the request's client leaves."""

    on_gone: Callable[[], object] | None


class Intake:
    """Around reading and checking a request, before the model takes it over: if that
    fails, the request is no longer on its way, and a refusal is counted."""

    __slots__ = ("_arrival", "_metrics")

    def __init__(self, arrival: Arrival, metrics: ModelMetrics) -> None:
        self._arrival = arrival
        self._metrics = metrics

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if error is not None:
            self._arrival.done()
            if isinstance(error, LoopserveError):
                self._metrics.reject(error.reason)


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
        self.content_types = frozenset(settings.content_types) or servable.content_types
        self.tiled = is_tiled(servable)  # a detector: /predict tiles images of any size
        self._clock = clock
        self.slots = SlotPool(
            settings.name,
            self.signature.inputs,
            settings.slot_count,
            settings.max_slot_bytes,
            shared=settings.preprocess_workers > 0,
        )
        self.workers: PreprocessPool | None = None
        instances = [Instance(r, f"loopserve-{settings.name}-{i}") for i, r in enumerate(runners)]
        if self.slots.fixed:  # one preallocated batch buffer per instance and input
            for instance in instances:
                instance.buffers = {
                    spec.name: np.empty(
                        (settings.max_batch_size, *self.slots.arenas[spec.name].shape[1:]),
                        dtype=spec.dtype,
                    )
                    for spec in self.signature.inputs
                }
        self.batcher = Batcher(
            settings.name,
            instances,
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
        if settings.preprocess_workers:
            if not model.slots.fixed:
                model.slots.close()
                raise ValueError(
                    f"models.{settings.name}.preprocess_workers: workers write into "
                    "preallocated slots, which need the model's input shapes to be fixed"
                )
            from pipeline.workers import PreprocessPool

            model.workers = PreprocessPool(
                settings, model.signature, model.slots.layout, settings.preprocess_workers
            )
            try:
                await model.workers.start()
            except BaseException:
                await model.workers.close()
                model.slots.close()
                raise
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

    def intake(self, arrival: Arrival) -> Intake:
        return Intake(arrival, self.metrics)

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
        respond: Callable[[object], Awaitable[None]] | None = None,
    ) -> object:
        """Answer one request; ``watch`` calls back if the caller disconnects. With
        ``respond``, the reply is written before the request's slot is freed."""
        started = self._clock.now()
        slot: Slot | None = None
        try:
            try:
                self.check_content_type(content_type)
                parsed = self.servable.parse(body, content_type)
                ticket = self.batcher.admit(deadline, priority)
                if watch is not None:
                    watch.on_gone = lambda: ticket.fail(ClientGone("the client disconnected"))
                try:
                    slot = await self._slot_for(ticket)
                    await self._preprocess(parsed, slot)
                    self.batcher.enqueue(ticket, slot.inputs)
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
            if respond is not None:
                await respond(result)
        except LoopserveError as exc:
            self.metrics.reject(exc.reason)
            raise
        finally:
            if slot is not None:
                self.slots.release(slot)
        self.metrics.observe_latency(self._clock.now() - started)
        return result

    async def sub_request(
        self, make_inputs: Callable[[], Arrays], deadline: float, priority: int = 0
    ) -> Arrays:
        """One item that a request makes up itself (a tile of a big image): admitted,
        given a slot, its inputs made in a thread right into the slot, batched with
        everyone else's. Cancelling the caller drops it from the queue."""
        ticket = self.batcher.admit(deadline, priority)
        slot: Slot | None = None
        try:
            try:
                slot = await self._slot_for(ticket)
                self.slots.hold(slot, await asyncio.to_thread(make_inputs))
                self.batcher.enqueue(ticket, slot.inputs)
            except BaseException:
                ticket.future.cancel()  # never queued: release the admission
                raise
            return await ticket.future
        finally:
            if slot is not None:
                self.slots.release(slot)

    async def _slot_for(self, ticket: Ticket) -> Slot:
        """A data slot for ``ticket``; waiting ends with its error if its deadline passes
        or its client leaves first."""
        slot = self.slots.try_acquire()
        if slot is not None:
            return slot
        try:
            return await self.slots.acquire(abandon=ticket.future)
        except asyncio.CancelledError:
            if ticket.future.done() and not ticket.future.cancelled():
                ticket.future.result()  # raises why the request ended (504, 499)
            raise

    async def _preprocess(self, parsed: object, slot: Slot) -> None:
        if self.workers is not None:
            await self.workers.preprocess(parsed, slot.index)  # writes into the slot itself
        elif self.servable.offload:
            self.slots.hold(slot, await asyncio.to_thread(self.servable.preprocess, parsed))
        else:
            self.slots.hold(slot, self.servable.preprocess(parsed))

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
                        # An item's slot is freed once the item is answered, so a request
                        # of more items than slots streams through them.
                        slot = await self._slot_for(ticket)
                        ticket.future.add_done_callback(partial(self._free, slot))
                        self.slots.hold(slot, inputs)
                        self.batcher.enqueue(ticket, slot.inputs)
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

    def _free(self, slot: Slot, _future: object) -> None:
        self.slots.release(slot)

    def check_content_type(self, content_type: str) -> None:
        if content_type not in self.content_types:
            accepted = ", ".join(sorted(t for t in self.content_types if t))
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
            "slots": self.slots.describe(),
            "preprocess_workers": s.preprocess_workers,
        }

    async def close(self, drain_timeout_s: float) -> None:
        await self.batcher.close(drain_timeout_s)
        if self.workers is not None:
            await self.workers.close()
        self.slots.close()

    # what /metrics and /models read
    @property
    def queued(self) -> int:
        return self.batcher.queued

    @property
    def backlog(self) -> int:
        return self.batcher.backlog

    @property
    def outstanding(self) -> int:
        return self.batcher.outstanding
