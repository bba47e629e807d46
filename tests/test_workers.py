"""Preprocess worker processes on the real classifier: exact rows, errors, deaths, shutdown.

A request is held inside a worker, without sleeps, by a payload that unpickles (in the
worker) as ``Path(fifo).read_bytes()``: the worker blocks on a FIFO that the test controls,
and the test knows it is inside the request once its own open of the FIFO returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
from collections.abc import AsyncIterator, Iterator
from io import BytesIO
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

import pipeline.workers
from models import classifier
from pipeline.errors import BadRequest, LoopserveError, ShuttingDown
from pipeline.servable import Servable
from pipeline.settings import ModelSettings
from pipeline.signature import Signature, spec_from_ort
from pipeline.slots import ArenaLayout, SlotPool
from pipeline.workers import PreprocessPool, WorkerDied

pytestmark = pytest.mark.anyio

SLOTS = 8


@pytest.fixture(scope="module")
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # Module scope, so that one pool of worker processes serves the whole module.
    return ("asyncio", {"debug": True})


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> ModelSettings:
    path = tmp_path_factory.mktemp("classifier") / "classifier.onnx"
    classifier.build(path)
    return ModelSettings(name="classifier", path=path, servable="classifier")


@pytest.fixture(scope="module")
def signature(settings: ModelSettings) -> Signature:
    sess = ort.InferenceSession(str(settings.path), providers=["CPUExecutionProvider"])
    return Signature(
        inputs=tuple(spec_from_ort(a) for a in sess.get_inputs()),
        outputs=tuple(spec_from_ort(a) for a in sess.get_outputs()),
    )


@pytest.fixture(scope="module")
def servable(settings: ModelSettings, signature: Signature) -> Servable[bytes]:
    return classifier.create(signature, settings)


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """A gradient with noise: compresses like a photo, differs per seed."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    phase = rng.uniform(0, 2 * np.pi, 3)
    channels = [127 + 100 * np.sin(xs / (40 + 30 * i) + ys / 70 + phase[i]) for i in range(3)]
    noisy = np.stack(channels, axis=-1) + rng.normal(0, 12, (height, width, 3))
    return np.clip(noisy, 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, fmt: str) -> bytes:
    out = BytesIO()
    Image.fromarray(pixels).save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    """JPEGs and PNGs of several sizes; the last, a 1200x900 noisy PNG, is about 3 MB."""
    bodies = [
        encode(photo(200 + 60 * i, 180 + 40 * i, seed=i), "JPEG" if i % 2 else "PNG")
        for i in range(SLOTS - 1)
    ]
    return [*bodies, encode(photo(1200, 900, seed=99), "PNG")]


@pytest.fixture(scope="module")
def expected(servable: Servable[bytes], images: list[bytes]) -> list[np.ndarray]:
    return [servable.preprocess(body)["image"] for body in images]


@pytest.fixture(scope="module")
def slots(signature: Signature) -> Iterator[SlotPool]:
    pool = SlotPool("classifier", signature.inputs, SLOTS, max_slot_bytes=1 << 30, shared=True)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
async def pool(
    settings: ModelSettings, signature: Signature, slots: SlotPool
) -> AsyncIterator[PreprocessPool]:
    workers = PreprocessPool(settings, signature, slots.layout, workers=2)
    await workers.start()
    yield workers
    await workers.close()


class Held:
    """Unpickles in a worker as the bytes later written to ``fifo``, blocking until then."""

    def __init__(self, fifo: Path) -> None:
        self.fifo = fifo

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (Path.read_bytes, (self.fifo,))


async def inside(fifo: Path) -> int:
    """Our write end of ``fifo``, once a worker has opened it: it is inside the request."""
    opening = asyncio.ensure_future(asyncio.to_thread(os.open, fifo, os.O_WRONLY))
    try:
        return await asyncio.wait_for(asyncio.shield(opening), 30)
    except BaseException:
        # Free the blocked open with a reader of our own: no thread may be left behind.
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        os.close(await opening)
        raise


async def settle() -> None:
    """Let every ready task run until it blocks again (zero-length yields, not a timed wait)."""
    for _ in range(20):
        await asyncio.sleep(0)


def fresh(tmp_path: Path, name: str = "fifo") -> Path:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    return fifo


