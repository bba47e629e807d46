"""Decomposed inference end to end: generated aerial-like scenes of 640 to 10000 px a
side through POST /predict/detector, against their ground truth; bounded tiles,
fairness, cancellation and failure."""

from __future__ import annotations

import asyncio
import io
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from models.detector import Detector
from models.detector.scenes import Box, Scene, generate, seams
from pipeline.app import create_app, lifespan_of
from pipeline.settings import DEMO_CONFIG, ModelSettings, ServerSettings
from tests.fakes import post_scope

pytestmark = pytest.mark.anyio

DETECTOR = DEMO_CONFIG.parent / "repository" / "detector" / "1" / "model.onnx"
SLOTS = 8


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # No debug-mode blocked-loop check here: these tests make 100-300 MB scenes and encode
    # them in threads beside the server, and the GIL they hold shows up as slow loop steps
    # that a server alone does not have (run alone, `detect` on 10000x10000 has none).
    return "asyncio"


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = ModelSettings(
        name="detector",
        path=DETECTOR,
        servable="detector",
        max_batch_size=8,
        slots=SLOTS,
        max_image_pixels=400_000_000,
        max_body_bytes=1 << 30,
    )
    app = create_app(ServerSettings(models=(settings,)))
    async with lifespan_of(app)(None):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            yield c, app.state.service.get("detector")


def encoded(scene: Scene, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    options = {"compress_level": 1} if fmt == "PNG" else {}
    Image.fromarray(scene.image).save(buffer, format=fmt, **options)
    return buffer.getvalue()


def box_iou(a: tuple[float, float, float, float], b: Box) -> float:
    x1, y1 = max(a[0], b.x1), max(a[1], b.y1)
    x2, y2 = min(a[2], b.x2), min(a[3], b.y2)
    inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b.x2 - b.x1) * (b.y2 - b.y1) - inter
    return inter / union if union else 0.0


def score(found: list[dict[str, Any]], truth: list[Box]) -> tuple[float, float, set[int]]:
    """Precision, recall at IoU 0.5 (same label, one-to-one), and the matched truths."""
    matched: set[int] = set()
    hits = 0
    for det in sorted(found, key=lambda d: -d["score"]):
        best, best_iou = None, 0.5
        for i, t in enumerate(truth):
            if i in matched or t.label != det["label"]:
                continue
            value = box_iou(tuple(det["box"]), t)  # type: ignore[arg-type]
            if value >= best_iou:
                best, best_iou = i, value
        if best is not None:
            matched.add(best)
            hits += 1
    precision = hits / len(found) if found else 1.0
    recall = hits / len(truth) if truth else 1.0
    return precision, recall, matched


def crosses_a_seam(box: Box, width: int, height: int) -> bool:
    xs, ys = seams(width, 640, 0.2), seams(height, 640, 0.2)
    return any(box.x1 < s < box.x2 for s in xs) or any(box.y1 < s < box.y2 for s in ys)


