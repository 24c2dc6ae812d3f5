"""VAE decoder against diffusers' AutoencoderKLQwenImage (tiny config), tiling, both key layouts, bad files, CLI."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import AutoencoderKLQwenImage  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from models.commands.cli import main as cli_main  # noqa: E402
from models.base.safetensors_io import SafeTensorsFile, TensorEntry, save_arrays, write_safetensors  # noqa: E402
from models.vae import VAE, VAEError, decode_to_png  # noqa: E402
from models.vae.keys import decoder_shapes, detect_config, full_shapes  # noqa: E402
from models.vae.synth import VAE_PRESETS, vae_entries  # noqa: E402
from models.vae.tiled import axis_plan  # noqa: E402

TINY = VAE_PRESETS["tiny"]


def _latent(h: int, w: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((16, h, w)).astype(np.float32)     # model space


def _diffusers_decode(model: AutoencoderKLQwenImage, latent: np.ndarray) -> torch.Tensor:
    """diffusers' own path: de-normalise with its config's constants, decode one frame [1, 16, 1, h, w]."""
    mean = torch.tensor(model.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(model.config.latents_std).view(1, -1, 1, 1, 1)
    z = torch.from_numpy(latent)[None, :, None] * std + mean
    with torch.no_grad():
        return model.decode(z).sample[0, :, 0]                                           # [3, H, W] in [-1, 1]


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR of two decoder outputs after clamping to [-1, 1] and mapping to [0, 1]."""
    mse = (((a.clamp(-1, 1) - b.clamp(-1, 1)) / 2) ** 2).mean().item()
    return 10 * math.log10(1.0 / mse)


@pytest.fixture(scope="module")
def vae(tiny_vae_files):
    return VAE.open(tiny_vae_files["orig"], threads=1)


def test_untiled_matches_diffusers(tiny_vae_files, vae):
    lat = _latent(20, 24)
    ours = vae.decode_raw(lat, tile=None)                                                # [3, 160, 192]
    ref = _diffusers_decode(tiny_vae_files["ref"], lat)
    assert ours.shape == ref.shape == (3, 160, 192)
    assert torch.isfinite(ours).all()
    assert (ours.clamp(-1, 1) - ref).abs().max().item() <= 1e-4
    res = vae.decode(lat, tile=None)
    want = ((ref + 1) / 2).clamp(0, 1).numpy()
    assert res.array.shape == (3, 160, 192) and res.array.dtype == np.float32
    assert np.abs(res.array - want).max() <= 1e-4
    assert res.image.shape == (160, 192, 3) and res.image.dtype == np.uint8
    assert np.abs(res.image.astype(int) - np.round(want.transpose(1, 2, 0) * 255)).max() <= 1
    # synthetic weights at a realistic scale: the image is mostly inside [-1, 1], not saturated
    assert ours.abs().mean().item() < 0.6 and (ours.abs() > 1).float().mean().item() < 0.1


def test_diffusers_layout_from_diffusers_state_dict(tmp_path):
    """A file saved by diffusers-side code (its own state_dict names, F32, safetensors library) decodes identically."""
    torch.manual_seed(3)
    model = AutoencoderKLQwenImage(base_dim=TINY.base_dim, z_dim=TINY.z_dim).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn_like(p))
            else:
                fan_in = p.shape[1] * p.shape[-1] * p.shape[-2] if p.ndim >= 4 else p.shape[1]
                p.copy_(torch.randn_like(p) * (0.6 / math.sqrt(fan_in)))
    path = tmp_path / "diffusers.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    ours = VAE.open(path, threads=1)
    assert ours.weights.layout == "diffusers"
    lat = _latent(16, 12, seed=5)
    a = ours.decode_raw(lat, tile=None)
    assert (a.clamp(-1, 1) - _diffusers_decode(model, lat)).abs().max().item() <= 1e-4


def test_both_layouts_identical(tiny_vae_files, vae):
    other = VAE.open(tiny_vae_files["diff"], threads=1)
    assert vae.weights.layout == "original" and other.weights.layout == "diffusers"
    assert other.config == vae.config == TINY
    lat = _latent(12, 10, seed=2)
    assert torch.equal(vae.decode_raw(lat, tile=None), other.decode_raw(lat, tile=None))