async def exited(pid: int) -> None:
    """Wait until process ``pid`` has exited: its pidfd turns readable (no polling)."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()
    fd = os.pidfd_open(pid)

    def readable() -> None:
        if not gone.done():  # level-triggered: it may fire again before we resume
            gone.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await gone
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def running(model: str) -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.endswith(f"-{model}")]


async def test_rows_are_bit_identical(
    pool: PreprocessPool, slots: SlotPool, images: list[bytes], expected: list[np.ndarray]
) -> None:
    arena = slots.arenas["image"]
    for slot, (body, want) in enumerate(zip(images, expected, strict=True)):
        arena[slot] = np.nan  # so a row left unwritten cannot pass
        await pool.preprocess(body, slot)
        assert np.array_equal(arena[slot], want)


async def test_concurrent_requests_use_both_workers(
    pool: PreprocessPool, slots: SlotPool, images: list[bytes], expected: list[np.ndarray]
) -> None:
    arena = slots.arenas["image"]
    arena[:] = np.nan
    order = list(reversed(range(SLOTS)))  # image i into slot SLOTS-1-i
    tasks = [asyncio.create_task(pool.preprocess(images[i], slot)) for slot, i in enumerate(order)]
    # One turn: each task runs until it waits, two holding a worker and six queued (more
    # turns could let a worker answer meanwhile).
    await asyncio.sleep(0)
    assert len(pool.busy_pids()) == 2
    await asyncio.gather(*tasks)
    for slot, i in enumerate(order):
        assert np.array_equal(arena[slot], expected[i])
    assert pool.busy_pids() == []


async def test_corrupt_image_is_the_same_bad_request(
    pool: PreprocessPool, servable: Servable[bytes], images: list[bytes]
) -> None:
    restarts = pool.restarts
    half = images[1][: len(images[1]) // 2]  # a JPEG cut in two
    with pytest.raises(BadRequest) as here:
        servable.preprocess(half)
    with pytest.raises(BadRequest) as there:
        await pool.preprocess(half, 0)
    assert type(there.value) is type(here.value)
    assert there.value.message == here.value.message
    assert there.value.status == 400
    assert (pool.workers_alive, pool.restarts) == (2, restarts)


async def test_unexpected_exception_is_500_without_internals(
    pool: PreprocessPool, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(LoopserveError) as failed:
        await pool.preprocess(12345, 0)  # not bytes: AttributeError inside the decoder
    assert type(failed.value) is LoopserveError
    assert failed.value.status == 500
    assert "AttributeError" in failed.value.message
    assert "Traceback" not in failed.value.message
    [record] = [r for r in caplog.records if r.name == "pipeline.workers"]
    assert record.levelno == logging.ERROR
    assert "Traceback" in record.getMessage()
    assert pool.workers_alive == 2


async def test_unpicklable_input_leaves_the_worker_idle(
    pool: PreprocessPool, images: list[bytes]
) -> None:
    with pytest.raises(LoopserveError, match=r"cannot be sent to a worker.*this is a bug"):
        await pool.preprocess(lambda: None, 0)
    with pytest.raises(LoopserveError, match="this is a bug"):
        await pool.preprocess(images[0], SLOTS)  # no such slot
    assert pool.busy_pids() == []
    await asyncio.gather(*(pool.preprocess(images[0], s) for s in range(3)))


async def test_killed_worker_fails_only_its_request(
    pool: PreprocessPool,
    slots: SlotPool,
    images: list[bytes],
    expected: list[np.ndarray],
    tmp_path: Path,
) -> None:
    restarts = pool.restarts
    fifo = fresh(tmp_path)
    held = asyncio.create_task(pool.preprocess(Held(fifo), 0))
    end = await inside(fifo)
    try:
        [pid] = pool.busy_pids()
        other = asyncio.create_task(pool.preprocess(images[3], 1))  # on the other worker
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=r"died while handling this request .*SIGKILL"):
            await held
    finally:
        os.close(end)
    await other
    assert np.array_equal(slots.arenas["image"][1], expected[3])
    assert pool.restarts == restarts + 1
    await pool.wait_restarts()
    assert pool.workers_alive == 2
    assert pid not in pool.busy_pids()
    await asyncio.gather(*(pool.preprocess(images[s], s) for s in range(4)))
    for s in range(4):
        assert np.array_equal(slots.arenas["image"][s], expected[s])


async def test_idle_worker_that_dies_is_replaced(
    pool: PreprocessPool, slots: SlotPool, images: list[bytes], expected: list[np.ndarray]
) -> None:
    restarts = pool.restarts
    [first, _] = [p.pid for p in running("classifier")]
    assert first is not None
    os.kill(first, signal.SIGKILL)
    await exited(first)
    await settle()  # its sentinel turned readable before its pidfd did
    assert pool.restarts == restarts + 1
    await pool.wait_restarts()
    assert pool.workers_alive == 2
    await asyncio.gather(*(pool.preprocess(images[s], s) for s in range(4)))
    for s in range(4):
        assert np.array_equal(slots.arenas["image"][s], expected[s])


async def test_queued_request_can_leave(
    pool: PreprocessPool,
    slots: SlotPool,
    images: list[bytes],
    expected: list[np.ndarray],
    tmp_path: Path,
) -> None:
    fifos = [fresh(tmp_path, "a"), fresh(tmp_path, "b")]
    held = [asyncio.create_task(pool.preprocess(Held(f), s)) for s, f in enumerate(fifos)]
    ends: list[int] = []
    try:
        for fifo in fifos:
            ends.append(await inside(fifo))
        queued = asyncio.create_task(pool.preprocess(images[0], 2))
        await settle()
        assert not queued.done()  # both workers are held
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        for end, body in zip(ends, images[5:7], strict=True):
            await asyncio.to_thread(os.write, end, body)
    finally:
        for end in ends:
            os.close(end)
    await asyncio.gather(*held)
    assert np.array_equal(slots.arenas["image"][0], expected[5])
    assert np.array_equal(slots.arenas["image"][1], expected[6])
    assert pool.busy_pids() == []


async def test_cancelled_request_returns_once_its_worker_is_done(
    pool: PreprocessPool,
    slots: SlotPool,
    images: list[bytes],
    expected: list[np.ndarray],
    tmp_path: Path,
) -> None:
    restarts = pool.restarts
    slots.arenas["image"][2] = np.nan
    fifo = fresh(tmp_path)
    held = asyncio.create_task(pool.preprocess(Held(fifo), 2))
    end = await inside(fifo)
    try:
        held.cancel()
        await settle()
        # The worker may be writing into slot 2: the caller must not release it yet.
        assert not held.done()
        await asyncio.to_thread(os.write, end, images[4])
    finally:
        os.close(end)
    with pytest.raises(asyncio.CancelledError):
        await held
    assert np.array_equal(slots.arenas["image"][2], expected[4])
    assert (pool.busy_pids(), pool.workers_alive, pool.restarts) == ([], 2, restarts)


async def test_cancelled_request_on_a_hung_worker_kills_it(
    pool: PreprocessPool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    restarts = pool.restarts
    fifo = fresh(tmp_path)
    pool.cancel_grace_s = 0.0
    try:
        held = asyncio.create_task(pool.preprocess(Held(fifo), 0))
        end = await inside(fifo)
        try:
            held.cancel()  # the worker stays blocked: only the kill can end the request
            with pytest.raises(asyncio.CancelledError):
                await held
        finally:
            os.close(end)
    finally:
        pool.cancel_grace_s = 5.0
    assert any("still busy" in r.getMessage() for r in caplog.records)
    assert pool.restarts == restarts + 1
    await pool.wait_restarts()
    assert pool.workers_alive == 2


async def test_close_finishes_the_request_in_hand_then_stops(
    settings: ModelSettings,
    signature: Signature,
    images: list[bytes],
    expected: list[np.ndarray],
    tmp_path: Path,
) -> None:
    closing_settings = dataclasses.replace(settings, name="closing")
    slots = SlotPool("closing", signature.inputs, 2, max_slot_bytes=1 << 30, shared=True)
    workers = PreprocessPool(closing_settings, signature, slots.layout, workers=1)
    try:
        await workers.start()
        assert len(running("closing")) == 1
        fifo = fresh(tmp_path)
        held = asyncio.create_task(workers.preprocess(Held(fifo), 0))
        end = await inside(fifo)
        try:
            queued = asyncio.create_task(workers.preprocess(images[0], 1))
            closing = asyncio.create_task(workers.close())
            await settle()
            assert not closing.done()  # it waits for the request in hand
            with pytest.raises(ShuttingDown):
                await queued
            with pytest.raises(ShuttingDown):
                await workers.preprocess(images[0], 1)
            await asyncio.to_thread(os.write, end, images[5])
        finally:
            os.close(end)
        await held
        await closing
        await workers.close()  # idempotent
        assert running("closing") == []
        assert workers.workers_alive == 0
        # The workers attached the arena and exited; it is still there, by name too.
        assert np.array_equal(slots.arenas["image"][0], expected[5])
        [layout] = slots.layout
        again = shared_memory.SharedMemory(name=layout.shm_name)
        view = np.ndarray(layout.shape, np.dtype(layout.dtype), buffer=again.buf)
        assert np.array_equal(view[0], expected[5])
        del view
        again.close()
    finally:
        await workers.close()
        slots.close()


async def test_wrong_arena_shape_is_a_bug_and_close_kills_a_hung_worker(
    settings: ModelSettings,
    signature: Signature,
    images: list[bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory = shared_memory.SharedMemory(create=True, size=2 * 3 * 8 * 8 * 4)
    layout = [ArenaLayout("image", memory.name, (2, 3, 8, 8), "<f4")]
    workers = PreprocessPool(dataclasses.replace(settings, name="mismatch"), signature, layout, 1)
    try:
        await workers.start()
        with pytest.raises(LoopserveError, match=r"float32 \(3, 224, 224\).*this is a bug"):
            await workers.preprocess(images[0], 1)
        assert workers.workers_alive == 1
        # Then close() with a request that never ends: the worker is killed, not waited for.
        monkeypatch.setattr(pipeline.workers, "STOP_TIMEOUT_S", 0.0)
        fifo = fresh(tmp_path)
        held = asyncio.create_task(workers.preprocess(Held(fifo), 0))
        end = await inside(fifo)
        try:
            await workers.close()
            with pytest.raises(ShuttingDown):
                await held
        finally:
            os.close(end)
        assert any("did not stop" in r.getMessage() for r in caplog.records)
    finally:
        await workers.close()
        memory.close()
        memory.unlink()


async def test_replacement_that_cannot_start_fails_what_waits(
    settings: ModelSettings, signature: Signature, images: list[bytes], tmp_path: Path
) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"class {i}\n" for i in range(1000)))
    doomed = dataclasses.replace(settings, name="doomed", labels=labels)
    slots = SlotPool("doomed", signature.inputs, 2, max_slot_bytes=1 << 30, shared=True)
    workers = PreprocessPool(doomed, signature, slots.layout, workers=1)
    try:
        await workers.start()
        labels.unlink()  # a new worker cannot create its servable any more
        fifo = fresh(tmp_path)
        held = asyncio.create_task(workers.preprocess(Held(fifo), 0))
        end = await inside(fifo)
        try:
            queued = asyncio.create_task(workers.preprocess(images[0], 1))
            [pid] = workers.busy_pids()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(WorkerDied):
                await held
        finally:
            os.close(end)
        await workers.wait_restarts()
        with pytest.raises(LoopserveError, match=r"no preprocessing worker left.*cannot read"):
            await queued
        with pytest.raises(LoopserveError, match="no preprocessing worker left"):
            await workers.preprocess(images[0], 1)
        assert (workers.workers_alive, workers.restarts) == (0, 1)
    finally:
        await workers.close()
        slots.close()


async def test_a_worker_that_cannot_start_stops_the_start(
    settings: ModelSettings, signature: Signature, slots: SlotPool
) -> None:
    broken = dataclasses.replace(settings, name="broken", servable="no_such_servable")
    workers = PreprocessPool(broken, signature, slots.layout, workers=2)
    with pytest.raises(RuntimeError, match=r"failed to start: ValueError: .*no_such_servable"):
        await workers.start()
    assert running("broken") == []
    await workers.close()


def test_refuses_private_arenas(settings: ModelSettings, signature: Signature) -> None:
    private = SlotPool("classifier", signature.inputs, 1, max_slot_bytes=1 << 30)
    with pytest.raises(ValueError, match="shared memory"):
        PreprocessPool(settings, signature, private.layout, workers=1)
    with pytest.raises(ValueError, match="must be >= 1"):
        PreprocessPool(settings, signature, private.layout, workers=0)


def test_held_payload_reads_the_fifo(tmp_path: Path) -> None:
    path = tmp_path / "plain"
    path.write_bytes(b"body")
    assert pickle.loads(pickle.dumps(Held(path))) == b"body"
