"""Latent hires fix and batches (models.sampling.latent_ops) against torch and a direct reimplementation of ComfyUI's
nodes (nodes.py LatentUpscale / LatentUpscaleBy / RepeatLatentBatch / LatentFromBatch, comfy/utils.py common_upscale
and bislerp, comfy/sample.py prepare_noise) written here in torch."""
from __future__ import annotations

import math

import numpy as np
import pytest

from models.sampling import latent_ops as lo

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _latent(shape=(2, 16, 5, 7), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---- upscale: torch's interpolate and ComfyUI's bislerp ------------------------------------------------------------
@pytest.mark.parametrize("method", ["nearest-exact", "bilinear", "bicubic", "area"])
@pytest.mark.parametrize("size", [(8, 11), (3, 4), (5, 7), (10, 10)])
def test_upscale_equals_torch_interpolate(method, size):
    x = _latent()
    want = F.interpolate(torch.from_numpy(x), size=size, mode=method).numpy()
    got = lo.common_upscale(x, size[1], size[0], method)
    assert got.shape == want.shape and got.dtype == np.float32
    # float32 rounding order only (bicubic's negative lobes sum terms of either sign): a wrong kernel is off by ~0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def _torch_bislerp(samples, width, height):
    """ComfyUI's comfy.utils.bislerp, as published, in torch."""
    def slerp(b1, b2, r):
        c = b1.shape[-1]
        b1n, b2n = torch.norm(b1, dim=-1, keepdim=True), torch.norm(b2, dim=-1, keepdim=True)
        u1, u2 = b1 / b1n, b2 / b2n
        u1[b1n.expand(-1, c) == 0.0] = 0.0
        u2[b2n.expand(-1, c) == 0.0] = 0.0
        dot = (u1 * u2).sum(1)
        omega = torch.acos(dot)
        so = torch.sin(omega)
        res = (torch.sin((1.0 - r.squeeze(1)) * omega) / so).unsqueeze(1) * u1 + \
            (torch.sin(r.squeeze(1) * omega) / so).unsqueeze(1) * u2
        res *= (b1n * (1.0 - r) + b2n * r).expand(-1, c)
        res[dot > 1 - 1e-5] = b1[dot > 1 - 1e-5]
        res[dot < 1e-5 - 1] = (b1 * (1.0 - r) + b2 * r)[dot < 1e-5 - 1]
        return res

    def data(n_old, n_new):
        c1 = F.interpolate(torch.arange(n_old, dtype=torch.float32).reshape(1, 1, 1, -1), size=(1, n_new),
                           mode="bilinear")
        ratios = c1 - c1.floor()
        c2 = torch.arange(n_old, dtype=torch.float32).reshape(1, 1, 1, -1) + 1
        c2[:, :, :, -1] -= 1
        c2 = F.interpolate(c2, size=(1, n_new), mode="bilinear")
        return ratios, c1.to(torch.int64), c2.to(torch.int64)

    n, c, h, w = samples.shape
    r, c1, c2 = data(w, width)
    p1 = samples.gather(-1, c1.expand((n, c, h, -1))).movedim(1, -1).reshape((-1, c))
    p2 = samples.gather(-1, c2.expand((n, c, h, -1))).movedim(1, -1).reshape((-1, c))
    res = slerp(p1, p2, r.expand((n, 1, h, -1)).movedim(1, -1).reshape((-1, 1)))
    res = res.reshape(n, h, width, c).movedim(-1, 1)
    r, c1, c2 = data(h, height)
    c1 = c1.reshape((1, 1, -1, 1)).expand((n, c, -1, width))
    c2 = c2.reshape((1, 1, -1, 1)).expand((n, c, -1, width))
    p1 = res.gather(-2, c1).movedim(1, -1).reshape((-1, c))
    p2 = res.gather(-2, c2).movedim(1, -1).reshape((-1, c))
    r = r.reshape((1, 1, -1, 1)).expand((n, 1, -1, width)).movedim(1, -1).reshape((-1, 1))
    return slerp(p1, p2, r).reshape(n, height, width, c).movedim(-1, 1)


@pytest.mark.parametrize("size", [(8, 11), (7, 10), (3, 4)])
def test_bislerp_equals_comfyuis(size):
    x = _latent()
    x[0, :, 1, 2] = 0.0                                  # a zero vector: the norm-0 case
    x[1, :, 2, 3] = x[1, :, 2, 4]                        # identical neighbours: the "same" case
    want = _torch_bislerp(torch.from_numpy(x.copy()), size[1], size[0]).numpy()
    got = lo.common_upscale(x, size[1], size[0], "bislerp")
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-6)
    assert np.isfinite(got).all()


def test_center_crop_then_upscale():
    x = _latent((1, 4, 6, 12))
    # aspect 2 -> 1: ComfyUI narrows x by round((12 - 12 * 0.5) / 2) = 3 on each side
    want = F.interpolate(torch.from_numpy(x[..., 3:9].copy()), size=(9, 9), mode="bilinear").numpy()
    np.testing.assert_allclose(lo.common_upscale(x, 9, 9, "bilinear", "center"), want, atol=2e-6)


