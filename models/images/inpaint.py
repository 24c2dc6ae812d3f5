"""A1111's img2img mask handling in pixels (stable-diffusion-webui modules/processing.py
StableDiffusionProcessingImg2Img.init, modules/masking.py `fill`, processing.apply_overlay), for the non-"only
masked" path:

    blur_mask(mask, bx, by)   the binary mask blurred along x then y as cv2.GaussianBlur does it there (kernel
                              2 * int(2.5 * blur + 0.5) + 1, sigma = blur, border reflect-101), rounded to 8 bits;
                              computed in float64 as FFT products (the cost per pixel does not grow with
                              the blur), so within 1 of OpenCV's fixed-point result
    fill(image, mask)         inpainting_fill 0: the masked part filled from the rest by blurs of radius 256, 64, 16,
                              4, 2, 0 composited over each other (Pillow, as masking.fill)
    overlay_mask(mask)        the blurred mask * 2 clipped to 255: where the original is pasted back
    paste_back(out, init, m)  the generated image with the original over it, alpha 255 - m (so the unmasked area is
                              the original's pixels exactly)

and for "only masked" (inpaint_full_res, A1111's masking.get_crop_region and expand_crop_region):

    crop_region(mask, pad)    the box (x1, y1, x2, y2) around every nonzero pixel, widened by pad on each side,
                              clipped to the image; None when the mask is empty
    expand_region(box, w, h, image_w, image_h)
                              that box grown along one axis to the job's aspect ratio w / h (centred, shifted back
                              inside the image, clipped at its far edge)
    paste_back(..., at=box)   the generated image resized (crop and resize) into the box of the full-size original

and ComfyUI's VAEEncodeForInpaint (comfy nodes.py) on the float image and its MASK:

    grey_under(rgb, mask)     the pixels under the rounded mask set to 0.5 ((x - 0.5) * (1 - round(m)) + 0.5)
    grow_mask(mask, by)       its noise mask: the rounded mask convolved with a by x by box of ones (padding
                              ceil((by - 1) / 2)), clamped to 1, cropped to the image, rounded; by 0: the mask rounded
"""
from __future__ import annotations

import math

import numpy as np


