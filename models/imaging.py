"""What the image servables share: formats recognised by their magic bytes, headers
read without decoding pixels, EXIF orientation, and RGB conversion.

Every failure to read an image is a ``BadRequest``. The format plugin classes are
used rather than ``Image.open``: ``Image.open`` applies Pillow's global
decompression-bomb check, which *warns* (an error under -W error) between 89M and
179M pixels; each servable enforces its own, configurable pixel limit instead.
"""

from __future__ import annotations

from io import BytesIO

import numpy as np
from PIL import Image, ImageFile, JpegImagePlugin, PngImagePlugin, TiffImagePlugin

from pipeline.errors import BadRequest

FORMATS: dict[str, tuple[tuple[bytes, ...], type[ImageFile.ImageFile]]] = {
    "JPEG": ((b"\xff\xd8\xff",), JpegImagePlugin.JpegImageFile),
    "PNG": ((b"\x89PNG\r\n\x1a\n",), PngImagePlugin.PngImageFile),
    "TIFF": ((b"II*\x00", b"MM\x00*"), TiffImagePlugin.TiffImageFile),
}
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)

# EXIF orientation -> the transpose that shows the image upright (as ImageOps.exif_transpose).
ORIENTATION_TAG = 0x0112
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def open_header(body: bytes, formats: tuple[str, ...]) -> ImageFile.ImageFile:
    """Identify one of ``formats`` by its magic bytes and read its header only."""
    for name in formats:
        magics, plugin = FORMATS[name]
        if body.startswith(magics):
            try:
                return plugin(BytesIO(body))
            except (SyntaxError, OSError, ValueError, EOFError) as exc:
                raise BadRequest(f"could not read the image header: {exc}") from None
    names = formats[0] if len(formats) == 1 else f"{', '.join(formats[:-1])} or {formats[-1]}"
    raise BadRequest(f"not a {names} image")


def orientation_of(image: Image.Image) -> int:
    value = image.getexif().get(ORIENTATION_TAG, 1)
    return value if isinstance(value, int) else 1


def upright(image: Image.Image, orientation: int) -> Image.Image:
    """The image as it should be shown, by its EXIF orientation."""
    transpose = _UPRIGHT.get(orientation)
    return image if transpose is None else image.transpose(transpose)


def to_rgb(image: Image.Image) -> Image.Image:
    if image.mode.startswith("I;16"):
        # 16-bit greyscale: keep the top byte; convert("RGB") would clip at 255 instead.
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
    # convert() copies even an RGB image: at 20000x20000 that is 1.2 GB more at the peak.
    return image if image.mode == "RGB" else image.convert("RGB")