def test_tiled_close_to_untiled(vae):
    lat = _latent(48, 40, seed=4)
    whole = vae.decode_raw(lat, tile=None)
    assert len(axis_plan(48, 32, 16, 8)) == 2 and len(axis_plan(40, 32, 16, 8)) == 2   # defaults split it
    assert _psnr(vae.decode_raw(lat), whole) >= 40.0                                     # tile 32, overlap 0.5
    small = vae.decode_raw(lat, tile=16, overlap=0.5)                                    # 5 x 4 tiles
    assert _psnr(small, whole) >= 40.0
    assert not torch.equal(small, whole)                                                 # tiling did something


def test_blend_weights_partition_unity():
    for n, tile, stride in [(48, 32, 16), (40, 16, 8), (37, 16, 12), (10, 32, 16)]:
        total = np.zeros(n * 8)
        for start, size, w in axis_plan(n, tile, stride, 8):
            assert w.shape == (size * 8,) and (w > 0).all()
            total[start * 8:(start + size) * 8] += w
        assert np.allclose(total, 1.0), (n, tile, stride)


def test_decoder_only_file(tiny_vae_files, vae, tmp_path):
    st = SafeTensorsFile(tiny_vae_files["orig"])
    keep = [k for k in st.keys() if k.startswith(("decoder.", "conv2."))]
    path = tmp_path / "decoder-only.safetensors"
    save_arrays(path, {k: st.get(k) for k in keep})
    lat = _latent(8, 8, seed=6)
    assert torch.equal(VAE.open(path, threads=1).decode_raw(lat, None), vae.decode_raw(lat, None))


def test_config_from_full_shapes():
    full = VAE_PRESETS["full"]
    shapes = full_shapes(full)
    assert detect_config(shapes) == full
    assert sum(int(np.prod(s)) for s in shapes.values()) * 2 / 1e6 == pytest.approx(253.8, abs=0.1)
    assert len(vae_entries("full", 0)) == len(shapes) == 194


def _write(path, arrays: dict) -> None:
    write_safetensors(path, [TensorEntry(k, "F32", v.shape, v) for k, v in arrays.items()])


