"""An image classifier servable: JPEG or PNG bytes in, the top-5 labels with scores out.

``parse`` (on the loop) checks the content type, the magic bytes and the header's
pixel count without decoding; ``preprocess`` and ``postprocess`` (worker thread)
decode to a (3, 224, 224) tensor and turn logits into probabilities. The weights
are synthetic (seeded), so the predictions carry no meaning.
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from models.classifier.imaging import CROP_PX, open_header, to_tensor
from models.classifier.labels import LABELS
from models.classifier.network import build
from pipeline.errors import (
    BadRequest,
    ModelError,
    PayloadTooLarge,
    SettingsError,
    UnsupportedMediaType,
)
from pipeline.runtime import Arrays
from pipeline.settings import ModelSettings
from pipeline.signature import Signature

__all__ = ["LABELS", "MAX_PIXELS", "Classifier", "Prediction", "build", "create"]

MAX_PIXELS = 40_000_000  # about a 7700x5200 photo; decoded RGB that is 120 MB
TOP_K = 5
CONTENT_TYPES = frozenset({"image/jpeg", "image/png", "application/octet-stream"})
INPUT = "image"
OUTPUT = "logits"


class Prediction(TypedDict):
    label: str
    score: float


class Classifier:
    content_types: frozenset[str] = CONTENT_TYPES
    offload: bool = True

    def parse(self, body: bytes, content_type: str) -> bytes:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type not in self.content_types:
            raise UnsupportedMediaType(
                f"content type {content_type!r} is not accepted; "
                f"send one of {', '.join(sorted(self.content_types))}"
            )
        if not body:
            raise BadRequest("the request body is empty; send the bytes of one JPEG or PNG image")
        width, height = open_header(body).size
        if width * height > MAX_PIXELS:
            raise PayloadTooLarge(
                f"the image is {width}x{height} = {width * height} pixels; "
                f"the limit is {MAX_PIXELS} pixels, so scale it down first"
            )
        return body

    def preprocess(self, parsed: bytes) -> Arrays:
        return {INPUT: to_tensor(parsed)}

    def postprocess(self, outputs: Arrays) -> dict[str, list[Prediction]]:
        logits = np.asarray(outputs[OUTPUT], dtype=np.float64)
        if logits.shape != (len(LABELS),):
            raise ModelError(
                f"classifier: logits of shape {logits.shape}, expected ({len(LABELS)},); "
                "this is a bug"
            )
        # Softmax without overflow: shifting by the maximum leaves it unchanged.
        exp = np.exp(logits - logits.max())
        scores = exp / exp.sum()
        top = np.argsort(-scores, kind="stable")[:TOP_K]
        return {"predictions": [Prediction(label=LABELS[i], score=float(scores[i])) for i in top]}

    def describe(self) -> dict[str, object]:
        return {
            "kind": "image-classifier",
            "input": "JPEG or PNG bytes",
            "classes": len(LABELS),
            "weights": "synthetic (seeded), not trained",
        }


def create(signature: Signature, settings: ModelSettings) -> Classifier:
    """Check that the loaded model has the classifier's tensors, then serve it."""
    image = signature.input(INPUT)
    want_image = (3, CROP_PX, CROP_PX)
    if image is None or image.dtype != np.float32 or image.item_shape != want_image:
        raise SettingsError(
            f"models.{settings.name}.path: {settings.path} is not the classifier's model; "
            f"expected a float32 input {INPUT!r} of item shape {want_image}, "
            f"got {signature.describe()['inputs']}"
        )
    logits = next((s for s in signature.outputs if s.name == OUTPUT), None)
    if logits is None or logits.item_shape != (len(LABELS),):
        raise SettingsError(
            f"models.{settings.name}.path: {settings.path} is not the classifier's model; "
            f"expected an output {OUTPUT!r} of item shape ({len(LABELS)},), "
            f"got {signature.describe()['outputs']}"
        )
    return Classifier()
