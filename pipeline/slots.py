"""The exclusive resource allocator: a fixed pool of data slots per model.

A request holds one slot from before its preprocessing until its reply is
written; the slot holds its model input. For models whose item shape is fixed the
inputs live in one preallocated arena per input, ``count`` rows, optionally in
shared memory so that worker processes write into them directly; a slot is a row.
Memory is therefore a function of configuration, not of load: when every slot is
taken, requests wait (FIFO, woken by a release, never by polling). For variable
shapes a slot bounds the bytes its request may hold instead.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from pipeline.errors import LoopserveError, PayloadTooLarge, ShuttingDown
from pipeline.runtime import Arrays
from pipeline.signature import TensorSpec


@dataclass(frozen=True)
class ArenaLayout:
    """Where one input's arena lives, so another process can attach to it."""

    name: str  # the model input
    shm_name: str | None  # None: private memory of this process
    shape: tuple[int, ...]  # (count, *item_shape)
    dtype: str


class Slot:
    __slots__ = ("index", "inputs", "released")

    def __init__(self, index: int, inputs: Arrays) -> None:
        self.index = index
        self.inputs = inputs  # views into the arenas (fixed shapes) or the request's own arrays
        self.released = False


class SlotPool:
    def __init__(
        self,
        model: str,
        specs: Sequence[TensorSpec],
        count: int,
        max_slot_bytes: int,
        shared: bool = False,
    ) -> None:
        self.model = model
        self.count = count
        self.max_slot_bytes = max_slot_bytes
        self.fixed = all(
            all(d is not None for d in s.item_shape) and s.dtype.kind != "O" for s in specs
        )
        self._shm: list[shared_memory.SharedMemory] = []
        self.arenas: dict[str, np.ndarray] = {}
        self.layout: list[ArenaLayout] = []
        if self.fixed:
            for spec in specs:
                shape = (count, *(int(d) for d in spec.item_shape if d is not None))
                self.arenas[spec.name] = self._arena(spec, shape, shared)
        # Each slot is made once, with its views of the arenas: taking one is a popleft.
        self._slots = [
            Slot(i, {name: arena[i] for name, arena in self.arenas.items()}) for i in range(count)
        ]
        self._free: deque[int] = deque(range(count))
        self._waiters: deque[asyncio.Future[int]] = deque()
        self._closed = False
        self.high_water = 0  # the most slots ever held at once

    def _arena(self, spec: TensorSpec, shape: tuple[int, ...], shared: bool) -> np.ndarray:
        nbytes = max(1, math.prod(shape) * spec.dtype.itemsize)
        if not shared:
            self.layout.append(ArenaLayout(spec.name, None, shape, spec.dtype.str))
            return np.zeros(shape, dtype=spec.dtype)
        memory = shared_memory.SharedMemory(create=True, size=nbytes)
        self._shm.append(memory)
        self.layout.append(ArenaLayout(spec.name, memory.name, shape, spec.dtype.str))
        return np.ndarray(shape, dtype=spec.dtype, buffer=memory.buf)

    @property
    def in_use(self) -> int:
        return self.count - len(self._free)

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def try_acquire(self) -> Slot | None:
        """A free slot at once if nobody is waiting for one (the hot path), else None."""
        waiters = self._waiters
        while waiters and waiters[0].done():  # cancelled waiters at the front
            waiters.popleft()
        if not self._free or waiters or self._closed:
            return None
        return self._take(self._free.popleft())

    def _take(self, index: int) -> Slot:
        slot = self._slots[index]
        slot.released = False
        self.high_water = max(self.high_water, self.count - len(self._free))
        return slot

    async def acquire(self, abandon: asyncio.Future[Any] | None = None) -> Slot:
        """A free slot, or wait for one in arrival order. If ``abandon`` (the request's
        own future) completes first, the wait ends with CancelledError."""
        if self._closed:
            raise ShuttingDown(f"model {self.model} is shutting down")
        waiters = self._waiters
        while waiters and waiters[0].done():  # cancelled waiters at the front
            waiters.popleft()
        if self._free and not waiters:
            index = self._free.popleft()
        else:
            waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            if abandon is not None:
                abandon.add_done_callback(lambda _: waiter.cancel())
            try:
                index = await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._give(waiter.result())  # handed a slot as we were cancelled
                raise
        return self._take(index)

    def hold(self, slot: Slot, inputs: Arrays) -> None:
        """Put a request's preprocessed inputs in its slot (no-op for the shared path,
        where a worker already wrote them); variable shapes are bounded here."""
        if self.fixed:
            for name, target in slot.inputs.items():
                value = inputs[name]
                if value.shape != target.shape or value.dtype != target.dtype:
                    raise LoopserveError(
                        f"model {self.model}: preprocessing gave {name} as {value.dtype}"
                        f"{list(value.shape)}, the model takes {target.dtype}"
                        f"{list(target.shape)}; this is a bug"
                    )
                target[...] = value
            return
        size = sum(v.nbytes for v in inputs.values())
        if size > self.max_slot_bytes:
            raise PayloadTooLarge(
                f"this input needs {size} bytes of model input; a slot of model {self.model} "
                f"holds at most {self.max_slot_bytes}"
            )
        slot.inputs = inputs

    def release(self, slot: Slot) -> None:
        if slot.released:
            return
        slot.released = True
        if not self.fixed:
            slot.inputs = {}  # the request's own arrays go with it
        self._give(slot.index)

    def _give(self, index: int) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(index)
                return
        self._free.append(index)

    def close(self) -> None:
        """Fail the waiters and free the shared memory (after every holder is done)."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ShuttingDown(f"model {self.model} is shutting down"))
        for slot in self._slots:
            slot.inputs = {}  # views into the arenas: shared memory cannot close under them
        self.arenas.clear()
        for memory in self._shm:
            memory.close()
            memory.unlink()
        self._shm.clear()

    def describe(self) -> dict[str, object]:
        return {
            "count": self.count,
            "in_use": self.in_use,
            "waiting": self.waiting,
            "high_water": self.high_water,
            "preallocated": self.fixed,
            "shared_memory": bool(self._shm),
            "bytes": sum(a.nbytes for a in self.arenas.values()),
        }
