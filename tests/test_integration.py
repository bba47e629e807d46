"""End to end on a real ``uvicorn`` over 127.0.0.1, as a user would talk to it."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from tests.server_proc import ROOT, RunningServer, uvicorn

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    # The server runs in another process: its loop is not this one, so this test loop
    # runs without debug mode (which would flag the test's own subprocess handling).
    return "asyncio"


REPOSITORY = ROOT / "repository"


@pytest.fixture(scope="module")
def demo() -> Iterator[RunningServer]:
    """``uvicorn server:app`` with the demo set, as `make serve` runs it."""
    build = [sys.executable, "-m", "models.build", "--repository", str(REPOSITORY)]
    subprocess.run(build, cwd=ROOT, check=True, capture_output=True)
    with uvicorn("server:app") as server:
        yield server


@pytest.fixture(scope="module")
def photo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(7)
    gradient = np.linspace(0, 255, 800, dtype=np.float32)[None, :, None]
    pixels = np.clip(gradient + rng.normal(0, 30, (600, 800, 3)), 0, 255).astype(np.uint8)
    path = tmp_path_factory.mktemp("img") / "photo.jpg"
    Image.fromarray(pixels).save(path, format="JPEG", quality=90)
    return path


def curl(*args: str) -> tuple[int, dict[str, object]]:
    out = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", *args], capture_output=True, text=True, check=True
    ).stdout
    body, status = out.rsplit("\n", 1)
    return int(status), json.loads(body)


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
def test_curl_uploads_a_photo_to_the_classifier(demo: RunningServer, photo: Path) -> None:
    url = f"{demo.url}/predict/classifier"
    status, raw = curl("--data-binary", f"@{photo}", "-H", "Content-Type: image/jpeg", url)
    assert status == 200
    status, multipart = curl("-F", f"file=@{photo};type=image/jpeg", url)
    assert status == 200
    assert raw == multipart  # the same image gives the same answer either way
    predictions = raw["predictions"]
    assert isinstance(predictions, list) and len(predictions) == 5
    scores = [p["score"] for p in predictions]
    assert scores == sorted(scores, reverse=True)
    assert all(isinstance(p["label"], str) and p["label"] for p in predictions)


async def test_200_concurrent_clients_each_get_their_own_answer(demo: RunningServer) -> None:
    rng = np.random.default_rng(11)
    inputs = rng.standard_normal((200, 256)).astype(np.float32)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=demo.url, limits=limits, timeout=60) as client:
        responses = await asyncio.gather(
            *(client.post("/predict/mlp", json={"inputs": {"x": row.tolist()}}) for row in inputs)
        )
        metrics = (await client.get("/metrics")).text
    assert [r.status_code for r in responses] == [200] * 200
    got = np.array([r.json()["outputs"]["y"] for r in responses], dtype=np.float32)
    session = ort.InferenceSession(
        str(REPOSITORY / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    expected = np.concatenate([session.run(None, {"x": row[None]})[0] for row in inputs])
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)
    assert not np.allclose(got[0], got[1])  # distinct inputs, distinct answers
    batches = _metric(metrics, 'loopserve_batch_size_count{model="mlp"}')
    assert batches < 200  # requests were batched together


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def jpeg(photo: Path) -> bytes:
    return photo.read_bytes()


async def test_bad_inputs_get_4xx_and_the_server_keeps_serving(
    demo: RunningServer, jpeg: bytes
) -> None:
    cases = [
        ("classifier", b"not an image at all", "image/jpeg", 400),
        ("classifier", jpeg[: len(jpeg) // 3], "image/jpeg", 400),  # truncated
        ("classifier", jpeg, "text/plain", 415),
        ("classifier", b"", "image/png", 400),
        ("mlp", b'{"inputs": {"x": [1, 2]}}', "application/json", 422),
        ("mlp", b'{"inputs": ', "application/json", 400),
        ("mlp", b"[" * 100_000, "application/json", 400),
        ("mlp", b"0" * (17 * 1024 * 1024), "application/json", 413),
        ("nope", b"{}", "application/json", 404),
    ]
    async with httpx.AsyncClient(base_url=demo.url, timeout=60) as client:
        for model, content, content_type, status in cases:
            response = await client.post(
                f"/predict/{model}", content=content, headers={"content-type": content_type}
            )
            assert response.status_code == status, (model, content[:20], response.text)
            assert set(response.json()) == {"error"}
        ok = await client.post("/predict/tiny", json={"inputs": {"x": [0.5] * 64}})
        ready = await client.get("/ready")
    assert ok.status_code == 200
    assert len(ok.json()["outputs"]["y"]) == 64
    assert ready.json()["ready"] is True
    assert ready.json()["models"]["mlp"]["providers"][-1] == "CPUExecutionProvider"
    assert demo.process.poll() is None  # still running


async def test_health_answers_while_a_mounted_model_is_saturated() -> None:
    with uvicorn("tests.apps:parent_app", "--factory") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.get("/hello")).json() == {"hello": "from the parent app"}
            stuck = [
                asyncio.ensure_future(
                    client.post("/ml/predict/slow", json={"inputs": {"x": [1] * 4}})
                )
                for _ in range(4)
            ]
            # Probe until admission refuses: then one request is inside the model, which
            # never finishes, and the backlog (3) is full. Admitted probes time out fast.
            for _ in range(200):
                probe = await client.post(
                    "/ml/predict/slow?timeout_s=0.05", json={"inputs": {"x": [2] * 4}}
                )
                if probe.status_code == 503:
                    break
                assert probe.status_code == 504
            assert probe.status_code == 503
            health = await client.get("/ml/health", timeout=2)
            ready = await client.get("/ml/ready", timeout=2)
            assert health.status_code == 200
            assert ready.json()["models"]["slow"]["providers"] == ["FakeProvider"]
            # The one inside the model is still waiting (the others may have been refused).
            assert not all(t.done() for t in stuck)
            answers = await asyncio.gather(*stuck)
    codes = [a.status_code for a in answers]
    assert set(codes) <= {503, 504} and 504 in codes  # each got exactly one answer
