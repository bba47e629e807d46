"""One tile's score and size maps to boxes: peaks, sub-cell centres, class-wise NMS.

Pure numpy. A peak is a cell at the maximum of its PEAK_WINDOW neighbourhood and
above the threshold; its centre is refined by a weighted centroid of the logits
around it; the box is square, centred there, with the size map's side.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

Detection = tuple[float, float, float, float, float, str]

PEAK_WINDOW = 5  # cells: narrower than the smallest object (6 cells) plus the gap
NMS_IOU = 0.5
_EPS = 1e-6


def find_peaks(
    scores: np.ndarray, sizes: np.ndarray, labels: Sequence[str], stride: int, threshold: float
) -> list[Detection]:
    """Boxes (x1, y1, x2, y2, score, label) in the tile's pixels, best first per class."""
    found: list[Detection] = []
    for c, label in enumerate(labels):
        boxes = [_box(scores[c], sizes[c], i, j, stride) for i, j in _peaks(scores[c], threshold)]
        found.extend((*box, label) for box in _nms(boxes))
    return found


def _peaks(score: np.ndarray, threshold: float) -> list[tuple[int, int]]:
    half = PEAK_WINDOW // 2
    padded = np.pad(score, half, constant_values=-np.inf)
    local_max = sliding_window_view(padded, (PEAK_WINDOW, PEAK_WINDOW)).max(axis=(2, 3))
    # Ties (an object centred between two cells) give two peaks; NMS keeps one.
    rows, cols = np.nonzero((score >= local_max) & (score > threshold))
    return list(zip(rows.tolist(), cols.tolist(), strict=True))


def _box(
    score: np.ndarray, size: np.ndarray, i: int, j: int, stride: int
) -> tuple[float, float, float, float, float]:
    i0, i1 = max(i - 1, 0), min(i + 2, score.shape[0])
    j0, j1 = max(j - 1, 0), min(j + 2, score.shape[1])
    window = np.clip(score[i0:i1, j0:j1].astype(np.float64), _EPS, 1 - _EPS)
    # Centroid of the logits above the window's least: the response falls off about
    # linearly from the true centre, so this lands within a tenth of a cell of it.
    weight = np.log(window / (1 - window))
    weight -= weight.min()
    total = float(weight.sum())
    rows = np.arange(i0, i1, dtype=np.float64)[:, None]
    cols = np.arange(j0, j1, dtype=np.float64)[None, :]
    ci = float((weight * rows).sum()) / total if total > 0 else float(i)
    cj = float((weight * cols).sum()) / total if total > 0 else float(j)
    # Cell k covers pixels [k * stride, (k + 1) * stride): its centre is k * stride + stride / 2.
    cy, cx = (ci + 0.5) * stride, (cj + 0.5) * stride
    half = float(size[i, j]) / 2
    return cx - half, cy - half, cx + half, cy + half, float(score[i, j])


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _nms(
    boxes: list[tuple[float, float, float, float, float]],
) -> list[tuple[float, float, float, float, float]]:
    kept: list[tuple[float, float, float, float, float]] = []
    for box in sorted(boxes, key=lambda b: -b[4]):
        if all(iou(box, other) < NMS_IOU for other in kept):
            kept.append(box)
    return kept
