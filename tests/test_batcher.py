"""Batcher semantics against a fake model and a hand-moved clock: no sleeps, no timing."""

from __future__ import annotations

import asyncio
import heapq
import threading
from collections.abc import AsyncIterator, Mapping

import numpy as np
import pytest

from pipeline.batcher import Batcher, Ticket
from pipeline.errors import (
    ClientGone,
    DeadlineExceeded,
    LoopserveError,
    ModelError,
    Overloaded,
    ShuttingDown,
)
from pipeline.runtime import Arrays, Instance
from tests.fakes import POISON, FakeClock, FakeRunner

pytestmark = pytest.mark.anyio


async def settle() -> None:
    """Let every ready task run until it blocks again (zero-length yields, not a timed wait)."""
    for _ in range(20):
        await asyncio.sleep(0)


def item(value: float, width: int = 4) -> Arrays:
    return {"x": np.full((width,), value, dtype=np.float32)}


class Rig:
    def __init__(self, runners: list[FakeRunner], clock: FakeClock, **kwargs: float) -> None:
        self.clock = clock
        self.runners = runners
        options = {"max_batch_size": 8, "max_delay_ms": 1.0, "max_queue": 100} | kwargs
        self.batcher = Batcher(
            "fake",
            [Instance(r, f"fake-{i}") for i, r in enumerate(runners)],
            max_batch_size=int(options["max_batch_size"]),
            max_delay_ms=float(options["max_delay_ms"]),
            max_queue=int(options["max_queue"]),
            clock=clock,
        )

    @property
    def runner(self) -> FakeRunner:
        return self.runners[0]

    def submit(self, value: float, deadline: float = 30.0, priority: int = 0) -> Ticket:
        ticket = self.batcher.admit(deadline, priority)
        self.batcher.enqueue(ticket, item(value))
        return ticket

    async def started(self) -> int:
        return await asyncio.wait_for(self.runner.started.get(), 5)


async def answer(ticket: Ticket) -> np.ndarray:
    result = await asyncio.wait_for(ticket.future, 5)
    return result["y"]


@pytest.fixture
async def gate() -> AsyncIterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # never leave an executor thread blocked


def make_rig(gate: threading.Event | None = None, instances: int = 1, **kwargs: float) -> Rig:
    loop = asyncio.get_running_loop()
    runners = [FakeRunner(gate=gate, loop=loop) for _ in range(instances)]
    rig = Rig(runners, FakeClock(), **kwargs)
    rig.batcher.start()
    return rig


async def close(rig: Rig) -> None:
    await rig.batcher.close(drain_timeout_s=5)


async def test_lone_request_is_dispatched_at_once_without_waiting_out_the_delay() -> None:
    rig = make_rig(max_delay_ms=1000)
    ticket = rig.submit(1.0)
    assert (await answer(ticket) == 2.0).all()
    assert rig.runner.sizes == [1]
    assert rig.clock.now() == 0.0  # no time had to pass
    await close(rig)


async def test_one_deadline_is_fixed_by_the_first_item_and_not_reset_by_later_ones() -> None:
    rig = make_rig(max_delay_ms=1.0)
    waiting_for = rig.batcher.arrival()  # another request is being parsed: worth waiting for
    first = rig.submit(1.0)
    await settle()
    assert rig.runner.sizes == []
    rig.clock.advance(0.0008)
    second = rig.submit(2.0)
    await settle()
    assert rig.runner.sizes == []  # still inside the first item's 1 ms
    rig.clock.advance(0.0002)  # the first item's deadline; a reset one would be at 1.8 ms
    assert (await answer(first) == 2.0).all()
    assert (await answer(second) == 4.0).all()
    assert rig.runner.sizes == [2]
    waiting_for.done()
    await close(rig)


async def test_the_last_arrival_landing_ends_the_wait_early() -> None:
    rig = make_rig(max_delay_ms=1000)
    waiting_for = rig.batcher.arrival()
    first = rig.submit(1.0)
    await settle()
    assert rig.runner.sizes == []
    second = rig.submit(2.0)
    waiting_for.done()  # nobody else is coming: no reason to wait out the second
    await answer(first)
    await answer(second)
    assert rig.runner.sizes == [2]
    assert rig.clock.now() == 0.0
    await close(rig)


