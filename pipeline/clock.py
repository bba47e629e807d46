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
    """The running event loop's monotonic clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_at(when, callback)