@pytest.mark.parametrize("kw,want", [(dict(scale_by=1.5), (48, 48)), (dict(width=384, height=384), (48, 48)),
                                     (dict(width=0, height=512), (64, 64)), (dict(width=40, height=0), (8, 8)),
                                     (dict(scale_by=1.25), (40, 40))])
def test_upscale_sizes_follow_the_nodes(kw, want):
    # LatentUpscale: pixel sizes // 8, each at least 64 pixels; 0 keeps the aspect; LatentUpscaleBy: round(side·s)
    assert lo.upscale_size((1, 16, 32, 32), **kw) == want


def test_upscale_refuses_bad_arguments_by_name():
    x = _latent()
    for call, name in ((lambda: lo.common_upscale(x, 4, 4, "lanczos3"), "upscale_method"),
                       (lambda: lo.common_upscale(x, 4, 4, "area", "middle"), "crop"),
                       (lambda: lo.upscale_size(x.shape, scale_by=0), "scale_by"),
                       (lambda: lo.upscale_size(x.shape, width=-8), "width"),
                       (lambda: lo.upscale_size((1, 16, 200, 200), scale_by=8.0), "1..1024")):
        with pytest.raises(lo.LatentOpError, match=name):
            call()


# ---- batches ---------------------------------------------------------------------------------------------------------
def test_batch_noise_is_one_generator_over_the_batch():
    shape = (3, 16, 4, 6)
    want = torch.randn(shape, generator=torch.manual_seed(1234)).numpy()
    got = lo.batch_noise(1234, shape)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    # image 1 of the batch is not what seed 1234 gives a single image
    assert not np.allclose(got[1], torch.randn((1,) + shape[1:], generator=torch.manual_seed(1234)).numpy()[0])


def test_batch_index_noise_takes_its_own_draw():
    shape = (2, 16, 4, 6)
    g = torch.manual_seed(99)
    draws = [torch.randn((1,) + shape[1:], generator=g) for _ in range(4)]       # indices 0..3
    want = torch.cat([draws[3], draws[1]]).numpy()
    np.testing.assert_allclose(lo.batch_noise(99, shape, [3, 1]), want, rtol=0, atol=2e-6)


def _comfy_repeat(s, amount):
    """nodes.py RepeatLatentBatch on a dict of torch tensors."""
    s_in = s["samples"]
    out = dict(s, samples=s_in.repeat((amount, 1, 1, 1)))
    if "noise_mask" in s and s["noise_mask"].shape[0] > 1:
        out["noise_mask"] = s["noise_mask"].repeat((amount, 1, 1, 1))
    if "batch_index" in s:
        off = max(s["batch_index"]) - min(s["batch_index"]) + 1
        out["batch_index"] = s["batch_index"] + [x + i * off for i in range(1, amount) for x in s["batch_index"]]
    return out


def _comfy_from_batch(s, batch_index, length):
    """nodes.py LatentFromBatch on a dict of torch tensors."""
    s_in = s["samples"]
    if batch_index < 0:
        batch_index += s_in.shape[0]
    batch_index = max(0, min(s_in.shape[0] - 1, batch_index))
    length = min(s_in.shape[0] - batch_index, length)
    out = dict(s, samples=s_in[batch_index:batch_index + length].clone())
    if "noise_mask" in s:
        m = s["noise_mask"]
        if m.shape[0] > 1:
            if m.shape[0] < s_in.shape[0]:
                m = m.repeat(math.ceil(s_in.shape[0] / m.shape[0]), 1, 1, 1)[:s_in.shape[0]]
            out["noise_mask"] = m[batch_index:batch_index + length].clone()
    out["batch_index"] = (list(range(batch_index, batch_index + length)) if "batch_index" not in s
                          else s["batch_index"][batch_index:batch_index + length])
    return out


def test_repeat_and_from_batch_follow_the_nodes():
    x = _latent((2, 16, 3, 3))
    mask = np.random.default_rng(5).random((2, 1, 24, 24)).astype(np.float32)
    ref = {"samples": torch.from_numpy(x), "noise_mask": torch.from_numpy(mask), "batch_index": [4, 5]}
    want = _comfy_repeat(ref, 3)
    got, m, idx = lo.repeat_batch(x, 3, mask, [4, 5])
    np.testing.assert_array_equal(got, want["samples"].numpy())
    np.testing.assert_array_equal(m, want["noise_mask"].numpy())
    assert idx == want["batch_index"] == [4, 5, 6, 7, 8, 9]
    for start, n in ((1, 2), (5, 4), (9, 1), (-1, 3), (-4, 2), (-6, 6), (-40, 1)):   # clamped as ComfyUI clamps
        w = _comfy_from_batch(want, start, n)
        g, gm, gi = lo.from_batch(got, start, n, m, idx)
        np.testing.assert_array_equal(g, w["samples"].numpy())
        np.testing.assert_array_equal(gm, w["noise_mask"].numpy())
        assert gi == w["batch_index"]
    w = _comfy_from_batch({"samples": torch.from_numpy(x)}, 1, 1)
    assert lo.from_batch(x, 1, 1)[2] == w["batch_index"] == [1]
    with pytest.raises(lo.LatentOpError, match="amount"):
        lo.repeat_batch(x, 0)
    with pytest.raises(lo.LatentOpError, match="length"):
        lo.from_batch(x, 0, 0)
    with pytest.raises(lo.LatentOpError, match="batch_index"):
        lo.from_batch(x, -16385, 1)


