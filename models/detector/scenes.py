"""Synthetic aerial-like scenes with known objects: the detector's ground truth.

``generate`` is deterministic by seed. The ground (smooth brightness and hue
variation plus per-pixel noise, dull green and brown) is made in horizontal bands
straight into a uint8 image, so a 10000x10000 scene needs no float copy of the
whole. Objects never overlap (``GAP_PX`` apart); some are placed across the seams
of the tile plan ``tile_starts`` describes, some touch the image borders.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from models.detector.catalog import CLASSES, ObjectClass

__all__ = ["CLASSES", "GAP_PX", "Box", "Scene", "generate", "seams", "tile_starts"]

GAP_PX = 10  # the least distance between two objects
BAND_ROWS = 256  # ground rows made at a time: bounds the float scratch memory
NOISE_STD = 9.0  # per-pixel ground noise, in grey levels
OBJECT_NOISE_STD = 5.0
GREEN = np.array([70.0, 95.0, 45.0], dtype=np.float32)
BROWN = np.array([115.0, 95.0, 65.0], dtype=np.float32)
SEAM_SHARE = 0.2  # of the objects, at least MIN_SEAM when the plan has seams
BORDER_SHARE = 0.1  # of the objects, at least MIN_BORDER
MIN_SEAM = 4
MIN_BORDER = 2
ATTEMPTS = 60  # placements tried per object before it is dropped (a crowded scene)


@dataclass(frozen=True)
class Box:
    x1: int
    y1: int
    x2: int  # exclusive
    y2: int  # exclusive
    label: str


@dataclass
class Scene:
    image: np.ndarray  # uint8, (height, width, 3), RGB
    boxes: list[Box] = field(default_factory=list)


def tile_starts(size: int, tile: int, overlap: float) -> list[int]:
    """Tile origins along one axis: every int(tile * (1 - overlap)) px, the last one
    shifted inward to end at the image edge."""
    if size <= tile:
        return [0]
    step = max(1, int(tile * (1 - overlap)))
    return [*range(0, size - tile, step), size - tile]


def seams(size: int, tile: int, overlap: float) -> list[int]:
    """Where tile edges fall inside the image along one axis (starts and ends, no borders)."""
    lines = {edge for s in tile_starts(size, tile, overlap) for edge in (s, s + tile)}
    return sorted(line for line in lines if 0 < line < size)


def generate(
    width: int,
    height: int,
    seed: int,
    density: float = 20.0,
    tile: int = 640,
    overlap: float = 0.2,
) -> Scene:
    """A scene with about ``density`` objects per megapixel."""
    if width < 1 or height < 1:
        raise ValueError(f"scene size must be positive, got {width}x{height}")
    if density < 0:
        raise ValueError(f"density must be >= 0, got {density}")
    if tile < 1 or not 0 <= overlap < 1:
        raise ValueError(f"need tile >= 1 and 0 <= overlap < 1, got {tile} and {overlap}")
    rng = np.random.default_rng(seed)
    image = np.empty((height, width, 3), dtype=np.uint8)
    _ground(image, rng, seed)
    boxes = _place(width, height, rng, density, tile, overlap)
    for box in boxes:
        _draw(image, box, rng)
    return Scene(image, boxes)


def _waves(rng: np.random.Generator, terms: int) -> list[tuple[float, float, float, float, float]]:
    """Random separable waves: (amplitude, x frequency, x phase, y frequency, y phase)."""
    waves = []
    for _ in range(terms):
        fx, fy = 2 * np.pi / rng.uniform(300, 3000, size=2)
        px, py = rng.uniform(0, 2 * np.pi, size=2)
        waves.append((float(rng.uniform(0.3, 1.0)), float(fx), float(px), float(fy), float(py)))
    total = sum(w[0] for w in waves)
    return [(a / total, fx, px, fy, py) for a, fx, px, fy, py in waves]


def _field(
    waves: list[tuple[float, float, float, float, float]], xs: np.ndarray, ys: np.ndarray
) -> np.ndarray:
    """Sum of the waves on the grid ys x xs, in [-1, 1]: outer products, cheap per band."""
    out = np.zeros((ys.size, xs.size), dtype=np.float32)
    for a, fx, px, fy, py in waves:
        col = (a * np.sin(fy * ys + py)).astype(np.float32)
        row = np.sin(fx * xs + px).astype(np.float32)
        out += col[:, None] * row[None, :]
    return out


def _ground(image: np.ndarray, rng: np.random.Generator, seed: int) -> None:
    height, width = image.shape[:2]
    brightness = _waves(rng, 3)
    hue = _waves(rng, 2)
    xs = np.arange(width, dtype=np.float64)
    for band, y0 in enumerate(range(0, height, BAND_ROWS)):
        y1 = min(height, y0 + BAND_ROWS)
        ys = np.arange(y0, y1, dtype=np.float64)
        # A band's noise depends on (seed, band) only: the same image however it is cut.
        noise_rng = np.random.default_rng([seed, band])
        light = _field(brightness, xs, ys)
        light *= 0.25
        light += 1.0  # brightness factor in [0.75, 1.25]
        mix = _field(hue, xs, ys)
        mix += 1.0
        mix *= 0.5  # 0 = green, 1 = brown
        noise = noise_rng.standard_normal((y1 - y0, width), dtype=np.float32)
        noise *= NOISE_STD
        for c in range(3):
            channel = mix * (BROWN[c] - GREEN[c])
            channel += GREEN[c]
            channel *= light
            channel += noise
            np.clip(channel, 0, 255, out=channel)
            image[y0:y1, :, c] = channel


def _place(
    width: int, height: int, rng: np.random.Generator, density: float, tile: int, overlap: float
) -> list[Box]:
    fitting = [c for c in CLASSES if c.size_px <= min(width, height)]
    count = int(rng.poisson(density * width * height / 1e6)) if fitting else 0
    lines = [("x", s) for s in seams(width, tile, overlap)]
    lines += [("y", s) for s in seams(height, tile, overlap)]
    n_border = min(count, max(MIN_BORDER, round(BORDER_SHARE * count)))
    n_seam = min(count - n_border, max(MIN_SEAM, round(SEAM_SHARE * count))) if lines else 0
    kinds = ["border"] * n_border + ["seam"] * n_seam + ["free"] * (count - n_border - n_seam)
    placed = np.empty((0, 4), dtype=np.int64)
    boxes: list[Box] = []
    for kind in kinds:
        cls = fitting[int(rng.integers(len(fitting)))]
        for _ in range(ATTEMPTS):
            x1, y1 = _position(kind, cls.size_px, width, height, lines, rng)
            x2, y2 = x1 + cls.size_px, y1 + cls.size_px
            clash = (
                (placed[:, 0] < x2 + GAP_PX)
                & (x1 - GAP_PX < placed[:, 2])
                & (placed[:, 1] < y2 + GAP_PX)
                & (y1 - GAP_PX < placed[:, 3])
            )
            if not clash.any():
                placed = np.vstack([placed, [x1, y1, x2, y2]])
                boxes.append(Box(x1, y1, x2, y2, cls.label))
                break
    return boxes


def _position(
    kind: str,
    size: int,
    width: int,
    height: int,
    lines: list[tuple[str, int]],
    rng: np.random.Generator,
) -> tuple[int, int]:
    x = int(rng.integers(0, width - size + 1))
    y = int(rng.integers(0, height - size + 1))
    if kind == "border":
        side = int(rng.integers(4))
        if side == 0:
            x = 0
        elif side == 1:
            x = width - size
        elif side == 2:
            y = 0
        else:
            y = height - size
    elif kind == "seam":
        axis, line = lines[int(rng.integers(len(lines)))]
        # Straddle the line: at least one pixel of the object on each side of it.
        start = line - int(rng.integers(1, size))
        if axis == "x":
            x = min(max(start, 0), width - size)
        else:
            y = min(max(start, 0), height - size)
    return x, y


def _draw(image: np.ndarray, box: Box, rng: np.random.Generator) -> None:
    cls = _by_label(box.label)
    size = cls.size_px
    patch = image[box.y1 : box.y2, box.x1 : box.x2]
    colour = np.asarray(cls.rgb, dtype=np.float32)
    noise = rng.standard_normal((size, size, 1), dtype=np.float32) * OBJECT_NOISE_STD
    paint = np.clip(colour + noise, 0, 255).astype(np.uint8)
    if cls.shape == "square":
        patch[...] = paint
    else:
        # Pixel centres within the radius of the box centre.
        centre = np.arange(size) + 0.5 - size / 2
        inside = centre[:, None] ** 2 + centre[None, :] ** 2 <= (size / 2) ** 2
        patch[inside] = paint[inside]


def _by_label(label: str) -> ObjectClass:
    return next(c for c in CLASSES if c.label == label)
