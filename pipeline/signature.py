"""What a model takes and returns: names, dtypes and shapes, read from the model.

Dimension ``None`` is variable. The first dimension of every input and output is
the batch dimension; a fixed first dimension of 1 means the model cannot batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# ONNX Runtime's type strings -> numpy dtypes (the types ONNX models use).
ORT_DTYPES: Mapping[str, np.dtype[np.generic]] = {
    "tensor(bool)": np.dtype(np.bool_),
    "tensor(uint8)": np.dtype(np.uint8),
    "tensor(uint16)": np.dtype(np.uint16),
    "tensor(uint32)": np.dtype(np.uint32),
    "tensor(uint64)": np.dtype(np.uint64),
    "tensor(int8)": np.dtype(np.int8),
    "tensor(int16)": np.dtype(np.int16),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(float)": np.dtype(np.float32),
    "tensor(double)": np.dtype(np.float64),
    "tensor(string)": np.dtype(np.object_),
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype[np.generic]
    shape: tuple[int | None, ...]  # including the batch dimension

    @property
    def item_shape(self) -> tuple[int | None, ...]:
        """The shape of one item: the model's shape without the batch dimension."""
        return self.shape[1:]

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "dtype": self.dtype.name, "shape": list(self.shape)}


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def batchable(self) -> bool:
        return all(spec.shape and spec.shape[0] is None for spec in self.inputs)

    def describe(self) -> dict[str, object]:
        return {
            "inputs": [s.describe() for s in self.inputs],
            "outputs": [s.describe() for s in self.outputs],
        }


class _OrtArg:  # the subset of onnxruntime.NodeArg we read
    name: str
    type: str
    shape: Sequence[int | str | None]


def spec_from_ort(arg: _OrtArg) -> TensorSpec:
    dtype = ORT_DTYPES.get(arg.type)
    if dtype is None:
        raise ValueError(f"tensor {arg.name!r} has type {arg.type}, which loopserve cannot serve")
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
    return TensorSpec(arg.name, dtype, shape)