def test_bad_files(tiny_vae_files, tmp_path, tiny_dit):
    with pytest.raises(VAEError, match="DiT"):
        VAE.open(tiny_dit)
    te = tmp_path / "te.safetensors"
    _write(te, {"model.embed_tokens.weight": np.zeros((8, 4), np.float32),
                "model.layers.0.mlp.up_proj.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(VAEError, match="text encoder"):
        VAE.open(te)
    st = SafeTensorsFile(tiny_vae_files["orig"])
    arrays = {k: st.get(k) for k in st.keys()}
    enc = tmp_path / "encoder-only.safetensors"
    _write(enc, {k: v for k, v in arrays.items() if k.startswith("encoder.")})
    with pytest.raises(VAEError, match="without its decoder"):
        VAE.open(enc)
    missing = tmp_path / "missing.safetensors"
    _write(missing, {k: v for k, v in arrays.items() if k != "decoder.upsamples.5.residual.2.weight"})
    with pytest.raises(VAEError, match=r"decoder\.upsamples\.5\.residual\.2\.weight"):
        VAE.open(missing)
    wrong = tmp_path / "wrong.safetensors"
    _write(wrong, {**arrays, "decoder.middle.1.proj.weight": np.zeros((3, 3, 1, 1), np.float32)})
    with pytest.raises(VAEError, match=r"decoder\.middle\.1\.proj\.weight.*shape"):
        VAE.open(wrong)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(VAEError, match="GGUF"):
        VAE.open(junk)
    with pytest.raises(VAEError, match="cannot open"):
        VAE.open(tmp_path / "absent.safetensors")
    assert set(decoder_shapes(TINY)) <= set(arrays)


def test_bad_latents(vae):
    for bad, msg in [(np.zeros((4, 8, 8), np.float32), "shape"), (np.zeros((16, 8, 8), np.int64), "dtype"),
                     (np.full((16, 4, 4), np.nan, np.float32), "NaN")]:
        with pytest.raises(ValueError, match=msg):
            vae.decode(bad)
    with pytest.raises(ValueError, match="overlap"):
        vae.decode(_latent(8, 8), tile=4, overlap=1.0)


def test_uint8_as_comfyui_saveimage():
    """Pixels = clip(255 * x, 0, 255) computed in float32 and truncated (ComfyUI's SaveImage), at the boundaries."""
    from models.vae.api import to_uint8
    hand = {0.0: 0, 0.5: 127, 1.0: 255, 0.999: 254, 0.0039: 0, 0.004: 1, -0.3: 0, 1.7: 255, -0.0: 0}
    x = np.array(list(hand), np.float32)
    got = to_uint8(np.broadcast_to(x, (3, 1, len(x))))                  # [1, n, 3]
    assert got.dtype == np.uint8 and got.shape == (1, len(x), 3)
    assert got[0, :, 0].tolist() == list(hand.values()) and (got == got[..., :1]).all()
    # Every k/255 and its float32 neighbours. Reference: the exact product (float32 x 255 is exact in float64),
    # rounded once to float32 as an IEEE float32 multiply does, then floored and clipped.
    k = np.arange(256, dtype=np.float32) / np.float32(255.0)
    xs = np.concatenate([k, np.nextafter(k, np.float32(-1)), np.nextafter(k, np.float32(2)),
                         np.random.default_rng(0).uniform(-0.1, 1.1, 5000).astype(np.float32)])
    ref = np.clip(np.floor((xs.astype(np.float64) * 255.0).astype(np.float32).astype(np.float64)), 0, 255)
    got = to_uint8(xs.reshape(1, 1, -1).repeat(3, 0))[0, :, 0]
    assert got.tolist() == ref.astype(int).tolist()
    # and it is not round-to-nearest (which would differ from ComfyUI's pixels): 0.5 -> 127, not 128
    assert (np.floor(xs.astype(np.float64) * 255.0 + 0.5).clip(0, 255) != ref).sum() > 1000


def test_png_metadata(vae, tmp_path):
    from PIL import Image
    path = tmp_path / "img.png"
    meta = {"prompt": "1girl, 桜の木", "seed": 7, "steps": {"n": 20}}
    res = decode_to_png(vae, _latent(8, 6), path, meta)
    with Image.open(path) as im:
        assert im.size == (48, 64) and im.mode == "RGB"
        assert im.text == {"prompt": "1girl, 桜の木", "seed": "7", "steps": '{"n": 20}'}
        assert np.array_equal(np.asarray(im), res.image)


def test_cli_decode(tiny_vae_files, vae, tmp_path, capsys):
    lat = _latent(10, 12, seed=8)
    np.save(tmp_path / "lat.npy", lat)
    rc = cli_main(["decode", "--vae", str(tiny_vae_files["diff"]), "--latent", str(tmp_path / "lat.npy"),
                   "--out", str(tmp_path / "o.png"), "--save-array", str(tmp_path / "o.npy"), "--no-tile",
                   "--threads", "1"])
    assert rc == 0
    arr = np.load(tmp_path / "o.npy")
    assert arr.shape == (3, 80, 96) and np.array_equal(arr, vae.decode(lat, tile=None).array)
    from PIL import Image
    with Image.open(tmp_path / "o.png") as im:                   # the PNG's pixels: clip(255 x) truncated of o.npy
        assert np.array_equal(np.asarray(im), np.clip(255.0 * arr, 0, 255).astype(np.uint8).transpose(1, 2, 0))
    np.save(tmp_path / "bad.npy", lat[:3])
    rc = cli_main(["decode", "--vae", str(tiny_vae_files["orig"]), "--latent", str(tmp_path / "bad.npy"),
                   "--out", str(tmp_path / "b.png")])
    assert rc == 2 and "expected [16, h, w]" in capsys.readouterr().err
    assert not (tmp_path / "b.png").exists()


def test_flop_count_matches_torch_counter(vae):
    """The analytic count (models.vae.flops) against torch's FlopCounterMode on what the decoder runs."""
    from torch.utils.flop_counter import FlopCounterMode
    from models.vae.flops import decoder_flops
    z = torch.randn(1, 16, 6, 5)
    with FlopCounterMode(display=False) as counter:
        vae.decoder.forward(z)
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    want = decoder_flops(TINY, 6, 5)
    assert counts["aten.convolution"] == want["executed"] - want["attention"]       # convs, sub-pixel upsample
    assert counts.get("aten._scaled_dot_product_flash_attention_for_cpu", want["attention"]) == want["attention"]
