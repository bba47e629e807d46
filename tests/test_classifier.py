"""The classifier servable: parse refuses bad input cheaply; pre- and postprocess are exact."""

from __future__ import annotations

import contextlib
import struct
import zlib
from io import BytesIO
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from models import classifier, tiny
from models.classifier import LABELS, MAX_PIXELS, Classifier, create
from pipeline.errors import BadRequest, PayloadTooLarge, SettingsError, UnsupportedMediaType
from pipeline.servable import Servable
from pipeline.settings import ModelSettings
from pipeline.signature import Signature, spec_from_ort

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def signature_of(path: Path) -> Signature:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return Signature(
        inputs=tuple(spec_from_ort(a) for a in sess.get_inputs()),
        outputs=tuple(spec_from_ort(a) for a in sess.get_outputs()),
    )


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("classifier") / "classifier.onnx"
    classifier.build(path)
    return path


@pytest.fixture(scope="module")
def session(model_path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def servable(model_path: Path) -> Servable[bytes]:
    settings = ModelSettings(name="classifier", path=model_path, servable="classifier")
    return create(signature_of(model_path), settings)


def encode(pixels: np.ndarray, fmt: str, **options: object) -> bytes:
    out = BytesIO()
    Image.fromarray(pixels).save(out, fmt, **options)
    return out.getvalue()


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """A gradient with noise: compresses like a photo, differs per seed."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    phase = rng.uniform(0, 2 * np.pi, 3)
    channels = [127 + 100 * np.sin(xs / (40 + 30 * i) + ys / 70 + phase[i]) for i in range(3)]
    noisy = np.stack(channels, axis=-1) + rng.normal(0, 12, (height, width, 3))
    return np.clip(noisy, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return encode(photo(640, 480, seed=1), "JPEG", quality=90)


@pytest.fixture(scope="module")
def png() -> bytes:
    return encode(photo(300, 400, seed=2), "PNG")


def classify(servable: Servable[bytes], session: ort.InferenceSession, body: bytes) -> object:
    item = servable.preprocess(servable.parse(body, "application/octet-stream"))
    [logits] = session.run(None, {"image": item["image"][None]})
    return servable.postprocess({"logits": logits[0]})


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_parse_and_preprocess(
    servable: Servable[bytes], kind: str, request: pytest.FixtureRequest
) -> None:
    body: bytes = request.getfixturevalue(kind)
    assert servable.parse(body, f"image/{kind}") is body
    [(name, tensor)] = servable.preprocess(body).items()
    assert name == "image"
    assert tensor.shape == (3, 224, 224)
    assert tensor.dtype == np.float32
    assert tensor.flags.c_contiguous
    assert np.isfinite(tensor).all()


def test_solid_colour_gives_the_normalised_constant(servable: Servable[bytes]) -> None:
    colour = (200, 100, 30)
    pixels = np.empty((300, 500, 3), np.uint8)
    pixels[:] = colour
    tensor = servable.preprocess(encode(pixels, "PNG"))["image"]
    for c in range(3):
        value = (np.float32(colour[c]) / np.float32(255) - np.float32(MEAN[c])) / np.float32(STD[c])
        np.testing.assert_array_equal(tensor[c], np.full((224, 224), value, np.float32))


def test_centre_crop_of_the_shorter_side(servable: Servable[bytes]) -> None:
    # A wide image: the left and right thirds are red, the middle green. Scaled to
    # height 256 the green band is 341 wide, so the 224 crop is all green.
    pixels = np.zeros((300, 900, 3), np.uint8)
    pixels[:, :, 0] = 255
    pixels[:, 300:600] = (0, 255, 0)
    tensor = servable.preprocess(encode(pixels, "PNG"))["image"]
    green = (np.float32(1) - np.float32(MEAN[1])) / np.float32(STD[1])
    np.testing.assert_allclose(tensor[1], green, rtol=1e-6)


def test_exif_orientation_is_applied(servable: Servable[bytes]) -> None:
    pixels = photo(320, 240, seed=3)
    exif = Image.Exif()
    exif[0x0112] = 3  # stored upside down: rotate by 180 degrees to show it
    rotated = encode(pixels, "JPEG", quality=95, exif=exif.tobytes())
    upright = encode(pixels[::-1, ::-1].copy(), "JPEG", quality=95)
    a = servable.preprocess(rotated)["image"]
    b = servable.preprocess(upright)["image"]
    assert np.abs(a - b).mean() < 0.1  # equal up to JPEG noise
    assert np.abs(a - servable.preprocess(encode(pixels, "JPEG", quality=95))["image"]).mean() > 0.5


def test_big_jpeg_is_drafted_to_the_same_result(servable: Servable[bytes]) -> None:
    pixels = np.repeat(np.repeat(photo(400, 300, seed=4), 4, axis=0), 4, axis=1)  # 1600x1200
    small = servable.preprocess(encode(pixels[::4, ::4].copy(), "PNG"))["image"]
    big = servable.preprocess(encode(pixels, "JPEG", quality=95))["image"]
    assert np.abs(big - small).mean() < 0.1


@pytest.mark.parametrize("content_type", ["text/plain", "image/gif", "application/json", ""])
def test_wrong_content_type(servable: Servable[bytes], jpeg: bytes, content_type: str) -> None:
    with pytest.raises(UnsupportedMediaType, match="image/jpeg, image/png"):
        servable.parse(jpeg, content_type)


def test_content_type_parameters_are_ignored(servable: Servable[bytes], jpeg: bytes) -> None:
    assert servable.parse(jpeg, "Image/JPEG; charset=binary") is jpeg


@pytest.mark.parametrize(
    "body", [b"garbage, not an image", b"GIF89a" + bytes(100), b"\xff\xd8", b"\x89PNG"]
)
def test_garbage_is_bad_request(servable: Servable[bytes], body: bytes) -> None:
    with pytest.raises(BadRequest, match="not a JPEG or PNG image"):
        servable.parse(body, "application/octet-stream")


def test_empty_is_bad_request(servable: Servable[bytes]) -> None:
    with pytest.raises(BadRequest, match="empty"):
        servable.parse(b"", "image/png")


def test_unreadable_header_is_bad_request(servable: Servable[bytes], png: bytes) -> None:
    with pytest.raises(BadRequest, match="header"):
        servable.parse(png[:20], "image/png")


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_truncated_image_is_bad_request(
    servable: Servable[bytes], kind: str, request: pytest.FixtureRequest
) -> None:
    body: bytes = request.getfixturevalue(kind)
    half = body[: len(body) // 2]
    with pytest.raises(BadRequest):
        servable.preprocess(servable.parse(half, "application/octet-stream"))


def test_damaged_images_fail_only_as_bad_request(
    servable: Servable[bytes], jpeg: bytes, png: bytes
) -> None:
    rng = np.random.default_rng(5)
    for body in (jpeg, png):
        for _ in range(25):
            damaged = bytearray(body)
            for at in rng.integers(0, len(body), 8):
                damaged[at] = rng.integers(0, 256)
            cut = bytes(damaged[: rng.integers(1, len(body) + 1)])
            with contextlib.suppress(BadRequest, PayloadTooLarge):
                servable.preprocess(servable.parse(cut, "application/octet-stream"))


def png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR is patched to claim another size (CRC recomputed)."""
    body = bytearray(encode(np.zeros((1, 1, 3), np.uint8), "PNG"))
    # Signature (8) + IHDR length (4) + type (4), then width, height and the rest (13).
    assert body[12:16] == b"IHDR"
    body[16:24] = struct.pack(">II", width, height)
    body[29:33] = struct.pack(">I", zlib.crc32(body[12:29]))
    return bytes(body)


def test_huge_image_header_is_payload_too_large(servable: Servable[bytes]) -> None:
    with pytest.raises(PayloadTooLarge, match="50000x50000"):
        servable.parse(png_claiming(50_000, 50_000), "image/png")
    # Between our limit and Pillow's own bomb threshold: refused too, with no warning.
    with pytest.raises(PayloadTooLarge):
        servable.parse(png_claiming(10_000, 9_000), "image/png")


def test_pixel_limit_is_inclusive(servable: Servable[bytes]) -> None:
    body = png_claiming(MAX_PIXELS // 5000, 5000)
    assert servable.parse(body, "image/png") is body
    with pytest.raises(PayloadTooLarge):
        servable.parse(png_claiming(MAX_PIXELS // 5000 + 1, 5000), "image/png")


def test_postprocess_top5(
    servable: Servable[bytes], session: ort.InferenceSession, jpeg: bytes
) -> None:
    result = classify(servable, session, jpeg)
    assert isinstance(result, dict)
    predictions = result["predictions"]
    assert len(predictions) == 5
    scores = [p["score"] for p in predictions]
    assert all(isinstance(s, float) for s in scores)
    assert scores == sorted(scores, reverse=True)
    assert 0 < sum(scores) <= 1 + 1e-9
    assert all(p["label"] in LABELS for p in predictions)
    assert len({p["label"] for p in predictions}) == 5


def test_postprocess_softmax_is_stable() -> None:
    logits = np.zeros(1000, np.float32)
    logits[[3, 1, 4]] = [1000.0, 999.0, 998.0]  # exp() of these would overflow
    predictions = Classifier().postprocess({"logits": logits})["predictions"]
    assert [p["label"] for p in predictions[:3]] == [LABELS[3], LABELS[1], LABELS[4]]
    e = np.exp([0.0, -1.0, -2.0])
    np.testing.assert_allclose([p["score"] for p in predictions[:3]], e / e.sum(), rtol=1e-6)


def test_different_images_classify_differently(
    servable: Servable[bytes], session: ort.InferenceSession, jpeg: bytes, png: bytes
) -> None:
    assert classify(servable, session, jpeg) != classify(servable, session, png)


def test_labels_are_distinct_and_stable() -> None:
    assert len(LABELS) == len(set(LABELS)) == 1000
    assert all(len(label.split()) == 2 for label in LABELS)
    assert classifier.labels.make_labels() == LABELS


def test_describe(servable: Servable[bytes]) -> None:
    assert servable.describe() == {
        "kind": "image-classifier",
        "input": "JPEG or PNG bytes",
        "classes": 1000,
        "weights": "synthetic (seeded), not trained",
        "v2_outputs": [{"name": "predictions", "datatype": "BYTES", "shape": [-1, 5]}],
    }
    assert servable.offload is True
    assert servable.content_types == {"image/jpeg", "image/png", "application/octet-stream"}


def test_create_refuses_another_model(tmp_path: Path) -> None:
    path = tmp_path / "tiny.onnx"
    tiny.build(path)
    with pytest.raises(SettingsError, match=r"models\.classifier\.path"):
        create(signature_of(path), ModelSettings(name="classifier", path=path))
