"""A three-layer perceptron served as raw tensors: ``x`` [batch, 256] -> ``y`` [batch, 1000].

Big enough (about 6.8M weights) that batching visibly pays off; no ``create``, so
the pipeline serves its tensors as they are.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from models.onnxbuild import GraphBuilder, float_tensor, normal, save

SEED = 256
WIDTHS = (256, 2048, 2048, 1000)


def build(path: Path) -> None:
    rng = np.random.default_rng(SEED)
    g = GraphBuilder()
    x = "x"
    layers = list(itertools.pairwise(WIDTHS))
    for i, (fan_in, fan_out) in enumerate(layers):
        last = i == len(layers) - 1
        # He scaling before a ReLU and 1/sqrt(fan_in) for the head keep outputs O(1).
        std = (1.0 if last else 2.0) ** 0.5 / fan_in**0.5
        w = g.weight("w", normal(rng, (fan_in, fan_out), std))
        b = g.weight("b", normal(rng, (fan_out,), 0.01))
        x = g.op("Gemm", x, w, b, output="y" if last else None)
        if not last:
            x = g.op("Relu", x)
    model = g.model(
        "mlp", [float_tensor("x", ["batch", WIDTHS[0]])], [float_tensor("y", ["batch", WIDTHS[-1]])]
    )
    save(model, path)
