"""The detector finds the scene generator's objects: precision and recall on real tiles."""

from __future__ import annotations

import struct
import time
import tracemalloc
import zlib
from collections import Counter
from io import BytesIO
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from models import detector
from models.detector import CLASSES, STRIDE, TILE, Detector, create, scenes
from models.detector.peaks import Detection, iou
from pipeline.errors import BadRequest, PayloadTooLarge, Unprocessable, UnsupportedMediaType
from pipeline.settings import ModelSettings
from pipeline.signature import Signature, spec_from_ort

GRID = TILE // STRIDE


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("detector") / "detector.onnx"
    detector.build(path)
    return path


@pytest.fixture(scope="module")
def session(model_path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def det(model_path: Path, session: ort.InferenceSession) -> Detector:
    signature = Signature(
        inputs=tuple(spec_from_ort(a) for a in session.get_inputs()),
        outputs=tuple(spec_from_ort(a) for a in session.get_outputs()),
    )
    settings = ModelSettings(name="detector", path=model_path, servable="detector")
    return create(signature, settings)


def run_tiles(
    session: ort.InferenceSession, det: Detector, tiles: list[np.ndarray], threshold: float = 0.5
) -> list[list[Detection]]:
    batch = np.stack([det.tile_input(t)["image"] for t in tiles])
    scores, sizes = session.run(["scores", "sizes"], {"image": batch})
    return [
        det.detections({"scores": s, "sizes": z}, threshold)
        for s, z in zip(scores, sizes, strict=True)
    ]


def encode(pixels: np.ndarray, fmt: str, **options: object) -> bytes:
    out = BytesIO()
    Image.fromarray(pixels).save(out, fmt, **options)
    return out.getvalue()


def in_tile(box: scenes.Box, x0: int, y0: int) -> tuple[float, float, float, float]:
    return (box.x1 - x0, box.y1 - y0, box.x2 - x0, box.y2 - y0)


class Tally:
    """Per-class true positives, false positives and misses over many tiles."""

    def __init__(self) -> None:
        self.tp: Counter[str] = Counter()
        self.fp: Counter[str] = Counter()
        self.fn: Counter[str] = Counter()
        self.ious: list[float] = []
        self.size_errors: list[float] = []
        self.wrong_class: list[str] = []

    def add(self, found: list[Detection], scene: scenes.Scene, x0: int, y0: int) -> None:
        full, partial = [], []
        for box in scene.boxes:
            x1, y1, x2, y2 = in_tile(box, x0, y0)
            if x1 >= 0 and y1 >= 0 and x2 <= TILE and y2 <= TILE:
                full.append(box)
            elif x1 < TILE and y1 < TILE and x2 > 0 and y2 > 0:
                partial.append(box)
        matched: set[int] = set()
        for d in sorted(found, key=lambda d: -d[4]):
            for other in full + partial:
                if other.label != d[5] and iou(d[:4], in_tile(other, x0, y0)) > 0.05:
                    self.wrong_class.append(f"{d} on {other}")
            best, best_iou = None, 0.5
            for k, box in enumerate(full):
                overlap = iou(d[:4], in_tile(box, x0, y0))
                if k not in matched and box.label == d[5] and overlap >= best_iou:
                    best, best_iou = k, overlap
            if best is not None:
                matched.add(best)
                self.tp[d[5]] += 1
                self.ious.append(best_iou)
                side = full[best].x2 - full[best].x1
                self.size_errors.append(abs((d[2] - d[0]) - side) / side)
            elif not any(
                box.label == d[5] and iou(d[:4], in_tile(box, x0, y0)) > 0 for box in partial
            ):
                # A box on an object the tile edge cuts is neither right nor wrong here:
                # the tiled merge resolves it with the neighbouring tile.
                self.fp[d[5]] += 1
        for k, box in enumerate(full):
            if k not in matched:
                self.fn[box.label] += 1

    def precision(self, label: str) -> float:
        found = self.tp[label] + self.fp[label]
        return self.tp[label] / found if found else 1.0

    def recall(self, label: str) -> float:
        real = self.tp[label] + self.fn[label]
        return self.tp[label] / real if real else 1.0


def test_finds_the_objects_of_tiles_cut_from_scenes(
    session: ort.InferenceSession, det: Detector
) -> None:
    tally = Tally()
    small = scenes.generate(TILE, TILE, seed=1, density=40)
    tally.add(run_tiles(session, det, [small.image])[0], small, 0, 0)
    big = scenes.generate(2000, 1500, seed=2, density=40)
    origins = [
        (x, y)
        for y in scenes.tile_starts(1500, TILE, 0.2)
        for x in scenes.tile_starts(2000, TILE, 0.2)
    ]
    tiles = [big.image[y : y + TILE, x : x + TILE] for x, y in origins]
    for found, (x, y) in zip(run_tiles(session, det, tiles), origins, strict=True):
        tally.add(found, big, x, y)
    for label in CLASSES:
        assert tally.tp[label] >= 5, f"too few {label} to measure"
        assert tally.precision(label) >= 0.98, (label, tally.tp, tally.fp)
        assert tally.recall(label) >= 0.98, (label, tally.tp, tally.fn)
    assert not tally.wrong_class
    assert min(tally.ious) > 0.7 and float(np.mean(tally.ious)) > 0.85
    assert max(tally.size_errors) < 0.15


def test_jpeg_scene_through_decode(session: ort.InferenceSession, det: Detector) -> None:
    scene = scenes.generate(900, 700, seed=3, density=40)
    pixels = det.decode(encode(scene.image, "JPEG", quality=85))
    tally = Tally()
    origins = [(0, 0), (260, 60)]
    tiles = [pixels[y : y + TILE, x : x + TILE] for x, y in origins]
    for found, (x, y) in zip(run_tiles(session, det, tiles), origins, strict=True):
        tally.add(found, scene, x, y)
    assert sum(tally.tp.values()) >= 10
    assert not tally.fp and not tally.fn and not tally.wrong_class


def test_objects_cut_by_the_tile_edge_keep_their_class(
    session: ort.InferenceSession, det: Detector
) -> None:
    scene = scenes.generate(1600, 1600, seed=4, density=60)
    cut = 0
    tiles, origins = [], []
    # Tiles whose left or top edge runs through an object.
    for box in scene.boxes[:24]:
        x = box.x1 + (box.x2 - box.x1) // 3
        y = max(0, min(box.y1 - 100, 1600 - TILE))
        if x + TILE <= 1600:
            tiles.append(scene.image[y : y + TILE, x : x + TILE])
            origins.append((x, y))
    tally = Tally()
    for found, (x, y) in zip(run_tiles(session, det, tiles), origins, strict=True):
        tally.add(found, scene, x, y)
        cut += len(found)
    assert len(tiles) >= 12 and cut > 0
    assert not tally.wrong_class


def test_ground_and_padding_give_nothing(session: ort.InferenceSession, det: Detector) -> None:
    ground = scenes.generate(TILE, TILE, seed=5, density=0).image
    black = np.zeros((TILE, TILE, 3), dtype=np.uint8)
    corner = scenes.generate(300, 200, seed=6, density=0).image
    assert run_tiles(session, det, [ground, black, corner], threshold=0.1) == [[], [], []]


def test_the_wrong_shape_or_size_scores_low(session: ort.InferenceSession, det: Detector) -> None:
    red, white = (225, 30, 35), (248, 248, 248)
    tile = np.full((TILE, TILE, 3), (80, 95, 50), dtype=np.uint8)
    tile[100:148, 100:148] = red  # a red square twice the size
    rows, cols = np.mgrid[:TILE, :TILE]
    tile[(rows - 300) ** 2 + (cols - 300) ** 2 <= 12**2] = red  # a red disc, 24 px
    tile[400:428, 400:428] = white  # a white square the size of the white disc
    tile[500:524, 100:124] = red  # the real thing, centred between cells: the worst case
    (found,) = run_tiles(session, det, [tile])
    assert [d[5] for d in found] == ["red square"]
    assert abs(found[0][0] - 100) <= 2 and abs(found[0][1] - 500) <= 2


def test_a_small_padded_tile_keeps_pixel_coordinates(
    session: ort.InferenceSession, det: Detector
) -> None:
    scene = scenes.generate(300, 200, seed=7, density=200)
    (found,) = run_tiles(session, det, [scene.image])
    assert len(found) == len(scene.boxes) >= 3
    tally = Tally()
    tally.add(found, scene, 0, 0)
    assert sum(tally.tp.values()) == len(scene.boxes)


def test_servable_hooks(session: ort.InferenceSession, det: Detector) -> None:
    scene = scenes.generate(TILE, TILE, seed=8, density=40)
    body = det.parse(encode(scene.image, "PNG"), "image/png")
    inputs = det.preprocess(body)
    assert inputs["image"].shape == (3, TILE, TILE) and inputs["image"].dtype == np.float32
    scores, sizes = session.run(["scores", "sizes"], {"image": inputs["image"][None]})
    assert scores.shape == sizes.shape == (1, len(CLASSES), GRID, GRID)
    assert scores.min() >= 0 and scores.max() <= 1
    answer = det.postprocess({"scores": scores[0], "sizes": sizes[0]})
    got = sorted((d["label"], round(d["box"][0])) for d in answer["detections"])
    want = sorted((b.label, b.x1) for b in scene.boxes)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert all(abs(g[1] - w[1]) <= 2 for g, w in zip(got, want, strict=True))
    assert all(d["score"] > 0.5 for d in answer["detections"])
    assert det.describe()["classes"] == list(CLASSES)
    with pytest.raises(UnsupportedMediaType):
        det.parse(body, "text/plain")
    with pytest.raises(BadRequest):
        det.parse(b"", "image/png")


def test_an_image_bigger_than_a_tile_is_fitted(det: Detector) -> None:
    pixels = np.full((800, 1280, 3), 255, dtype=np.uint8)
    image = det.preprocess(encode(pixels, "PNG"))["image"]
    assert image.shape == (3, TILE, TILE)
    assert image[:, :400].min() == 1.0 and image[:, 400:].max() == 0.0  # 1280x800 -> 640x400
    with pytest.raises(Unprocessable):
        det.tile_input(pixels)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF", "JPEG"])
def test_decode_round_trips(det: Detector, fmt: str) -> None:
    pixels = scenes.generate(150, 100, seed=9, density=100).image
    body = encode(pixels, fmt, quality=95) if fmt == "JPEG" else encode(pixels, fmt)
    decoded = det.decode(body)
    assert decoded.shape == pixels.shape and decoded.dtype == np.uint8
    if fmt == "JPEG":
        with Image.open(BytesIO(body)) as reference:
            assert np.array_equal(decoded, np.asarray(reference.convert("RGB")))
        assert np.abs(decoded.astype(np.int16) - pixels).mean() < 5
    else:
        assert np.array_equal(decoded, pixels)


def test_decode_refuses_bad_input(det: Detector) -> None:
    png = encode(np.zeros((20, 20, 3), dtype=np.uint8), "PNG")
    with pytest.raises(BadRequest):
        det.decode(b"GIF89a not accepted")
    with pytest.raises(BadRequest):
        det.decode(png[:-30] + b"\x00" * 30)  # corrupt image data
    with pytest.raises(PayloadTooLarge):
        Detector(max_pixels=399).decode(png)


def test_pixel_limit_is_read_from_the_header(det: Detector) -> None:
    # A valid 1x1 PNG whose header claims 50000x50000 pixels: refused by size before
    # any decoding, which only a header check can do.
    body = bytearray(encode(np.zeros((1, 1, 3), dtype=np.uint8), "PNG"))
    assert body[12:16] == b"IHDR"
    body[16:24] = struct.pack(">II", 50_000, 50_000)
    body[29:33] = struct.pack(">I", zlib.crc32(bytes(body[12:29])))
    with pytest.raises(PayloadTooLarge):
        det.parse(bytes(body), "image/png")
    with pytest.raises(PayloadTooLarge):
        det.decode(bytes(body))


def test_scenes_are_deterministic_and_well_formed() -> None:
    a = scenes.generate(2000, 1500, seed=10)
    b = scenes.generate(2000, 1500, seed=10)
    c = scenes.generate(2000, 1500, seed=11)
    assert np.array_equal(a.image, b.image) and a.boxes == b.boxes
    assert not np.array_equal(a.image, c.image) and a.boxes != c.boxes
    assert a.image.shape == (1500, 2000, 3) and a.image.dtype == np.uint8
    boxes = a.boxes
    assert len(boxes) >= 20
    for k, box in enumerate(boxes):
        assert 0 <= box.x1 < box.x2 <= 2000 and 0 <= box.y1 < box.y2 <= 1500
        for other in boxes[k + 1 :]:
            apart = (
                other.x1 >= box.x2 + scenes.GAP_PX
                or box.x1 >= other.x2 + scenes.GAP_PX
                or other.y1 >= box.y2 + scenes.GAP_PX
                or box.y1 >= other.y2 + scenes.GAP_PX
            )
            assert apart, (box, other)
    xs, ys = scenes.seams(2000, TILE, 0.2), scenes.seams(1500, TILE, 0.2)
    assert xs == [512, 640, 1024, 1152, 1360, 1664] and ys == [512, 640, 860, 1152]
    crossing = [
        b for b in boxes if any(b.x1 < s < b.x2 for s in xs) or any(b.y1 < s < b.y2 for s in ys)
    ]
    touching = [b for b in boxes if b.x1 == 0 or b.y1 == 0 or b.x2 == 2000 or b.y2 == 1500]
    assert len(crossing) >= 4 and len(touching) >= 2


def test_ground_is_duller_than_any_object() -> None:
    scene = scenes.generate(1000, 1000, seed=12, density=0)
    assert scene.boxes == []
    ground = scene.image.astype(np.int16)
    saturation = ground.max(axis=2) - ground.min(axis=2)
    assert ground.mean(axis=2).max() < 200 and saturation.max() < 150


@pytest.mark.parametrize("size", [(300, 200), (640, 640), (30, 20)])
def test_small_scenes(size: tuple[int, int]) -> None:
    scene = scenes.generate(*size, seed=13)
    assert scene.image.shape == (size[1], size[0], 3)
    assert all(b.x2 <= size[0] and b.y2 <= size[1] for b in scene.boxes)


def test_a_huge_scene_is_quick_and_lean() -> None:
    tracemalloc.start()
    try:
        start = time.perf_counter()
        scene = scenes.generate(10_000, 10_000, seed=14)
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert scene.image.dtype == np.uint8 and scene.image.nbytes == 300_000_000
    assert elapsed < 20
    assert peak < 450_000_000  # the image plus a band of scratch, no whole-scene float copy
    assert 1500 < len(scene.boxes) < 2500  # about 20 per megapixel
