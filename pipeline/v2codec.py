"""The KServe V2 / Open Inference Protocol codec for HTTP/REST, binary tensor extension included.

Pure: bytes in, dataclasses and numpy arrays out, and back; no HTTP framework. Decoding
never converts silently: a tensor's data match its datatype and shape exactly, or the
request is a BadRequest naming the input. In JSON, ``null`` means the same as absent.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from pipeline.errors import BadRequest

DATATYPES: Mapping[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),  # each element a bytes object
}
_NAMES = {dtype: name for name, dtype in DATATYPES.items()}
_LENGTH = struct.Struct("<I")  # the 4-byte length before each BYTES element


def datatype_of(dtype: np.dtype[Any]) -> str:
    if dtype.kind in "OSU":
        return "BYTES"
    name = _NAMES.get(dtype.newbyteorder("="))
    if name is None:
        raise ValueError(f"numpy dtype {dtype} has no V2 datatype")
    return name


@dataclass(frozen=True, eq=False)  # eq=False: comparing arrays with == has no single truth
class InferInput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: npt.NDArray[Any]  # shaped `shape`, dtype DATATYPES[datatype]
    parameters: dict[str, Any]  # without binary_data_size, which the codec consumed


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool | None  # parameters.binary_data; None when the client did not say
    parameters: dict[str, Any]  # without binary_data


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    parameters: dict[str, Any]  # without binary_data_output; timeout, priority... stay
    inputs: tuple[InferInput, ...]
    outputs: tuple[RequestedOutput, ...] | None  # None: every output the model has
    binary_output: bool  # parameters.binary_data_output

    def wants_binary(self, output_name: str) -> bool:
        for output in self.outputs or ():
            if output.name == output_name and output.binary is not None:
                return output.binary
        return self.binary_output


# Decoding


def decode_request(body: bytes, header_length: int | None) -> InferRequest:
    if header_length is None:
        header_length = len(body)
    elif not 0 <= header_length <= len(body):
        raise BadRequest(
            f"Inference-Header-Content-Length is {header_length} but the body has {len(body)} bytes"
        )
    try:
        document = orjson.loads(memoryview(body)[:header_length])
    except orjson.JSONDecodeError as exc:
        hint = ""
        if header_length == len(body):
            hint = " (if binary tensor data follow it, say so with Inference-Header-Content-Length)"
        raise BadRequest(f"the inference request header is not valid JSON: {exc}{hint}") from None
    if not isinstance(document, dict):
        raise BadRequest("the inference request must be a JSON object")

    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest(f"id must be a string; got {request_id!r}")
    parameters = _parameters(document, "the request")
    binary_output = _flag(parameters, "binary_data_output", "the request")

    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise BadRequest("inputs must be a non-empty list of tensor objects")
    inputs: list[InferInput] = []
    offset = header_length  # binary tensor data follow the header, in input order
    for index, raw in enumerate(raw_inputs):
        tensor, offset = _decode_input(raw, index, body, offset)
        inputs.append(tensor)
    if offset != len(body):
        raise BadRequest(f"binary data ends at byte {offset} but the body has {len(body)}")
    _unique((tensor.name for tensor in inputs), "input")

    return InferRequest(
        id=request_id,
        parameters=parameters,
        inputs=tuple(inputs),
        outputs=_decode_outputs(document.get("outputs")),
        binary_output=bool(binary_output),
    )


def _parameters(owner: dict[str, Any], where: str) -> dict[str, Any]:
    parameters = owner.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise BadRequest(f"parameters of {where} must be an object; got {parameters!r}")
    return parameters


def _flag(parameters: dict[str, Any], key: str, where: str) -> bool | None:
    value = parameters.pop(key, None)
    if value is None or isinstance(value, bool):
        return value
    raise BadRequest(f"parameters.{key} of {where} must be true or false; got {value!r}")


def _unique(names: Iterable[str], kind: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise BadRequest(f"{kind} {name!r} is given twice")
        seen.add(name)


def _decode_input(raw: object, index: int, body: bytes, offset: int) -> tuple[InferInput, int]:
    if not isinstance(raw, dict):
        raise BadRequest(f"inputs[{index}] must be a tensor object; got {raw!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"inputs[{index}] needs a name (a non-empty string)")
    where = f"input {name!r}"
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise BadRequest(f"{where}: shape must be a list of non-negative integers; got {shape!r}")
    datatype = raw.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise BadRequest(
            f"{where}: unsupported datatype {datatype!r}; use one of {', '.join(DATATYPES)}"
        )
    parameters = _parameters(raw, where)
    if "shared_memory_region" in parameters:
        raise BadRequest(f"{where}: shared memory is not supported; send the data in the body")
    size = parameters.pop("binary_data_size", None)
    data = raw.get("data")
    if (data is None) == (size is None):
        raise BadRequest(f"{where} needs either data or parameters.binary_data_size (not both)")

    dims = tuple(shape)
    if size is None:
        array = _from_json(data, datatype, dims, where)
    else:
        if type(size) is not int or size < 0:
            raise BadRequest(f"{where}: binary_data_size must be a non-negative integer")
        end = offset + size
        if end > len(body):
            raise BadRequest(f"binary data ends at byte {end} but the body has {len(body)}")
        array = _from_binary(body, offset, size, datatype, dims, where)
        offset = end
    return InferInput(name, datatype, dims, array, parameters), offset


def _reshape(array: npt.NDArray[Any], shape: tuple[int, ...], where: str) -> npt.NDArray[Any]:
    try:
        return array.reshape(shape)
    except ValueError:  # over 64 dimensions, or a zero one beside dimensions too large to index
        raise BadRequest(f"{where}: shape {list(shape)} is too large for numpy") from None


def _from_json(data: object, datatype: str, shape: tuple[int, ...], where: str) -> npt.NDArray[Any]:
    if not isinstance(data, list):
        raise BadRequest(f"{where}: data must be a list; got {data!r}")
    count = math.prod(shape)
    kinds = set(map(type, data))
    if list in kinds:
        leaves = _flatten(data, shape, where)
        kinds = set(map(type, leaves))
    elif len(data) != count:
        raise BadRequest(
            f"{where}: data has {len(data)} elements but shape {list(shape)} needs {count}"
        )
    else:
        leaves = data
    return _reshape(_leaves_to_array(leaves, kinds, datatype, where), shape, where)


def _flatten(data: list[Any], shape: tuple[int, ...], where: str) -> list[Any]:
    """Nested data, level by level, each level checked whole (no per-element Python)."""
    level: list[Any] = [data]
    for depth, size in enumerate(shape):
        if set(map(type, level)) - {list} or set(map(len, level)) - {size}:
            raise BadRequest(
                f"{where}: nested data do not have shape {list(shape)} (at dimension {depth})"
            )
        level = list(chain.from_iterable(level))
    return level


def _leaves_to_array(
    leaves: list[Any], kinds: set[type], datatype: str, where: str
) -> npt.NDArray[Any]:
    """``kinds`` is the set of the leaves' types: checking it is one pass in C."""
    if list in kinds:
        raise BadRequest(f"{where}: data are nested deeper than the shape")
    dtype = DATATYPES[datatype]
    if datatype == "BOOL":
        _check_types(leaves, kinds, {bool}, "true or false", where)
        return np.array(leaves, dtype=dtype)
    if datatype == "BYTES":
        _check_types(leaves, kinds, {str}, "strings", where)
        # orjson refuses lone surrogates, so every str encodes to UTF-8.
        return np.array([text.encode() for text in leaves], dtype=dtype)
    if dtype.kind in "iu":
        # bool is not int here: type() is exact, so true/false are refused too.
        _check_types(leaves, kinds, {int}, "integers", where)
        info = np.iinfo(dtype.name)
        if leaves and (min(leaves) < info.min or max(leaves) > info.max):
            bad = next(v for v in leaves if not info.min <= v <= info.max)
            raise BadRequest(
                f"{where}: {bad} is out of range for {datatype} [{info.min}, {info.max}]"
            )
        return np.array(leaves, dtype=dtype)
    _check_types(leaves, kinds, {int, float}, "numbers", where)
    try:
        # Python numbers are float64 already; narrower types overflow to inf, which
        # JSON cannot mean (it has no infinity), so overflow is an error.
        with np.errstate(over="raise"):
            return np.array(leaves, dtype=np.float64).astype(dtype)
    except FloatingPointError:
        raise BadRequest(f"{where}: a value is out of range for {datatype}") from None


