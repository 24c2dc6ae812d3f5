"""VAE encoder: the torch reference against diffusers' AutoencoderKLQwenImage (its own causal 3D convs, tiny config),
both key layouts, the normalisation, tiling, bad images and files."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import AutoencoderKLQwenImage  # noqa: E402

from models.base.safetensors_io import SafeTensorsFile, save_arrays  # noqa: E402
from models.vae import VAEError  # noqa: E402
from models.vae.encode import TorchEncoder, check_image  # noqa: E402
from models.vae.keys import encoder_shapes, full_shapes  # noqa: E402
from models.vae.latent import denormalize, normalize  # noqa: E402
from models.vae.synth import VAE_PRESETS  # noqa: E402

TINY = VAE_PRESETS["tiny"]


def smooth_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """[3, H, W] f32 in [-1, 1]: low-frequency colour waves plus a little noise (a photo's statistics, roughly)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / 23.0
    ph = rng.uniform(0, 6.28, 3)
    img = np.stack([np.sin(yy + xx + ph[0]), np.cos(1.3 * yy + ph[1]), np.sin(0.7 * xx + ph[2])]) * 0.85
    return np.clip(img + 0.1 * rng.standard_normal((3, h, w)), -1, 1).astype(np.float32)


@pytest.fixture(scope="module")
def enc(tiny_vae_files):
    return TorchEncoder.open(tiny_vae_files["orig"], threads=1)


def _diffusers_encode(model: AutoencoderKLQwenImage, image: np.ndarray) -> np.ndarray:
    """diffusers' own path: one frame [1, 3, 1, H, W], the posterior's mean, normalised with its config's constants
    (the way ComfyUI's VAEEncode + the Wan 2.1 latent format's process_in do)."""
    with torch.no_grad():
        mu = model.encode(torch.from_numpy(image)[None, :, None]).latent_dist.mean[0, :, 0]     # [16, h, w]
    mean = torch.tensor(model.config.latents_mean).view(-1, 1, 1)
    std = torch.tensor(model.config.latents_std).view(-1, 1, 1)
    return ((mu - mean) / std).numpy()


def test_untiled_matches_diffusers(tiny_vae_files, enc):
    for h, w, seed in [(48, 64, 1), (40, 24, 2)]:
        img = np.random.default_rng(seed).uniform(-1, 1, (3, h, w)).astype(np.float32)
        want = _diffusers_encode(tiny_vae_files["ref"], img)
        got = enc.encode(img, tile=None).latent
        assert got.shape == (16, h // 8, w // 8) and got.dtype == np.float32
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), (h, w)


def test_both_layouts_identical(tiny_vae_files, enc):
    other = TorchEncoder.open(tiny_vae_files["diff"], threads=1)
    assert enc.weights.layout == "original" and other.weights.layout == "diffusers"
    assert set(enc.weights.tensors) == set(encoder_shapes(TINY, None)) and other.config == TINY
    img = smooth_image(32, 40, seed=3)
    assert np.array_equal(enc.encode(img, tile=None).latent, other.encode(img, tile=None).latent)


def test_normalize_inverts_denormalize():
    z = np.random.default_rng(5).standard_normal((16, 3, 4)).astype(np.float32)
    assert np.allclose(normalize(denormalize(z)), z, atol=1e-5)
    with pytest.raises(ValueError, match="4 channels"):
        normalize(z[:4])


def test_tiled_close_to_untiled(enc):
    """Tiles of 16 latent pixels (128 image pixels), half overlapping: the features blended before the attention;
    a tile as large as the image is the untiled encode exactly."""
    img = smooth_image(192, 256, seed=4)                                   # latent 24 x 32: 2 x 3 tiles of 16
    whole = enc.encode(img, tile=None).latent
    tiled = enc.encode(img, tile=16, overlap=0.5).latent
    rel = float(np.sqrt(np.mean((tiled - whole) ** 2)) / whole.std())
    assert 0 < rel < 0.03, rel
    assert np.array_equal(enc.encode(img, tile=32).latent, whole)          # one tile: nothing blended


def test_bad_images(enc):
    good = smooth_image(16, 16)
    for bad, msg in [(good.astype(np.uint8), "not floating point"), (good[:2], r"expected \[3, H, W\]"),
                     (good[None, None], r"expected \[3, H, W\]"), (smooth_image(16, 20), "multiples of 8"),
                     (np.where(good > 0.5, np.nan, good), "NaN"), (good * 200, r"expected \[-1, 1\]")]:
        with pytest.raises(ValueError, match=msg):
            enc.encode(bad)
    assert check_image(good[None]).shape == (3, 16, 16)


def test_files_without_an_encoder(tiny_vae_files, tmp_path):
    st = SafeTensorsFile(tiny_vae_files["orig"])
    dec_only = tmp_path / "decoder-only.safetensors"
    save_arrays(dec_only, {k: st.get(k) for k in st.keys() if not k.startswith(("encoder.", "conv1."))})
    with pytest.raises(VAEError, match="without its encoder .*encoder.conv1.weight"):
        TorchEncoder.open(dec_only)
    short = tmp_path / "short.safetensors"
    drop = "encoder.downsamples.3.residual.2.weight"
    assert drop in full_shapes(TINY)
    save_arrays(short, {k: st.get(k) for k in st.keys() if k != drop})
    with pytest.raises(VAEError, match=f"missing tensor '{drop}'"):
        TorchEncoder.open(short)
