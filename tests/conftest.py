from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # Debug mode: asyncio logs any callback that holds the loop over 100 ms (a blocking
    # call), and raises on loop calls made from the wrong thread.
    return ("asyncio", {"debug": True})


@pytest.fixture(autouse=True)
def no_blocking_on_the_loop(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fails a test if the event loop was blocked while it ran (in debug mode)."""
    yield
    slow = [
        r.getMessage()
        for r in caplog.get_records("call")
        if r.name == "asyncio" and "took" in r.getMessage()
    ]
    assert not slow, f"the event loop was blocked: {slow}"