def grey_under(rgb: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[H, W, 3] f32 in 0..1 and a [H, W] mask in 0..1 -> the image VAEEncodeForInpaint encodes (float32 as there)."""
    m = (np.float32(1.0) - np.round(mask).astype(np.float32))[..., None]
    return ((rgb.astype(np.float32) - np.float32(0.5)) * m + np.float32(0.5)).astype(np.float32)


def grow_mask(mask: np.ndarray, by: int) -> np.ndarray:
    """VAEEncodeForInpaint's noise mask at the image's size ([H, W] f32, 0 or 1). The box of ones is separable: a
    sum of `by` shifted rows, then of `by` shifted columns (exact: sums of 0s and 1s)."""
    r = np.round(mask).astype(np.float32)
    if by == 0:
        return r
    h, w = r.shape
    pad = math.ceil((by - 1) / 2)
    p = np.pad(r, pad)
    rows = sum(p[a:a + h, :] for a in range(by))
    box = sum(rows[:, b:b + w] for b in range(by))
    return np.round(np.clip(box, 0.0, 1.0)).astype(np.float32)


def _kernel(sigma: float) -> np.ndarray:
    k = 2 * int(2.5 * sigma + 0.5) + 1
    x = np.arange(k, dtype=np.float64) - (k - 1) / 2
    w = np.exp(-x * x / (2 * sigma * sigma))
    return w / w.sum()


BLUR_CHUNK = 256                # lines transformed at once: bounds the FFT's working memory (~ 256 x 8 KB x 16 B)


def _blur_axis(a: np.ndarray, sigma: float, axis: int) -> np.ndarray:
    """The uint8 [H, W] `a` blurred by the kernel along `axis` over reflect-101 borders and rounded to uint8, as a
    product of FFTs: the cost per pixel does not grow with the radius (a tap sum is 2 * int(2.5 * sigma + 0.5) + 1
    passes over the image: 321 at blur 64). Equal to the tap sum within float64 rounding (~1e-12). Float64 only for
    BLUR_CHUNK lines at a time: the whole mask is never held as floats (a 4096² one: 134 MB a copy)."""
    w = _kernel(sigma)
    r = len(w) // 2
    a = np.moveaxis(a, axis, -1)                                     # [lines, n]
    n = a.shape[-1]
    # numpy's reflect is reflect-101; a kernel longer than the line reflects again (wrap through np.pad's rule)
    padded_len = n + 2 * r
    size = 1 << (padded_len + len(w) - 1 - 1).bit_length()          # linear (not circular) convolution
    kf = np.fft.rfft(w, size)
    out = np.empty(a.shape, np.uint8)
    for lo in range(0, a.shape[0], BLUR_CHUNK):
        rows = a[lo:lo + BLUR_CHUNK].astype(np.float64)
        p = np.pad(rows, ((0, 0), (r, r)), mode="reflect") if n > 1 else np.pad(rows, ((0, 0), (r, r)), mode="edge")
        full = np.fft.irfft(np.fft.rfft(p, size, axis=-1) * kf, size, axis=-1)   # [chunk, size]
        out[lo:lo + BLUR_CHUNK] = np.clip(np.round(full[:, 2 * r:2 * r + n]), 0, 255)
    return np.moveaxis(out, -1, axis)


def blur_mask(mask: np.ndarray, blur_x: int, blur_y: int) -> np.ndarray:
    """[H, W] uint8 -> [H, W] uint8: A1111's mask_blur_x then mask_blur_y (0: that axis untouched), each rounded to
    8 bits as cv2.GaussianBlur's uint8 output is."""
    a = np.asarray(mask, dtype=np.uint8)
    if blur_x > 0:
        a = _blur_axis(a, blur_x, 1)
    if blur_y > 0:
        a = _blur_axis(a, blur_y, 0)
    return np.ascontiguousarray(a)


def fill(image, mask):
    """A1111's masking.fill: the masked part (mask white) of the PIL RGB `image` filled with blurred colours of the
    rest; `mask` a PIL L image."""
    from PIL import Image, ImageFilter, ImageOps
    image_mod = Image.new("RGBA", (image.width, image.height))
    image_masked = Image.new("RGBa", (image.width, image.height))
    image_masked.paste(image.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    image_masked = image_masked.convert("RGBa")
    for radius, repeats in ((256, 1), (64, 1), (16, 2), (4, 4), (2, 2), (0, 1)):
        blurred = image_masked.filter(ImageFilter.GaussianBlur(radius)).convert("RGBA")
        for _ in range(repeats):
            image_mod.alpha_composite(blurred)
    return image_mod.convert("RGB")


def overlay_mask(blurred: np.ndarray) -> np.ndarray:
    """[H, W] uint8: where (and how much) the generated image shows through the pasted-back original."""
    out = np.minimum(blurred, 127).astype(np.uint8) << 1            # 2 * m clipped at 255, in 8 bits (no float copy)
    out[blurred > 127] = 255
    return out


def crop_region(mask: np.ndarray, pad: int) -> tuple[int, int, int, int] | None:
    """[H, W] mask -> (x1, y1, x2, y2), x2/y2 exclusive: the nonzero pixels' bounding box widened by `pad`, clipped."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if rows.size == 0:
        return None
    h, w = mask.shape
    return (max(int(cols[0]) - pad, 0), max(int(rows[0]) - pad, 0), min(int(cols[-1]) + 1 + pad, w),
            min(int(rows[-1]) + 1 + pad, h))


def _grow_span(lo: int, hi: int, want: float, limit: int) -> tuple[int, int]:
    """[lo, hi) grown to about `want` long around its centre (the extra split low half first), pushed back inside
    [0, limit) when it runs past either end, and cut at `limit` if still longer."""
    extra = int(want - (hi - lo))
    lo, hi = lo - extra // 2, hi + extra - extra // 2
    if hi >= limit:
        lo, hi = lo - (hi - limit), limit
    if lo < 0:
        lo, hi = 0, hi - lo
    return lo, min(hi, limit)


def expand_region(box: tuple[int, int, int, int], width: int, height: int, image_w: int,
                  image_h: int) -> tuple[int, int, int, int]:
    """The crop box grown to the processing aspect ratio width / height: the short axis lengthened (A1111 grows the
    region rather than distorting it when it is resized to the job's size)."""
    x1, y1, x2, y2 = box
    ratio = width / height
    if (x2 - x1) / (y2 - y1) > ratio:
        y1, y2 = _grow_span(y1, y2, (x2 - x1) / ratio, image_h)
    else:
        x1, x2 = _grow_span(x1, x2, (y2 - y1) * ratio, image_w)
    return x1, y1, x2, y2


def paste_back(out, init, overlay: np.ndarray, at: tuple[int, int, int, int] | None = None):
    """The generated PIL image `out` with the original `init` composited over it, alpha 255 - overlay; with `at`
    (only masked), `out` is first resized (crop and resize) into that box of a blank image of the original's size."""
    from PIL import Image, ImageOps
    over = Image.new("RGBa", init.size)
    over.paste(init.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(Image.fromarray(overlay, "L")))
    if at is not None:
        from models.images.fit import fit_image
        x1, y1, x2, y2 = at
        base = Image.new("RGBA", init.size)
        base.paste(fit_image(out.convert("RGB"), x2 - x1, y2 - y1, 1), (x1, y1))
        out = base
    result = out.convert("RGBA")
    result.alpha_composite(over.convert("RGBA"))
    return result.convert("RGB")
