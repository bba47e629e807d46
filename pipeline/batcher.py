"""Dynamic batching for one model, owned by one task on the event loop.

Policy (DESIGN.md step 6): take the first live item and fix ONE deadline,
``now + max_delay``; drain what is queued without waiting; wait for more only
until that deadline or the cap, and not at all when an instance is free and no
admitted request is on its way (a lone client never pays the delay); while every
instance is busy keep collecting up to the cap; skip items whose caller left or
whose deadline passed. The task wakes on notifications (an item arrives, an
instance frees, the last arrival lands, the deadline timer fires), never on a
polling tick. Invariants: every admitted ticket's future is resolved exactly
once, on the loop; if the task dies, every pending future fails with the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np

from pipeline.clock import Clock, Timer
from pipeline.errors import (
    DeadlineExceeded,
    LoopserveError,
    ModelError,
    Overloaded,
    ShuttingDown,
)
from pipeline.runtime import Arrays, Instance

log = logging.getLogger(__name__)

ADMITTED, QUEUED, DISPATCHED, DONE = range(4)


class BatchObserver(Protocol):
    def observe_batch(self, size: int, compute_s: float) -> None: ...

    def observe_queue_wait(self, wait_s: float) -> None: ...


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted item: its future is the only way its answer travels."""

    future: asyncio.Future[Arrays]
    deadline: float
    priority: int
    inputs: Arrays | None = None
    enqueued_at: float = 0.0
    state: int = ADMITTED
    seq: int = 0  # queue order within a priority level

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class Arrival:
    """A request on its way to the queue (being read, parsed or preprocessed)."""

    __slots__ = ("_batcher", "_open")

    def __init__(self, batcher: Batcher) -> None:
        self._batcher = batcher
        self._open = True
        batcher._arriving += 1

    def done(self) -> None:
        if self._open:
            self._open = False
            self._batcher._arrived()


