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
