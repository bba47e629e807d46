"""App factories for real-uvicorn tests (``uvicorn tests.apps:parent_app --factory``)."""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi import FastAPI

from pipeline.app import create_app, lifespan_of
from pipeline.settings import ModelSettings, ServerSettings
from tests.fakes import fake_factory


def parent_app() -> FastAPI:
    """A FastAPI app of a user's, with loopserve mounted at /ml serving ``slow``: a model
    whose forward pass never finishes until shutdown closes it, so it stays saturated."""
    gate = threading.Event()  # opened only by the runner's close() at shutdown
    factory, _ = fake_factory(gate)
    slow = ModelSettings(
        name="slow", path=Path("unused.onnx"), max_batch_size=1, max_queue=3, timeout_s=2.0
    )
    inner = create_app(ServerSettings(models=(slow,), drain_timeout_s=1), runner_factory=factory)
    parent = FastAPI(lifespan=lifespan_of(inner))

    @parent.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "from the parent app"}

    parent.mount("/ml", inner)
    return parent