def test_from_batch_noise_is_the_batch_images_noise():
    # a LatentFromBatch image keeps its place in the batch's noise: prepare_noise with its batch_index
    full = lo.batch_noise(7, (4, 16, 4, 4))
    _, _, idx = lo.from_batch(np.zeros((4, 16, 4, 4), np.float32), 2, 2)
    np.testing.assert_array_equal(lo.batch_noise(7, (2, 16, 4, 4), idx), full[2:4])


# ---- the pixel path: ImageScale / ImageScaleBy on the decoded 8-bit image ------------------------------------------
def _image(h=24, w=20, seed=3):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("method", ["nearest-exact", "bilinear", "bicubic", "area"])
@pytest.mark.parametrize("size", [(36, 30), (48, 40), (20, 16)])
def test_image_scale_is_torch_interpolate_on_the_unit_image(method, size):
    """ComfyUI's ImageScale: image.movedim(-1, 1) through common_upscale (torch interpolate), back to [.., H, W, C];
    here from u8 / 255 as ComfyUI's LoadImage makes the float image."""
    img = _image()
    x = torch.from_numpy(img.astype(np.float32) / 255.0).movedim(-1, 0)[None]
    want = F.interpolate(x, size=size, mode=method).numpy()[0]
    got = lo.image_scale(img, size[1], size[0], method)
    assert got.shape == (3, *size) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _comfy_lanczos(samples, width, height):
    """comfy.utils.lanczos as published: each [C, H, W] float image clipped to 8 bits (truncated), Pillow's LANCZOS,
    back to float / 255."""
    from PIL import Image
    images = [Image.fromarray(np.clip(255. * im.movedim(0, -1).cpu().numpy(), 0, 255).astype(np.uint8))
              for im in samples]
    images = [im.resize((width, height), resample=Image.Resampling.LANCZOS) for im in images]
    return torch.stack([torch.from_numpy(np.array(im).astype(np.float32) / 255.0).movedim(-1, 0) for im in images])


def _numpy_lanczos(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """An independent Lanczos-3 in float (Pillow's kernel: support 3 * max(in/out, 1), centres (i + 0.5) * in/out,
    weights normalised), along rows then columns, the intermediate image rounded and clipped to 8 bits as Pillow's
    is, in float64 (Pillow's weights are 22-bit fixed point)."""
    def axis(n_in, n_out):
        scale = n_in / n_out
        fs = max(scale, 1.0)
        wm = np.zeros((n_out, n_in))
        for i in range(n_out):
            c = (i + 0.5) * scale
            lo_, hi_ = max(int(c - 3 * fs + 0.5), 0), min(int(c + 3 * fs + 0.5), n_in)
            j = np.arange(lo_, hi_)
            x = (j - c + 0.5) / fs
            k = np.sinc(x) * np.sinc(x / 3) * (np.abs(x) < 3)
            wm[i, lo_:hi_] = k / k.sum()
        return wm
    a = img.astype(np.float64)
    a = np.clip(np.round(np.einsum("xw,hwc->hxc", axis(img.shape[1], width), a)), 0, 255)
    a = np.einsum("yh,hxc->yxc", axis(img.shape[0], height), a)
    return np.clip(a, 0, 255).transpose(2, 0, 1) / 255.0


@pytest.mark.parametrize("size", [(36, 30), (48, 40), (29, 23)])
def test_image_scale_lanczos_is_comfys_pillow_lanczos(size):
    img = _image()
    got = lo.image_scale(img, size[1], size[0], "lanczos")
    x = torch.from_numpy(img.astype(np.float32) / 255.0).movedim(-1, 0)[None]
    np.testing.assert_array_equal(got, _comfy_lanczos(x, size[1], size[0]).numpy()[0])   # 8-bit in: bitwise
    # and it is a Lanczos-3 of this image at this size (not another filter, not transposed): within Pillow's
    # fixed-point and 8-bit rounding of the float kernel
    np.testing.assert_allclose(got, _numpy_lanczos(img, size[1], size[0]), rtol=0, atol=1.01 / 255)


def test_image_scale_refuses_bad_arguments():
    with pytest.raises(lo.LatentOpError, match="bislerp"):
        lo.image_scale(_image(), 30, 36, "bislerp")
    with pytest.raises(lo.LatentOpError, match="uint8"):
        lo.image_scale(_image().astype(np.float32), 30, 36, "bilinear")
