"""The Open Inference Protocol end to end: NVIDIA's tritonclient, unchanged, against a
real ``uvicorn server:app`` serving a model repository on 127.0.0.1."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from onnx import TensorProto, helper, numpy_helper
from PIL import Image
from tritonclient.utils import InferenceServerException

from tests.server_proc import ROOT, RunningServer, uvicorn

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

TYPES = {  # input name -> (ONNX element type, numpy dtype, V2 datatype)
    "i8": (TensorProto.INT8, np.int8, "INT8"),
    "u16": (TensorProto.UINT16, np.uint16, "UINT16"),
    "i32": (TensorProto.INT32, np.int32, "INT32"),
    "i64": (TensorProto.INT64, np.int64, "INT64"),
    "u8": (TensorProto.UINT8, np.uint8, "UINT8"),
    "u64": (TensorProto.UINT64, np.uint64, "UINT64"),
    "f16": (TensorProto.FLOAT16, np.float16, "FP16"),
    "f64": (TensorProto.DOUBLE, np.float64, "FP64"),
    "flag": (TensorProto.BOOL, np.bool_, "BOOL"),
    "text": (TensorProto.STRING, np.object_, "BYTES"),
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the server runs in another process (see test_integration.py)


def save(model: onnx.ModelProto, path: Path) -> None:
    model.ir_version = 8  # onnxruntime 1.31 loads at most IR 13; the newest onnx writes 14
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)


def scale_model(factor: float) -> onnx.ModelProto:
    """y = factor * x on FP32 [batch, 4]: the answer says which version ran."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.array([factor], dtype=np.float32), "k")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def types_model() -> onnx.ModelProto:
    """Identity on one input of every datatype: what goes in must come back out."""
    nodes = [helper.make_node("Identity", [n], [f"{n}_out"]) for n in TYPES]
    inputs = [helper.make_tensor_value_info(n, t, ["batch", 3]) for n, (t, _, _) in TYPES.items()]
    outputs = [
        helper.make_tensor_value_info(f"{n}_out", t, ["batch", 3]) for n, (t, _, _) in TYPES.items()
    ]
    graph = helper.make_graph(nodes, "types", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("repository")
    (folder / "scale").mkdir()
    (folder / "scale" / "config.toml").write_text(
        "max_batch_size = 8\nmax_queue = 4096\nversion_policy = { all = true }\n"
    )
    save(scale_model(1.0), folder / "scale" / "1" / "model.onnx")
    save(scale_model(2.0), folder / "scale" / "2" / "model.onnx")
    (folder / "types").mkdir()
    (folder / "types" / "config.toml").write_text("max_batch_size = 8\n")
    save(types_model(), folder / "types" / "1" / "model.onnx")
    demo = ROOT / "repository" / "classifier"
    shutil.copytree(demo, folder / "classifier")
    return folder


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    config = tmp_path_factory.mktemp("config") / "v2.toml"
    config.write_text(f'[server]\ndrain_timeout_s = 5\nrepository = "{repo}"\n')
    with uvicorn("server:app", env={"LOOPSERVE_CONFIG": str(config)}) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(url=server.url.removeprefix("http://"), concurrency=4)
    yield c
    c.close()


def infer_scale(
    client: triton.InferenceServerClient, x: np.ndarray, binary: bool, version: str = ""
) -> np.ndarray:
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = [triton.InferRequestedOutput("y", binary_data=binary)]
    result = client.infer("scale", [tensor], model_version=version, outputs=wanted)
    y: np.ndarray = result.as_numpy("y")
    return y


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    server = client.get_server_metadata()
    assert server["name"] == "loopserve"
    assert "binary_tensor_data" in server["extensions"]
    meta = client.get_model_metadata("scale")
    assert meta["versions"] == ["1", "2"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]
    assert client.get_model_metadata("scale", "1")["name"] == "scale"
    assert client.is_model_ready("scale")
    assert client.is_model_ready("scale", "1")
    assert not client.is_model_ready("nope")


@pytest.mark.parametrize("binary", [False, True])
def test_infer_json_and_binary_reaches_the_latest_or_the_named_version(
    client: triton.InferenceServerClient, binary: bool
) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)  # a batch of 3: three items
    np.testing.assert_array_equal(infer_scale(client, x, binary), x * 2)
    np.testing.assert_array_equal(infer_scale(client, x, binary, version="1"), x)


@pytest.mark.parametrize("binary", [False, True])
def test_every_datatype_round_trips(client: triton.InferenceServerClient, binary: bool) -> None:
    rng = np.random.default_rng(5)
    inputs, expected = [], {}
    for name, (_, dtype, datatype) in TYPES.items():
        if datatype == "BYTES":
            value = np.array([[b"a", b"bc", "\u00e9t\u00e9".encode()]] * 2, dtype=np.object_)
        elif datatype == "BOOL":
            value = rng.random((2, 3)) > 0.5
        elif np.dtype(dtype).kind == "f":
            value = rng.standard_normal((2, 3)).astype(dtype)
        else:
            info = np.iinfo(dtype)
            value = np.array([[info.min, 0, info.max], [1, 2, 3]], dtype=dtype)
        tensor = triton.InferInput(name, [2, 3], datatype)
        tensor.set_data_from_numpy(value, binary_data=binary)
        inputs.append(tensor)
        expected[f"{name}_out"] = value
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in expected]
    result = client.infer("types", inputs, outputs=outputs)
    for name, value in expected.items():
        got = result.as_numpy(name)
        if value.dtype == np.object_ and not binary:
            value = np.vectorize(bytes.decode, otypes=[object])(value)  # JSON BYTES: str
        assert got.dtype == value.dtype, name
        np.testing.assert_array_equal(got, value, err_msg=name)


