"""JPEG, PNG or TIFF bytes to a uint8 RGB array; every failure is a ``BadRequest``.

``open_header`` reads only the header (cheap: safe on the event loop) and refuses
images over the pixel limit before any pixel is decoded; ``decode`` does the rest.
"""

from __future__ import annotations

from io import BytesIO

import numpy as np
from PIL import Image, ImageFile, JpegImagePlugin, PngImagePlugin, TiffImagePlugin

from pipeline.errors import BadRequest, PayloadTooLarge

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIFF_MAGICS = (b"II*\x00", b"MM\x00*")

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


def open_header(body: bytes, max_pixels: int) -> ImageFile.ImageFile:
    """Identify the format by its magic bytes, read the header, check the pixel count."""
    # The plugin classes rather than Image.open: Image.open applies Pillow's global
    # decompression-bomb check, which *warns* (an error under -W error) between 89M
    # and 179M pixels; max_pixels is the limit that counts here.
    plugin: type[ImageFile.ImageFile]
    if body.startswith(JPEG_MAGIC):
        plugin = JpegImagePlugin.JpegImageFile
    elif body.startswith(PNG_MAGIC):
        plugin = PngImagePlugin.PngImageFile
    elif body.startswith(TIFF_MAGICS):
        plugin = TiffImagePlugin.TiffImageFile
    else:
        raise BadRequest("not a JPEG, PNG or TIFF image")
    try:
        image = plugin(BytesIO(body))
    except (SyntaxError, OSError, ValueError, EOFError) as exc:
        raise BadRequest(f"could not read the image header: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise PayloadTooLarge(
            f"the image is {width}x{height} = {width * height} pixels; "
            f"the limit is {max_pixels} pixels, so send a smaller part of it"
        )
    return image


def decode(body: bytes, max_pixels: int) -> np.ndarray:
    """The whole image as uint8 (height, width, 3) RGB, upright by its EXIF orientation."""
    image = open_header(body, max_pixels)
    try:
        image.load()
        orientation = image.getexif().get(_ORIENTATION_TAG, 1)
        rgb = _to_rgb(image)
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise BadRequest(f"could not decode the image: {exc}") from None
    upright = _UPRIGHT.get(orientation) if isinstance(orientation, int) else None
    if upright is not None:
        rgb = rgb.transpose(upright)
    return np.asarray(rgb, dtype=np.uint8)


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode.startswith("I;16"):
        # 16-bit greyscale: keep the top byte; convert("RGB") would clip at 255 instead.
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
    # convert() copies even an RGB image: at 20000x20000 that is 1.2 GB more at the peak.
    return image if image.mode == "RGB" else image.convert("RGB")
