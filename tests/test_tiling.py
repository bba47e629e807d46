"""Tiling: tile plans checked pixel by pixel over a grid of shapes, merging on hand-made cases,
against a plain reference implementation, and end to end on random objects cut by tiles."""

from __future__ import annotations

import math
import random
from itertools import pairwise

import numpy as np
import pytest

from pipeline.tiling import (
    Detection,
    Tile,
    full_image_scale,
    ios,
    iou,
    merge,
    plan_tiles,
    shift,
)

SIZES = [1, 2, 3, 7, 64, 100, 640]
OVERLAPS = [0.0, 0.1, 0.2, 0.25, 0.5, 0.75, 0.9, 0.99]


def _lengths(size: int) -> list[int]:
    """Image sides around the interesting points: below, at and just past one tile, multiples."""
    candidates = {1, size // 2, size - 1, size, size + 1, 2 * size - 1, 2 * size, 3 * size + 7}
    return sorted(n for n in candidates if n >= 1)


def _axis_count(length: int, size: int, step: int) -> int:
    return 1 if length <= size else math.ceil((length - size) / step) + 1


def _check_plan(width: int, height: int, size: int, overlap: float) -> None:
    tiles = plan_tiles(width, height, size, overlap)
    step = max(1, size - round(size * overlap))
    shared = size - step  # round(size * overlap), unless the step had to be raised to 1

    assert len(set(tiles)) == len(tiles)
    assert tiles == sorted(tiles, key=lambda t: (t.y, t.x))  # row-major
    for t in tiles:
        assert t.size == size
        assert (t.width, t.height) == (min(width, size), min(height, size))
        assert t.x >= 0 and t.x + t.width <= width
        assert t.y >= 0 and t.y + t.height <= height

    xs = sorted({t.x for t in tiles})
    ys = sorted({t.y for t in tiles})
    assert len(tiles) == len(xs) * len(ys)  # a full grid
    for starts, length in ((xs, width), (ys, height)):
        assert len(starts) == _axis_count(length, size, step)  # minimal for this step
        assert starts[0] == 0
        assert starts[-1] + min(length, size) == length
        for a, b in pairwise(starts):
            assert 0 < b - a <= step
            assert a + size - b >= shared

    # Tiles form a full grid, so every pixel is covered exactly when each axis is; the
    # pixel-by-pixel check is kept where it is cheap, as a check on that reasoning.
    for starts, length in ((xs, width), (ys, height)):
        seen = np.zeros(length, dtype=np.bool_)
        for start in starts:
            seen[start : start + size] = True
        assert seen.all()
    if len(tiles) <= 2000:
        covered = np.zeros((height, width), dtype=np.bool_)
        for t in tiles:
            covered[t.y : t.y + t.height, t.x : t.x + t.width] = True
        assert covered.all()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_plan_grid(size: int, overlap: float) -> None:
    for width in _lengths(size):
        for height in _lengths(size):
            _check_plan(width, height, size, overlap)


@pytest.mark.parametrize(
    ("width", "height", "size", "overlap"),
    [
        (10000, 7000, 640, 0.2),
        (7000, 10000, 640, 0.2),
        (10000, 7000, 1024, 0.25),
        (10000, 7000, 512, 0.0),
        (4000, 3000, 640, 0.5),
        (641, 10000, 640, 0.2),
        (333, 4999, 640, 0.2),
    ],
)
def test_plan_large(width: int, height: int, size: int, overlap: float) -> None:
    _check_plan(width, height, size, overlap)


def test_plan_examples() -> None:
    # step 640 - 128 = 512: x starts 0, then the last tile shifted inward to end at 1000.
    assert plan_tiles(1000, 500) == [Tile(0, 0, 640, 500, 640), Tile(360, 0, 640, 500, 640)]
    assert plan_tiles(640, 640) == [Tile(0, 0, 640, 640, 640)]
    assert plan_tiles(300, 200) == [Tile(0, 0, 300, 200, 640)]
    assert [t.x for t in plan_tiles(1664, 640)] == [0, 512, 1024]  # ends exactly on the edge
    assert [t.x for t in plan_tiles(1665, 640)] == [0, 512, 1024, 1025]
    assert len(plan_tiles(10000, 7000)) == 20 * 14


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"width": 0, "height": 10}, "width"),
        ({"width": 10, "height": -1}, "height"),
        ({"width": 10, "height": 10, "size": 0}, "size"),
        ({"width": 10.5, "height": 10}, "width"),
        ({"width": True, "height": 10}, "width"),
        ({"width": 10, "height": 10, "overlap": 1.0}, "overlap"),
        ({"width": 10, "height": 10, "overlap": -0.1}, "overlap"),
        ({"width": 10, "height": 10, "overlap": math.nan}, "overlap"),
    ],
)
def test_plan_rejects(kwargs: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        plan_tiles(**kwargs)  # type: ignore[arg-type]


def test_full_image_scale() -> None:
    assert full_image_scale(1280, 640) == 0.5
    assert full_image_scale(640, 1280) == 0.5
    assert full_image_scale(10000, 7000) == pytest.approx(0.064)
    assert full_image_scale(640, 480) == 1.0
    assert full_image_scale(100, 100) == 1.0
    assert full_image_scale(2048, 1000, size=1024) == 0.5
    with pytest.raises(ValueError, match="size"):
        full_image_scale(100, 100, size=0)


def _det(
    x1: float, y1: float, x2: float, y2: float, score: float = 0.9, label: str = "a"
) -> Detection:
    return Detection(x1, y1, x2, y2, score, label)


def test_shift() -> None:
    assert shift([], 10, 20) == []
    assert shift([_det(1, 2, 3, 4)], 10, 20) == [_det(11, 22, 13, 24)]
    assert shift([_det(1, 2, 3, 4, 0.5, "b")], 10, 20, scale=2.0) == [
        _det(12, 24, 16, 28, 0.5, "b")
    ]
    # The full-image pass: detect on the downscaled image, map back with 1 / scale.
    scale = full_image_scale(2000, 1000)
    seen = _det(100 * scale, 50 * scale, 1900 * scale, 950 * scale)
    (back,) = shift([seen], 0, 0, scale=1 / scale)
    assert (back.x1, back.y1, back.x2, back.y2) == pytest.approx((100, 50, 1900, 950))
    with pytest.raises(ValueError, match="scale"):
        shift([seen], 0, 0, scale=0.0)


def test_iou_and_ios() -> None:
    big, small = _det(0, 0, 100, 100), _det(10, 10, 20, 20)
    assert ios(big, small) == ios(small, big) == 1.0
    assert iou(big, small) == pytest.approx(0.01)
    a, b = _det(0, 0, 10, 10), _det(5, 0, 15, 10)
    assert iou(a, b) == pytest.approx(1 / 3)
    assert ios(a, b) == 0.5
    assert iou(a, _det(10, 0, 20, 10)) == ios(a, _det(10, 0, 20, 10)) == 0.0  # touching
    assert iou(a, a) == ios(a, a) == 1.0
    empty = _det(5, 5, 5, 5)
    assert iou(empty, empty) == ios(empty, a) == ios(a, _det(8, 8, 2, 2)) == 0.0


def _box(d: Detection) -> tuple[float, float, float, float]:
    return (d.x1, d.y1, d.x2, d.y2)


# One object at x 100..200, y 0..50, cut by a tile edge: the left tile sees 60% of it, the
# right one 50%, and a third tile (in the overlap) sees it whole.
WHOLE = _det(100, 0, 200, 50, 0.9)
LEFT = _det(100, 0, 160, 50, 0.6)
RIGHT = _det(150, 0, 200, 50, 0.6)


def test_split_across_two_tiles_is_one_detection() -> None:
    for pieces in ([LEFT, WHOLE, RIGHT], [RIGHT, LEFT, WHOLE]):
        assert merge(pieces) == [WHOLE]
        assert merge(pieces, strategy="nms") == [WHOLE]
        assert merge(pieces, strategy="nmm") == [WHOLE]
    # A partial view scoring highest grows to the whole object, with its score; greedy
    # merging does not chain, so the other piece (matching only the whole view) stays apart.
    best_left = _det(100, 0, 160, 50, 0.95)
    assert merge([best_left, WHOLE, RIGHT]) == [_det(100, 0, 200, 50, 0.95), RIGHT]
    assert merge([best_left, WHOLE, RIGHT], strategy="nmm") == [_det(100, 0, 200, 50, 0.95)]
    assert merge([best_left, WHOLE, RIGHT], strategy="nms") == [best_left, RIGHT]


def test_split_across_four_tiles_is_one_detection() -> None:
    whole = _det(100, 100, 200, 180, 0.9)
    quarters = [
        _det(100, 100, 155, 145, 0.6),
        _det(145, 100, 200, 145, 0.6),
        _det(100, 135, 155, 180, 0.6),
        _det(145, 135, 200, 180, 0.6),
    ]
    assert merge([*quarters, whole]) == [whole]
    assert merge([*quarters, whole], strategy="nms") == [whole]
    assert merge([*quarters, whole], strategy="nmm") == [whole]


def test_pieces_without_the_whole_view() -> None:
    # 60% and 50% views share 10% of the object: 0.2 of the smaller, so not matched.
    assert merge([LEFT, RIGHT]) == [LEFT, RIGHT]
    # 70% and 60% views share 30%: exactly half of the smaller, which matches (>=).
    left, right = _det(100, 0, 170, 50, 0.6), _det(140, 0, 200, 50, 0.5)
    assert merge([left, right]) == [_det(100, 0, 200, 50, 0.6)]


def test_two_nearby_objects_stay_two() -> None:
    a, b = _det(0, 0, 40, 40, 0.9), _det(35, 0, 75, 40, 0.8)  # share 5 of 40 columns
    for strategy in ("greedynmm", "nmm", "nms"):
        for metric in ("ios", "iou"):
            assert merge([b, a], strategy, metric) == [a, b]


def test_labels_class_wise_and_agnostic() -> None:
    car, truck = _det(0, 0, 100, 50, 0.9, "car"), _det(0, 0, 60, 50, 0.7, "truck")
    assert merge([truck, car]) == [car, truck]
    assert merge([truck, car], strategy="nms") == [car, truck]
    assert merge([truck, car], class_agnostic=True) == [car]
    assert merge([truck, car], strategy="nms", class_agnostic=True) == [car]
    wide_truck = _det(0, 0, 120, 50, 0.7, "truck")
    assert merge([wide_truck, car], class_agnostic=True) == [_det(0, 0, 120, 50, 0.9, "car")]


def test_nested_boxes_ios_versus_iou() -> None:
    big, small = _det(0, 0, 100, 100, 0.6), _det(10, 10, 20, 20, 0.9)
    assert merge([big, small], metric="iou") == [small, big]
    assert merge([big, small], metric="ios") == [_det(0, 0, 100, 100, 0.9)]
    assert merge([big, small], strategy="nms", metric="ios") == [small]


def test_threshold_boundary() -> None:
    a, b = _det(0, 0, 10, 10, 0.9), _det(5, 0, 15, 10, 0.8)  # ios 0.5, iou 1/3
    above = float(np.nextafter(0.5, 1.0))
    for strategy in ("greedynmm", "nmm"):
        assert merge([a, b], strategy, "ios", 0.5) == [_det(0, 0, 15, 10, 0.9)]
        assert merge([a, b], strategy, "ios", above) == [a, b]
        assert merge([a, b], strategy, "iou", 0.33) == [_det(0, 0, 15, 10, 0.9)]
        assert merge([a, b], strategy, "iou", 0.34) == [a, b]
    assert merge([a, b], "nms", "ios", 0.5) == [a]
    assert merge([a, b], "nms", "ios", above) == [a, b]
    assert merge([a, b], threshold=0.0) == [_det(0, 0, 15, 10, 0.9)]
    assert merge([a, _det(50, 50, 60, 60)], threshold=1.0) == [a, _det(50, 50, 60, 60)]
    assert merge([a, a], threshold=1.0) == [a]


def test_nmm_chains_and_greedy_does_not() -> None:
    # a matches b (ios 0.6), b matches c (0.6), a and c barely overlap (0.2).
    a, b, c = _det(0, 0, 10, 10, 0.9), _det(4, 0, 14, 10, 0.8), _det(8, 0, 18, 10, 0.7)
    assert merge([c, b, a]) == [_det(0, 0, 14, 10, 0.9), c]
    assert merge([c, b, a], strategy="nmm") == [_det(0, 0, 18, 10, 0.9)]
    assert merge([c, b, a], strategy="nms") == [a, c]


def test_merge_drops_a_match_the_grown_box_no_longer_matches() -> None:
    # SAHI's rule: b matches a (iou 0.6) and widens it; c matched a (iou 0.5) but not the
    # widened box, so c is suppressed rather than widening it further.
    a = _det(0, 0, 10, 10, 0.9)
    b = _det(-2.5, 0, 7.5, 10, 0.8)  # iou with a: 7.5 / 12.5 = 0.6
    c = _det(10 / 3, 0, 40 / 3, 10, 0.7)  # iou with a: 0.5; with (-2.5..10): < 0.5
    assert iou(a, c) == pytest.approx(0.5)
    assert merge([a, b, c], metric="iou", threshold=0.49) == [_det(-2.5, 0, 10, 10, 0.9)]


def test_merge_empty_order_and_names() -> None:
    for strategy in ("greedynmm", "nmm", "nms"):
        assert merge([], strategy) == []
    far = [_det(100 * i, 0, 100 * i + 10, 10, 0.5) for i in range(5)]
    assert merge(far) == far  # ties keep their input order
    assert merge([far[0], _det(0, 50, 10, 60, 0.7)]) == [_det(0, 50, 10, 60, 0.7), far[0]]
    assert merge([LEFT, WHOLE, RIGHT], strategy="GREEDYNMM", metric="IOS") == [WHOLE]
    with pytest.raises(ValueError, match="greedynmm, nmm, nms"):
        merge([WHOLE], strategy="soft-nms")
    with pytest.raises(ValueError, match="ios, iou"):
        merge([WHOLE], metric="giou")
    with pytest.raises(ValueError, match="threshold"):
        merge([WHOLE], threshold=1.5)


def test_merge_degenerate_boxes_match_nothing() -> None:
    point, flipped = _det(5, 5, 5, 5, 0.9), _det(8, 8, 2, 2, 0.8)
    assert merge([point, flipped, WHOLE]) == [point, WHOLE, flipped]


# A plain, quadratic-per-step reference of the documented rules, to check the vectorised one.
def _reference(dets: list[Detection], strategy: str, metric: str, t: float) -> list[Detection]:
    value = ios if metric == "ios" else iou
    ranked = sorted(dets, key=lambda d: -d.score)
    groups: dict[int, list[int]] = {}
    owner = [-1] * len(ranked)
    for r, d in enumerate(ranked):
        if owner[r] >= 0 and strategy != "nmm":
            continue
        if owner[r] < 0:
            owner[r] = r
            groups[r] = []
        for j in range(r + 1, len(ranked)):
            if owner[j] < 0 and ranked[j].label == d.label and value(d, ranked[j]) >= t:
                owner[j] = owner[r]
                groups[owner[r]].append(j)
    out = []
    for keep, members in groups.items():
        kept = ranked[keep]
        if strategy == "nms":
            out.append(kept)
            continue
        box = kept
        for m in sorted(members):
            if value(box, ranked[m]) >= t:
                o = ranked[m]
                box = _det(
                    min(box.x1, o.x1), min(box.y1, o.y1), max(box.x2, o.x2), max(box.y2, o.y2)
                )
        out.append(Detection(box.x1, box.y1, box.x2, box.y2, kept.score, kept.label))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_merge_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    dets = []
    for _ in range(rng.randint(1, 60)):
        x, y = rng.randint(0, 60), rng.randint(0, 60)
        dets.append(
            _det(
                x, y, x + rng.randint(0, 30), y + rng.randint(0, 30), rng.random(), rng.choice("ab")
            )
        )
    for strategy in ("greedynmm", "nmm", "nms"):
        for metric in ("ios", "iou"):
            for t in (0.0, 0.25, 0.5, 0.9, 1.0):
                assert merge(dets, strategy, metric, t) == _reference(dets, strategy, metric, t)
                agnostic = [Detection(*_box(d), d.score, "x") for d in dets]
                kept = merge(dets, strategy, metric, t, class_agnostic=True)
                assert [(*_box(d), d.score) for d in kept] == [
                    (*_box(d), d.score) for d in _reference(agnostic, strategy, metric, t)
                ]


def test_merge_thousands() -> None:
    rng = np.random.default_rng(0)
    corners = rng.uniform(0, 5000, size=(4000, 2))
    sides = rng.uniform(5, 80, size=(4000, 2))
    dets = [
        _det(x, y, x + w, y + h, s, lab)
        for (x, y), (w, h), s, lab in zip(
            corners.tolist(),
            sides.tolist(),
            rng.random(4000).tolist(),
            rng.choice(["a", "b"], 4000).tolist(),
            strict=True,
        )
    ]
    for strategy in ("greedynmm", "nmm", "nms"):
        kept = merge(dets, strategy)
        assert 0 < len(kept) < len(dets)
        assert [d.score for d in kept] == sorted((d.score for d in kept), reverse=True)


def _iou_matrix(a: list[Detection], b: list[Detection]) -> np.ndarray:
    boxes_a = np.array([_box(d) for d in a]).reshape(-1, 1, 4)
    boxes_b = np.array([_box(d) for d in b]).reshape(1, -1, 4)
    lo = np.maximum(boxes_a[..., :2], boxes_b[..., :2])
    hi = np.minimum(boxes_a[..., 2:], boxes_b[..., 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=-1)
    area_a = np.prod(boxes_a[..., 2:] - boxes_a[..., :2], axis=-1)
    area_b = np.prod(boxes_b[..., 2:] - boxes_b[..., :2], axis=-1)
    return np.asarray(inter / (area_a + area_b - inter))


def _random_objects(rng: random.Random, width: int, height: int, largest: int) -> list[Detection]:
    """Up to 400 tries at an object, kept when it overlaps none kept before (touching is fine)."""
    objects: list[Detection] = []
    for _ in range(400):
        w, h = rng.uniform(2, largest), rng.uniform(2, largest)
        x, y = rng.uniform(0, width - w), rng.uniform(0, height - h)
        candidate = _det(x, y, x + w, y + h, 1.0)
        if not objects or not _iou_matrix([candidate], objects).any():
            objects.append(candidate)
    return objects


def _seen_by(tile: Tile, truth: Detection) -> Detection | None:
    """What a perfect model reports for `truth` in `tile`, in tile coordinates."""
    x1, y1 = max(truth.x1, tile.x), max(truth.y1, tile.y)
    x2, y2 = min(truth.x2, tile.x + tile.width), min(truth.y2, tile.y + tile.height)
    if x2 <= x1 or y2 <= y1:
        return None
    whole = (x1, y1, x2, y2) == _box(truth)
    return _det(x1 - tile.x, y1 - tile.y, x2 - tile.x, y2 - tile.y, 0.9 if whole else 0.6)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("width", "height", "size", "overlap"),
    [
        (1000, 700, 128, 0.25),
        (640, 640, 64, 0.5),
        (300, 200, 50, 0.2),
        (2000, 1500, 256, 0.2),
        (700, 90, 64, 0.3),
    ],
)
def test_tiled_objects_come_back_once(
    seed: int, width: int, height: int, size: int, overlap: float
) -> None:
    rng = random.Random(seed)
    tiles = plan_tiles(width, height, size, overlap)
    # Objects no larger than the overlap always lie whole inside some tile.
    truths = _random_objects(rng, width, height, largest=round(size * overlap))
    found = []
    for tile in tiles:
        seen = [d for d in (_seen_by(tile, t) for t in truths) if d is not None]
        found.extend(shift(seen, tile.x, tile.y))
    assert len(found) > len(truths)  # the overlap did produce duplicates and pieces

    merged = merge(found)

    assert len(merged) == len(truths)
    overlaps = _iou_matrix(merged, truths)
    best = overlaps.argmax(axis=0)  # each truth's best detection
    assert sorted(best.tolist()) == list(range(len(merged)))  # one each, none shared
    assert (overlaps.max(axis=0) >= 0.9).all()
    assert all(d.score == 0.9 for d in merged)