def test_outputs_default_to_all_and_to_tritonclients_binary_choice(
    client: triton.InferenceServerClient,
) -> None:
    tensor = triton.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    result = client.infer("scale", [tensor])  # no outputs named: tritonclient asks binary
    np.testing.assert_array_equal(result.as_numpy("y"), np.full((1, 4), 2, dtype=np.float32))


def test_the_classifier_takes_encoded_images_as_bytes(client: triton.InferenceServerClient) -> None:
    images = []
    for colour in ((250, 10, 10), (10, 10, 250)):
        buffer = io.BytesIO()
        Image.new("RGB", (300, 200), colour).save(buffer, format="JPEG")
        images.append(buffer.getvalue())
    tensor = triton.InferInput("input", [2], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_))
    result = client.infer("classifier", [tensor])
    meta = client.get_model_metadata("classifier")
    assert meta["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "predictions", "datatype": "BYTES", "shape": [-1, 5]}]
    predictions = result.as_numpy("predictions")
    assert predictions.shape == (2, 5)
    first = [json.loads(p) for p in predictions[0]]
    assert {"label", "score"} <= set(first[0])


@pytest.mark.parametrize(
    ("model", "name", "shape", "datatype", "status", "message"),
    [
        ("scale", "x", [1, 4], "FP64", 400, "datatype FP64"),
        ("scale", "x", [1, 5], "FP32", 400, "shape"),
        ("scale", "z", [1, 4], "FP32", 400, "unknown input"),
        ("nope", "x", [1, 4], "FP32", 404, "no model"),
    ],
)
def test_bad_requests_get_the_protocols_errors(
    client: triton.InferenceServerClient,
    model: str,
    name: str,
    shape: list[int],
    datatype: str,
    status: int,
    message: str,
) -> None:
    tensor = triton.InferInput(name, shape, datatype)
    dtype = np.float64 if datatype == "FP64" else np.float32
    tensor.set_data_from_numpy(np.zeros(shape, dtype=dtype))
    with pytest.raises(InferenceServerException) as error:
        client.infer(model, [tensor])
    assert error.value.status() == str(status)
    assert message in error.value.message()


async def test_malformed_bodies_are_400_json_and_the_server_keeps_serving(
    server: RunningServer,
) -> None:
    header = json.dumps(
        {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                     "parameters": {"binary_data_size": 64}}]}
    ).encode()  # fmt: skip
    cases = [
        (b"{", {}),
        (b'{"inputs": []}', {}),
        (header + b"\0" * 16, {"inference-header-content-length": str(len(header))}),
        (header, {"inference-header-content-length": "999999"}),
    ]
    async with httpx.AsyncClient(base_url=server.url) as http:
        for body, headers in cases:
            response = await http.post("/v2/models/scale/infer", content=body, headers=headers)
            assert response.status_code == 400, response.text
            assert set(response.json()) == {"error"}
        bad_version = await http.post("/v2/models/scale/versions/9/infer", content=b"{}")
        escape = await http.post("/v2/repository/models/..%2Fetc/load")
        ok = await http.get("/v2/health/ready")
    assert bad_version.status_code == 404
    assert escape.status_code in (400, 404)
    assert ok.status_code == 200


async def test_64_concurrent_aio_clients_each_get_their_own_results(server: RunningServer) -> None:
    client = triton_aio.InferenceServerClient(url=server.url.removeprefix("http://"))
    try:

        async def one(i: int) -> np.ndarray:
            x = np.full((1, 4), i, dtype=np.float32)
            tensor = triton_aio.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(x, binary_data=i % 2 == 0)
            result = await client.infer("scale", [tensor])
            y: np.ndarray = result.as_numpy("y")
            return y

        answers = await asyncio.gather(*(one(i) for i in range(64)))
    finally:
        await client.close()
    for i, y in enumerate(answers):
        np.testing.assert_array_equal(y, np.full((1, 4), 2 * i, dtype=np.float32))


def test_loading_a_new_version_and_unloading_lose_no_request(
    client: triton.InferenceServerClient, repo: Path, server: RunningServer
) -> None:
    x = np.ones((1, 4), dtype=np.float32)
    answers: list[float] = []
    errors: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        own = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
        try:
            while not stop.is_set() and len(answers) + len(errors) < 5000:
                try:
                    answers.append(float(infer_scale(own, x, binary=True)[0, 0]))
                except InferenceServerException as exc:
                    errors.append(f"{exc.status()} {exc.message()}")
        finally:
            own.close()

    workers = [threading.Thread(target=traffic) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        # A new version 3 arrives and the policy moves to the latest one only.
        save(scale_model(3.0), repo / "scale" / "3" / "model.onnx")
        (repo / "scale" / "config.toml").write_text(
            "max_batch_size = 8\nmax_queue = 4096\nversion_policy = { latest = 1 }\n"
        )
        client.load_model("scale")
        served_3 = infer_scale(client, x, binary=True)
        assert client.get_model_metadata("scale")["versions"] == ["3"]
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
    assert errors == [], "".join(server.log)[-3000:]  # nothing in flight was dropped
    assert set(answers) <= {2.0, 3.0} and 3.0 in set(answers) | {float(served_3[0, 0])}
    index = {(r["name"], r["version"]): r["state"] for r in client.get_model_repository_index()}
    assert index[("scale", "3")] == "READY"
    assert index[("scale", "1")] == "UNAVAILABLE"

    client.unload_model("types")
    assert not client.is_model_ready("types")
    with pytest.raises(InferenceServerException) as gone:
        client.get_model_metadata("types")
    assert gone.value.status() == "404"
    client.load_model("types")
    assert client.is_model_ready("types")
