"""A VAE pack through the real rknn-toolkit2 2.5.0 (.venv-rknn): compile (the one compile path), the simulator's
decode against the FP32 torch decoder, the FP16 norm scales in the simulator, and the board backend (`rknn`, written
against RKNNLite) on the labelled stand-in, in process and in the VAE stage.

Costs (2 shared cores): pack + compile of the tiny pack ~25 s; the simulator decode (trunk + 6 tiles, both built in
the simulator) ~15 s; the hot-VAE check builds and runs two more tiny packs there (~30 s). Full-size runs (512x512 and
512x768, PSNR, placement, timings) are bench/vae_npu.py's.
"""
from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from models.runtime.backends import make_backend
from models.commands.cli import main as cli_main
from models.vae.pack import build_vae_pack, load_vae_pack
from models.vae.pack_decoder import PackDecoder
from models.vae.synth import write_vae

RES = (192, 256)                     # latent 32 x 24, tile 16 / overlap 0.5: 6 tiles
MIN_PSNR_DB = 40.0


def _latent(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((16, h, w)).astype(np.float32)


def _psnr(a, b) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


@pytest.fixture(scope="module")
def vae_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vae-rknn") / "tiny-vae.safetensors"
    write_vae("tiny", 0, path)
    return path


@pytest.fixture(scope="module")
def compiled(vae_file, rknn_venv, tmp_path_factory):
    """pack-vae + compile through the CLI (the commands the board docs give, the two models in one worker: each
    worker is a toolkit import, seconds of CPU; the resume test below compiles with the default, a worker per
    model); -> the loaded pack."""
    out = tmp_path_factory.mktemp("vae-rknn-pack") / "vae"
    assert cli_main(["pack-vae", str(vae_file), "--out", str(out), "--resolution", f"{RES[0]}x{RES[1]}",
                     "--tile", "16", "--threads", "1"]) == 0
    assert cli_main(["compile", str(out), "--target", "rk3588", "--toolkit-venv", str(rknn_venv),
                     "--per-worker", "0"]) == 0
    return load_vae_pack(out)                          # checks every file's sha256, the .rknn files included


def test_compile_puts_every_operator_on_the_npu(compiled):
    m = compiled.manifest
    assert compiled.compiled() and m["rknn"]["toolkit"] == "2.5.0" and m["rknn"]["branches"] == 2
    for b in m["branches"]:
        e = b["rknn"]
        assert e["file"] == f"rknn/{b['name']}.rknn" and e["onnx_sha256"] == b["sha256"] and e["target"] == "rk3588"
        assert (compiled.dir / e["file"]).stat().st_size == e["bytes"] > 10_000
        log = (compiled.dir / e["log"]).read_text()
        assert "REGTASK" not in log and "Network Layer Information Table" in log
        print(f"{b['name']}: {e['bytes']} B, {e['layers']} layers ({e['npu_layers']} NPU), CPU ops {e['cpu_ops']}")
        assert e["cpu_ops"] == [] and e["npu_layers"] > 10
    from models.rknn.buildlog import parse_build_log
    trunk = parse_build_log((compiled.dir / m["branches"][0]["rknn"]["log"]).read_text())
    attn = [lay for lay in trunk.layers if "Attention" in lay.op or lay.op == "Softmax"]
    assert attn and all(lay.target == "NPU" for lay in attn)          # the middle block's attention runs on the NPU


def test_compile_is_resumable_and_refuses_blocks(compiled, rknn_venv, tmp_path, capsys):
    pack = tmp_path / "vae"
    shutil.copytree(compiled.dir, pack)
    (pack / "rknn" / "tile.rknn").write_bytes(b"damaged")
    assert cli_main(["compile", str(pack), "--toolkit-venv", str(rknn_venv)]) == 0
    out = capsys.readouterr().out
    assert "1 built, 1 up to date, 0 failed" in out
    load_vae_pack(pack)
    assert cli_main(["compile", str(pack), "--blocks", "0"]) == 2
    assert "not a DiT pack" in capsys.readouterr().err


def test_simulator_decode_vs_fp32_torch(compiled, vae_file):
    from models.vae import VAE
    lat = _latent(32, 24, seed=3)
    res = PackDecoder(compiled, make_backend("rknn-sim")).decode(lat)
    ref = VAE.open(vae_file, threads=1).decode(lat, tile=16, overlap=0.5)        # FP32, the same tiling
    assert res.array.shape == ref.array.shape == (3, 256, 192)
    assert np.isfinite(res.array).all()
    p = _psnr(res.array, ref.array)
    print(f"rknn-sim vs FP32 torch: PSNR {p:.1f} dB, max |diff| {np.abs(res.array - ref.array).max():.4f}")
    assert MIN_PSNR_DB <= p < 120                                              # FP16 on the NPU: not bit-exact


def test_fp16_norm_scales_matter_in_the_simulator(vae_file, tmp_path, rknn_venv):
    """A VAE with activations in the hundreds: its pack's scaled norms decode at >= 40 dB in the simulator; the same
    graphs without the scales overflow FP16 (x² past 65504) and fall far below."""
    import onnx
    from test_vae_pack import hot_vae
    from models.vae import load_vae
    from models.vae.graphs import tile_graph, trunk_graph
    hot = hot_vae(vae_file, tmp_path / "hot.safetensors")
    pack = load_vae_pack(build_vae_pack(hot, tmp_path / "hot-pack", (128, 128), tile=16, threads=1))
    assert max(pack.manifest["fp16"]["norm_scales"].values()) >= 64
    plain = tmp_path / "hot-plain"
    shutil.copytree(pack.dir, plain)
    w = load_vae(hot)
    onnx.save(trunk_graph(w.tensors, w.config, 16, 16)[0], plain / "onnx" / "trunk.onnx")
    onnx.save(tile_graph(w.tensors, w.config, 16, 16)[0], plain / "onnx" / "tile.onnx")
    lat = _latent(16, 16, seed=2)
    ref = PackDecoder(pack, make_backend("onnx", threads=1)).decode(lat).array
    sim = make_backend("rknn-sim", venv=rknn_venv)
    scaled = _psnr(PackDecoder(pack, sim).decode(lat).array, ref)
    unscaled = _psnr(PackDecoder(load_vae_pack(plain, check=False), sim).decode(lat).array, ref)
    print(f"hot VAE in the simulator: scaled norms {scaled:.1f} dB, unscaled {unscaled:.1f} dB")
    assert scaled >= MIN_PSNR_DB and unscaled < 30.0


def test_board_backend_on_the_standin(compiled):
    """RknnLiteBackend (the real API's calls) on the labelled stand-in: load_rknn/init_runtime once per model, one
    inference per tile with data_format nchw, release; the image is the ONNX graphs' (the stand-in runs them)."""
    from models.runtime.backends.rknn import RknnLiteBackend
    from models.runtime.backends.standin.rknnlite import RKNNLite
    lat = _latent(32, 24, seed=5)
    RKNNLite.calls.clear()
    got = PackDecoder(compiled, RknnLiteBackend(lite="standin")).decode(lat)
    want = PackDecoder(compiled, make_backend("onnx", threads=1)).decode(lat)
    assert np.array_equal(got.image, want.image) and np.abs(got.array - want.array).max() <= 1e-6
    calls = [(c[0], c[1]) for c in RKNNLite.calls]
    assert calls == ([("load_rknn", "trunk.rknn"), ("init_runtime", "trunk.rknn"), ("inference", "trunk.rknn"),
                      ("release", "trunk.rknn"), ("load_rknn", "tile.rknn"), ("init_runtime", "tile.rknn")]
                     + [("inference", "tile.rknn")] * 6 + [("release", "tile.rknn")])


def test_vae_stage_on_the_board_backend_standin(compiled):
    """[stage.vae] backend = "rknn" (lite = "standin"): the stage process decodes through the compiled pack."""
    from vae_stage import VaeStage
    lat = _latent(32, 24, seed=6)
    want = PackDecoder(compiled, make_backend("onnx", threads=1)).decode(lat).image
    with VaeStage(f'backend = "rknn"\nvae_pack = "{compiled.dir}"\nlite = "standin"\ncore_mask = "0_1_2"') as st:
        assert st.ready.info["backend"] == "rknn"
        got = st.image(st.decode(lat))
    assert np.array_equal(got, want)
