"""An input image of another size than the job's: A1111's resize modes, or a refusal naming both sizes.

    fit_image(im, width, height, mode)     # mode: 0 just resize | 1 crop and resize | 2 resize and fill | None refuse

A1111's modules/images.py `resize_image` (the img2img `resize_mode` field), on a PIL image with Lanczos resampling:
0 stretches to the size; 1 scales so the image covers the size (the short side fits) and crops the centre; 2 scales
so the image fits inside and fills the two uncovered strips by stretching the resized image's outermost row or column
across them. A1111's mode 3 (just resize, latent upscale) works on latents, so it is not a pixel mode here. A1111
sends an upscale through its upscaler setting; this resizes with Lanczos as A1111 does when no upscaler is chosen.
"""
from __future__ import annotations

from models.images.decode import ImageInputError

RESIZE_MODES = {0: "just resize", 1: "crop and resize", 2: "resize and fill"}


class ImageSizeError(ImageInputError):
    """An image of another size than the job's, with no resize mode to make it fit."""


def _resize(im, width: int, height: int):
    from PIL import Image
    return im if im.size == (width, height) else im.resize((width, height), resample=Image.LANCZOS)


def _crop_and_resize(im, width: int, height: int):
    from PIL import Image
    ratio, src_ratio = width / height, im.width / im.height
    src_w = width if ratio > src_ratio else im.width * height // im.height
    src_h = height if ratio <= src_ratio else im.height * width // im.width
    resized = _resize(im, src_w, src_h)
    out = Image.new(im.mode, (width, height))
    out.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    return out


def _resize_and_fill(im, width: int, height: int):
    from PIL import Image
    ratio, src_ratio = width / height, im.width / im.height
    src_w = width if ratio < src_ratio else im.width * height // im.height
    src_h = height if ratio >= src_ratio else im.height * width // im.width
    resized = _resize(im, src_w, src_h)
    out = Image.new(im.mode, (width, height))
    out.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    if ratio < src_ratio:
        fill = height // 2 - src_h // 2
        if fill > 0:
            out.paste(resized.resize((width, fill), box=(0, 0, width, 0)), box=(0, 0))
            out.paste(resized.resize((width, fill), box=(0, resized.height, width, resized.height)),
                      box=(0, fill + src_h))
    elif ratio > src_ratio:
        fill = width // 2 - src_w // 2
        if fill > 0:
            out.paste(resized.resize((fill, height), box=(0, 0, 0, height)), box=(0, 0))
            out.paste(resized.resize((fill, height), box=(resized.width, 0, resized.width, height)),
                      box=(fill + src_w, 0))
    return out


def fit_image(im, width: int, height: int, mode: int | None, *, what: str = "the image"):
    """`im` (PIL) at width x height by A1111's resize `mode`; an image already that size is returned as it is.
    mode None: ImageSizeError naming both sizes."""
    if im.size == (width, height):
        return im
    if mode is None:
        raise ImageSizeError(f"{what} is {im.width}x{im.height} but the job is {width}x{height}; send it at "
                             f"{width}x{height} or choose a resize mode ({_modes()})")
    if mode not in RESIZE_MODES:
        raise ImageSizeError(f"resize mode {mode!r}: must be one of {_modes()}")
    if mode == 0:
        return _resize(im, width, height)
    if mode == 1:
        return _crop_and_resize(im, width, height)
    return _resize_and_fill(im, width, height)


def _modes() -> str:
    return ", ".join(f"{k} {v}" for k, v in RESIZE_MODES.items())