async def test_zero_delay_dispatches_at_once_even_with_arrivals_pending() -> None:
    rig = make_rig(max_delay_ms=0)
    waiting_for = rig.batcher.arrival()
    await answer(rig.submit(1.0))
    assert rig.runner.sizes == [1]
    waiting_for.done()
    await close(rig)


async def test_cap_is_respected_and_queued_items_are_drained_greedily() -> None:
    rig = make_rig(max_batch_size=4)
    waiting_for = rig.batcher.arrival()
    tickets = [rig.submit(float(v)) for v in range(1, 11)]  # all queued before the task runs
    for _ in range(2):
        await rig.started()
    await settle()
    assert rig.runner.sizes == [4, 4]  # full batches go at once, without the delay
    rig.clock.advance(0.001)  # the two left wait for company until their deadline
    results = [await answer(t) for t in tickets]
    assert [float(r[0]) for r in results] == [2.0 * v for v in range(1, 11)]
    assert rig.runner.sizes == [4, 4, 2]
    waiting_for.done()
    await close(rig)


async def test_collection_continues_while_every_instance_is_busy(gate: threading.Event) -> None:
    rig = make_rig(gate, max_batch_size=8)
    first = rig.submit(1.0)
    assert await rig.started() == 1
    later = [rig.submit(float(v)) for v in range(2, 8)]  # no arrival pending, instance busy
    await settle()
    assert rig.runner.sizes == [1]
    gate.set()
    await answer(first)
    for t in later:
        await answer(t)
    assert rig.runner.sizes == [1, 6]
    await close(rig)


async def test_a_second_instance_takes_a_batch_while_the_first_is_busy(
    gate: threading.Event,
) -> None:
    rig = make_rig(gate, instances=2, max_batch_size=8)
    first = rig.submit(1.0)
    await asyncio.wait_for(rig.runners[0].started.get(), 5)
    second = rig.submit(2.0)
    assert await asyncio.wait_for(rig.runners[1].started.get(), 5) == 1
    gate.set()
    await answer(first)
    await answer(second)
    await close(rig)


async def test_expired_and_cancelled_items_never_reach_the_model(gate: threading.Event) -> None:
    rig = make_rig(gate)
    running = rig.submit(1.0)
    await rig.started()
    expires = rig.submit(2.0, deadline=5.0)
    leaves = rig.submit(3.0)
    leaves.fail(ClientGone("the client disconnected"))
    rig.clock.advance(5.0)  # while the first batch still runs
    with pytest.raises(DeadlineExceeded):
        await answer(expires)
    assert rig.batcher.backlog == 0  # dropped from the backlog at once, not when dequeued
    stays = rig.submit(4.0, deadline=60.0)
    gate.set()
    await answer(running)
    await answer(stays)
    assert rig.runner.seen() == {1.0, 4.0}
    await close(rig)


async def test_a_deadline_passing_during_the_batch_answers_504_at_the_deadline(
    gate: threading.Event,
) -> None:
    rig = make_rig(gate)
    ticket = rig.submit(1.0, deadline=2.0)
    await rig.started()
    rig.clock.advance(2.0)
    with pytest.raises(DeadlineExceeded):
        await answer(ticket)  # answered although the model has not finished
    gate.set()
    await close(rig)


async def test_a_failing_item_fails_alone_and_its_batch_mates_succeed() -> None:
    rig = make_rig()
    values = [1.0, POISON, 3.0, 4.0, 5.0]
    tickets = [rig.submit(v) for v in values]
    for value, ticket in zip(values, tickets, strict=True):
        if value == POISON:
            with pytest.raises(ModelError, match="failed on this input"):
                await answer(ticket)
        else:
            assert float((await answer(ticket))[0]) == 2 * value
    assert rig.runner.sizes[0] == 5  # the whole batch was tried first
    await close(rig)


async def test_items_of_different_shapes_run_in_separate_stacks() -> None:
    rig = make_rig()
    a = rig.batcher.admit(30.0)
    rig.batcher.enqueue(a, item(1.0, width=4))
    b = rig.batcher.admit(30.0)
    rig.batcher.enqueue(b, item(2.0, width=3))
    assert (await answer(a)).shape == (4,)
    assert (await answer(b)).shape == (3,)
    await close(rig)


