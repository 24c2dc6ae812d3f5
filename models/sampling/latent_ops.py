"""What ComfyUI does to latents around a KSampler (numpy, no torch): the sigmas of a partial denoise and of
KSamplerAdvanced's step window, a batch's starting noise, RepeatLatentBatch / LatentFromBatch, the noise mask's
resize, and LatentUpscale's five methods.

Sources (ComfyUI, github.com/comfyanonymous/ComfyUI):
- comfy/samplers.py `KSampler.set_steps`: denoise d < 0.9999 builds the schedule of int(steps / d) steps and keeps
  its last steps + 1 sigmas; `KSampler.sample`: last_step cuts `sigmas[:last_step + 1]` (force_full_denoise sets the
  last to 0), start_step keeps `sigmas[start_step:]`, or returns the latent untouched when nothing is left.
- comfy/sample.py `prepare_noise`: one torch generator seeded once, one randn over the whole [B, C, ...] latent; with
  a `batch_index` one [1, C, ...] draw per index up to the largest, each image taking the draw of its index.
- nodes.py `RepeatLatentBatch`, `LatentFromBatch`, `LatentUpscale` (width // 8, at least 64 pixels),
  `LatentUpscaleBy` (round(size * scale)).
- comfy/utils.py `common_upscale` (torch.nn.functional.interpolate with align_corners False, or `bislerp`) and
  `reshape_mask` (the mask interpolated bilinearly to the latent, repeated over channels and batch).
Every resize below is written as torch's CPU kernels compute in float32 (area_pixel_compute_scale = in / out, the
source index scale·(dst + 0.5) - 0.5), so the results equal torch's up to float32 rounding order.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from models.sampling.k_sampling import ksampler_sigmas
from models.sampling.noise import TorchCpuGenerator, comfy_noise
from models.sampling.schedules import DEFAULT_SHIFT

F32 = np.float32
UPSCALE_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "bislerp")
CROP_METHODS = ("disabled", "center")
LATENT_SCALE = 8                # pixels per latent cell (the Qwen-Image VAE)
MAX_LATENT_SIDE = 1024          # 8192 pixels: far above any pack, a bound for what a graph may ask
MAX_BATCH = 64                  # ComfyUI's RepeatLatentBatch / EmptyLatentImage cap is 64 (4096 for the latter)
MAX_FROM_BATCH_INDEX = 16384    # LatentFromBatch's batch_index bound, either sign (nodes.py: MAX_RESOLUTION)
# the longest full schedule a partial denoise may build (int(steps / denoise) steps): ComfyUI's KSampler `steps` maximum
# (nodes.py), so a denoise never asks for a schedule ComfyUI would refuse as a step count; 10000 sigmas cost ~80 KB
MAX_SCHEDULE_STEPS = 10_000


class LatentOpError(ValueError):
    """An argument ComfyUI's node would not accept; the message names it."""


# ---- sigmas --------------------------------------------------------------------------------------------------------
def schedule_steps(steps: int, denoise: float) -> int:
    """The length of the full schedule KSampler.set_steps builds for `steps` at `denoise` (int(steps / denoise) below
    0.9999), refused past MAX_SCHEDULE_STEPS before anything is allocated. The message starts with "denoise"."""
    if isinstance(denoise, bool) or not isinstance(denoise, (int, float)) or not 0.0 < denoise <= 1.0:
        raise LatentOpError(f"denoise must be in (0, 1], got {denoise!r}")
    if denoise > 0.9999:
        return steps
    ratio = steps / denoise                         # a float (inf for the tiniest denoise): never a huge int
    if ratio >= MAX_SCHEDULE_STEPS + 1:
        raise LatentOpError(f"denoise {denoise!r} at {steps} steps would sample the last {steps} of a schedule of "
                            f"int(steps / denoise) = {ratio:.4g} steps; the limit is {MAX_SCHEDULE_STEPS} (ComfyUI's "
                            f"KSampler steps maximum): use a denoise of at least steps / {MAX_SCHEDULE_STEPS} = "
                            f"{steps / MAX_SCHEDULE_STEPS:.6g}")
    return int(ratio)