def _check_types(
    leaves: list[Any], kinds: set[type], allowed: set[type], what: str, where: str
) -> None:
    if kinds <= allowed:
        return
    bad = next(v for v in leaves if type(v) not in allowed)
    raise BadRequest(f"{where}: data must be {what}; got {orjson.dumps(bad).decode()}")


def _from_binary(
    body: bytes, offset: int, size: int, datatype: str, shape: tuple[int, ...], where: str
) -> npt.NDArray[Any]:
    count = math.prod(shape)
    if datatype == "BYTES":
        return _reshape(_bytes_elements(body, offset, size, count, where), shape, where)
    dtype = DATATYPES[datatype]
    if size != count * dtype.itemsize:
        raise BadRequest(
            f"{where}: binary_data_size is {size} but shape {list(shape)} of {datatype} "
            f"takes {count * dtype.itemsize} bytes"
        )
    if datatype == "BOOL":
        raw = np.frombuffer(body, dtype=np.uint8, count=count, offset=offset)
        if (raw > 1).any():
            raise BadRequest(f"{where}: BOOL bytes must be 0 or 1")
        array = raw.astype(np.bool_)
    else:
        # astype copies: the array must not pin the whole request body.
        wire = dtype.newbyteorder("<")
        array = np.frombuffer(body, dtype=wire, count=count, offset=offset).astype(dtype)
    return _reshape(array, shape, where)


