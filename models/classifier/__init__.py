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

    def __init__(
        self,
        labels: tuple[str, ...] = LABELS,
        input_name: str = INPUT,
        output_name: str = OUTPUT,
        synthetic: bool = True,
        max_pixels: int = MAX_PIXELS,
    ) -> None:
        self.max_pixels = max_pixels
        self.labels = labels
        self.input_name = input_name
        self.output_name = output_name
        self.synthetic = synthetic

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
        if width * height > self.max_pixels:
            raise PayloadTooLarge(
                f"the image is {width}x{height} = {width * height} pixels; "
                f"the limit is {self.max_pixels} pixels, so scale it down first"
            )
        return body

    def preprocess(self, parsed: bytes) -> Arrays:
        return {self.input_name: to_tensor(parsed)}

    def postprocess(self, outputs: Arrays) -> dict[str, list[Prediction]]:
        logits = np.asarray(outputs[self.output_name], dtype=np.float64)
        if logits.shape != (len(self.labels),):
            raise ModelError(
                f"classifier: logits of shape {logits.shape}, expected ({len(self.labels)},); "
                "this is a bug"
            )
        # Softmax without overflow: shifting by the maximum leaves it unchanged.
        exp = np.exp(logits - logits.max())
        scores = exp / exp.sum()
        top = np.argsort(-scores, kind="stable")[:TOP_K]
        labels = self.labels
        return {"predictions": [Prediction(label=labels[i], score=float(scores[i])) for i in top]}

    def describe(self) -> dict[str, object]:
        return {
            "kind": "image-classifier",
            "input": "JPEG or PNG bytes",
            "classes": len(self.labels),
            "weights": "synthetic (seeded), not trained" if self.synthetic else "yours",
            # What the Open Inference Protocol answers: each prediction's JSON, TOP_K per image.
            "v2_outputs": [{"name": "predictions", "datatype": "BYTES", "shape": [-1, TOP_K]}],
        }


def create(signature: Signature, settings: ModelSettings) -> Classifier:
    """Serve any classifier with one float32 (3, 224, 224) input and a score vector output.

    The demo model's labels are generated; ``labels`` in the model's settings names a
    text file with one class name per line, in the order of the model's outputs.
    """
    where = f"models.{settings.name}"
    want_image = (3, CROP_PX, CROP_PX)
    if len(signature.inputs) != 1:
        raise SettingsError(
            f"{where}.path: a classifier takes one input, got {len(signature.inputs)}"
        )
    image = signature.inputs[0]
    if image.dtype != np.float32 or image.item_shape != want_image:
        raise SettingsError(
            f"{where}.path: {settings.path} is not an image classifier this servable can feed; "
            f"expected one float32 input of item shape {want_image}, "
            f"got {signature.describe()['inputs']}"
        )
    labels = LABELS if settings.labels is None else _read_labels(settings, where)
    scores = signature.outputs[0] if signature.outputs else None
    if scores is None or scores.item_shape != (len(labels),):
        raise SettingsError(
            f"{where}.path: expected the first output to hold one score per label "
            f"(item shape ({len(labels)},)), got {signature.describe()['outputs']}"
        )
    return Classifier(
        labels,
        image.name,
        scores.name,
        synthetic=settings.labels is None,
        max_pixels=settings.max_image_pixels,
    )


def _read_labels(settings: ModelSettings, where: str) -> tuple[str, ...]:
    path = settings.labels
    try:
        text = path.read_text(encoding="utf-8") if path is not None else ""
    except OSError as exc:
        raise SettingsError(f"{where}.labels: cannot read {path}: {exc.strerror}") from None
    labels = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not labels:
        raise SettingsError(f"{where}.labels: {path} holds no labels (one per line)")
    return labels
