"""Test doubles: a clock moved by hand and a numpy model that can block or fail on command."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Callable, Mapping

import numpy as np

from pipeline.runtime import Arrays
from pipeline.settings import ModelSettings
from pipeline.signature import Signature, TensorSpec

POISON = -1.0  # an input holding this value makes FakeRunner raise


class FakeTimer:
    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Time stands still until the test calls ``advance``; due timers then fire in order."""

    def __init__(self) -> None:
        self.t = 0.0
        self._timers: list[tuple[float, int, FakeTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    def call_at(self, when: float, callback: Callable[[], object]) -> FakeTimer:
        timer = FakeTimer(when, callback)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def advance(self, seconds: float) -> None:
        self.t += seconds
        while self._timers and self._timers[0][0] <= self.t:
            timer = heapq.heappop(self._timers)[2]
            if not timer.cancelled:
                timer.callback()


class FakeRunner:
    """y = 2x on float32 [batch, width]. Records every batch it sees; optionally holds
    each call until ``gate`` is set, and raises for any batch containing POISON."""

    def __init__(
        self,
        width: int = 4,
        gate: threading.Event | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        spec_x = TensorSpec("x", np.dtype(np.float32), (None, width))
        spec_y = TensorSpec("y", np.dtype(np.float32), (None, width))
        self.signature = Signature(inputs=(spec_x,), outputs=(spec_y,))
        self.providers = ("FakeProvider",)
        self.gate = gate
        self.batches: list[np.ndarray] = []
        self.started: asyncio.Queue[int] = asyncio.Queue()
        self._loop = loop  # where to report started batches; None: nobody listens
        self._lock = threading.Lock()
        self.closed = False

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        x = inputs["x"]
        with self._lock:
            self.batches.append(x.copy())
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.started.put_nowait, len(x))
        if self.gate is not None and not self.gate.wait(timeout=30):
            raise TimeoutError("test gate never opened")
        if (x == POISON).any():
            raise RuntimeError("poisoned input")
        return {"y": x * 2}

    def close(self) -> None:
        self.closed = True
        if self.gate is not None:
            self.gate.set()

    @property
    def sizes(self) -> list[int]:
        with self._lock:
            return [len(b) for b in self.batches]

    def seen(self) -> set[float]:
        """The first value of every item the model computed."""
        with self._lock:
            return {float(row[0]) for b in self.batches for row in b}


def fake_factory(
    gate: threading.Event | None = None,
    width: int = 4,
    loop: asyncio.AbstractEventLoop | None = None,
) -> tuple[Callable[[ModelSettings, int], FakeRunner], list[FakeRunner]]:
    made: list[FakeRunner] = []

    def factory(_settings: ModelSettings, _index: int) -> FakeRunner:
        runner = FakeRunner(width=width, gate=gate, loop=loop)
        made.append(runner)
        return runner

    return factory, made


def post_scope(path: str, content_type: str) -> dict[str, object]:
    """The ASGI scope of a POST from 127.0.0.1, for tests that drive an app by hand."""
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
        "headers": [(b"content-type", content_type.encode())],
    }  # fmt: skip
