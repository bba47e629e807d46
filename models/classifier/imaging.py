"""Image bytes to the classifier's input tensor, with every decoding failure as ``BadRequest``.

``open_header`` reads only the header (cheap: safe on the event loop); ``to_tensor``
does the full decode, resize, crop and normalisation (for a worker thread). Only
JPEG and PNG are accepted, recognised by their magic bytes.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageFile, JpegImagePlugin

from models import imaging
from pipeline.errors import BadRequest

RESIZE_PX = 256  # the shorter side is scaled to this ...
CROP_PX = 224  # ... then the centre square of this side is kept
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # ImageNet, RGB
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
FORMATS = ("JPEG", "PNG")


def open_header(body: bytes) -> ImageFile.ImageFile:
    """Identify a JPEG or PNG and read its header; the pixel data is not decoded yet."""
    return imaging.open_header(body, FORMATS)


def to_tensor(body: bytes) -> np.ndarray:
    """Decode, scale the shorter side to 256, centre-crop 224, normalise: (3, 224, 224) float32."""
    image = open_header(body)
    try:
        if isinstance(image, JpegImagePlugin.JpegImageFile):
            # Let libjpeg decode big photos at 1/2, 1/4 or 1/8 scale, keeping the shorter
            # side >= RESIZE_PX: far less work and memory than a full decode.
            image.draft("RGB", (RESIZE_PX, RESIZE_PX))
        image.load()  # the full decode happens here
        orientation = imaging.orientation_of(image)
        rgb = imaging.to_rgb(image)
    except imaging.DECODE_ERRORS as exc:
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
    square = imaging.upright(square, orientation)
    pixels = np.asarray(square, dtype=np.float32)  # (224, 224, 3), HWC
    pixels /= 255
    pixels -= MEAN
    pixels /= STD
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))
