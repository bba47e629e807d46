"""Tiled inference for images far larger than the model input, as pure functions (no I/O).

`plan_tiles` cuts an image into overlapping model-sized tiles that cover every pixel and lie
inside it; `shift` maps tile (or downscaled full-image) detections back to image pixels;
`merge` joins the duplicates the overlap creates, with SAHI's strategies, metrics and defaults
(greedy non-maximum merging, intersection over the smaller box, 0.5, class-wise).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

STRATEGIES = ("greedynmm", "nmm", "nms")
METRICS = ("ios", "iou")

_Floats = npt.NDArray[np.float64]
_Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class Tile:
    """A model input of `size` x `size` whose top-left is image pixel (`x`, `y`).

    `width` x `height` of it is image; they are below `size` only on an axis where the whole
    image is, and the rest is padding (never stretching, which would change object shapes).
    """

    x: int
    y: int
    width: int
    height: int
    size: int


@dataclass(frozen=True)
class Detection:
    x1: float
    y1: float
    x2: float
    y2: float
    score: float
    label: str


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _starts(length: int, size: int, step: int) -> list[int]:
    if length <= size:
        return [0]
    # The last tile is pushed inward to end on the image edge instead of hanging past it, so
    # every tile sees only real pixels; it overlaps its neighbour by more than the others do.
    last = length - size
    return [*range(0, last, step), last]


def plan_tiles(width: int, height: int, size: int = 640, overlap: float = 0.2) -> list[Tile]:
    """The fewest `size` tiles, row-major, with neighbours sharing `round(size * overlap)` px.

    The overlap is what lets an object cut by one tile's edge appear whole in the next, so it
    should exceed the objects of interest; `merge` then removes the duplicates.
    """
    _check_positive(width=width, height=height, size=size)
    if not 0.0 <= overlap < 1.0:  # also refuses NaN
        raise ValueError(f"overlap must be in [0, 1), got {overlap!r}")
    step = max(1, size - round(size * overlap))
    tile_width, tile_height = min(width, size), min(height, size)
    return [
        Tile(x, y, tile_width, tile_height, size)
        for y in _starts(height, size, step)
        for x in _starts(width, size, step)
    ]


def full_image_scale(width: int, height: int, size: int = 640) -> float:
    """The factor that shrinks the whole image so its longer side is `size` (never enlarges).

    The extra full-image pass at this scale finds objects too large for any one tile.
    """
    _check_positive(width=width, height=height, size=size)
    return min(1.0, size / max(width, height))


def shift(
    detections: Iterable[Detection], dx: float, dy: float, scale: float = 1.0
) -> list[Detection]:
    """Tile (or resized-image) coordinates to image coordinates: `x * scale + dx`."""
    if not scale > 0.0:  # also refuses NaN
        raise ValueError(f"scale must be positive, got {scale!r}")
    return [
        Detection(
            d.x1 * scale + dx,
            d.y1 * scale + dy,
            d.x2 * scale + dx,
            d.y2 * scale + dy,
            d.score,
            d.label,
        )
        for d in detections
    ]


def _pair_value(a: _Box, b: _Box, metric: str) -> float:
    # The same operations, in the same order, as `_match_values`, so that a pair judged by
    # both gets the same verdict at the threshold. A box without area matches nothing.
    inter = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0) * max(
        min(a[3], b[3]) - max(a[1], b[1]), 0.0
    )
    area_a = max(a[2] - a[0], 0.0) * max(a[3] - a[1], 0.0)
    area_b = max(b[2] - b[0], 0.0) * max(b[3] - b[1], 0.0)
    denominator = area_b + area_a - inter if metric == "iou" else min(area_b, area_a)
    return inter / denominator if denominator > 0.0 else 0.0


def _corners(d: Detection) -> _Box:
    return (d.x1, d.y1, d.x2, d.y2)


def iou(a: Detection, b: Detection) -> float:
    """Intersection over union; 0.0 when both boxes are empty."""
    return _pair_value(_corners(a), _corners(b), "iou")


def ios(a: Detection, b: Detection) -> float:
    """Intersection over the smaller box's area: 1.0 when one box lies inside the other.

    This is the metric for tiles: a tile's partial view of an object lies inside the whole
    view, however small the part, where their IoU can be arbitrarily low.
    """
    return _pair_value(_corners(a), _corners(b), "ios")


def _match_values(box: _Box, boxes: _Floats, areas: _Floats, metric: str) -> _Floats:
    """`metric` of `box` against every row of `boxes` (x1, y1, x2, y2), whose `areas` are given."""
    widths = np.minimum(boxes[:, 2], box[2]) - np.maximum(boxes[:, 0], box[0])
    heights = np.minimum(boxes[:, 3], box[3]) - np.maximum(boxes[:, 1], box[1])
    inter = np.maximum(widths, 0.0) * np.maximum(heights, 0.0)
    area = max(box[2] - box[0], 0.0) * max(box[3] - box[1], 0.0)
    denominator = areas + area - inter if metric == "iou" else np.minimum(areas, area)
    values: _Floats = np.zeros(len(boxes), dtype=np.float64)
    np.divide(inter, denominator, out=values, where=denominator > 0.0)
    return values


def _enclose(a: _Box, b: _Box) -> _Box:
    return (min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3]))


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    # Case-insensitive so that SAHI's spellings ("GREEDYNMM", "IOS") work unchanged.
    key = value.lower()
    if key not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return key


def merge(
    detections: Sequence[Detection],
    strategy: str = "greedynmm",
    metric: str = "ios",
    threshold: float = 0.5,
    class_agnostic: bool = False,
) -> list[Detection]:
    """One detection per object from overlapping tiles' detections, best score first.

    Two boxes match when `metric` >= `threshold` (SAHI's comparison) and, unless
    `class_agnostic`, their labels are equal. Highest score first (ties in input order):
    "nms" keeps the box and drops its matches; "greedynmm" merges its matches into it;
    "nmm" merges as well, and a merged box's matches join the same group (chaining). A
    merged detection is the enclosing box of its group, with the kept box's score (the
    group's highest) and label. As in SAHI, each match is merged in descending score only
    while it still matches the grown box; one that no longer does is dropped, as by NMS.
    """
    strategy = _choice("strategy", strategy, STRATEGIES)
    metric = _choice("metric", metric, METRICS)
    if not 0.0 <= threshold <= 1.0:  # also refuses NaN
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    if not detections:
        return []
    # Work in rank order (a stable sort, so ties keep input order): the boxes still to be
    # judged after rank r are exactly ranks > r, and the output comes out sorted.
    order = np.argsort(-np.array([d.score for d in detections], dtype=np.float64), kind="stable")
    ranked = [detections[i] for i in order.tolist()]
    boxes = np.array([_corners(d) for d in ranked], dtype=np.float64).reshape(-1, 4)
    areas = np.maximum(boxes[:, 2] - boxes[:, 0], 0.0) * np.maximum(boxes[:, 3] - boxes[:, 1], 0.0)
    codes: dict[str, int] = {}
    classes = np.array(
        [0 if class_agnostic else codes.setdefault(d.label, len(codes)) for d in ranked],
        dtype=np.int64,
    )
    groups = (_chained if strategy == "nmm" else _greedy)(boxes, areas, classes, metric, threshold)
    if strategy == "nms":
        return [ranked[keep] for keep in groups]
    return [_merged(ranked, keep, members, metric, threshold) for keep, members in groups.items()]


def _greedy(
    boxes: _Floats, areas: _Floats, classes: npt.NDArray[np.int64], metric: str, threshold: float
) -> dict[int, list[int]]:
    """Kept rank -> the ranks matching it, among those no better box took (GreedyNMM, NMS)."""
    free = np.ones(len(boxes), dtype=np.bool_)
    groups: dict[int, list[int]] = {}
    for rank in range(len(boxes)):
        if not free[rank]:
            continue
        tail = slice(rank + 1, None)
        values = _match_values(_row(boxes, rank), boxes[tail], areas[tail], metric)
        matched = free[tail] & (classes[tail] == classes[rank]) & (values >= threshold)
        members = np.flatnonzero(matched) + rank + 1
        free[members] = False
        groups[rank] = members.tolist()
    return groups


def _chained(
    boxes: _Floats, areas: _Floats, classes: npt.NDArray[np.int64], metric: str, threshold: float
) -> dict[int, list[int]]:
    """Kept rank -> its group, where a member's own matches join the group too (SAHI's NMM).

    Every box is visited in rank order; one that no earlier box took starts a group. A box
    already taken by a better group stays there (groups never merge with each other).
    """
    group_of = np.full(len(boxes), -1, dtype=np.int64)
    groups: dict[int, list[int]] = {}
    for rank in range(len(boxes)):
        if group_of[rank] < 0:
            group_of[rank] = rank
            groups[rank] = []
        # Every earlier rank already belongs to a group, so only later ones can join.
        tail = slice(rank + 1, None)
        values = _match_values(_row(boxes, rank), boxes[tail], areas[tail], metric)
        matched = (group_of[tail] < 0) & (classes[tail] == classes[rank]) & (values >= threshold)
        members = np.flatnonzero(matched) + rank + 1
        group = int(group_of[rank])
        group_of[members] = group
        groups[group].extend(members.tolist())
    for group_members in groups.values():
        group_members.sort()  # merge in descending score, as the greedy strategy does
    return groups


def _row(boxes: _Floats, rank: int) -> _Box:
    x1, y1, x2, y2 = boxes[rank].tolist()
    return (x1, y1, x2, y2)


def _merged(
    ranked: list[Detection], keep: int, members: list[int], metric: str, threshold: float
) -> Detection:
    kept = ranked[keep]
    box = _corners(kept)
    for member in members:
        other = _corners(ranked[member])
        if _pair_value(box, other, metric) >= threshold:
            box = _enclose(box, other)
    # The kept box ranks first in its group, so its score is the group's maximum.
    return Detection(*box, score=kept.score, label=kept.label)