def denoise_sigmas(sampler: str, scheduler: str, steps: int, denoise: float = 1.0,
                   shift: float = DEFAULT_SHIFT) -> np.ndarray:
    """KSampler.set_steps: the sigmas for `steps` at denoise `denoise` ([<= steps + 1] f32)."""
    full = schedule_steps(steps, denoise)
    if full == steps:
        return ksampler_sigmas(sampler, scheduler, steps, shift)
    return ksampler_sigmas(sampler, scheduler, full, shift)[-(steps + 1):]


def a1111_start_step(steps: int, denoise: float) -> int:
    """stable-diffusion-webui's img2img count (sd_samplers_common.setup_img2img_steps without img2img_fix_steps) as a
    KSamplerAdvanced start_at_step on the schedule of `steps`: t_enc = int(min(denoise, 0.999) * steps), the last
    t_enc + 1 steps computed, fewer the lower the denoise (ComfyUI's KSampler computes `steps` whatever the
    denoise)."""
    if isinstance(denoise, bool) or not isinstance(denoise, (int, float)) or not 0.0 < denoise <= 1.0:
        raise LatentOpError(f"denoise must be in (0, 1], got {denoise!r}")
    return steps - int(min(denoise, 0.999) * steps) - 1


def a1111_img2img_sigmas(sampler: str, scheduler: str, steps: int, denoise: float,
                         shift: float = DEFAULT_SHIFT) -> np.ndarray:
    """The sigmas of A1111's img2img count: the schedule of `steps` from a1111_start_step."""
    return ksampler_sigmas(sampler, scheduler, steps, shift)[a1111_start_step(steps, denoise):]


