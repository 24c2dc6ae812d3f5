"""Bytes of an uploaded image -> float arrays, bounded before any pixel is decoded.

    load_image(data)                 -> LoadedImage(pixels [H, W, 3] in 0..1, mask [H, W] or None): ComfyUI's LoadImage
    load_image_mask(data, channel)   -> [H, W] in 0..1: ComfyUI's LoadImageMask (alpha | red | green | blue)
    a1111_mask(data)                 -> [H, W] in 0..1: A1111's img2img mask (white = repaint)
    load_rgb8(data), a1111_mask8(data) the same rounded to 8 bits (255 * value), never a float copy of the picture
    image_size(data)                 -> (width, height) from the header (bounded; nothing decoded)
    open_bounded(data)               -> the PIL image, its header checked, EXIF orientation applied

What ComfyUI's nodes.py does, followed here: the EXIF orientation is applied first (ImageOps.exif_transpose); the
IMAGE is the picture converted to RGB / 255; LoadImage's MASK is 1 - alpha / 255 where the file has an alpha band
(LA, RGBA, PA) or a palette with a transparent entry; LoadImageMask converts anything but RGBA to RGBA and takes one
band (alpha inverted the same way). ComfyUI gives a 64x64 zero MASK to a file without alpha; here that is `None`
("nothing masked"), which a caller expands to its size. Pillow's CMYK -> RGB conversion is ComfyUI's (both call
`convert("RGB")`). Two differences, both where ComfyUI's result is not the picture: a 16-bit greyscale file (Pillow's
I;16 modes) is scaled by 1/65535 (ComfyUI's `convert("RGB")` clips it to white above 255); a 32-bit `I` file is read
as ComfyUI reads it (values / 255, clipped). Only the first frame of an animated file is read (one image per job).

A1111's mask (modules/processing.py, create_binary_mask): an RGBA mask whose alpha is not all opaque gives its alpha
(rounded to 0 or 255 at 128 with mask_round, A1111's default); any other mask is its greyscale (`convert("L")`).

Bounds, before decoding: at most MAX_INPUT_BYTES of file, a format Pillow names in FORMATS, and width x height at most
`max_pixels` (MAX_PIXELS by default) as the header says; Pillow's own decompression-bomb check is turned into an
error while the header is read. Everything refused is an `ImageInputError` with a message a user can act on.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np

MAX_PIXELS = 4096 * 4096               # 16.8 Mpixel: 201 MB as float32 RGB; far above any size a pack runs
MAX_INPUT_BYTES = 64 * 2**20
MAX_SIDE = 16384                       # also the largest width/height a job may ask for
ROWS = 256                             # rows converted at once by the 8-bit paths
FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF")
CHANNELS = ("alpha", "red", "green", "blue")     # LoadImageMask's choices, in ComfyUI's order


class ImageInputError(ValueError):
    """An input that is not a usable image: the message says what it is and what is allowed."""


@dataclass(frozen=True)
class LoadedImage:
    pixels: np.ndarray                 # float32 [H, W, 3], 0..1
    mask: np.ndarray | None            # float32 [H, W], 1 = masked (ComfyUI's 1 - alpha); None: no alpha

    @property
    def size(self) -> tuple[int, int]:
        """(width, height)."""
        return self.pixels.shape[1], self.pixels.shape[0]


def _header(data: bytes, max_pixels: int):
    from PIL import Image, UnidentifiedImageError
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageInputError(f"expected the image file's bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ImageInputError("the image is empty (0 bytes)")
    if len(data) > MAX_INPUT_BYTES:
        raise ImageInputError(f"the image file is {len(data)} bytes; at most {MAX_INPUT_BYTES} are taken")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(bytes(data)), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageInputError(f"refused as a decompression bomb before decoding: {e}") from None
    except UnidentifiedImageError:
        raise ImageInputError(f"not an image (or not one of {', '.join(FORMATS)})") from None
    except (OSError, SyntaxError, ValueError) as e:          # a header Pillow recognises but cannot read
        raise ImageInputError(f"not a readable image: {e}"[:300]) from None
    w, h = im.size
    if w < 1 or h < 1 or w > MAX_SIDE or h > MAX_SIDE or w * h > max_pixels:
        im.close()
        raise ImageInputError(f"the image is {w}x{h} ({w * h} pixels) by its header; at most {max_pixels} pixels "
                              f"and {MAX_SIDE} a side are taken (refused before decoding)")
    return im


def image_size(data: bytes, *, max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(width, height) as the header says, under the same bounds; no pixel decoded (what a caller budgets by)."""
    im = _header(data, max_pixels)
    im.close()
    return im.size


def open_bounded(data: bytes, *, max_pixels: int = MAX_PIXELS, transpose: bool = True):
    """The decoded first frame as a PIL image, EXIF orientation applied (unless not `transpose`: the stored pixels,
    as ComfyUI's mask upload reads them); ImageInputError for anything refused."""
    from PIL import ImageOps
    im = _header(data, max_pixels)
    try:
        im.seek(0)
        im.load()
        out = ImageOps.exif_transpose(im) if transpose else im.copy()
    except (OSError, SyntaxError, ValueError, EOFError) as e:     # truncated or corrupt pixel data
        raise ImageInputError(f"the image data cannot be decoded: {e}"[:300]) from None
    finally:
        im.close()
    return out


