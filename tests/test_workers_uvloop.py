"""Worker processes under uvloop, as `uvicorn server:app` runs them: uvloop makes the
file descriptors it watches non-blocking, which once broke sending a big photo to a
worker (the default asyncio loop, which the other tests use, does not)."""

from __future__ import annotations

import httpx
import uvloop

from bench.images import photo_jpeg
from pipeline.app import create_app, lifespan_of
from pipeline.settings import DEMO_CONFIG, ModelSettings, ServerSettings


def test_a_photo_sized_jpeg_reaches_a_worker_process_on_uvloop() -> None:
    body = photo_jpeg(1920, 1080)
    assert len(body) > 1_000_000  # far more than a pipe buffer holds
    classifier = DEMO_CONFIG.parent / "repository" / "classifier" / "1" / "model.onnx"
    pooled = ModelSettings(
        name="pooled", path=classifier, servable="classifier", preprocess_workers=1
    )

    async def scenario() -> list[int]:
        app = create_app(ServerSettings(models=(pooled,)))
        async with lifespan_of(app)(None):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                codes = []
                for _ in range(3):
                    response = await client.post(
                        "/predict/pooled", content=body, headers={"content-type": "image/jpeg"}
                    )
                    codes.append(response.status_code)
                    assert len(response.json()["predictions"]) == 5, response.text
                return codes

    assert uvloop.run(scenario()) == [200, 200, 200]