async def test_a_model_returning_the_wrong_number_of_rows_is_reported_as_a_bug() -> None:
    class Short(FakeRunner):
        def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
            return {"y": inputs["x"][:1]}

    rig = Rig([Short()], FakeClock())
    rig.batcher.start()
    tickets = [rig.submit(1.0), rig.submit(2.0)]
    for t in tickets:
        with pytest.raises(LoopserveError, match="this is a bug"):
            await answer(t)
    await close(rig)


async def test_higher_priority_enters_batches_first(gate: threading.Event) -> None:
    rig = make_rig(gate, max_batch_size=1)
    rig.submit(0.5)
    await rig.started()
    low = rig.submit(1.0)
    high = rig.submit(2.0, priority=5)
    gate.set()
    await answer(low)
    await answer(high)
    order = [float(b[0][0]) for b in rig.runner.batches]
    assert order == [0.5, 2.0, 1.0]
    await close(rig)


async def test_over_the_backlog_limit_admission_refuses_at_once_with_retry_after(
    gate: threading.Event,
) -> None:
    rig = make_rig(gate, max_queue=2)
    running = rig.submit(1.0)
    await rig.started()  # dispatched: no longer in the backlog
    queued = [rig.submit(2.0), rig.submit(3.0)]
    with pytest.raises(Overloaded) as refused:
        rig.submit(4.0)
    assert refused.value.status == 503
    assert int(refused.value.headers()["Retry-After"]) >= 1
    gate.set()
    for t in [running, *queued]:
        await answer(t)
    await answer(rig.submit(5.0))  # admitted again once the backlog drained
    await close(rig)


async def test_a_crash_of_the_batch_task_fails_every_pending_future(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = make_rig()

    def broken(_batch: list[Ticket]) -> list[Ticket]:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(rig.batcher, "_collect", broken)
    first, second = rig.submit(1.0), rig.submit(2.0)
    for t in (first, second):
        with pytest.raises(LoopserveError, match="this is a bug"):
            await answer(t)
    with pytest.raises(LoopserveError, match="batcher stopped"):
        rig.batcher.admit(30.0)
    assert not rig.batcher.running
    await close(rig)


async def test_close_drains_what_is_admitted(gate: threading.Event) -> None:
    rig = make_rig(gate)
    running = rig.submit(1.0)
    await rig.started()
    queued = rig.submit(2.0)
    closing = asyncio.ensure_future(rig.batcher.close(drain_timeout_s=30))
    await settle()
    with pytest.raises(ShuttingDown):
        rig.batcher.admit(30.0)  # no longer admitting
    gate.set()
    assert float((await answer(running))[0]) == 2.0
    assert float((await answer(queued))[0]) == 4.0
    await asyncio.wait_for(closing, 5)


async def test_close_fails_what_cannot_finish_in_time(gate: threading.Event) -> None:
    rig = make_rig(gate)
    running = rig.submit(1.0)
    await rig.started()
    queued = rig.submit(2.0)
    await rig.batcher.close(drain_timeout_s=0)
    for t in (running, queued):
        with pytest.raises(ShuttingDown):
            await answer(t)
    assert rig.batcher.outstanding == 0


async def test_answered_requests_do_not_pile_up_in_the_deadline_heap() -> None:
    rig = make_rig()
    for value in range(3000):
        await answer(rig.submit(float(value), deadline=1e9))
    assert len(rig.batcher._deadlines) <= 1024 + 1  # bounded, not one entry per request ever
    await close(rig)


class EarlyClock(FakeClock):
    """Fires timers up to half a millisecond early, as uvloop's rounding can."""

    def advance(self, seconds: float) -> None:
        self.t += seconds
        while self._timers and self._timers[0][0] <= self.t + 0.0005:
            timer = heapq.heappop(self._timers)[2]
            if not timer.cancelled:
                timer.callback()


async def test_a_deadline_timer_that_fires_early_is_armed_again() -> None:
    rig = Rig([FakeRunner(loop=asyncio.get_running_loop())], EarlyClock(), max_delay_ms=1.0)
    rig.batcher.start()
    waiting_for = rig.batcher.arrival()  # someone is on the way: wait for the deadline
    ticket = rig.submit(1.0)
    await settle()
    rig.clock.advance(0.0006)  # the timer fires, but before the 1 ms deadline
    await settle()
    assert rig.runner.sizes == []
    rig.clock.advance(0.0004)  # the deadline: the re-armed timer dispatches
    await answer(ticket)
    assert rig.runner.sizes == [1]
    waiting_for.done()
    await close(rig)
