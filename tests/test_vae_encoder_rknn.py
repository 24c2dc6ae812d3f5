"""A VAE encoder pack through the real rknn-toolkit2 2.5.0 (.venv-rknn): the one compile path puts every operator on
the NPU, and the simulator's encode matches the FP32 torch encoder at >= 40 dB.

Costs (2 shared cores): pack + compile of the tiny encoder pack ~15 s; the simulator encode (6 feature tiles and the
head, both built in the simulator) ~6 s. The full size is bench/vae_encoder_npu.py's.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from models.rknn.compile import compile_pack
from models.runtime.backends import make_backend
from models.vae.encode import TorchEncoder
from models.vae.encoder_pack import build_vae_encoder_pack, calibration_image, load_vae_encoder_pack
from models.vae.pack_encoder import PackEncoder
from models.vae.synth import write_vae

RES = (192, 256)                     # latent 32 x 24, tile 16 / overlap 0.5: 6 tiles
MIN_PSNR_DB = 40.0


def _latent_psnr(got, ref) -> float:
    """PSNR with the reference latent's peak-to-peak range as the peak."""
    ref = np.asarray(ref, np.float64)
    mse = float(np.mean((np.asarray(got, np.float64) - ref) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(float(ref.max() - ref.min()) ** 2 / mse)


@pytest.fixture(scope="module")
def vae_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vae-enc-rknn") / "tiny-vae.safetensors"
    write_vae("tiny", 0, path)
    return path


@pytest.fixture(scope="module")
def compiled(vae_file, rknn_venv, tmp_path_factory):
    out = build_vae_encoder_pack(vae_file, tmp_path_factory.mktemp("vae-enc-rknn-pack") / "enc", RES, tile=16,
                                 threads=1)
    rep = compile_pack(out, target="rk3588", jobs=1, venv=rknn_venv)
    assert rep["built"] == 2 and rep["failed"] == 0, rep
    return load_vae_encoder_pack(out)                  # checks every file's sha256, the .rknn files included


def test_compile_puts_every_operator_on_the_npu(compiled):
    assert compiled.compiled() and compiled.manifest["rknn"]["toolkit"] == "2.5.0"
    for b in compiled.manifest["branches"]:
        e = b["rknn"]
        assert e["file"] == f"rknn/{b['name']}.rknn" and e["onnx_sha256"] == b["sha256"] and e["target"] == "rk3588"
        assert e["cpu_ops"] == [], (b["name"], e["cpu_ops"])


def test_simulator_encode_vs_fp32_torch(compiled, vae_file):
    img = calibration_image(3, RES[1], RES[0])
    got = PackEncoder(compiled, make_backend("rknn-sim")).encode(img).latent
    assert np.isfinite(got).all()
    want = TorchEncoder.open(vae_file, threads=1).encode(img, tile=16, overlap=0.5).latent
    assert _latent_psnr(got, want) >= MIN_PSNR_DB
    assert not np.array_equal(got, want)               # FP16 on the NPU: the comparison is not vacuous
