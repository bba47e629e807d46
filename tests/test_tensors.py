"""JSON tensors for raw models: dtypes checked, never silently narrowed; shapes per item."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.errors import Unprocessable
from pipeline.signature import TensorSpec
from pipeline.tensors import to_array


def spec(dtype: type, *shape: int | None) -> TensorSpec:
    return TensorSpec("t", np.dtype(dtype), (None, *shape))


@pytest.mark.parametrize(
    ("dtype", "value", "expected"),
    [
        (np.float32, [1, 2.5], np.array([1, 2.5], dtype=np.float32)),
        (np.float16, [[0.5], [1]], np.array([[0.5], [1]], dtype=np.float16)),
        (np.int64, [1, -2], np.array([1, -2], dtype=np.int64)),
        (np.uint8, [0, 255], np.array([0, 255], dtype=np.uint8)),
        (np.bool_, [True, False], np.array([True, False])),
    ],
)
def test_values_of_the_right_kind_become_arrays(
    dtype: type, value: object, expected: np.ndarray
) -> None:
    shape = expected.shape
    got = to_array(spec(dtype, *shape), value)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("dtype", "value", "message"),
    [
        (np.int32, [1.5, 2], "expected integers"),
        (np.uint8, [0, 256], "out of range"),
        (np.int8, [-129, 0], "out of range"),
        (np.bool_, [1, 0], "true/false"),
        (np.float32, ["1", "2"], "expected numbers"),
        (np.float32, [True, False], "expected numbers"),
        (np.float32, [[1, 2], [3]], "one shape"),
        (np.float32, [1, 2, 3], "expected shape [2]"),
    ],
)
def test_wrong_kinds_and_shapes_are_422(dtype: type, value: object, message: str) -> None:
    with pytest.raises(Unprocessable, match=message.replace("[", r"\[")):
        to_array(spec(dtype, 2), value)


def test_variable_dimensions_take_any_length() -> None:
    assert to_array(spec(np.float32, None), [1, 2, 3]).shape == (3,)
    assert to_array(spec(np.float32, None), [1]).shape == (1,)