def _bytes_elements(
    body: bytes, offset: int, size: int, count: int, where: str
) -> npt.NDArray[Any]:
    end = offset + size
    if count * _LENGTH.size > size:
        raise BadRequest(
            f"{where}: {count} BYTES elements need at least {count * _LENGTH.size} bytes; "
            f"binary_data_size is {size}"
        )
    elements: list[bytes] = []
    position = offset
    for index in range(count):
        if position + _LENGTH.size > end:
            raise BadRequest(f"{where}: BYTES element {index} has no 4-byte length")
        (length,) = _LENGTH.unpack_from(body, position)
        position += _LENGTH.size
        if position + length > end:
            raise BadRequest(
                f"{where}: BYTES element {index} of {length} bytes overruns binary_data_size"
            )
        elements.append(body[position : position + length])
        position += length
    if position != end:
        raise BadRequest(
            f"{where}: {count} BYTES elements take {position - offset} bytes "
            f"but binary_data_size is {size}"
        )
    return np.array(elements, dtype=np.object_)


def _decode_outputs(raw: object) -> tuple[RequestedOutput, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BadRequest(f"outputs must be a list of objects; got {raw!r}")
    outputs = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise BadRequest(f"outputs[{index}] must be an object with a name; got {item!r}")
        where = f"output {item['name']!r}"
        parameters = _parameters(item, where)
        if "shared_memory_region" in parameters:
            raise BadRequest(f"{where}: shared memory is not supported")
        binary = _flag(parameters, "binary_data", where)
        outputs.append(RequestedOutput(item["name"], binary, parameters))
    _unique((output.name for output in outputs), "output")
    return tuple(outputs)


# Encoding


def encode_response(
    model_name: str,
    model_version: str | None,
    request_id: str | None,
    outputs: Sequence[tuple[str, npt.NDArray[Any], bool]],
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    header: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        header["model_version"] = model_version
    if request_id is not None:
        header["id"] = request_id
    if parameters:
        header["parameters"] = dict(parameters)
    tensors: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, array, binary in outputs:
        try:
            datatype = datatype_of(array.dtype)
        except ValueError as exc:
            raise ValueError(f"output {name!r}: {exc}; this is a bug") from None
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        data = None if binary else _json_data(array, datatype)
        if data is None:
            chunk = _binary_data(array, datatype)
            tensor["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            tensor["data"] = data
        tensors.append(tensor)
    header["outputs"] = tensors
    head = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return head, None
    return b"".join([head, *chunks]), len(head)


def _json_data(array: npt.NDArray[Any], datatype: str) -> object | None:
    """The flat data for JSON, or None where JSON cannot carry them exactly."""
    if datatype == "BYTES":
        try:
            return [element.decode() for element in _byte_elements(array)]
        except UnicodeDecodeError:
            return None  # JSON strings are text: arbitrary bytes go binary instead
    if array.dtype.kind == "f":
        if not np.isfinite(array).all():
            return None  # JSON has no NaN or infinity (orjson would write null): go binary
        if datatype == "FP16":
            array = array.astype(np.float32)  # orjson does not serialise float16
    # orjson serialises only C-contiguous arrays in native byte order.
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("=")).reshape(-1)


def _binary_data(array: npt.NDArray[Any], datatype: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(
            chain.from_iterable((_LENGTH.pack(len(e)), e) for e in _byte_elements(array))
        )
    # numpy bools are one byte, 0 or 1, as the wire wants.
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def _byte_elements(array: npt.NDArray[Any]) -> list[bytes]:
    elements = []
    for element in array.reshape(-1).tolist():
        if isinstance(element, str):
            element = element.encode()
        elif not isinstance(element, bytes):
            raise ValueError(f"a BYTES output holds a {type(element).__name__}; this is a bug")
        elements.append(element)
    return elements
