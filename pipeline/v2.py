"""The Open Inference Protocol (KServe V2) over HTTP/REST, for existing clients.

Routes map V2 requests onto the same models, batchers, admission and deadlines as
``/predict``: a request whose batch dimension is n becomes n items that batch with
everyone else's and are joined back in order. Servables with preprocessing take
a BYTES tensor of encoded inputs and answer the tensors of their postprocess.
The wire format lives in ``pipeline.v2codec``; this module is the HTTP side.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pipeline.asgi import Watches, header, json_response, read_body, send_body
from pipeline.batcher import Arrival
from pipeline.errors import BadRequest, LoopserveError
from pipeline.model import ServedModel
from pipeline.runtime import Arrays
from pipeline.service import Service
from pipeline.signature import TensorSpec
from pipeline.tensors import RawTensors
from pipeline.v2codec import InferInput, InferRequest, datatype_of, decode_request, encode_response

SERVER_NAME = "loopserve"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ("binary_tensor_data", "model_repository", "schedule_policy")
PLATFORM = "onnxruntime_onnx"
SERVABLE_INPUT = "input"  # the BYTES tensor a servable with preprocessing takes


def routes(service: Service, watches: Watches) -> list[Route]:
    infer = _Infer(service, watches)
    simple = _Simple(service)
    model = "/v2/models/{name}"
    version = "/v2/models/{name}/versions/{version}"
    return [
        Route("/v2", simple.server, methods=["GET"]),
        Route("/v2/health/live", simple.live, methods=["GET"]),
        Route("/v2/health/ready", simple.ready, methods=["GET"]),
        Route(model, simple.metadata, methods=["GET"]),
        Route(version, simple.metadata, methods=["GET"]),
        Route(f"{model}/ready", simple.model_ready, methods=["GET"]),
        Route(f"{version}/ready", simple.model_ready, methods=["GET"]),
        Route(f"{model}/infer", infer, methods=["POST"]),
        Route(f"{version}/infer", infer, methods=["POST"]),
        Route("/v2/repository/index", simple.index, methods=["POST"]),
        Route("/v2/repository/models/{name}/load", simple.load, methods=["POST"]),
        Route("/v2/repository/models/{name}/unload", simple.unload, methods=["POST"]),
    ]


class _Infer:
    """``POST /v2/models/{name}[/versions/{v}]/infer``, raw ASGI like ``/predict``."""

    def __init__(self, service: Service, watches: Watches) -> None:
        self.service = service
        self.watches = watches

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = scope["path_params"]
        model = self.service.get(params["name"], params.get("version"))
        arrival = model.arrival()
        with model.intake(arrival):
            body = await read_body(
                receive, header(scope, b"content-length"), model.settings.max_body_bytes
            )
            request = decode_request(body, _header_length(scope))
            deadline = model.deadline(_timeout_s(request.parameters))
            priority = _priority(request.parameters, model.settings.priority_levels)
            raw = isinstance(model.servable, RawTensors)
            items = _items(model, request) if raw else []
        watch = self.watches.watch(receive)
        try:
            if raw:
                answers = await model.infer(items, deadline, arrival, watch, priority)
                outputs = {
                    spec.name: np.stack([a[spec.name] for a in answers])
                    for spec in model.signature.outputs
                }
            else:
                outputs = await _servable_outputs(model, request, deadline, arrival, priority)
        finally:
            watch.close()
        chosen = _select(request, outputs)
        payload, json_length = encode_response(
            model.name, str(model.settings.version), request.id, chosen
        )
        if json_length is None:
            await send_body(send, payload, b"application/json")
        else:
            length = str(json_length).encode()
            await send_body(
                send,
                payload,
                b"application/octet-stream",
                [(b"inference-header-content-length", length)],
            )


def _header_length(scope: Scope) -> int | None:
    raw = header(scope, b"inference-header-content-length")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise BadRequest(f"bad Inference-Header-Content-Length {raw!r}")
    return int(raw)


def _timeout_s(parameters: dict[str, Any]) -> float | None:
    """Triton's ``timeout`` parameter, in microseconds; it can only shorten the deadline."""
    raw = parameters.get("timeout")
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float) or raw <= 0:
        raise BadRequest(
            f"parameters.timeout must be a positive number of microseconds, got {raw!r}"
        )
    return float(raw) / 1e6


