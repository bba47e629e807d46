"""The smallest servable: one 64x64 MatMul, ``x`` [batch, 64] -> ``y`` [batch, 64].

Served as raw tensors (no ``create``); its forward pass costs next to nothing, so
it measures the server's own overhead.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.onnxbuild import GraphBuilder, float_tensor, normal, save

SEED = 64
WIDTH = 64


def build(path: Path) -> None:
    rng = np.random.default_rng(SEED)
    g = GraphBuilder()
    w = g.weight("w", normal(rng, (WIDTH, WIDTH), WIDTH**-0.5))
    g.op("MatMul", "x", w, output="y")
    model = g.model(
        "tiny", [float_tensor("x", ["batch", WIDTH])], [float_tensor("y", ["batch", WIDTH])]
    )
    save(model, path)
