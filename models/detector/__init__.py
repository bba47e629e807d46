"""An object detector servable for huge aerial-like scenes, tiled by the pipeline.

The network (``network``) is designed, not trained: it finds the bright squares
and discs of ``catalog.CLASSES`` in 640 px tiles at stride 4. The tiled flow calls
``decode`` once per image, ``tile_input`` per tile and ``detections`` per tile's
outputs; the plain Servable hooks serve one image of at most a tile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import numpy as np
from PIL import Image

from models.detector.catalog import LABELS
from models.detector.decoding import decode, open_header
from models.detector.network import GRID, STRIDE, TILE, build
from models.detector.peaks import Detection, find_peaks
from pipeline.errors import (
    BadRequest,
    ModelError,
    SettingsError,
    Unprocessable,
    UnsupportedMediaType,
)
from pipeline.runtime import Arrays
from pipeline.settings import ModelSettings
from pipeline.signature import Signature

__all__ = ["CLASSES", "STRIDE", "TILE", "DetectionJSON", "Detector", "build", "create"]

CLASSES = LABELS  # output channel order
MAX_PIXELS = 100_000_000  # a 10000x10000 scene; decoded RGB that is 300 MB
SCORE_THRESHOLD = 0.5  # for the single-image hooks; the tiled flow passes its own
CONTENT_TYPES = frozenset({"image/jpeg", "image/png", "image/tiff", "application/octet-stream"})


class DetectionJSON(TypedDict):
    box: list[float]  # x1, y1, x2, y2 in pixels, x2 and y2 exclusive
    score: float
    label: str


class Detector:
    content_types: frozenset[str] = CONTENT_TYPES
    offload: bool = True

    def __init__(
        self,
        labels: tuple[str, ...] = CLASSES,
        input_name: str = "image",
        scores_name: str = "scores",
        sizes_name: str = "sizes",
        max_pixels: int = MAX_PIXELS,
    ) -> None:
        self.labels = labels
        self.input_name = input_name
        self.scores_name = scores_name
        self.sizes_name = sizes_name
        self.max_pixels = max_pixels

    # The tiled flow.

    def decode(self, body: bytes) -> np.ndarray:
        """JPEG, PNG or TIFF bytes to uint8 (height, width, 3) RGB."""
        return decode(body, self.max_pixels)

    def tile_input(self, tile: np.ndarray) -> Arrays:
        """A uint8 (h, w, 3) tile, h and w <= TILE, padded black at the bottom and right."""
        if tile.ndim != 3 or tile.shape[2] != 3 or tile.dtype != np.uint8:
            raise ModelError(
                f"detector: a tile must be uint8 (h, w, 3), got {tile.dtype} {tile.shape}; "
                "this is a bug"
            )
        height, width = tile.shape[:2]
        if height > TILE or width > TILE:
            # The objects have fixed sizes in pixels: a scaled-down tile would hide them.
            raise Unprocessable(
                f"tiles of {width}x{height} px are larger than this detector's {TILE} px "
                f"input; ask for tiles of at most {TILE} px"
            )
        image = np.zeros((3, TILE, TILE), dtype=np.float32)
        image[:, :height, :width] = tile.transpose(2, 0, 1)
        image /= 255
        return {self.input_name: image}

    def detections(
        self, outputs: Mapping[str, np.ndarray], score_threshold: float
    ) -> list[Detection]:
        """One tile's outputs to (x1, y1, x2, y2, score, label) in the tile's pixels."""
        scores = self._output(outputs, self.scores_name)
        sizes = self._output(outputs, self.sizes_name)
        return find_peaks(scores, sizes, self.labels, STRIDE, score_threshold)

    def _output(self, outputs: Mapping[str, np.ndarray], name: str) -> np.ndarray:
        want = (len(self.labels), GRID, GRID)
        array = outputs.get(name)
        if array is None or array.shape != want:
            got = None if array is None else array.shape
            raise ModelError(f"detector: output {name!r} of shape {got}, expected {want}; bug")
        return array

    # The single-image Servable hooks.

    def parse(self, body: bytes, content_type: str) -> bytes:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type not in self.content_types:
            raise UnsupportedMediaType(
                f"content type {content_type!r} is not accepted; "
                f"send one of {', '.join(sorted(self.content_types))}"
            )
        if not body:
            raise BadRequest("the request body is empty; send one JPEG, PNG or TIFF image")
        open_header(body, self.max_pixels)
        return body

    def preprocess(self, parsed: bytes) -> Arrays:
        pixels = self.decode(parsed)
        height, width = pixels.shape[:2]
        if height > TILE or width > TILE:
            # One request is one tile: fit a bigger image into it. Objects shrink with
            # it (and may be missed); boxes are in the fitted image's pixels.
            scale = TILE / max(height, width)
            fitted = (max(1, round(width * scale)), max(1, round(height * scale)))
            resized = Image.fromarray(pixels).resize(fitted, Image.Resampling.BILINEAR)
            pixels = np.asarray(resized, dtype=np.uint8)
        return self.tile_input(pixels)

    def postprocess(self, outputs: Arrays) -> dict[str, list[DetectionJSON]]:
        found = self.detections(outputs, SCORE_THRESHOLD)
        return {
            "detections": [
                DetectionJSON(box=[x1, y1, x2, y2], score=score, label=label)
                for x1, y1, x2, y2, score, label in found
            ]
        }

    def describe(self) -> dict[str, object]:
        return {
            "kind": "object-detector",
            "input": "JPEG, PNG or TIFF bytes; one tile here, any size through tiling",
            "tile_px": TILE,
            "stride_px": STRIDE,
            "classes": list(self.labels),
            "weights": "designed kernels (colour match, matched filter), not trained",
            "v2_outputs": [{"name": "detections", "datatype": "BYTES", "shape": [-1]}],
        }


def create(signature: Signature, settings: ModelSettings) -> Detector:
    """Serve a detector with one float32 (3, 640, 640) input and ``scores`` and ``sizes``
    outputs of item shape (classes, 160, 160)."""
    where = f"models.{settings.name}.path"
    # Pillow's own decompression-bomb guard is process-wide and fixed (89 Mpx warns,
    # 179 Mpx refuses: a 20000 x 20000 scene is 400 Mpx). Every loopserve image servable
    # checks its own, configurable `max_image_pixels` from the header before decoding,
    # so the global guard only gets in the way.
    Image.MAX_IMAGE_PIXELS = None
    want_image = (3, TILE, TILE)
    if len(signature.inputs) != 1:
        raise SettingsError(f"{where}: a detector takes one input, got {len(signature.inputs)}")
    image = signature.inputs[0]
    if image.dtype != np.float32 or image.item_shape != want_image:
        raise SettingsError(
            f"{where}: {settings.path} is not a detector this servable can feed; expected "
            f"one float32 input of item shape {want_image}, got {signature.describe()['inputs']}"
        )
    want_map = (len(CLASSES), GRID, GRID)
    names = {spec.name: spec for spec in signature.outputs}
    for name in ("scores", "sizes"):
        spec = names.get(name)
        if spec is None or spec.item_shape != want_map:
            raise SettingsError(
                f"{where}: expected outputs 'scores' and 'sizes' of item shape {want_map}, "
                f"got {signature.describe()['outputs']}"
            )
    return Detector(input_name=image.name, max_pixels=settings.max_image_pixels)
