"""Per-request CPU at the ASGI level: the apps called directly, no HTTP, no wrk.

On 2 cores the event loop's CPU is the server's first ceiling, so this isolates
loopserve's own cost per request (parse, admit, batch, answer) from uvicorn's and
the load generator's: 64 concurrent callers post the `tiny` body to the bare
route and to the server (tiny batched, cap 64), in one process on uvloop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from bench.bare import app as bare_app
from bench.payload import request_body
from bench.servers import model_path
from pipeline.app import create_app, lifespan_of
from pipeline.settings import ModelSettings, ServerSettings

CALLERS = 64


@dataclass(frozen=True)
class Overhead:
    bare_us: float
    server_us: float
    mean_batch: float

    @property
    def extra_us(self) -> float:
        return self.server_us - self.bare_us


async def _call(app: Any, scope: dict[str, Any], body: bytes) -> None:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    status: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(dict(scope), receive, send)
    if status != [200]:
        raise RuntimeError(f"overhead bench: the app answered {status}")


async def _per_request_us(app: Any, body: bytes, requests: int) -> float:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/predict/tiny", "raw_path": b"/predict/tiny",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2), "state": {},
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    each = requests // CALLERS

    async def caller() -> None:
        for _ in range(each):
            await _call(app, scope, body)

    await asyncio.gather(*(caller() for _ in range(CALLERS)))  # warm-up
    started = time.process_time()
    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    return 1e6 * (time.process_time() - started) / (each * CALLERS)


async def _measure(models: Path, requests: int) -> Overhead:
    tiny = ModelSettings(name="tiny", path=model_path(models, "tiny"), max_batch_size=64)
    server = create_app(ServerSettings(models=(tiny,)))
    body = request_body("tiny")
    async with lifespan_of(server)(None):
        bare_us = await _per_request_us(bare_app, body, requests)
        server_us = await _per_request_us(server, body, requests)
        histogram = server.state.service.metrics.models["tiny"].histograms["batch_size"]
        mean_batch = histogram.total / max(1, sum(histogram.counts))
    return Overhead(bare_us, server_us, mean_batch)


def run_overhead(models: Path, requests: int = 20_000) -> Overhead:
    result = uvloop.run(_measure(models, requests))
    print(
        f"  bare route {result.bare_us:.1f} us/request, loopserve {result.server_us:.1f} "
        f"us/request (+{result.extra_us:.1f}), mean batch {result.mean_batch:.1f}",
        flush=True,
    )
    return result
