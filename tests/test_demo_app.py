"""The demo set in-process with real ONNX Runtime sessions: classifier uploads, raw tensors."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
from PIL import Image

from pipeline.app import create_app, lifespan_of
from pipeline.settings import DEMO_CONFIG, load_settings

pytestmark = pytest.mark.anyio

ROOT_REPOSITORY = DEMO_CONFIG.parent / "repository"


@pytest.fixture(scope="module")
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"debug": True})  # module scope: one loop for the shared app


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(load_settings(DEMO_CONFIG))
    async with lifespan_of(app)(None):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            yield c


def image(fmt: str, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (320, 240), colour).save(buffer, format=fmt)
    return buffer.getvalue()


async def test_raw_and_multipart_uploads_give_the_same_top5(client: httpx.AsyncClient) -> None:
    png = image("PNG")
    raw = await client.post(
        "/predict/classifier", content=png, headers={"content-type": "image/png"}
    )
    form = await client.post("/predict/classifier", files={"file": ("a.png", png, "image/png")})
    assert raw.status_code == form.status_code == 200
    assert raw.json() == form.json()
    assert len(raw.json()["predictions"]) == 5


async def test_multipart_without_a_file_or_malformed_is_400(client: httpx.AsyncClient) -> None:
    no_file = await client.post("/predict/classifier", data={"field": "value"}, files={})
    broken = await client.post(
        "/predict/classifier",
        content=b"--x\r\nnot a part",
        headers={"content-type": "multipart/form-data; boundary=x"},
    )
    assert no_file.status_code in (400, 415)
    assert broken.status_code == 400
    assert "error" in broken.json()


@pytest.fixture(scope="module")
def bomb() -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buffer, format="PNG")  # 81 Mpx, compresses to ~80 kB
    return buffer.getvalue()


async def test_a_decompression_bomb_is_refused_before_decoding(
    client: httpx.AsyncClient, bomb: bytes
) -> None:
    response = await client.post(
        "/predict/classifier", content=bomb, headers={"content-type": "image/png"}
    )
    assert response.status_code == 413


async def test_raw_tensors_round_trip_through_the_real_models(client: httpx.AsyncClient) -> None:
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    response = await client.post("/predict/tiny", json={"inputs": {"x": x.tolist()}})
    assert response.status_code == 200
    assert np.asarray(response.json()["outputs"]["y"]).shape == (64,)
    models = (await client.get("/models")).json()["models"]
    assert [m["name"] for m in models] == ["classifier", "detector", "mlp", "tiny"]
    assert models[0]["api"]["weights"].startswith("synthetic")


async def test_your_own_classifier_with_your_labels(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Any ONNX classifier with a (3, 224, 224) float input serves with a config change only."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.settings import ModelSettings, ServerSettings

    folder = tmp_path_factory.mktemp("own")
    weights = np.zeros((3, 10), dtype=np.float32)
    weights[0, 7] = 50.0  # a red image scores class 7 ("seven") highest
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["input"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("Gemm", ["flat", "w"], ["scores"]),
        ],
        "own",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 3, 224, 224])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 10])],
        [numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "own.onnx")
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    (folder / "labels.txt").write_text("\n".join(names) + "\n")
    own = ModelSettings(
        name="own", path=folder / "own.onnx", servable="classifier", labels=folder / "labels.txt"
    )
    app = create_app(ServerSettings(models=(own,)))
    async with lifespan_of(app)(None):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            response = await c.post(
                "/predict/own",
                content=image("PNG", (255, 0, 0)),
                headers={"content-type": "image/png"},
            )
            described = (await c.get("/models")).json()["models"][0]["api"]
    assert response.json()["predictions"][0]["label"] == "seven"
    assert described["classes"] == 10
    assert described["weights"] == "yours"


async def test_per_model_input_limits_are_configurable() -> None:
    from pipeline.settings import ModelSettings, ServerSettings

    demo = ROOT_REPOSITORY / "classifier" / "1" / "model.onnx"
    strict = ModelSettings(
        name="strict",
        path=demo,
        servable="classifier",
        max_image_pixels=100 * 100,  # a decompression-bomb guard, from the header alone
        content_types=("image/png",),
        max_body_bytes=50_000,
    )
    app = create_app(ServerSettings(models=(strict,)))
    async with lifespan_of(app)(None):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            png = image("PNG")  # 320x240: over 100x100 pixels
            too_many_pixels = await c.post(
                "/predict/strict", content=png, headers={"content-type": "image/png"}
            )
            jpeg = await c.post(
                "/predict/strict", content=image("JPEG"), headers={"content-type": "image/jpeg"}
            )
            too_big = await c.post(
                "/predict/strict", content=b"\x89PNG" + b"0" * 60_000,
                headers={"content-type": "image/png"},
            )  # fmt: skip
    assert too_many_pixels.status_code == 413
    assert "10000 pixels" in too_many_pixels.json()["error"]
    assert jpeg.status_code == 415
    assert "image/png" in jpeg.json()["error"]
    assert too_big.status_code == 413


async def test_preprocessing_in_worker_processes_gives_the_same_answers(
    client: httpx.AsyncClient,
) -> None:
    from pipeline.settings import ModelSettings, ServerSettings

    demo = ROOT_REPOSITORY / "classifier" / "1" / "model.onnx"
    pooled = ModelSettings(
        name="pooled", path=demo, servable="classifier", preprocess_workers=2, max_batch_size=4
    )
    app = create_app(ServerSettings(models=(pooled,)))
    pictures = [image("JPEG", (200, 30, 30)), image("PNG", (20, 200, 90)), image("JPEG")]
    async with lifespan_of(app)(None):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            pooled_answers = [
                await c.post("/predict/pooled", content=p, headers={"content-type": "image/jpeg"})
                for p in pictures
            ]
            described = (await c.get("/models")).json()["models"][0]
    in_thread = [
        await client.post("/predict/classifier", content=p, headers={"content-type": "image/jpeg"})
        for p in pictures
    ]
    assert [a.json() for a in pooled_answers] == [a.json() for a in in_thread]
    assert described["preprocess_workers"] == 2
    assert described["slots"]["shared_memory"] is True
    assert described["slots"]["count"] == 8
