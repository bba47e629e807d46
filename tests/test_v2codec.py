"""The V2 codec: round trips, the refusals, and wire compatibility with tritonclient."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import pytest
import tritonclient.http as triton

from pipeline.errors import BadRequest
from pipeline.v2codec import (
    DATATYPES,
    InferRequest,
    RequestedOutput,
    datatype_of,
    decode_request,
    encode_response,
)

# One array per datatype, with the extremes of each type.
SAMPLES: dict[str, npt.NDArray[Any]] = {
    "BOOL": np.array([[True, False, True], [False, False, True]]),
    "UINT8": np.array([[0, 1, 255]], dtype=np.uint8),
    "UINT16": np.array([0, 65535], dtype=np.uint16),
    "UINT32": np.array([0, 2**32 - 1], dtype=np.uint32),
    "UINT64": np.array([0, 2**64 - 1], dtype=np.uint64),
    "INT8": np.array([-128, 0, 127], dtype=np.int8),
    "INT16": np.array([[-(2**15)], [2**15 - 1]], dtype=np.int16),
    "INT32": np.array([-(2**31), 7, 2**31 - 1], dtype=np.int32),
    "INT64": np.array([-(2**63), 2**63 - 1], dtype=np.int64),
    "FP16": np.array([[0.1, -65504.0], [6e-8, 1.5]], dtype=np.float16),
    "FP32": np.array([0.1, -3.4e38, 1e-45, 1 / 3], dtype=np.float32),
    "FP64": np.array([0.1, 1e308, 5e-324, -1 / 3], dtype=np.float64),
    "BYTES": np.array(
        [[b"", b"abc"], ["\u00e9t\u00e9 \u2603".encode(), b"\x00x\x00"]], dtype=object
    ),
}
# Bytes that are not UTF-8: only the binary encoding carries them.
RAW_BYTES = np.array([b"\xff\xfe", b"\x80", b"", b"\x00\x01\x02"], dtype=object)


def body_of(inputs: list[dict[str, Any]], **fields: Any) -> bytes:
    return orjson.dumps({"inputs": inputs, **fields})


def tensor(name: str = "x", datatype: Any = "INT32", shape: Any = (2,), **fields: Any) -> Any:
    return {"name": name, "datatype": datatype, "shape": list(shape), **fields}


def as_request(body: bytes, header_length: int | None) -> InferRequest:
    """Feeds a response back as a request: response outputs are valid request inputs."""
    end = len(body) if header_length is None else header_length
    header = orjson.loads(body[:end])
    request = orjson.dumps({"inputs": header["outputs"]})
    return decode_request(request + body[end:], None if header_length is None else len(request))


def assert_same(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> None:
    assert got.dtype == DATATYPES[datatype_of(want.dtype)]
    assert got.shape == want.shape
    if want.dtype.kind == "f":
        # bit-exact, which also tells -0.0 from 0.0 and compares NaNs
        assert got.tobytes() == want.tobytes()
    else:
        assert got.tolist() == want.tolist()


# Datatypes


def test_datatype_of_inverts_datatypes() -> None:
    for name, dtype in DATATYPES.items():
        assert datatype_of(dtype) == name
    assert datatype_of(np.dtype("S3")) == "BYTES"
    assert datatype_of(np.dtype("U3")) == "BYTES"
    assert datatype_of(np.dtype(">i4")) == "INT32"  # byte order is the encoder's business


@pytest.mark.parametrize("dtype", ["complex64", "datetime64[s]", "V4", "float128"])
def test_datatype_of_refuses_what_v2_cannot_carry(dtype: str) -> None:
    with pytest.raises(ValueError, match="has no V2 datatype"):
        datatype_of(np.dtype(dtype))


# Round trips through our own encoder and decoder


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_round_trip(datatype: str, binary: bool) -> None:
    array = SAMPLES[datatype]
    body, header_length = encode_response("m", "1", None, [("x", array, binary)])
    assert (header_length is not None) == binary
    (decoded,) = as_request(body, header_length).inputs
    assert decoded.datatype == datatype
    assert decoded.shape == array.shape
    assert_same(decoded.data, array)
    assert decoded.data.flags.writeable  # a copy, not a view pinning the request body


def test_round_trip_of_several_binary_and_json_outputs_keeps_their_order() -> None:
    outputs = [
        ("a", SAMPLES["FP32"], True),
        ("b", SAMPLES["INT8"], False),
        ("c", RAW_BYTES, True),
        ("d", SAMPLES["BOOL"], True),
    ]
    body, header_length = encode_response("m", None, None, outputs)
    decoded = as_request(body, header_length).inputs
    assert [t.name for t in decoded] == ["a", "b", "c", "d"]
    for tensor_, (_, array, _) in zip(decoded, outputs, strict=True):
        assert_same(tensor_.data, array)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3, 1), ()])
def test_round_trip_of_empty_and_scalar_tensors(shape: tuple[int, ...], binary: bool) -> None:
    for fill in (np.float32(1.5), True, b"7"):
        array = np.full(shape, fill, dtype=object if isinstance(fill, bytes) else type(fill))
        body, header_length = encode_response("m", None, None, [("x", array, binary)])
        (decoded,) = as_request(body, header_length).inputs
        assert_same(decoded.data, array)


def test_encoder_normalises_layout_and_byte_order() -> None:
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    strided = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]  # not contiguous
    fortran = np.asfortranarray(np.arange(6, dtype=np.uint16).reshape(2, 3))
    for binary in (False, True):
        outputs = [("a", big_endian, binary), ("b", strided, binary), ("c", fortran, binary)]
        body, header_length = encode_response("m", None, None, outputs)
        decoded = as_request(body, header_length).inputs
        for tensor_, (_, array, _) in zip(decoded, outputs, strict=True):
            assert tensor_.data.tolist() == array.tolist()


def test_encoder_takes_str_and_fixed_width_bytes_arrays_as_bytes() -> None:
    outputs = [
        ("u", np.array(["a", "\u00e9"]), False),
        ("s", np.array([b"ab", b"c"]), True),
        ("o", np.array(["x", b"y"], dtype=object), True),
    ]
    body, header_length = encode_response("m", None, None, outputs)
    u, s, o = as_request(body, header_length).inputs
    assert u.data.tolist() == [b"a", "\u00e9".encode()]
    assert s.data.tolist() == [b"ab", b"c"]
    assert o.data.tolist() == [b"x", b"y"]


def test_bytes_that_are_not_utf8_go_binary_even_when_json_was_asked() -> None:
    body, header_length = encode_response("m", None, None, [("x", RAW_BYTES, False)])
    assert header_length is not None
    (output,) = orjson.loads(body[:header_length])["outputs"]
    assert "data" not in output
    assert output["parameters"] == {"binary_data_size": 4 * 4 + 2 + 1 + 0 + 3}
    assert as_request(body, header_length).inputs[0].data.tolist() == RAW_BYTES.tolist()


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_non_finite_floats_go_binary_even_when_json_was_asked(value: float, dtype: type) -> None:
    array: npt.NDArray[Any] = np.array([1.0, value], dtype=dtype)
    body, header_length = encode_response("m", None, None, [("x", array, False)])
    assert header_length is not None
    assert_same(as_request(body, header_length).inputs[0].data, array)


def test_response_header_fields() -> None:
    body, header_length = encode_response(
        "m", "3", "req-1", [("y", np.array([1], dtype=np.int8), False)], {"sequence_id": 4}
    )
    assert header_length is None
    assert orjson.loads(body) == {
        "model_name": "m",
        "model_version": "3",
        "id": "req-1",
        "parameters": {"sequence_id": 4},
        "outputs": [{"name": "y", "datatype": "INT8", "shape": [1], "data": [1]}],
    }
    body, _ = encode_response("m", None, None, [], {})
    assert orjson.loads(body) == {"model_name": "m", "outputs": []}


def test_binary_output_bytes_are_little_endian_with_length_prefixes() -> None:
    outputs = [
        ("i", np.array([1, 256], dtype=np.uint16), True),
        ("b", np.array([True, False]), True),
        ("s", np.array([b"ab", b""], dtype=object), True),
    ]
    body, header_length = encode_response("m", None, None, outputs)
    assert header_length is not None
    assert body[header_length:] == b"\x01\x00\x00\x01" + b"\x01\x00" + b"\x02\0\0\0ab\0\0\0\0"


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.array([1 + 2j]), "output 'x': numpy dtype complex128 has no V2 datatype"),
        (np.array([b"a", 3], dtype=object), "a BYTES output holds a int; this is a bug"),
    ],
)
def test_encoder_refuses_what_it_cannot_carry(array: npt.NDArray[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_response("m", None, None, [("x", array, True)])


# JSON data


def test_nested_and_flat_json_data_mean_the_same() -> None:
    nested = decode_request(body_of([tensor(shape=[2, 3], data=[[1, 2, 3], [4, 5, 6]])]), None)
    flat = decode_request(body_of([tensor(shape=[2, 3], data=[1, 2, 3, 4, 5, 6])]), None)
    want = np.arange(1, 7, dtype=np.int32).reshape(2, 3)
    assert_same(nested.inputs[0].data, want)
    assert_same(flat.inputs[0].data, want)


@pytest.mark.parametrize(
    ("shape", "data"),
    [([], [5]), ([1], [5]), ([0], []), ([2, 0], [[], []]), ([2, 0], []), ([1, 1, 1], [[[5]]])],
)
def test_json_data_edge_shapes(shape: list[int], data: list[Any]) -> None:
    (decoded,) = decode_request(body_of([tensor(shape=shape, data=data)]), None).inputs
    assert decoded.data.shape == tuple(shape)
    assert decoded.data.dtype == np.int32


def test_bytes_json_data_nested_or_flat_are_utf8_encoded() -> None:
    strings = [["a", "\u00e9"], ["\u2603", ""]]
    want = [[s.encode() for s in row] for row in strings]
    for data in (strings, [s for row in strings for s in row]):
        request = body_of([tensor(datatype="BYTES", shape=[2, 2], data=data)])
        (decoded,) = decode_request(request, None).inputs
        assert decoded.data.dtype == np.object_
        assert decoded.data.tolist() == want


def test_fp_json_data_take_integers() -> None:
    request = body_of([tensor(datatype="FP16", shape=[3], data=[1, 0.5, -2])])
    assert decode_request(request, None).inputs[0].data.tolist() == [1.0, 0.5, -2.0]


# Requested outputs, flags and parameters


def test_no_outputs_means_all_in_json_by_default() -> None:
    request = decode_request(body_of([tensor(data=[1, 2])]), None)
    assert request.outputs is None
    assert request.id is None
    assert request.parameters == {}
    assert request.inputs[0].parameters == {}
    assert not request.binary_output
    assert not request.wants_binary("anything")


def test_request_level_binary_flag_and_per_output_override() -> None:
    request = decode_request(
        body_of(
            [tensor(data=[1, 2], parameters={"note": "kept"})],
            id="r-7",
            parameters={"binary_data_output": True, "timeout": 5000, "priority": 2},
            outputs=[
                {"name": "a", "parameters": {"binary_data": False, "classification": 3}},
                {"name": "b", "parameters": {"binary_data": True}},
                {"name": "c"},
                {"name": "d", "parameters": None},
            ],
        ),
        None,
    )
    assert request.id == "r-7"
    assert request.parameters == {"timeout": 5000, "priority": 2}
    assert request.inputs[0].parameters == {"note": "kept"}
    assert request.binary_output
    assert request.outputs == (
        RequestedOutput("a", False, {"classification": 3}),
        RequestedOutput("b", True, {}),
        RequestedOutput("c", None, {}),
        RequestedOutput("d", None, {}),
    )
    assert [request.wants_binary(n) for n in "abcdz"] == [False, True, True, True, True]


def test_per_output_binary_without_request_flag() -> None:
    request = decode_request(
        body_of(
            [tensor(data=[1, 2])], outputs=[{"name": "a", "parameters": {"binary_data": True}}]
        ),
        None,
    )
    assert not request.binary_output
    assert request.wants_binary("a")
    assert not request.wants_binary("b")


def test_empty_outputs_list_means_no_outputs() -> None:
    request = decode_request(body_of([tensor(data=[1, 2])], outputs=[]), None)
    assert request.outputs == ()


def test_binary_input_parameters_lose_only_binary_data_size() -> None:
    data = np.array([1, 2], dtype="<i4").tobytes()
    header = body_of([tensor(parameters={"binary_data_size": 8, "x": 1})])
    (decoded,) = decode_request(header + data, len(header)).inputs
    assert decoded.parameters == {"x": 1}
    assert decoded.data.tolist() == [1, 2]


# Refusals

HUGE_SHAPE = [10**12]


def _binary(
    datatype: str, shape: list[int], size: int, data: bytes, trailing: bytes = b""
) -> tuple[bytes, int]:
    header = body_of(
        [tensor(datatype=datatype, shape=shape, parameters={"binary_data_size": size})]
    )
    return header + data + trailing, len(header)


BAD_JSON_TENSORS: list[tuple[Any, str]] = [  # (the input object, what the message says)
    ({"datatype": "INT32", "shape": [1], "data": [1]}, "inputs[0] needs a name"),
    ({"name": "", "datatype": "INT32", "shape": [1], "data": [1]}, "inputs[0] needs a name"),
    ({"name": "x", "datatype": "INT32", "data": [1]}, "input 'x': shape must be a list of non-neg"),
    (tensor(shape=[-1], data=[]), "shape must be a list of non-negative integers; got [-1]"),
    (tensor(shape=[1.0], data=[1]), "shape must be a list of non-negative integers; got [1.0]"),
    (tensor(shape=[True], data=[1]), "shape must be a list of non-negative integers; got [True]"),
    ({"name": "x", "shape": 2, "datatype": "INT32", "data": [1, 2]}, "shape must be a list"),
    ({"name": "x", "shape": [1], "data": [1]}, "input 'x': unsupported datatype None; use one of"),
    (tensor(datatype="FP8", data=[1, 2]), "input 'x': unsupported datatype 'FP8'"),
    (tensor(datatype="BF16", data=[1, 2]), "input 'x': unsupported datatype 'BF16'"),
    (tensor(datatype=["FP32"], data=[1, 2]), "input 'x': unsupported datatype ['FP32']"),
    (tensor(), "input 'x' needs either data or parameters.binary_data_size (not both)"),
    (tensor(data=None), "needs either data or parameters.binary_data_size"),
    (tensor(data=[1, 2], parameters={"binary_data_size": 8}), "needs either data or param"),
    (tensor(data=[1, 2], parameters=[1]), "parameters of input 'x' must be an object; got [1]"),
    (tensor(parameters={"shared_memory_region": "r"}), "input 'x': shared memory is not support"),
    (tensor(data=3), "input 'x': data must be a list; got 3"),
    (tensor(data="12"), "input 'x': data must be a list; got '12'"),
    (tensor(data=[1, 2, 3]), "input 'x': data has 3 elements but shape [2] needs 2"),
    (tensor(shape=[2, 2], data=[1, 2, 3]), "data has 3 elements but shape [2, 2] needs 4"),
    (tensor(shape=[], data=[]), "data has 0 elements but shape [] needs 1"),
    (tensor(shape=[], data=[[1]]), "data are nested deeper than the shape"),
    (
        tensor(shape=[2, 2], data=[[1, 2], [3]]),
        "nested data do not have shape [2, 2] (at dimension 1)",
    ),
    (
        tensor(shape=[2, 2], data=[[1, 2], 3]),
        "nested data do not have shape [2, 2] (at dimension 1)",
    ),
    (tensor(shape=[2, 2], data=[[1, 2]]), "nested data do not have shape [2, 2] (at dimension 0)"),
    (tensor(shape=[3, 2], data=[[1, 2], [3, 4]]), "do not have shape [3, 2] (at dimension 0)"),
    (tensor(shape=[1, 1], data=[[[1]]]), "data are nested deeper than the shape"),
    (tensor(shape=[2], data=[1, [2]]), "data are nested deeper than the shape"),
    (tensor(shape=[4, 1], data=[[1, 2], [3, 4]]), "do not have shape [4, 1] (at dimension 0)"),
    (tensor(datatype="BOOL", data=[True, 1]), "input 'x': data must be true or false; got 1"),
    (tensor(datatype="BOOL", data=[True, "true"]), 'data must be true or false; got "true"'),
    (tensor(data=[1, 1.5]), "input 'x': data must be integers; got 1.5"),
    (tensor(data=[1, 1.0]), "input 'x': data must be integers; got 1.0"),
    (tensor(data=[1, True]), "input 'x': data must be integers; got true"),
    (tensor(data=[1, "2"]), "input 'x': data must be integers; got \"2\""),
    (tensor(data=[1, None]), "input 'x': data must be integers; got null"),
    (tensor(shape=[2, 1], data=[[1], [{}]]), "input 'x': data must be integers; got {}"),
    (tensor(datatype="UINT8", data=[0, 256]), "input 'x': 256 is out of range for UINT8 [0, 255]"),
    (tensor(datatype="UINT8", data=[-1, 0]), "-1 is out of range for UINT8 [0, 255]"),
    (tensor(datatype="INT8", data=[-129, 0]), "-129 is out of range for INT8 [-128, 127]"),
    (tensor(datatype="UINT32", data=[2**32, 0]), "4294967296 is out of range for UINT32"),
    (tensor(datatype="INT64", data=[2**63, 0]), "9223372036854775808 is out of range for INT64"),
    (tensor(datatype="UINT64", data=[-1, 0]), "-1 is out of range for UINT64"),
    (tensor(datatype="FP32", data=[1.0, True]), "input 'x': data must be numbers; got true"),
    (tensor(datatype="FP32", data=[1.0, "1.5"]), "input 'x': data must be numbers; got \"1.5\""),
    (tensor(datatype="FP64", data=[1.0, None]), "input 'x': data must be numbers; got null"),
    (tensor(datatype="FP16", data=[1.0, 70000]), "input 'x': a value is out of range for FP16"),
    (tensor(datatype="FP32", data=[1.0, -1e39]), "input 'x': a value is out of range for FP32"),
    (tensor(datatype="BYTES", data=["a", 1]), "input 'x': data must be strings; got 1"),
    (tensor(datatype="BYTES", data=["a", None]), "input 'x': data must be strings; got null"),
    (tensor(shape=[0, 2**62], data=[]), "input 'x': shape [0, 4611686018427387904] is too large"),
    (tensor(shape=[1] * 65, data=[1]), "is too large for numpy"),
    (tensor(parameters={"binary_data_size": -1}), "binary_data_size must be a non-negative int"),
    (tensor(parameters={"binary_data_size": 1.5}), "binary_data_size must be a non-negative int"),
    (tensor(parameters={"binary_data_size": True}), "binary_data_size must be a non-negative int"),
    (tensor(parameters={"binary_data_size": "8"}), "binary_data_size must be a non-negative int"),
]


@pytest.mark.parametrize(("raw", "message"), BAD_JSON_TENSORS, ids=[m for _, m in BAD_JSON_TENSORS])
def test_bad_input_tensors_are_refused_naming_the_input(raw: Any, message: str) -> None:
    with pytest.raises(BadRequest) as caught:
        decode_request(body_of([raw]), None)
    assert message in caught.value.message


def test_uint64_past_64_bits_reads_as_a_float_and_is_refused() -> None:
    request = (
        b'{"inputs":[{"name":"x","datatype":"UINT64","shape":[1],"data":[18446744073709551616]}]}'
    )
    with pytest.raises(BadRequest, match=r"data must be integers; got 1\.8446744073709552e\+19"):
        decode_request(request, None)


BAD_REQUESTS: list[tuple[bytes, int | None, str]] = [
    (b"", None, "the inference request header is not valid JSON"),
    (b"{nope", None, "not valid JSON"),
    (b"{nope\x00\x01", 5, "the inference request header is not valid JSON: "),
    (b'{"inputs": []}\x00\x01', None, "say so with Inference-Header-Content-Length"),
    (b"[1, 2]", None, "the inference request must be a JSON object"),
    (b"{}", None, "inputs must be a non-empty list of tensor objects"),
    (b'{"inputs": []}', None, "inputs must be a non-empty list of tensor objects"),
    (b'{"inputs": {"x": [1]}}', None, "inputs must be a non-empty list of tensor objects"),
    (b'{"inputs": [1]}', None, "inputs[0] must be a tensor object; got 1"),
    (b'{"inputs": []}', -1, "Inference-Header-Content-Length is -1 but the body has 14 bytes"),
    (b'{"inputs": []}', 15, "Inference-Header-Content-Length is 15 but the body has 14 bytes"),
    (body_of([tensor(data=[1, 2])], id=5), None, "id must be a string; got 5"),
    (body_of([tensor(data=[1, 2])], parameters=[]), None, "parameters of the request must be an"),
    (
        body_of([tensor(data=[1, 2])], parameters={"binary_data_output": 1}),
        None,
        "parameters.binary_data_output of the request must be true or false; got 1",
    ),
    (body_of([tensor(data=[1, 2])], outputs={"y": {}}), None, "outputs must be a list of objects"),
    (body_of([tensor(data=[1, 2])], outputs=["y"]), None, "outputs[0] must be an object with a"),
    (body_of([tensor(data=[1, 2])], outputs=[{"name": 3}]), None, "outputs[0] must be an object"),
    (
        body_of(
            [tensor(data=[1, 2])], outputs=[{"name": "y", "parameters": {"binary_data": "no"}}]
        ),
        None,
        "parameters.binary_data of output 'y' must be true or false; got 'no'",
    ),
    (
        body_of([tensor(data=[1, 2])], outputs=[{"name": "y", "parameters": 1}]),
        None,
        "parameters of output 'y' must be an object; got 1",
    ),
    (
        body_of(
            [tensor(data=[1, 2])],
            outputs=[{"name": "y", "parameters": {"shared_memory_region": "r"}}],
        ),
        None,
        "output 'y': shared memory is not supported",
    ),
    (body_of([tensor(data=[1, 2])], outputs=[{"name": "y"}] * 2), None, "output 'y' is given tw"),
    (body_of([tensor(data=[1, 2]), tensor(data=[3, 4])]), None, "input 'x' is given twice"),
    (
        body_of([tensor(parameters={"binary_data_size": 8})]),
        None,
        "binary data ends at byte",
    ),
    (*_binary("INT32", [2], 8, b"\0" * 7), "binary data ends at byte"),
    (
        *_binary("INT32", [2], 8, b"\0" * 8, b"\0"),
        "binary data ends at byte",
    ),
    (
        *_binary("INT32", [2], 7, b"\0" * 7),
        "input 'x': binary_data_size is 7 but shape [2] of INT32",
    ),
    (*_binary("FP16", [3], 8, b"\0" * 8), "binary_data_size is 8 but shape [3] of FP16 takes 6 b"),
    (*_binary("BOOL", [2], 2, b"\x01\x02"), "input 'x': BOOL bytes must be 0 or 1"),
    (*_binary("BYTES", [2], 4, b"\0" * 4), "2 BYTES elements need at least 8 bytes; binary_data_s"),
    (*_binary("BYTES", HUGE_SHAPE, 8, b"\0" * 8), "1000000000000 BYTES elements need at least"),
    (*_binary("BYTES", [2], 9, b"\1\0\0\0a\5\0\0\0"), "BYTES element 1 of 5 bytes overruns bin"),
    (*_binary("BYTES", [2], 9, b"\5\0\0\0abcde"), "BYTES element 1 has no 4-byte length"),
    (*_binary("BYTES", [1], 9, b"\1\0\0\0abcde"), "1 BYTES elements take 5 bytes but binary_data"),
    (
        *_binary("BYTES", [0], 4, b"\0" * 4),
        "0 BYTES elements take 0 bytes but binary_data_size is 4",
    ),
]


@pytest.mark.parametrize(
    ("body", "header_length", "message"), BAD_REQUESTS, ids=[m for *_, m in BAD_REQUESTS]
)
def test_bad_requests_are_refused_saying_why(
    body: bytes, header_length: int | None, message: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        decode_request(body, header_length)
    assert message in caught.value.message


@pytest.mark.parametrize(("data", "trailing"), [(b"\0" * 7, b""), (b"\0" * 8, b"\0\0")])
def test_binary_data_must_end_with_the_body(data: bytes, trailing: bytes) -> None:
    body, header_length = _binary("INT32", [2], 8, data, trailing)
    end = header_length + 8
    with pytest.raises(BadRequest) as caught:
        decode_request(body, header_length)
    assert caught.value.message == f"binary data ends at byte {end} but the body has {len(body)}"


def test_binary_data_follow_the_header_in_input_order() -> None:
    header = body_of(
        [
            tensor("a", "INT16", [2], parameters={"binary_data_size": 4}),
            tensor("b", "FP32", [1], data=[0.5]),
            tensor("c", "BYTES", [1], parameters={"binary_data_size": 6}),
            tensor("d", "BOOL", [1, 1], parameters={"binary_data_size": 1}),
        ]
    )
    tail = struct.pack("<hh", -2, 3) + b"\x02\0\0\0hi" + b"\x01"
    request = decode_request(header + tail, len(header))
    assert [t.data.tolist() for t in request.inputs] == [[-2, 3], [0.5], [b"hi"], [[True]]]


# Compatibility with tritonclient, the reference V2 client

TRITON_SAMPLES = {**SAMPLES, "BYTES (not UTF-8)": RAW_BYTES}


def triton_input(name: str, array: npt.NDArray[Any], binary: bool) -> Any:
    tensor_ = triton.InferInput(name, list(array.shape), datatype_of(array.dtype))
    tensor_.set_data_from_numpy(array, binary_data=binary)
    return tensor_


@pytest.mark.parametrize(
    ("datatype", "binary"),
    # tritonclient itself refuses to put bytes that are not UTF-8 into JSON
    [(d, b) for d in TRITON_SAMPLES for b in (False, True) if b or d != "BYTES (not UTF-8)"],
)
def test_decodes_what_tritonclient_sends(datatype: str, binary: bool) -> None:
    array = TRITON_SAMPLES[datatype]
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [triton_input("x", array, binary)], request_id="abc"
    )
    assert (header_length is not None) == binary
    request = decode_request(body, header_length)
    assert request.id == "abc"
    (decoded,) = request.inputs
    assert_same(decoded.data, array)
    # tritonclient asks for every output in binary when it names none
    assert request.outputs is None
    assert request.binary_output
    assert request.parameters == {}


def test_decodes_tritonclient_mixed_request_with_outputs_and_parameters() -> None:
    arrays = {
        "\u00e9l\u00e8ve": SAMPLES["FP16"],  # non-ASCII name in the JSON header
        "b": SAMPLES["BYTES"],
        "c": SAMPLES["BOOL"],
        "d": np.array(["\u2603", "snow"], dtype=object),  # str objects, JSON
        "e": np.zeros((0, 2), dtype=np.float32),
    }
    inputs = [
        triton_input(name, array, binary)
        for (name, array), binary in zip(
            arrays.items(), [True, True, False, False, True], strict=True
        )
    ]
    outputs = [
        triton.InferRequestedOutput("y", binary_data=False),
        triton.InferRequestedOutput("z", class_count=2),
    ]
    body, header_length = triton.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs, priority=3, timeout=100, parameters={"custom": "v"}
    )
    request = decode_request(body, header_length)
    assert request.id is None
    assert request.parameters == {"priority": 3, "timeout": 100, "custom": "v"}
    assert not request.binary_output
    assert request.outputs == (
        RequestedOutput("y", False, {}),
        RequestedOutput("z", True, {"classification": 2}),
    )
    assert [t.name for t in request.inputs] == list(arrays)
    for decoded, array in zip(request.inputs, arrays.values(), strict=True):
        if array.dtype == object:
            elements = [s.encode() if isinstance(s, str) else s for s in array.ravel()]
            array = np.array(elements, dtype=object).reshape(decoded.shape)
        assert_same(decoded.data, array)


def test_tritonclient_refuses_non_utf8_bytes_in_json() -> None:
    with pytest.raises(triton.InferenceServerException, match="Failed to encode"):
        triton_input("x", RAW_BYTES, binary=False)


def test_decodes_tritonclient_empty_bytes_tensor_in_binary() -> None:
    empty = np.array([], dtype=object).reshape(0, 3)
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [triton_input("x", empty, True)]
    )
    assert header_length == len(body)  # a binary input of zero bytes still sets the header length
    (decoded,) = decode_request(body, header_length).inputs
    assert decoded.data.shape == (0, 3)
    assert decoded.data.dtype == np.object_


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", list(TRITON_SAMPLES))
def test_tritonclient_reads_what_we_send(datatype: str, binary: bool) -> None:
    array = TRITON_SAMPLES[datatype]
    body, header_length = encode_response(
        "m", "2", "abc", [("y", array, binary), ("pad", np.array([7], dtype=np.int8), binary)]
    )
    result = triton.InferResult.from_response_body(body, verbose=False, header_length=header_length)
    assert result.get_response()["id"] == "abc"
    assert result.get_response()["model_version"] == "2"
    got = result.as_numpy("y")
    assert got.shape == array.shape
    if array.dtype == object and output_is_json(result, "y"):
        # tritonclient reads JSON BYTES as str; the bytes were UTF-8 text
        assert got.tolist() == np.vectorize(bytes.decode, otypes=[object])(array).tolist()
    else:
        assert got.dtype == array.dtype
        assert got.tolist() == array.tolist()
        if array.dtype.kind == "f":
            assert got.tobytes() == array.tobytes()
    assert result.as_numpy("pad").tolist() == [7]


def output_is_json(result: Any, name: str) -> bool:
    return "data" in result.get_output(name)


def test_tritonclient_reads_empty_and_non_finite_outputs() -> None:
    outputs: list[tuple[str, npt.NDArray[Any], bool]] = [
        ("e", np.zeros((2, 0), dtype=np.float32), True),
        ("f", np.zeros((0,), dtype=np.int64), False),
        ("s", np.array([], dtype=object), True),
        ("n", np.array([np.nan, -np.inf, 1.0], dtype=np.float16), False),
    ]
    body, header_length = encode_response("m", None, None, outputs)
    result = triton.InferResult.from_response_body(body, verbose=False, header_length=header_length)
    for name, array, _ in outputs:
        got = result.as_numpy(name)
        assert got.shape == array.shape
        assert got.dtype == array.dtype
        assert got.tobytes() == array.tobytes()
