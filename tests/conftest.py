from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

# asyncio's debug mode logs every loop step over 100 ms. On a loaded 2-core CI machine a
# thread start or a GIL hand-off can cost just that much, so only steps over this fail:
# real blocking work on the loop (a decode, a sleep, a big copy) is far longer.
BLOCKED_S = 0.25
_TOOK = re.compile(r"took (\d+\.\d+) seconds")


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # Debug mode: asyncio logs any callback that holds the loop (a blocking call), and
    # raises on loop calls made from the wrong thread.
    return ("asyncio", {"debug": True})


@pytest.fixture(autouse=True)
def no_blocking_on_the_loop(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fails a test if the event loop was blocked while it ran (in debug mode)."""
    yield
    slow = []
    for record in caplog.get_records("call"):
        found = _TOOK.search(record.getMessage()) if record.name == "asyncio" else None
        if found and float(found.group(1)) > BLOCKED_S:
            slow.append(record.getMessage())
    assert not slow, f"the event loop was blocked: {slow}"