def window_sigmas(sigmas: np.ndarray, start_step: Optional[int] = None, last_step: Optional[int] = None,
                  force_full_denoise: bool = False) -> Optional[np.ndarray]:
    """KSampler.sample's step window over `sigmas`; None when start_step leaves nothing to sample (ComfyUI then
    returns the input latent unchanged)."""
    for name, v in (("start_at_step", start_step), ("end_at_step", last_step)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
            raise LatentOpError(f"{name} must be an integer >= 0, got {v!r}")
    sig = np.array(sigmas, dtype=np.float32, copy=True)
    if last_step is not None and last_step < len(sig) - 1:
        sig = sig[:last_step + 1]
        if force_full_denoise:
            sig[-1] = 0.0
    if start_step is not None:
        if start_step >= len(sig) - 1:
            return None
        sig = sig[start_step:]
    return sig


# ---- batches -------------------------------------------------------------------------------------------------------
def batch_noise(seed: int, shape: Sequence[int], batch_index: Optional[Sequence[int]] = None) -> np.ndarray:
    """prepare_noise: [B, C, h, w] f32 of torch.manual_seed(seed) on the CPU; without batch_index one randn over the
    whole shape, with it one [1, C, h, w] draw per index 0..max(batch_index), image i taking draw batch_index[i]."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 4:
        raise LatentOpError(f"a batch latent is [B, C, h, w], got {list(shape)}")
    if batch_index is None:
        return comfy_noise(seed, shape)
    idx = [int(i) for i in batch_index]
    if len(idx) != shape[0] or min(idx) < 0 or max(idx) >= 4096:
        raise LatentOpError(f"batch_index must hold {shape[0]} indices in 0..4095, got {idx}")
    gen = TorchCpuGenerator(seed)
    draws = [gen.randn((1,) + shape[1:]) for _ in range(max(idx) + 1)]
    return np.concatenate([draws[i] for i in idx], axis=0)


def repeat_batch(samples: np.ndarray, amount: int, noise_mask: Optional[np.ndarray] = None,
                 batch_index: Optional[list] = None) -> tuple:
    """RepeatLatentBatch: (samples [B·amount, ...], noise_mask, batch_index) — a mask of one image is kept as is,
    a mask per image repeated with the latents, batch_index continued past its span."""
    if isinstance(amount, bool) or not isinstance(amount, int) or not 1 <= amount <= MAX_BATCH:
        raise LatentOpError(f"amount must be an integer in 1..{MAX_BATCH}, got {amount!r}")
    out = np.tile(samples, (amount,) + (1,) * (samples.ndim - 1))
    mask = noise_mask
    if noise_mask is not None and noise_mask.shape[0] > 1:
        mask = np.tile(noise_mask, (amount,) + (1,) * (noise_mask.ndim - 1))
    idx = batch_index
    if batch_index is not None:
        offset = max(batch_index) - min(batch_index) + 1
        idx = list(batch_index) + [x + i * offset for i in range(1, amount) for x in batch_index]
    return out, mask, idx


def from_batch(samples: np.ndarray, batch_index: int, length: int, noise_mask: Optional[np.ndarray] = None,
               indices: Optional[list] = None) -> tuple:
    """LatentFromBatch: (samples[i:i + n], noise_mask, batch_index) with i and n clamped to the batch as ComfyUI
    clamps them (a negative i counts from the batch's end; past either end, its first or last image); the images keep
    their own noise through batch_index."""
    for name, v, lo, hi in (("batch_index", batch_index, -MAX_FROM_BATCH_INDEX, MAX_FROM_BATCH_INDEX),
                            ("length", length, 1, MAX_BATCH)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise LatentOpError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")
    n = samples.shape[0]
    start = max(0, min(n - 1, batch_index + n if batch_index < 0 else batch_index))
    length = min(n - start, length)
    out = samples[start:start + length].copy()
    mask = noise_mask
    if noise_mask is not None and noise_mask.shape[0] > 1:
        m = noise_mask
        if m.shape[0] < n:
            m = np.tile(m, (math.ceil(n / m.shape[0]),) + (1,) * (m.ndim - 1))[:n]
        mask = m[start:start + length].copy()
    idx = list(range(start, start + length)) if indices is None else list(indices)[start:start + length]
    return out, mask, idx


def repeat_to_batch(x: np.ndarray, batch: int) -> np.ndarray:
    """comfy.utils.repeat_to_batch_size: cut to `batch`, or repeated whole and cut."""
    if x.shape[0] > batch:
        return x[:batch]
    if x.shape[0] < batch:
        return np.tile(x, (math.ceil(batch / x.shape[0]),) + (1,) * (x.ndim - 1))[:batch]
    return x


def prepare_mask(mask: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """reshape_mask: a noise mask ([h, w], [B, h, w] or [B, 1, h, w], values in [0, 1]) as the latent's [B, C, h, w]
    f32: bilinear to the latent's size, repeated over channels and batch."""
    m = np.asarray(mask, dtype=np.float32)
    if m.ndim < 2 or m.ndim > 4 or (m.ndim == 4 and m.shape[1] != 1) or m.size == 0:
        raise LatentOpError(f"mask must be [h, w], [B, h, w] or [B, 1, h, w], got {list(m.shape)}")
    if not np.isfinite(m).all() or m.min() < 0 or m.max() > 1:
        raise LatentOpError("mask values must be finite and within [0, 1]")
    b, c, h, w = (int(s) for s in shape)
    m = m.reshape((-1, 1) + m.shape[-2:])
    m = _resize(m, h, w, "bilinear")
    return np.ascontiguousarray(repeat_to_batch(np.tile(m, (1, c, 1, 1)), b))


# ---- upscale -------------------------------------------------------------------------------------------------------
def upscale_size(shape: Sequence[int], width: int = 0, height: int = 0, scale_by: Optional[float] = None) -> tuple:
    """(h, w) in latent cells LatentUpscale (pixel width/height, 0 keeps the aspect) or LatentUpscaleBy (scale_by)
    gives for a latent of `shape` [..., h, w]."""
    h0, w0 = int(shape[-2]), int(shape[-1])
    if scale_by is not None:
        if isinstance(scale_by, bool) or not isinstance(scale_by, (int, float)) or not 0.01 <= scale_by <= 8.0:
            raise LatentOpError(f"scale_by must be a number in 0.01..8, got {scale_by!r}")
        size = (round(h0 * scale_by), round(w0 * scale_by))
    else:
        for name, v in (("width", width), ("height", height)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LATENT_SIDE * LATENT_SCALE:
                raise LatentOpError(f"{name} must be an integer in 0..{MAX_LATENT_SIDE * LATENT_SCALE}, got {v!r}")
        if width == 0 and height == 0:
            return h0, w0
        if width == 0:
            height = max(64, height)
            width = max(64, round(w0 * height / h0))
        elif height == 0:
            width = max(64, width)
            height = max(64, round(h0 * width / w0))
        else:
            width, height = max(64, width), max(64, height)
        size = (height // LATENT_SCALE, width // LATENT_SCALE)
    if not all(1 <= s <= MAX_LATENT_SIDE for s in size):
        raise LatentOpError(f"the upscaled latent would be {size[0]}x{size[1]} cells; each side must be in "
                            f"1..{MAX_LATENT_SIDE}")
    return size


def common_upscale(samples: np.ndarray, width: int, height: int, method: str, crop: str = "disabled") -> np.ndarray:
    """comfy.utils.common_upscale on [B, C, h, w] f32 to [B, C, height, width]."""
    if method not in UPSCALE_METHODS:
        raise LatentOpError(f"upscale_method must be one of {list(UPSCALE_METHODS)}, got {method!r}")
    if crop not in CROP_METHODS:
        raise LatentOpError(f"crop must be one of {list(CROP_METHODS)}, got {crop!r}")
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim != 4:
        raise LatentOpError(f"a latent to upscale is [B, C, h, w], got {list(x.shape)}")
    if crop == "center":
        x = _center_crop(x, width, height)
    if method == "bislerp":
        return bislerp(x, width, height)
    return _resize(x, height, width, method)


def center_crop_margins(old_h: int, old_w: int, width: int, height: int) -> tuple[int, int]:
    """(dy, dx): what common_upscale's crop "center" cuts from each side of an old_h x old_w input before scaling
    it to width x height (the part of it of the new aspect); (0, 0) when the aspects agree."""
    old_aspect, new_aspect = old_w / old_h, width / height
    dx = dy = 0
    if old_aspect > new_aspect:
        dx = round((old_w - old_w * (new_aspect / old_aspect)) / 2)
    elif old_aspect < new_aspect:
        dy = round((old_h - old_h * (old_aspect / new_aspect)) / 2)
    return dy, dx


def _center_crop(x: np.ndarray, width: int, height: int) -> np.ndarray:
    old_h, old_w = x.shape[-2:]
    dy, dx = center_crop_margins(old_h, old_w, width, height)
    return x[..., dy:old_h - dy, dx:old_w - dx]


def _resize(x: np.ndarray, h: int, w: int, method: str) -> np.ndarray:
    """One of torch's interpolate modes on [B, C, H, W] f32, separably: along H, then along W."""
    along = {"nearest-exact": _nearest_axis, "bilinear": _linear_axis, "bicubic": _cubic_axis, "area": _area_axis}
    fn = along[method]
    if method in ("bilinear", "bicubic"):
        return _separable(x, h, w, fn)
    return fn(fn(x, h, 2), w, 3)


def _separable(x: np.ndarray, h: int, w: int, weights_fn) -> np.ndarray:
    """torch's linear and cubic kernels: out = sum_i wh_i · (sum_j ww_j · x[ih_i, iw_j]) in float32."""
    ih, wh = weights_fn(x.shape[2], h)                                  # [h, k] indices and weights
    iw, ww = weights_fn(x.shape[3], w)                                  # [w, k]
    out = None
    for a in range(ih.shape[1]):
        rows = x[:, :, ih[:, a], :]                                      # [B, C, h, W]
        inner = None
        for b in range(iw.shape[1]):
            t = rows[:, :, :, iw[:, b]] * ww[:, b]                       # [B, C, h, w]
            inner = t if inner is None else inner + t
        t = inner * wh[:, a][:, None]
        out = t if out is None else out + t
    return out.astype(np.float32)


def _scale(n_in: int, n_out: int) -> np.float32:
    return F32(n_in) / F32(n_out)


def _linear_axis(n_in: int, n_out: int) -> tuple:
    """Source indices [n_out, 2] and weights [n_out, 2] of torch's linear interpolation (align_corners False)."""
    src = _scale(n_in, n_out) * (np.arange(n_out, dtype=np.float32) + F32(0.5)) - F32(0.5)
    src = np.maximum(src, F32(0.0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    lam1 = np.clip(src - i0.astype(np.float32), F32(0.0), F32(1.0)).astype(np.float32)
    i1 = i0 + (i0 < n_in - 1)
    return np.stack([i0, i1], 1), np.stack([F32(1.0) - lam1, lam1], 1).astype(np.float32)


def _cubic_axis(n_in: int, n_out: int, a: float = -0.75) -> tuple:
    """Source indices [n_out, 4] (clamped to the edge) and weights [n_out, 4] of torch's bicubic (A = -0.75)."""
    src = _scale(n_in, n_out) * (np.arange(n_out, dtype=np.float32) + F32(0.5)) - F32(0.5)
    i0 = np.floor(src).astype(np.int64)
    t = (src - i0.astype(np.float32)).astype(np.float32)
    A = F32(a)

    def conv1(x):                                          # |x| <= 1
        return ((A + F32(2)) * x - (A + F32(3))) * x * x + F32(1)

    def conv2(x):                                          # 1 < |x| < 2
        return ((A * x - F32(5) * A) * x + F32(8) * A) * x - F32(4) * A
    one = F32(1.0)
    weights = np.stack([conv2(t + one), conv1(t), conv1(one - t), conv2((one - t) + one)], 1).astype(np.float32)
    idx = np.clip(i0[:, None] + np.arange(-1, 3)[None, :], 0, n_in - 1)
    return idx, weights


def _nearest_axis(x: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    """nearest-exact: source min(floor((dst + 0.5)·scale), n_in - 1)."""
    n_in = x.shape[axis]
    src = np.floor((np.arange(n_out, dtype=np.float32) + F32(0.5)) * _scale(n_in, n_out)).astype(np.int64)
    return np.take(x, np.minimum(src, n_in - 1), axis=axis)


def _area_axis(x: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    """adaptive_avg_pool along one axis: cell i averages [floor(i·n_in / n_out), ceil((i + 1)·n_in / n_out)).

    torch pools both axes at once (sum over the window / kh / kw); pooling one axis after the other sums in
    another order, a float32 rounding apart."""
    n_in = x.shape[axis]
    i = np.arange(n_out)
    start = np.floor((i * n_in).astype(np.float32) / F32(n_out)).astype(np.int64)
    end = np.ceil(((i + 1) * n_in).astype(np.float32) / F32(n_out)).astype(np.int64)
    cols = [np.take(x, np.arange(s, e), axis=axis).sum(axis=axis, dtype=np.float32) / F32(e - s)
            for s, e in zip(start, end)]
    return np.stack(cols, axis=axis).astype(np.float32)


def _slerp(b1: np.ndarray, b2: np.ndarray, r: np.ndarray) -> np.ndarray:
    """bislerp's slerp of row vectors [N, C] by ratios [N, 1], with ComfyUI's norm scaling and edge cases."""
    n1 = np.linalg.norm(b1, axis=-1, keepdims=True).astype(np.float32)
    n2 = np.linalg.norm(b2, axis=-1, keepdims=True).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        u1 = np.where(n1 == 0, F32(0), b1 / n1).astype(np.float32)
        u2 = np.where(n2 == 0, F32(0), b2 / n2).astype(np.float32)
        dot = (u1 * u2).sum(1, dtype=np.float32)
        omega = np.arccos(dot).astype(np.float32)
        so = np.sin(omega).astype(np.float32)
        rr = r[:, 0]
        res = (np.sin((F32(1) - rr) * omega) / so)[:, None] * u1 + (np.sin(rr * omega) / so)[:, None] * u2
    res = (res * (n1 * (F32(1) - r) + n2 * r)).astype(np.float32)
    same, opposite = dot > 1 - 1e-5, dot < 1e-5 - 1
    res[same] = b1[same]
    res[opposite] = (b1 * (F32(1) - r) + b2 * r)[opposite]
    return res


def _bislerp_axis(n_in: int, n_out: int) -> tuple:
    """ComfyUI's generate_bilinear_data: the two source indices and the ratio of each output position, read off a
    bilinear resize of the index ramp (so the positions are torch's bilinear ones)."""
    ramp = np.arange(n_in, dtype=np.float32).reshape(1, 1, 1, -1)
    c1 = _resize(ramp, 1, n_out, "bilinear").reshape(-1)
    ratios = (c1 - np.floor(c1)).astype(np.float32)
    ramp2 = ramp + F32(1)
    ramp2[..., -1] -= F32(1)
    c2 = _resize(ramp2, 1, n_out, "bilinear").reshape(-1)
    return ratios, c1.astype(np.int64), c2.astype(np.int64)


def bislerp(samples: np.ndarray, width: int, height: int) -> np.ndarray:
    """comfy.utils.bislerp: slerp between neighbouring latent vectors (over channels), along W then along H."""
    x = np.asarray(samples, dtype=np.float32)
    n, c, h, w = x.shape
    r, i1, i2 = _bislerp_axis(w, width)
    p1 = np.moveaxis(x[:, :, :, i1], 1, -1).reshape(-1, c)                   # [n·h·width, c]
    p2 = np.moveaxis(x[:, :, :, i2], 1, -1).reshape(-1, c)
    rr = np.broadcast_to(r[None, None, :], (n, h, width)).reshape(-1, 1)
    mid = np.moveaxis(_slerp(p1, p2, rr).reshape(n, h, width, c), -1, 1)       # [n, c, h, width]
    r, i1, i2 = _bislerp_axis(h, height)
    p1 = np.moveaxis(mid[:, :, i1, :], 1, -1).reshape(-1, c)                  # [n·height·width, c]
    p2 = np.moveaxis(mid[:, :, i2, :], 1, -1).reshape(-1, c)
    rr = np.broadcast_to(r[None, :, None], (n, height, width)).reshape(-1, 1)
    return np.ascontiguousarray(np.moveaxis(_slerp(p1, p2, rr).reshape(n, height, width, c), -1, 1))


IMAGE_SCALE_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "lanczos")


def image_scale(image: np.ndarray, width: int, height: int, method: str) -> np.ndarray:
    """ComfyUI's ImageScale / ImageScaleBy (crop disabled) on an 8-bit RGB image [H, W, 3] -> [3, height, width] f32:
    comfy.utils.common_upscale's torch interpolate on the [0, 1] float image (u8 / 255), or for "lanczos"
    comfy.utils.lanczos: Pillow's LANCZOS on the 8-bit image, then / 255. The float image is what VAEEncode takes;
    ComfyUI's own float image from VAEDecode is only clipped to [0, 1], ours was truncated to 8 bits by the PNG
    (the same clip(255 x).astype(uint8) comfy's lanczos does, so lanczos matches exactly, the others within 1/255)."""
    a = np.asarray(image)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
        raise LatentOpError(f"an image to scale is [H, W, 3] uint8, got {a.dtype} {list(a.shape)}")
    if method not in IMAGE_SCALE_METHODS:
        raise LatentOpError(f"upscale_method must be one of {list(IMAGE_SCALE_METHODS)}, got {method!r}")
    if method == "lanczos":
        from PIL import Image                # comfy.utils.lanczos is Pillow's filter itself
        scaled = Image.fromarray(a, "RGB").resize((width, height), resample=Image.Resampling.LANCZOS)
        return np.ascontiguousarray(np.asarray(scaled, dtype=np.float32).transpose(2, 0, 1) / F32(255.0))
    unit = (a.astype(F32) / F32(255.0)).transpose(2, 0, 1)[None]                     # [1, 3, H, W] in [0, 1]
    return np.ascontiguousarray(_resize(unit, height, width, method)[0])
