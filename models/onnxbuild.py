"""Shared pieces of the demo model builders: a small graph builder and a checked, atomic save.

Builders draw every weight from ``np.random.default_rng(seed)``, so building twice
writes the same bytes. Models are pinned to opset 17 and IR version 8: the newest
onnx writes IR versions that the onnxruntime releases we support cannot load.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

OPSET = 17
IR_VERSION = 8


class GraphBuilder:
    """Collects nodes and initializers; every node output gets a fresh, stable name."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._counts: dict[str, int] = {}

    def _fresh(self, prefix: str) -> str:
        count = self._counts.get(prefix, 0)
        self._counts[prefix] = count + 1
        return f"{prefix}_{count}"

    def weight(self, prefix: str, array: np.ndarray) -> str:
        """Add ``array`` as an initializer; return its name."""
        name = self._fresh(prefix)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, output: str | None = None, **attrs: Any) -> str:
        """Append one node; return the name of its (single) output."""
        out = output or self._fresh(op_type.lower())
        name = self._fresh(f"{op_type}_node")
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name, **attrs))
        return out

    def model(
        self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]
    ) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        return finalize(graph)


def float_tensor(name: str, shape: list[int | str]) -> onnx.ValueInfoProto:
    """A FLOAT graph input or output; string dimensions are symbolic (``"batch"``)."""
    return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)


def normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def finalize(graph: onnx.GraphProto) -> onnx.ModelProto:
    """Wrap ``graph`` in a model with the pinned opset and IR version, and check it."""
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="loopserve"
    )
    # Set explicitly: make_model stamps the installed onnx's IR version, which may be too new.
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def save(model: onnx.ModelProto, path: Path) -> None:
    """Write ``model`` to ``path`` atomically: readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = model.SerializeToString()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file private (0600); a model file is for every reader.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