def _priority(parameters: dict[str, Any], levels: int) -> int:
    """Triton's schedule policy: level 1 is served first; 0 or absent is the last level."""
    raw = parameters.get("priority", 0)
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= levels:
        raise BadRequest(f"parameters.priority must be an integer from 0 to {levels}, got {raw!r}")
    level = raw or levels
    return levels - level  # the batcher serves higher numbers first


def _items(model: ServedModel, request: InferRequest) -> list[Arrays]:
    """Split the request's tensors along the batch dimension into the batcher's items."""
    signature = model.signature
    given = {tensor.name: tensor for tensor in request.inputs}
    expected = {spec.name for spec in signature.inputs}
    for name in given:
        if name not in expected:
            raise BadRequest(f"unknown input {name!r}; model {model.name} takes {sorted(expected)}")
    count: int | None = None
    for spec in signature.inputs:
        tensor = given.get(spec.name)
        if tensor is None:
            raise BadRequest(f"missing input {spec.name!r}")
        rows = _rows(spec, tensor, batchable=signature.batchable)
        if count is not None and rows != count:
            raise BadRequest(f"input {spec.name!r} has {rows} rows, other inputs have {count}")
        count = rows
    if not count:
        raise BadRequest("the request holds no items (a batch dimension of 0)")
    data = {spec.name: _model_data(spec, given[spec.name]) for spec in signature.inputs}
    if signature.batchable:
        return [{name: data[name][i] for name in expected} for i in range(count)]
    return [{name: data[name][0] for name in expected}]


def _model_data(spec: TensorSpec, tensor: InferInput) -> np.ndarray:
    """ONNX string tensors hold ``str``; V2 BYTES carry bytes: decode them here, so
    that an undecodable element is the client's 400, not the model's 500."""
    if spec.dtype.kind != "O":
        return tensor.data
    try:
        decoded: np.ndarray = np.vectorize(_utf8, otypes=[object])(tensor.data)
    except UnicodeDecodeError:
        raise BadRequest(f"input {spec.name!r}: the model takes text; send UTF-8") from None
    return decoded


def _utf8(value: bytes) -> str:
    return value.decode("utf-8")


def _wire(array: np.ndarray) -> np.ndarray:
    """The other way: text a model returns goes out as BYTES."""
    if array.dtype.kind != "O":
        return array
    encoded: np.ndarray = np.vectorize(
        lambda v: v.encode() if isinstance(v, str) else v, otypes=[object]
    )(array)
    return encoded


def _rows(spec: TensorSpec, tensor: InferInput, batchable: bool) -> int:
    want = datatype_of(spec.dtype)
    if tensor.datatype != want:
        raise BadRequest(
            f"input {spec.name!r}: datatype {tensor.datatype} given, the model takes {want}"
        )
    shape = tensor.shape
    fits = len(shape) == len(spec.shape) and all(
        e is None or s == e for s, e in zip(shape[1:], spec.shape[1:], strict=True)
    )
    if not batchable:
        fits = fits and shape[0] == spec.shape[0]
    if not fits:
        shown = [-1 if d is None else d for d in spec.shape]
        raise BadRequest(f"input {spec.name!r}: shape {list(shape)} given, the model takes {shown}")
    return shape[0]


