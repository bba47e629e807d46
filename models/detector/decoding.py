"""JPEG, PNG or TIFF bytes to a uint8 RGB array; every failure is a ``BadRequest``.

``open_header`` reads only the header (cheap: safe on the event loop) and refuses
images over the pixel limit before any pixel is decoded; ``decode`` does the rest.
"""

from __future__ import annotations

import numpy as np
from PIL import ImageFile

from models import imaging
from pipeline.errors import BadRequest, PayloadTooLarge

FORMATS = ("JPEG", "PNG", "TIFF")


def open_header(body: bytes, max_pixels: int) -> ImageFile.ImageFile:
    """Identify the format by its magic bytes, read the header, check the pixel count."""
    image = imaging.open_header(body, FORMATS)
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
        orientation = imaging.orientation_of(image)
        rgb = imaging.to_rgb(image)
    except imaging.DECODE_ERRORS as exc:
        raise BadRequest(f"could not decode the image: {exc}") from None
    return np.asarray(imaging.upright(rgb, orientation), dtype=np.uint8)