def _sixteen_bit(im) -> bool:
    return im.mode.startswith("I;16")


def _rgb(im) -> np.ndarray:
    """[H, W, 3] float32 in 0..1, as ComfyUI's LoadImage makes its IMAGE (but 16-bit grey at full range)."""
    # divided in place: a 4096x4096 image is 201 MB as float32, and `a / 255` would hold a second copy beside it
    if _sixteen_bit(im):
        grey = np.asarray(im).astype(np.float32)
        grey /= 65535.0
        return np.repeat(grey[:, :, None], 3, axis=2)
    if im.mode == "I":
        im = im.point(lambda v: v * (1 / 255))
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")          # the same colours; Pillow warns on P -> RGB with transparency
    out = np.asarray(im.convert("RGB")).astype(np.float32)
    out /= 255.0
    return out


def _grey16_to_8(a: np.ndarray) -> np.ndarray:
    """16-bit grey v -> round(255 * v / 65535) = round(v / 257) in integers ((v + 128) // 257: v / 257 is never
    half-way), by rows: no 4-byte copy of the whole picture."""
    out = np.empty(a.shape, np.uint8)
    for lo in range(0, a.shape[0], ROWS):
        out[lo:lo + ROWS] = (a[lo:lo + ROWS].astype(np.uint32) + 128) // 257
    return out


def load_rgb8(data: bytes, *, max_pixels: int = MAX_PIXELS):
    """LoadImage's IMAGE rounded to 8 bits (round(255 * pixels), the same values) as a PIL RGB image: the decoded
    picture and one RGB copy, never the 12-byte-a-pixel float array (a 4096² image: 201 MB) load_image makes."""
    from PIL import Image
    im = open_bounded(data, max_pixels=max_pixels)
    if _sixteen_bit(im):
        grey = _grey16_to_8(np.asarray(im))
        im.close()
        return Image.fromarray(grey, "L").convert("RGB")
    if im.mode == "I":
        im = im.point(lambda v: v * (1 / 255))
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    return im if im.mode == "RGB" else im.convert("RGB")


def _alpha(im) -> np.ndarray | None:
    """The alpha band as uint8 [H, W] (a palette's transparency included), None when the file has none."""
    if "A" in im.getbands():
        return np.asarray(im.getchannel("A"))
    if im.mode == "P" and "transparency" in im.info:
        return np.asarray(im.convert("RGBA").getchannel("A"))
    return None


def load_image(data: bytes, *, max_pixels: int = MAX_PIXELS) -> LoadedImage:
    """ComfyUI's LoadImage on the file's bytes: (IMAGE, MASK = 1 - alpha)."""
    im = open_bounded(data, max_pixels=max_pixels)
    alpha = _alpha(im)
    mask = None if alpha is None else 1.0 - alpha.astype(np.float32) / 255.0
    return LoadedImage(_rgb(im), mask)


def load_image_mask(data: bytes, channel: str = "alpha", *, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """ComfyUI's LoadImageMask: one band of the image as RGBA, / 255; the alpha band inverted (1 = masked)."""
    if channel not in CHANNELS:
        raise ImageInputError(f"channel {channel!r}: must be one of {', '.join(CHANNELS)}")
    im = open_bounded(data, max_pixels=max_pixels)
    if im.getbands() != ("R", "G", "B", "A"):
        if _sixteen_bit(im):
            im = im.point(lambda v: v * (1 / 257), "L")
        elif im.mode == "I":
            im = im.point(lambda v: v * (1 / 255))
        im = im.convert("RGBA")
    band = np.asarray(im.getchannel(channel[0].upper()), dtype=np.float32) / 255.0
    return 1.0 - band if channel == "alpha" else band


def a1111_mask8(data: bytes, *, rounded: bool = True, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """A1111's img2img mask as [H, W] uint8 (255 = repaint): a translucent RGBA mask's alpha (rounded to 0 or 255 at
    128 unless not `rounded`: A1111's mask_round), else the greyscale of the mask (16-bit grey: round(v / 257))."""
    im = open_bounded(data, max_pixels=max_pixels)
    if im.mode == "RGBA" and im.getextrema()[-1] != (255, 255):
        alpha = np.asarray(im.getchannel("A"))
        return np.where(alpha > 128, np.uint8(255), np.uint8(0)) if rounded else alpha
    if _sixteen_bit(im):
        return _grey16_to_8(np.asarray(im))
    return np.asarray(im.convert("L"))


def a1111_mask(data: bytes, *, rounded: bool = True, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """A1111's img2img mask as [H, W] in 0..1 (1 = repaint): a1111_mask8 / 255."""
    grey = a1111_mask8(data, rounded=rounded, max_pixels=max_pixels).astype(np.float32)
    grey /= 255.0
    return grey