async def _servable_outputs(
    model: ServedModel, request: InferRequest, deadline: float, arrival: Arrival, priority: int
) -> dict[str, np.ndarray]:
    """Each element of the BYTES input is one raw request (an encoded image, say)."""
    try:
        if len(request.inputs) != 1 or request.inputs[0].datatype != "BYTES":
            raise BadRequest(
                f"model {model.name} takes one BYTES input ({SERVABLE_INPUT!r}) holding the "
                "encoded inputs, one element each"
            )
        tensor = request.inputs[0]
        elements = list(tensor.data.reshape(-1))
        if not elements:
            raise BadRequest("the request holds no items")
        content_type = tensor.parameters.get("content_type", _default_content_type(model))
        if not isinstance(content_type, str):
            raise BadRequest("the input's parameters.content_type must be a string")
        arrivals = [model.arrival() for _ in elements]  # each element is a request of its own
    finally:
        arrival.done()
    results = await asyncio.gather(
        *(
            model.predict(bytes(e), content_type, deadline, a, priority=priority)
            for e, a in zip(elements, arrivals, strict=True)
        ),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return _tensors_of([r for r in results if isinstance(r, dict)], model)


def _default_content_type(model: ServedModel) -> str:
    accepted = model.servable.content_types
    if "application/octet-stream" in accepted:
        return "application/octet-stream"
    return sorted(t for t in accepted if t)[0]


def _tensors_of(results: list[dict[str, Any]], model: ServedModel) -> dict[str, np.ndarray]:
    """Each key of the servable's answer becomes one output, stacked over the items:
    numbers and booleans stay numeric, strings become BYTES, anything else (records,
    mixed lists) becomes BYTES holding each element's JSON."""
    if not results:
        raise LoopserveError(f"model {model.name}: postprocess returned no mapping; this is a bug")
    return {key: np.stack([_tensor(r[key]) for r in results]) for key in results[0]}


def _tensor(value: object) -> np.ndarray:
    array = np.asarray(value) if not isinstance(value, dict) else np.empty(0, dtype=object)
    if isinstance(value, dict) or array.dtype.kind not in "biufU":
        elements = value if isinstance(value, list) else [value]
        return np.array([orjson.dumps(e) for e in elements], dtype=object)
    if array.dtype.kind == "U":
        encoded: np.ndarray = np.vectorize(lambda s: s.encode(), otypes=[object])(array)
        return encoded
    return array


def _select(
    request: InferRequest, outputs: dict[str, np.ndarray]
) -> list[tuple[str, np.ndarray, bool]]:
    if request.outputs is None:
        names = list(outputs)
    else:
        names = [o.name for o in request.outputs]
        for wanted in request.outputs:
            if wanted.name not in outputs:
                raise BadRequest(
                    f"unknown output {wanted.name!r}; the model gives {sorted(outputs)}"
                )
            if "classification" in wanted.parameters:
                raise BadRequest(
                    "the classification extension (class_count) is not supported; "
                    "ask for the output itself"
                )
    return [(name, _wire(outputs[name]), request.wants_binary(name)) for name in names]


class _Simple:
    """The small JSON endpoints: health, metadata, readiness and the repository."""

    def __init__(self, service: Service) -> None:
        self.service = service

    async def server(self, _request: Request) -> Response:
        return json_response(
            {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": list(EXTENSIONS)}
        )

    async def live(self, _request: Request) -> Response:
        return json_response({"live": True})

    async def ready(self, _request: Request) -> Response:
        if not self.service.ready:
            raise _NotReady("loopserve is not ready")
        return json_response({"ready": True})

    async def metadata(self, request: Request) -> Response:
        params = request.path_params
        model = self.service.get(params["name"], params.get("version"))
        versions = sorted(self.service.served.get(model.name, {}))
        return json_response(_metadata(model, versions))

    async def model_ready(self, request: Request) -> Response:
        params = request.path_params
        model = self.service.get(params["name"], params.get("version"))
        if not (self.service.ready and model.batcher.running):
            raise _NotReady(f"model {model.name} is not ready")
        return json_response({"name": model.name, "ready": True})

    async def index(self, _request: Request) -> Response:
        return json_response(await self.service.index())

    async def load(self, request: Request) -> Response:
        await self.service.load(request.path_params["name"])
        return json_response({})

    async def unload(self, request: Request) -> Response:
        await self.service.unload(request.path_params["name"])
        return json_response({})


class _NotReady(LoopserveError):
    status = 503
    reason = "unavailable"


def _metadata(model: ServedModel, versions: list[int]) -> dict[str, object]:
    if isinstance(model.servable, RawTensors):
        inputs = [_spec_metadata(s) for s in model.signature.inputs]
        outputs = [_spec_metadata(s) for s in model.signature.outputs]
    else:
        inputs = [{"name": SERVABLE_INPUT, "datatype": "BYTES", "shape": [-1]}]
        declared = model.servable.describe().get("v2_outputs", [])
        outputs = list(declared) if isinstance(declared, list) else []
    return {
        "name": model.name,
        "versions": [str(v) for v in versions],
        "platform": PLATFORM,
        "inputs": inputs,
        "outputs": outputs,
    }


def _spec_metadata(spec: TensorSpec) -> dict[str, object]:
    return {
        "name": spec.name,
        "datatype": datatype_of(spec.dtype),
        "shape": [-1 if d is None else d for d in spec.shape],
    }
