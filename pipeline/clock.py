"""Monotonic time and timers, behind a Protocol so tests can drive time by hand.

The real clock is the event loop's own (``loop.time()`` is monotonic), so a
timer is a plain ``loop.call_at``: deadlines wake the loop, nothing polls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer: ...


class LoopClock:
    """An event loop's monotonic clock, bound once: ``now`` is ``loop.time`` itself
    (a call per request several times over, so no ``get_running_loop`` lookup)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.now: Callable[[], float] = loop.time
        self._loop = loop

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        return self._loop.call_at(when, callback)
