"""Data slots: bounded memory under any load, FIFO waits, and preprocessing overlapping
the running batch. A fake image-like servable counts its live input buffers."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import pipeline.model
from pipeline.app import create_app, lifespan_of
from pipeline.errors import LoopserveError, PayloadTooLarge, ShuttingDown
from pipeline.runtime import Arrays
from pipeline.settings import ModelSettings, ServerSettings
from pipeline.signature import TensorSpec
from pipeline.slots import SlotPool
from tests.fakes import FakeClock, FakeRunner, fake_factory

pytestmark = pytest.mark.anyio

X = TensorSpec("x", np.dtype(np.float32), (None, 4))


class CountingServable:
    """Body bytes in (like an encoded image), a float32[4] input out, made in a worker
    thread; counts how many of those input buffers are alive at once."""

    content_types = frozenset({"application/octet-stream"})
    offload = True

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self.live = 0
        self.most_live = 0
        self.started: asyncio.Queue[float] = asyncio.Queue()

    def parse(self, body: bytes, content_type: str) -> bytes:
        return body

    def preprocess(self, parsed: bytes) -> Arrays:
        value = np.full(4, float(parsed.decode()), dtype=np.float32)
        with self._lock:
            self.live += 1
            self.most_live = max(self.most_live, self.live)
        weakref.finalize(value, self._dead)
        self._loop.call_soon_threadsafe(self.started.put_nowait, float(value[0]))
        return {"x": value}

    def _dead(self) -> None:
        with self._lock:
            self.live -= 1

    def postprocess(self, outputs: Arrays) -> object:
        return {"y": outputs["y"]}

    def describe(self) -> dict[str, object]:
        return {"kind": "counting"}


@asynccontextmanager
async def counting_app(
    monkeypatch: pytest.MonkeyPatch, gate: threading.Event, clock: FakeClock, **model: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, CountingServable, list[FakeRunner], Any]]:
    servable = CountingServable(asyncio.get_running_loop())
    monkeypatch.setattr(pipeline.model, "create_servable", lambda _s, _sig: servable)
    factory, made = fake_factory(gate, loop=asyncio.get_running_loop())
    options = {"name": "img", "path": Path("unused.onnx"), "servable": "counting"} | model
    settings = ServerSettings(models=(ModelSettings(**options),), drain_timeout_s=5)
    app = create_app(settings, runner_factory=factory, clock=clock)
    async with lifespan_of(app)(None):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield client, servable, made, app.state.service.get("img")
        gate.set()


def post(client: httpx.AsyncClient, value: float, query: str = "") -> Any:
    return asyncio.ensure_future(
        client.post(
            f"/predict/img{query}",
            content=str(value).encode(),
            headers={"content-type": "application/octet-stream"},
        )
    )


async def settle() -> None:
    for _ in range(100):
        await asyncio.sleep(0)


async def test_a_flood_20x_the_slots_keeps_memory_flat_and_answers_everyone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate, clock = threading.Event(), FakeClock()
    slots = 4
    async with counting_app(
        monkeypatch, gate, clock, max_batch_size=2, slots=slots, max_queue=40
    ) as (client, servable, made, model):
        flood = [post(client, float(i), "?timeout_s=1" if i % 2 else "") for i in range(80)]
        await asyncio.wait_for(made[0].started.get(), 5)
        await settle()
        assert model.slots.in_use == slots  # every slot taken, the rest wait or are refused
        assert model.slots.waiting > 0
        clock.advance(1.0)  # every other one has a 1 s deadline: it passes while they wait
        await settle()
        gate.set()
        answers = await asyncio.gather(*flood)
        metrics = (await client.get("/metrics")).text
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 503, 504} and len(codes) == 80  # everyone got one answer
    assert codes.count(503) >= 40  # beyond the backlog limit: refused at once
    assert 200 in codes and 504 in codes
    assert servable.most_live <= slots  # live input buffers never above the slot count
    assert model.slots.high_water <= slots
    assert (model.slots.in_use, model.slots.waiting, model.backlog) == (0, 0, 0)
    assert 'loopserve_slots_in_use{model="img"} 0.0' in metrics


async def test_preprocessing_of_the_next_batch_overlaps_the_running_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate, clock = threading.Event(), FakeClock()
    async with counting_app(monkeypatch, gate, clock, max_batch_size=2) as (
        client,
        servable,
        made,
        _,
    ):
        answers = [post(client, float(i)) for i in range(4)]  # 2 x max_batch_size slots
        started = [await asyncio.wait_for(servable.started.get(), 5) for _ in range(4)]
        assert sorted(started) == [0.0, 1.0, 2.0, 3.0]
        assert made[0].sizes == [2]  # batch k is still in the model (its gate is closed) ...
        gate.set()  # ... while batch k+1 was preprocessed and now runs at once
        await asyncio.gather(*answers)
    assert made[0].sizes == [2, 2]


async def test_the_pool_waits_in_order_and_a_finished_request_stops_waiting() -> None:
    pool = SlotPool("m", [X], count=2, max_slot_bytes=1024)
    first, second = await pool.acquire(), await pool.acquire()
    assert pool.in_use == 2 and pool.fixed
    abandon: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waits = [asyncio.ensure_future(pool.acquire()) for _ in range(2)]
    gives_up = asyncio.ensure_future(pool.acquire(abandon=abandon))
    await settle()
    assert pool.waiting == 3
    abandon.set_result(None)  # its deadline passed: it stops waiting
    with pytest.raises(asyncio.CancelledError):
        await gives_up
    pool.release(first)
    pool.release(first)  # releasing twice is harmless
    assert (await waits[0]).index == first.index  # the first waiter first
    pool.release(second)
    got = await waits[1]
    assert got.index == second.index
    assert pool.waiting == 0 and pool.high_water == 2


async def test_slots_hold_inputs_in_the_arena_and_check_them() -> None:
    pool = SlotPool("m", [X], count=2, max_slot_bytes=1024)
    slot = await pool.acquire()
    pool.hold(slot, {"x": np.arange(4, dtype=np.float32)})
    assert np.shares_memory(slot.inputs["x"], pool.arenas["x"])
    np.testing.assert_array_equal(pool.arenas["x"][slot.index], np.arange(4))
    with pytest.raises(LoopserveError, match="this is a bug"):
        pool.hold(slot, {"x": np.zeros(3, dtype=np.float32)})  # never broadcast silently
    variable = SlotPool("v", [TensorSpec("x", np.dtype(np.float32), (None, None))], 1, 64)
    assert not variable.fixed
    small = await variable.acquire()
    variable.hold(small, {"x": np.zeros(16, dtype=np.float32)})
    with pytest.raises(PayloadTooLarge):
        variable.hold(small, {"x": np.zeros(17, dtype=np.float32)})
    variable.release(small)
    assert small.inputs == {}


async def test_shared_arenas_are_attachable_and_closing_fails_the_waiters() -> None:
    from multiprocessing import shared_memory

    pool = SlotPool("m", [X], count=1, max_slot_bytes=1024, shared=True)
    layout = pool.layout[0]
    assert layout.shm_name is not None and layout.shape == (1, 4)
    other = shared_memory.SharedMemory(name=layout.shm_name)  # as a worker would
    view = np.ndarray(layout.shape, dtype=layout.dtype, buffer=other.buf)
    view[0] = 7.0
    assert pool.arenas["x"][0].tolist() == [7.0] * 4
    del view
    other.close()
    held = await pool.acquire()
    waiting = asyncio.ensure_future(pool.acquire())
    await settle()
    pool.close()
    with pytest.raises(ShuttingDown):
        await waiting
    assert pool.describe()["shared_memory"] is False
    assert held.index == 0
