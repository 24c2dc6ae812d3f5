"""An input image of another size than the job's: A1111's resize modes, or a refusal naming both sizes.

    fit_image(im, width, height, mode)     # mode: 0 just resize | 1 crop and resize | 2 resize and fill | None refuse

A1111's modules/images.py `resize_image` (the img2img `resize_mode` field), on a PIL image with Lanczos resampling:
0 stretches to the size; 1 scales so the image covers the size (the short side fits) and crops the centre; 2 scales
so the image fits inside and fills the two uncovered strips by stretching the resized image's outermost row or column
across them. A1111's mode 3 (just resize, latent upscale) works on latents, so it is not a pixel mode here. A1111
sends an upscale through its upscaler setting; this resizes with Lanczos as A1111 does when no upscaler is chosen.

Memory stays bounded by the job's size: mode 1 computes only the crop of a thin image's cover size (see
_crop_and_resize), and mode 2 keeps a side that would scale to 0 pixels at 1 (A1111 fails there: "height and width
must be > 0"), its strips then the stretched line.
"""
from __future__ import annotations

import numpy as np

from models.images.decode import ImageInputError

RESIZE_MODES = {0: "just resize", 1: "crop and resize", 2: "resize and fill"}


class ImageSizeError(ImageInputError):
    """An image of another size than the job's, with no resize mode to make it fit."""


def _resize(im, width: int, height: int):
    from PIL import Image
    return im if im.size == (width, height) else im.resize((width, height), resample=Image.LANCZOS)


def _crop_and_resize(im, width: int, height: int):
    """A1111's scale to the cover size and centre crop. An image of about the job's aspect is resized whole and cropped,
    as A1111 does; one whose cover size passes FULL_RESIZE_LIMIT times the job's pixels (a thin image: an 8192x1
    one's for a 256x256 job is 2,097,152x256) gets only the window computed, its memory the job's size times the
    image's long side. The window is the whole resize's in Pillow's horizontal-then-vertical order with its
    fixed-point weights (_lanczos_window), so equal to it wherever the short side is enlarged (a line a few pixels
    thin always is; tests/test_image_inputs.py checks it on ordinary sizes). Where the short side shrinks too, Pillow
    (13) runs the passes the other way round for some sizes, which can move pixels by a few levels."""
    from PIL import Image
    ratio, src_ratio = width / height, im.width / im.height
    src_w = width if ratio > src_ratio else im.width * height // im.height
    src_h = height if ratio <= src_ratio else im.height * width // im.width
    left, top = src_w // 2 - width // 2, src_h // 2 - height // 2
    window = (left, top, left + width, top + height)
    small = src_w * src_h <= FULL_RESIZE_LIMIT * width * height
    if small or (im.mode not in _PREMULTIPLIED and im.mode not in ("L", "RGB")):
        return _resize(im, src_w, src_h).crop(window)
    work = im.convert(_PREMULTIPLIED[im.mode]) if im.mode in _PREMULTIPLIED else im   # as Pillow's resize does
    if src_h == height:                             # wider than the job: the columns are the crop axis
        cols = _lanczos_window(np.asarray(work), 1, src_w, left, width)             # [im.height, width, ...]
        out = _image(cols, work.mode).resize((width, height), resample=Image.LANCZOS)
    else:                                           # taller: the rows are
        narrow = work.resize((width, work.height), resample=Image.LANCZOS)
        out = _image(_lanczos_window(np.asarray(narrow), 0, src_h, top, height), work.mode)
    return out.convert(im.mode) if out.mode != im.mode else out


FULL_RESIZE_LIMIT = 4                               # cover size / job size above which only the window is computed
_PREMULTIPLIED = {"RGBA": "RGBa", "LA": "La"}     # Pillow resamples these with the colour times alpha
_PRECISION_BITS = 22                                # Pillow's Resample.c for 8-bit images: 32 - 8 - 2


def _image(a: np.ndarray, mode: str):
    from PIL import Image
    a = np.ascontiguousarray(a)
    return Image.frombytes(mode, (a.shape[1], a.shape[0]), a.tobytes())


def _lanczos(x: np.ndarray) -> np.ndarray:
    """Pillow's lanczos_filter: sinc(x)·sinc(x / 3) on [-3, 3), its sinc sin(x·pi) / (x·pi) with sinc(0) = 1."""
    def sinc(v):
        t = v * np.pi
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(v == 0.0, 1.0, np.sin(t) / t)
    return np.where((x >= -3.0) & (x < 3.0), sinc(x) * sinc(x / 3.0), 0.0)


def _lanczos_window(a: np.ndarray, axis: int, n_out: int, start: int, count: int) -> np.ndarray:
    """Outputs start..start + count of Pillow's Lanczos resize of the 8-bit `a` ([H, W] or [H, W, C]) to n_out along
    `axis`, as Resample.c computes them: precompute_coeffs' weights in double, normalize_coeffs_8bpc's fixed point,
    the rounding sum and clip8."""
    n_in = a.shape[axis]
    scale = n_in / n_out
    filterscale = max(scale, 1.0)
    support = 3.0 * filterscale
    center = (np.arange(start, start + count) + 0.5) * scale                       # [count]
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)
    n = np.minimum((center + support + 0.5).astype(np.int64), n_in) - xmin
    taps = np.arange(int(np.ceil(support)) * 2 + 1)
    w = _lanczos(((taps[None, :] + xmin[:, None]) - center[:, None] + 0.5) * (1.0 / filterscale))
    w = np.where(taps[None, :] < n[:, None], w, 0.0)                               # [count, ksize]
    total = np.zeros(count)
    for j in taps:                                                                 # Pillow's order of the sum
        total += w[:, j]
    k = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)
    one = float(1 << _PRECISION_BITS)
    kk = np.where(k < 0, np.trunc(-0.5 + k * one), np.trunc(0.5 + k * one)).astype(np.int64)
    shape = [1] * a.ndim
    shape[axis] = count
    acc = np.full(a.shape[:axis] + (count,) + a.shape[axis + 1:], 1 << (_PRECISION_BITS - 1), dtype=np.int64)
    for j in taps:
        idx = np.minimum(xmin + j, n_in - 1)                                       # past n: weight 0
        acc += np.take(a, idx, axis=axis).astype(np.int64) * kk[:, j].reshape(shape)
    return np.clip(acc >> _PRECISION_BITS, 0, 255).astype(np.uint8)


def _resize_and_fill(im, width: int, height: int):
    from PIL import Image
    ratio, src_ratio = width / height, im.width / im.height
    # an image thinner than one pixel at the job's size (A1111: "height and width must be > 0") keeps one pixel
    src_w = width if ratio < src_ratio else max(1, im.width * height // im.height)
    src_h = height if ratio >= src_ratio else max(1, im.height * width // im.width)
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
