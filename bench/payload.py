"""The request bodies the benchmark sends: one JSON row per request, per model.

Bodies are built once, deterministically (a fixed seed), so every run and every
server sees the same bytes.
"""

from __future__ import annotations

import numpy as np
import orjson

# Input width of each demo model's ``x`` (see models/): the only model facts the load needs.
INPUT_WIDTH: dict[str, int] = {"mlp": 256, "tiny": 64}


def request_body(model: str) -> bytes:
    row = np.random.default_rng(0).standard_normal(INPUT_WIDTH[model]).astype(np.float32)
    return orjson.dumps({"inputs": {"x": row}}, option=orjson.OPT_SERIALIZE_NUMPY)


def v2_body(model: str, binary: bool) -> tuple[bytes, dict[str, str]]:
    """The same row as an Open Inference Protocol request, JSON or binary both ways.

    Binary is what tritonclient sends by default: a JSON header, then the raw
    little-endian tensor, with ``Inference-Header-Content-Length`` and no
    Content-Type; outputs are asked for as binary too.
    """
    row = np.random.default_rng(0).standard_normal(INPUT_WIDTH[model]).astype(np.float32)
    tensor: dict[str, object] = {"name": "x", "shape": [1, row.size], "datatype": "FP32"}
    if not binary:
        tensor["data"] = row
        body = orjson.dumps({"inputs": [tensor]}, option=orjson.OPT_SERIALIZE_NUMPY)
        return body, {"Content-Type": "application/json"}
    tensor["parameters"] = {"binary_data_size": row.nbytes}
    header = orjson.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}})
    return header + row.astype("<f4").tobytes(), {
        "Inference-Header-Content-Length": str(len(header))
    }