@pytest.mark.parametrize(("width", "height", "seed"), [(640, 640, 1), (3000, 2000, 2)])
async def test_scenes_are_detected_whole_across_tile_seams(
    served: tuple[httpx.AsyncClient, Any], width: int, height: int, seed: int
) -> None:
    client, _ = served
    scene = await asyncio.to_thread(generate, width, height, seed)
    png = await asyncio.to_thread(encoded, scene)
    response = await client.post(
        "/predict/detector", content=png, headers={"content-type": "image/png"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["image"] == {"width": width, "height": height}
    assert body["tiles"] == len(_plan(width, height))
    precision, recall, matched = await asyncio.to_thread(score, body["detections"], scene.boxes)
    assert precision >= 0.98 and recall >= 0.98, (precision, recall)
    on_seams = [i for i, b in enumerate(scene.boxes) if crosses_a_seam(b, width, height)]
    if width > 640:
        assert on_seams, "the generator places objects across seams"
    assert set(on_seams) <= matched  # every object cut by a seam is found, once


def _plan(width: int, height: int) -> list[Any]:
    from pipeline.tiling import plan_tiles

    return plan_tiles(width, height, 640, 0.2)


async def test_a_10000_px_scene_with_tiles_never_above_the_slots(
    served: tuple[httpx.AsyncClient, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, model = served
    live, most = 0, 0
    original = Detector.tile_input

    def counted(self: Detector, tile: np.ndarray) -> dict[str, np.ndarray]:
        nonlocal live, most
        made = original(self, tile)
        live += 1
        most = max(most, live)

        def gone() -> None:
            nonlocal live
            live -= 1

        weakref.finalize(made["image"], gone)
        return made

    monkeypatch.setattr(Detector, "tile_input", counted)
    scene = await asyncio.to_thread(generate, 10_000, 10_000, 3)
    body = await asyncio.to_thread(encoded, scene, "TIFF")  # uncompressed: quick both ways
    response = await client.post(
        "/predict/detector", content=body, headers={"content-type": "image/tiff"}
    )
    assert response.status_code == 200, response.text
    found = response.json()
    precision, recall, matched = await asyncio.to_thread(score, found["detections"], scene.boxes)
    assert precision >= 0.98 and recall >= 0.98, (precision, recall)
    seam_boxes = [i for i, b in enumerate(scene.boxes) if crosses_a_seam(b, 10_000, 10_000)]
    assert set(seam_boxes) <= matched
    assert found["tiles"] == 400
    assert most <= SLOTS  # tiles made at once never above the slot count
    assert model.slots.high_water <= SLOTS
    assert model.slots.in_use == 0 and model.outstanding == 0


async def test_render_png_draws_the_boxes_scaled_down(
    served: tuple[httpx.AsyncClient, Any],
) -> None:
    client, _ = served
    scene = await asyncio.to_thread(generate, 3000, 1500, 4)
    png = await asyncio.to_thread(encoded, scene)
    response = await client.post(
        "/predict/detector?render=png&full_image=true",
        content=png,
        headers={"content-type": "image/png"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png"
    picture = Image.open(io.BytesIO(response.content))
    assert picture.size == (2048, 1024)  # the longer side scaled down to 2048
    pixels = np.asarray(picture.convert("RGB"))
    assert ((pixels == (255, 0, 255)).all(axis=-1)).sum() > 100  # the drawn boxes


@pytest.mark.parametrize(
    "query",
    ["overlap=2", "strategy=magic", "metric=dice", "tile=9999", "score_threshold=x",
     "full_image=maybe", "render=jpeg", "colour=red"],
)  # fmt: skip
async def test_bad_options_are_400(served: tuple[httpx.AsyncClient, Any], query: str) -> None:
    client, _ = served
    png = await asyncio.to_thread(lambda: encoded(generate(100, 100, 5)))
    response = await client.post(
        f"/predict/detector?{query}", content=png, headers={"content-type": "image/png"}
    )
    assert response.status_code == 400
    assert "error" in response.json()


async def test_options_change_the_merge(served: tuple[httpx.AsyncClient, Any]) -> None:
    client, _ = served
    scene = await asyncio.to_thread(generate, 1500, 1500, 6)
    png = await asyncio.to_thread(encoded, scene)
    answers = {}
    for query in ("", "strategy=nms&metric=iou", "tile=400&overlap=0.25"):
        response = await client.post(
            f"/predict/detector?{query}", content=png, headers={"content-type": "image/png"}
        )
        assert response.status_code == 200, (query, response.text)
        answers[query] = response.json()
        precision, recall, _ = await asyncio.to_thread(
            score, answers[query]["detections"], scene.boxes
        )
        assert precision >= 0.95 and recall >= 0.95, (query, precision, recall)
    assert answers["tile=400&overlap=0.25"]["tiles"] > answers[""]["tiles"]


async def test_a_big_image_does_not_starve_another_client(
    served: tuple[httpx.AsyncClient, Any],
) -> None:
    client, model = served
    big = await asyncio.to_thread(lambda: encoded(generate(6000, 6000, 7), "TIFF"))
    small = await asyncio.to_thread(lambda: encoded(generate(640, 640, 8)))
    first = asyncio.ensure_future(
        client.post("/predict/detector", content=big, headers={"content-type": "image/tiff"})
    )
    for _ in range(100_000):  # yield until the big one's tiles are flowing (bounded)
        if model.batcher.outstanding or first.done():
            break
        await asyncio.sleep(0)
    other = await client.post(
        "/predict/detector", content=small, headers={"content-type": "image/png"}
    )
    assert other.status_code == 200
    assert not first.done()  # answered while the big image still had tiles to go
    assert (await first).status_code == 200


async def test_a_failing_tile_fails_the_request_and_leaves_nothing_running(
    served: tuple[httpx.AsyncClient, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, model = served
    calls = 0
    original = Detector.detections

    def flaky(self: Detector, outputs: Any, threshold: float) -> Any:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise RuntimeError("a broken tile")
        return original(self, outputs, threshold)

    monkeypatch.setattr(Detector, "detections", flaky)
    png = await asyncio.to_thread(lambda: encoded(generate(3000, 3000, 9)))
    response = await client.post(
        "/predict/detector", content=png, headers={"content-type": "image/png"}
    )
    assert response.status_code == 500
    assert response.json() == {
        "error": "model detector failed on a tile of this image; the request was stopped"
    }
    assert model.slots.in_use == 0 and model.outstanding == 0 and model.backlog == 0
    assert calls < 36  # the rest of its tiles were cancelled, not run


async def test_a_client_that_leaves_cancels_its_remaining_tiles(
    served: tuple[httpx.AsyncClient, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, model = served
    app = client._transport.app  # type: ignore[attr-defined]
    ran = 0
    original = Detector.detections

    def counting(self: Detector, outputs: Any, threshold: float) -> Any:
        nonlocal ran
        ran += 1
        return original(self, outputs, threshold)

    monkeypatch.setattr(Detector, "detections", counting)
    body = await asyncio.to_thread(lambda: encoded(generate(6000, 6000, 12), "TIFF"))
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, object]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()  # the client leaves when the test says so
        return {"type": "http.disconnect"}

    replies: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        replies.append(message)

    scope = post_scope("/predict/detector", "image/tiff")
    call = asyncio.ensure_future(app(scope, receive, send))
    for _ in range(1_000_000):  # yield until tiles are being answered (bounded)
        if ran >= 3 or call.done():
            break
        await asyncio.sleep(0)
    gone.set()
    await asyncio.wait_for(call, 60)
    assert replies[0]["status"] == 499
    assert 3 <= ran < 144  # 144 tiles planned: the rest were cancelled, not run
    assert model.slots.in_use == 0 and model.outstanding == 0 and model.backlog == 0
