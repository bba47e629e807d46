"""The detector's ONNX graph, from designed kernels (no training, no randomness).

image [batch, 3, 640, 640] (RGB in 0..1) -> scores, sizes [batch, C, 160, 160] (stride 4).
Per class: a colour match (1x1 conv on [rgb, rgb^2], so it is 1 - |rgb - colour|^2 / r^2,
doubled and clipped to 0..1); a 4x4 average pool; a matched filter on the pooled map
(the shape's mean minus a surround ring's mean, the corners weighted up: a whole
object scores near 1; a bigger blob, the other shape or a part of one less); a
scale, an offset and a sigmoid.
``sizes`` measures the object: the matched colour area over the shape and its ring,
as a square's side or a disc's diameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from models.detector.catalog import CLASSES, ObjectClass
from models.onnxbuild import GraphBuilder, float_tensor, save

TILE = 640
STRIDE = 4
GRID = TILE // STRIDE
KERNEL = 15  # cells: the largest class (40 px = 10 cells) plus its ring fits
RING_PX = 6.0  # surround width; below the scene's 10 px gap between objects
COLOUR_RADIUS = 0.35  # colour distance (RGB in 0..1) where the match falls to 0
GAIN = 14.0  # sigmoid(GAIN * (response - OFFSET))
OFFSET = 0.53
CORNER_WEIGHT = 3.0
SUPERSAMPLE = 16  # sub-samples per cell side when measuring a shape's coverage


def coverage(shape: str, size_px: float) -> np.ndarray:
    """The fraction of each cell of a KERNEL x KERNEL grid inside a square or disc of
    ``size_px``, centred on the middle cell's centre."""
    half = size_px / 2 / STRIDE  # in cells
    offsets = (np.arange(SUPERSAMPLE) + 0.5) / SUPERSAMPLE - 0.5
    axis = (np.arange(KERNEL) - KERNEL // 2)[:, None] + offsets[None, :]  # (cell, sub)
    u = axis.reshape(-1)
    if shape == "square":
        inside = (np.abs(u)[:, None] <= half) & (np.abs(u)[None, :] <= half)
    else:
        inside = u[:, None] ** 2 + u[None, :] ** 2 <= half**2
    cells = inside.reshape(KERNEL, SUPERSAMPLE, KERNEL, SUPERSAMPLE)
    fraction: np.ndarray = cells.mean(axis=(1, 3))
    return fraction


def matched_filter(cls: ObjectClass) -> np.ndarray:
    """The shape's mean minus its surround ring's mean. The corners that tell a square
    from a disc of the same size weigh CORNER_WEIGHT times more: positive for a
    square, in the ring for a disc, so the other shape scores well below a match."""
    inner = coverage(cls.shape, cls.size_px)
    ring = coverage(cls.shape, cls.size_px + 2 * RING_PX) - inner
    corners = coverage("square", cls.size_px) - coverage("disc", cls.size_px)
    if cls.shape == "square":
        inner = inner + (CORNER_WEIGHT - 1) * corners
    else:
        ring = ring + (CORNER_WEIGHT - 1) * corners
    kernel: np.ndarray = inner / inner.sum() - ring / ring.sum()
    return kernel


def area_to_size(cls: ObjectClass) -> float:
    """side^2 per unit of area: 1 for a square, 4/pi for a disc's diameter."""
    return 1.0 if cls.shape == "square" else 4 / np.pi


def build(path: Path) -> None:
    g = GraphBuilder()
    count = len(CLASSES)
    # Colour match: 1 - |x - c|^2 / r^2 = (2 c.x - x.x - c.c) / r^2 + 1, linear in [x, x*x].
    colour_w = np.zeros((count, 6, 1, 1), dtype=np.float32)
    colour_b = np.zeros(count, dtype=np.float32)
    r2 = COLOUR_RADIUS**2
    for k, cls in enumerate(CLASSES):
        c = np.asarray(cls.rgb, dtype=np.float64) / 255
        # Doubled, then clipped to [0, 1]: a near-binary mask, 1 within r / sqrt(2).
        colour_w[k, :3, 0, 0] = 2 * 2 * c / r2
        colour_w[k, 3:, 0, 0] = 2 * -1 / r2
        colour_b[k] = 2 * (1 - float(c @ c) / r2)
    shape_w = np.stack([GAIN * matched_filter(c) for c in CLASSES])[:, None].astype(np.float32)
    shape_b = np.full(count, -GAIN * OFFSET, dtype=np.float32)
    cell_px = STRIDE * STRIDE
    size_w = np.stack(
        [
            (coverage(c.shape, c.size_px + 2 * RING_PX) > 0) * cell_px * area_to_size(c)
            for c in CLASSES
        ]
    )[:, None].astype(np.float32)

    x = "image"
    squares = g.op("Mul", x, x)
    both = g.op("Concat", x, squares, axis=1)
    match = g.op("Conv", both, g.weight("colour_w", colour_w), g.weight("colour_b", colour_b))
    zero = g.weight("zero", np.array(0, dtype=np.float32))
    one = g.weight("one", np.array(1, dtype=np.float32))
    mask = g.op("Clip", match, zero, one)
    pooled = g.op("AveragePool", mask, kernel_shape=[STRIDE, STRIDE], strides=[STRIDE, STRIDE])
    pad = KERNEL // 2
    conv: dict[str, Any] = {"kernel_shape": [KERNEL, KERNEL], "pads": [pad] * 4, "group": count}
    logit = g.op("Conv", pooled, g.weight("shape_w", shape_w), g.weight("shape_b", shape_b), **conv)
    g.op("Sigmoid", logit, output="scores")
    area = g.op("Conv", pooled, g.weight("size_w", size_w), **conv)
    g.op("Sqrt", g.op("Relu", area), output="sizes")

    out_shape: list[int | str] = ["batch", count, GRID, GRID]
    model = g.model(
        "detector",
        [float_tensor("image", ["batch", 3, TILE, TILE])],
        [float_tensor("scores", out_shape), float_tensor("sizes", out_shape)],
    )
    save(model, path)