class Batcher:
    def __init__(
        self,
        name: str,
        instances: Sequence[Instance],
        *,
        max_batch_size: int,
        max_delay_ms: float,
        max_queue: int,
        clock: Clock,
        observer: BatchObserver | None = None,
    ) -> None:
        self.name = name
        self.instances = tuple(instances)
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self._max_delay_s = max_delay_ms / 1000.0
        self._clock = clock
        self._observer = observer
        self._input_names = [s.name for s in self.instances[0].runner.signature.inputs]
        self._queue: list[tuple[int, int, Ticket]] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._arriving = 0
        self._backlog = 0  # admitted, neither dispatched nor finished
        self._outstanding = 0  # admitted, not finished
        self._collecting: list[Ticket] = []
        self._running: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._event_loop = asyncio.get_running_loop()  # a batcher lives on the loop it is made on
        self._closing = False
        self._stopped = False
        self._failure: BaseException | None = None
        self._item_s = 0.0  # smoothed compute time per item, for Retry-After
        # Deadlines: one heap and ONE timer for the earliest, not a timer per request.
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self._deadline_timer: Timer | None = None
        self._timer_at = math.inf

    # -- what the request side calls -------------------------------------------------

    @property
    def backlog(self) -> int:
        return self._backlog

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None:
            self._task = self._event_loop.create_task(
                self._loop(), name=f"loopserve-batcher-{self.name}"
            )

    def arrival(self) -> Arrival:
        return Arrival(self)

    def admit(self, deadline: float, priority: int = 0) -> Ticket:
        """Admit one item or refuse at once (503); the deadline is armed from here on."""
        if self._closing:
            raise ShuttingDown(f"model {self.name} is shutting down")
        if self._failure is not None:
            raise LoopserveError(
                f"model {self.name}: batcher stopped ({self._failure!r}); this is a bug"
            )
        if self._backlog >= self.max_queue:
            raise Overloaded(
                f"model {self.name} is overloaded ({self._backlog} requests waiting); retry later",
                self.retry_after_s(),
            )
        future: asyncio.Future[Arrays] = self._event_loop.create_future()
        ticket = Ticket(future, deadline, priority)
        future.add_done_callback(partial(self._finished, ticket))
        self._backlog += 1
        self._outstanding += 1
        heapq.heappush(self._deadlines, (deadline, next(self._seq), ticket))
        if deadline < self._timer_at:
            self._arm_deadline_timer(deadline)
        return ticket

    def admit_many(self, count: int, deadline: float, priority: int = 0) -> list[Ticket]:
        """Admit ``count`` items of one request, all or none: it counts as that many."""
        if count > 1 and self._backlog + count > self.max_queue:
            raise Overloaded(
                f"model {self.name} is overloaded ({self._backlog} requests waiting, "
                f"{count} more asked for); retry later",
                self.retry_after_s(),
            )
        tickets: list[Ticket] = []
        try:
            for _ in range(count):
                tickets.append(self.admit(deadline, priority))
        except BaseException:
            for ticket in tickets:
                ticket.future.cancel()
            raise
        return tickets

    def enqueue(self, ticket: Ticket, inputs: Arrays) -> None:
        """Queue an admitted ticket's model input; raises what it already failed with."""
        if ticket.future.done():
            ticket.future.result()  # raises: expired or abandoned while preprocessing
        if self._stopped or self._failure is not None:
            error = ShuttingDown(f"model {self.name} is shutting down")
            ticket.fail(error)
            raise error
        ticket.inputs = inputs
        ticket.state = QUEUED
        ticket.enqueued_at = self._clock.now()
        ticket.seq = next(self._seq)
        heapq.heappush(self._queue, (-ticket.priority, ticket.seq, ticket))
        self._wake.set()

    def retry_after_s(self) -> int:
        if self._item_s <= 0:
            return 1
        return max(1, math.ceil(self._backlog * self._item_s / len(self.instances)))

    async def close(self, drain_timeout_s: float) -> None:
        """Stop admitting, let what is admitted finish (bounded), fail the rest, stop."""
        self._closing = True
        if self._outstanding:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_timeout_s):
                    await self._drained.wait()
        if self._outstanding:
            log.warning(
                "model %s: %d request(s) still unanswered after the %.1f s drain "
                "(queued %d, collecting %d, arriving %d, instances busy %s); failing them",
                self.name,
                self._outstanding,
                drain_timeout_s,
                len(self._queue),
                len(self._collecting),
                self._arriving,
                [i.busy for i in self.instances],
            )
        self._stopped = True
        self._fail_pending(ShuttingDown(f"model {self.name} shut down before answering"))
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadlines.clear()
        tasks = [t for t in (self._task, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for instance in self.instances:
            instance.shutdown()

    # -- bookkeeping callbacks (on the loop) ---------------------------------------

    def _arrived(self) -> None:
        self._arriving -= 1
        if self._arriving == 0:
            self._wake.set()

    def _arm_deadline_timer(self, when: float) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._timer_at = when
        self._deadline_timer = self._clock.call_at(when, self._expire_due)

    def _expire_due(self) -> None:
        """Answer 504 to every ticket past its deadline, then sleep until the next one."""
        self._deadline_timer = None
        self._timer_at = math.inf
        now = self._clock.now()
        heap = self._deadlines
        while heap and (heap[0][0] <= now or heap[0][2].future.done()):
            ticket = heapq.heappop(heap)[2]
            ticket.fail(DeadlineExceeded(f"model {self.name}: deadline passed before an answer"))
        if heap:
            self._arm_deadline_timer(heap[0][0])

    def _finished(self, ticket: Ticket, _future: asyncio.Future[Arrays]) -> None:
        if ticket.state < DISPATCHED:
            self._backlog -= 1
        ticket.state = DONE
        ticket.inputs = None
        self._outstanding -= 1
        # Answered tickets wait in the deadline heap until their time; keep it near the
        # number of live ones so it stays bounded under any load.
        if len(self._deadlines) > 4 * self._outstanding + 1024:
            self._deadlines = [e for e in self._deadlines if not e[2].future.done()]
            heapq.heapify(self._deadlines)
        if self._outstanding == 0 and self._closing:
            self._drained.set()

    # -- the batch task ----------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            while True:
                first = await self._take()
                await self._form_and_dispatch(first)
        except asyncio.CancelledError:
            self._fail_pending(ShuttingDown(f"model {self.name} shut down before answering"))
            raise
        except BaseException as exc:
            log.exception("batcher for model %s died; failing every pending request", self.name)
            self._failure = exc
            self._fail_pending(
                LoopserveError(f"model {self.name}: batcher stopped ({exc!r}); this is a bug")
            )
            raise

    async def _take(self) -> Ticket:
        while True:
            while self._queue:
                ticket = heapq.heappop(self._queue)[2]
                if not ticket.future.done():
                    return ticket
            self._wake.clear()
            await self._wake.wait()

    async def _form_and_dispatch(self, first: Ticket) -> None:
        cap = self.max_batch_size
        deadline = self._clock.now() + self._max_delay_s
        timer: Timer | None = None
        fired = False

        def fire() -> None:
            nonlocal fired
            fired = True
            self._wake.set()

        self._collecting = [first]
        try:
            while True:
                self._wake.clear()
                batch = self._collect(self._collecting)
                self._collecting = batch
                if not batch:
                    return
                instance = self._free_instance()
                now = self._clock.now()
                if instance is not None and (
                    len(batch) >= cap or self._arriving == 0 or now >= deadline
                ):
                    self._collecting = []
                    self._dispatch(instance, self._most_urgent(batch))
                    return
                # Re-arm a timer that fired early: uvloop rounds timers to milliseconds,
                # and waiting on without one would wait for an event that may not come.
                if (timer is None or fired) and len(batch) < cap and now < deadline:
                    fired = False
                    timer = self._clock.call_at(deadline, fire)
                await self._wake.wait()
        finally:
            if timer is not None:
                timer.cancel()

    def _collect(self, batch: list[Ticket]) -> list[Ticket]:
        live = [t for t in batch if not t.future.done()]
        queue = self._queue
        while len(live) < self.max_batch_size and queue:
            ticket = heapq.heappop(queue)[2]
            if not ticket.future.done():
                live.append(ticket)
        return live

    def _most_urgent(self, batch: list[Ticket]) -> list[Ticket]:
        """A batch collected while the instances were busy may hold less urgent items
        than have queued since: put it back and take the most urgent ones."""
        queue = self._queue
        if not queue or -queue[0][0] <= min(t.priority for t in batch):
            return batch
        for ticket in batch:
            heapq.heappush(queue, (-ticket.priority, ticket.seq, ticket))
        return self._collect([])

    def _free_instance(self) -> Instance | None:
        for instance in self.instances:
            if not instance.busy:
                return instance
        return None

    def _dispatch(self, instance: Instance, batch: list[Ticket]) -> None:
        now = self._clock.now()
        for ticket in batch:
            ticket.state = DISPATCHED
            if self._observer is not None:
                self._observer.observe_queue_wait(now - ticket.enqueued_at)
        self._backlog -= len(batch)
        instance.busy = True
        task = self._event_loop.create_task(
            self._run(instance, batch), name=f"loopserve-batch-{self.name}"
        )
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, instance: Instance, batch: list[Ticket]) -> None:
        try:
            live = [t for t in batch if not t.future.done()]
            for group in _same_shapes(live, self._input_names):
                await self._execute(instance, group)
        except asyncio.CancelledError:
            for ticket in batch:
                ticket.fail(ShuttingDown(f"model {self.name} shut down before answering"))
            raise
        except Exception as exc:
            log.exception("model %s: batch handling failed", self.name)
            for ticket in batch:
                ticket.fail(LoopserveError(f"model {self.name}: {exc!r}; this is a bug"))
        finally:
            instance.busy = False
            self._wake.set()

    async def _execute(self, instance: Instance, tickets: list[Ticket]) -> None:
        """Run one batch; on failure re-run halves so only the failing items fail."""
        live = [t for t in tickets if not t.future.done()]
        if not live:
            return
        inputs: Arrays = {}
        for name in self._input_names:
            rows = [t.inputs[name] for t in live]  # type: ignore[index]
            buffer = instance.buffers.get(name)
            if buffer is not None and rows[0].shape == buffer.shape[1:]:
                inputs[name] = np.stack(rows, out=buffer[: len(rows)])
            else:
                inputs[name] = np.stack(rows)
        started = self._clock.now()
        try:
            outputs = await self._event_loop.run_in_executor(
                instance.executor, instance.runner.run, inputs
            )
        except Exception as exc:
            if len(live) == 1:
                log.warning("model %s failed on one input: %r", self.name, exc)
                live[0].fail(ModelError(f"model {self.name} failed on this input"))
                return
            half = len(live) // 2
            await self._execute(instance, live[:half])
            await self._execute(instance, live[half:])
            return
        compute_s = self._clock.now() - started
        size = len(live)
        self._item_s = (
            compute_s / size if self._item_s == 0 else (0.8 * self._item_s + 0.2 * compute_s / size)
        )
        if self._observer is not None:
            self._observer.observe_batch(size, compute_s)
        for name, value in outputs.items():
            if value.shape[:1] != (size,):
                error = LoopserveError(
                    f"model {self.name}: output {name} has {value.shape[:1]} rows for {size} "
                    "inputs; this is a bug"
                )
                for ticket in live:
                    ticket.fail(error)
                return
        for index, ticket in enumerate(live):
            if not ticket.future.done():
                ticket.future.set_result({name: value[index] for name, value in outputs.items()})

    def _fail_pending(self, error: LoopserveError) -> None:
        for _, _, ticket in self._queue:
            ticket.fail(error)
        self._queue.clear()
        for ticket in self._collecting:
            ticket.fail(error)
        self._collecting = []


def _same_shapes(batch: list[Ticket], names: list[str]) -> list[list[Ticket]]:
    """Items stack only with items of the same shapes (models with variable dims).

    Only live tickets come here, and a live ticket still holds its inputs.
    """

    def key(ticket: Ticket) -> tuple[tuple[int, ...], ...]:
        inputs = ticket.inputs or {}
        return tuple(inputs[n].shape for n in names)

    if not batch:
        return []
    first = key(batch[0])
    if all(key(t) == first for t in batch[1:]):
        return [batch]
    groups: dict[tuple[tuple[int, ...], ...], list[Ticket]] = {}
    for ticket in batch:
        groups.setdefault(key(ticket), []).append(ticket)
    return list(groups.values())
