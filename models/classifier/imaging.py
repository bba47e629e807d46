"""Image bytes to the classifier's input tensor, with every decoding failure as ``BadRequest``.

``open_header`` reads only the header (cheap: safe on the event loop); ``to_tensor``
does the full decode, resize, crop and normalisation (for a worker thread). Only
JPEG and PNG are accepted, recognised by their magic bytes.
"""

from __future__ import annotations

from io import BytesIO

import numpy as np
from PIL import Image, ImageFile, JpegImagePlugin, PngImagePlugin

from pipeline.errors import BadRequest

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RESIZE_PX = 256  # the shorter side is scaled to this ...
CROP_PX = 224  # ... then the centre square of this side is kept
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # ImageNet, RGB
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

# EXIF orientation -> the transpose that shows the image upright (as ImageOps.exif_transpose).
_ORIENTATION_TAG = 0x0112
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def open_header(body: bytes) -> ImageFile.ImageFile:
    """Identify a JPEG or PNG and read its header; the pixel data is not decoded yet."""
    # The plugin classes rather than Image.open: Image.open applies Pillow's global
    # decompression-bomb check, which *warns* (an error under -W error) between 89M
    # and 179M pixels; the caller enforces its own, lower pixel limit instead.
    if body.startswith(JPEG_MAGIC):
        plugin: type[ImageFile.ImageFile] = JpegImagePlugin.JpegImageFile
    elif body.startswith(PNG_MAGIC):
        plugin = PngImagePlugin.PngImageFile
    else:
        raise BadRequest("not a JPEG or PNG image")
    try:
        return plugin(BytesIO(body))
    except (SyntaxError, OSError, ValueError) as exc:
        raise BadRequest(f"could not read the image header: {exc}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode.startswith("I;16"):
        # 16-bit greyscale PNG: keep the top byte; convert("RGB") would clip at 255 instead.
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
    return image.convert("RGB")


def to_tensor(body: bytes) -> np.ndarray:
    """Decode, scale the shorter side to 256, centre-crop 224, normalise: (3, 224, 224) float32."""
    image = open_header(body)
    try:
        if isinstance(image, JpegImagePlugin.JpegImageFile):
            # Let libjpeg decode big photos at 1/2, 1/4 or 1/8 scale, keeping the shorter
            # side >= RESIZE_PX: far less work and memory than a full decode.
            image.draft("RGB", (RESIZE_PX, RESIZE_PX))
        image.load()  # the full decode happens here
        orientation = image.getexif().get(_ORIENTATION_TAG, 1)
        rgb = _to_rgb(image)
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise BadRequest(f"could not decode the image: {exc}") from None
    # Resize-then-crop as one resize of the source box that maps onto the crop: the
    # same pixels, without materialising a huge image when the aspect ratio is extreme.
    width, height = rgb.size
    side = min(width, height) * CROP_PX / RESIZE_PX
    left, top = (width - side) / 2, (height - side) / 2
    box = (left, top, left + side, top + side)
    square = rgb.resize((CROP_PX, CROP_PX), Image.Resampling.BILINEAR, box=box)
    # The centre crop commutes with the EXIF rotations and flips, so applying the
    # orientation to the small result costs little and gives the same image.
    upright = _UPRIGHT.get(orientation) if isinstance(orientation, int) else None
    if upright is not None:
        square = square.transpose(upright)
    pixels = np.asarray(square, dtype=np.float32)  # (224, 224, 3), HWC
    pixels /= 255
    pixels -= MEAN
    pixels /= STD
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))
