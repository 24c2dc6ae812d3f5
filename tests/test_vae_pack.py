"""VAE packs without the NPU compiler: the ONNX graphs against the torch decoder (itself checked against diffusers in
test_vae.py), the FP16 norm scales, the manifest and its checks, decoding through ONNX Runtime and the rknn stand-in's
layout rules, the CLI, and the run-time path's imports (no torch, no onnx)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models.runtime.backends import make_backend
from models.runtime.backends.base import BackendError
from models.commands.cli import main as cli_main
from models.packs.kinds import load_branch_pack
from models.packs.pack import PackError, load_pack
from models.base.safetensors_io import SafeTensorsFile, TensorEntry, write_safetensors
from models.vae.pack import VaePackError, build_vae_pack, load_vae_pack
from models.vae.pack_decoder import PackDecoder
from models.vae.synth import write_vae

ROOT = Path(__file__).resolve().parents[1]
RES = (192, 256)              # W x H -> latent 32 x 24 (h x w); tile 16, overlap 0.5 -> 3 x 2 = 6 tiles


def _latent(h: int, w: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((16, h, w)).astype(np.float32)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR of two images in [0, 1]."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


@pytest.fixture(scope="module")
def vae_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vae") / "tiny-vae.safetensors"
    write_vae("tiny", 0, path)
    return path


@pytest.fixture(scope="module")
def pack(vae_file, tmp_path_factory):
    return load_vae_pack(build_vae_pack(vae_file, tmp_path_factory.mktemp("packs") / "vae", RES, tile=16,
                                        threads=1))


@pytest.fixture(scope="module")
def torch_vae(vae_file):
    from models.vae import VAE
    return VAE.open(vae_file, threads=1)


def test_graphs_equal_the_torch_decoder(torch_vae):
    """trunk and tile graphs in ONNX Runtime (FP32) vs VAEDecoder.trunk / .upsampler, at odd sizes."""
    import torch
    from models.vae.fp16 import ort_session
    from models.vae.graphs import tile_graph, trunk_graph
    from models.vae.latent import denormalize
    cfg, w = torch_vae.config, torch_vae.weights.tensors
    z = denormalize(_latent(11, 7))[None]                                    # [1, 16, 11, 7]
    with torch.inference_mode():
        feats = torch_vae.decoder.trunk(torch.from_numpy(z)).numpy()         # [1, 32, 11, 7]
        img = torch_vae.decoder.upsampler(torch.from_numpy(feats)).numpy()   # [1, 3, 88, 56]
    got = ort_session(trunk_graph(w, cfg, 11, 7)[0], 1).run(None, {"z": z})[0]
    assert got.shape == feats.shape and np.abs(got - feats).max() <= 1e-5 * np.abs(feats).max()
    got = ort_session(tile_graph(w, cfg, 11, 7)[0], 1).run(None, {"feats": feats})[0]
    assert got.shape == img.shape and np.abs(got - img).max() <= 1e-5 * max(1.0, np.abs(img).max())


def hot_vae(src: Path, out: Path, gain: float = 200.0) -> Path:
    """The tiny VAE with decoder.conv1 (weight and bias) times `gain`: the trunk's residual stream, and so most norm
    inputs, grow to hundreds, where FP16 squares overflow (|x| > 255)."""
    st = SafeTensorsFile(src)
    entries = []
    for k in st.keys():
        a = st.get(k)
        if k.startswith("decoder.conv1."):
            a = a * np.float32(gain)
        entries.append(TensorEntry(k, "F32", a.shape, a))
    write_safetensors(out, entries)
    return out


def test_norm_scales_follow_the_ranges():
    from models.vae.fp16 import SCALE_TARGET, norm_scales
    norms = {f"n{i}": f"t{i}" for i in range(6)}
    ranges = {f"t{i}": v for i, v in enumerate((0.0, 3.0, 8.0, 8.5, 100.0, 5000.0))}
    s = norm_scales(norms, ranges)
    assert list(s.values()) == [1.0, 1.0, 1.0, 2.0, 16.0, 1024.0]
    for k, v in s.items():                                   # the smallest power of two with max / s <= target
        assert ranges[norms[k]] / v <= SCALE_TARGET and (v == 1.0 or ranges[norms[k]] / v > SCALE_TARGET / 2)
    with pytest.raises(ValueError, match="not finite"):
        norm_scales({"n": "t"}, {"t": float("inf")})


def test_scaled_graphs_of_a_hot_vae_equal_the_plain_ones_in_fp32(vae_file, tmp_path):
    """A checkpoint whose activations reach hundreds gets norm scales > 1 at pack time; in FP32 the scaled graphs
    give what the plain ones give (x / rms(x) is unchanged by a power of two), and the FP16 report is honest."""
    from models.vae import load_vae
    from models.vae.fp16 import FP16_MAX, activation_ranges, headroom, norm_scales, ort_session
    from models.vae.graphs import tile_graph, trunk_graph
    from models.vae.latent import denormalize
    weights = load_vae(hot_vae(vae_file, tmp_path / "hot.safetensors"))
    cfg, w = weights.config, weights.tensors
    z = denormalize(_latent(8, 8))[None]
    plain, norms = trunk_graph(w, cfg, 8, 8)
    ranges = activation_ranges(plain, [{"z": z}], threads=1)
    assert max(ranges[t] for t in norms.values()) > 255                     # FP16 squares would overflow
    scales = norm_scales(norms, ranges)
    assert max(scales.values()) >= 64
    rep = headroom(ranges, norms, scales)
    assert rep["norm_square_max"] <= 64 and rep["max_abs"] > 255 and rep["headroom"] == round(FP16_MAX / rep["max_abs"], 1)
    a = ort_session(plain, 1).run(None, {"z": z})[0]
    b = ort_session(trunk_graph(w, cfg, 8, 8, scales)[0], 1).run(None, {"z": z})[0]
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max() and not np.array_equal(a, b)    # scaled, same values
    tplain, tnorms = tile_graph(w, cfg, 8, 8)
    c = ort_session(tplain, 1).run(None, {"feats": a})[0]
    d = ort_session(tile_graph(w, cfg, 8, 8, {**scales, **norm_scales(tnorms, activation_ranges(
        tplain, [{"feats": a}], threads=1))})[0], 1).run(None, {"feats": a})[0]
    assert np.abs(c - d).max() <= 1e-5 * max(1.0, np.abs(c).max())


def test_manifest_and_files(pack, vae_file):
    m = pack.manifest
    assert m["kind"] == "anima-vae-pack" and m["schema"] == 1 and m["opset"] == 19
    assert (pack.width, pack.height) == RES and pack.latent_shape == (16, 32, 24)
    t = m["tiling"]
    assert (t["tile"], t["overlap"], t["stride"], t["tile_h"], t["tile_w"]) == (16, 0.5, 8, 16, 16)
    assert (t["rows"], t["cols"], t["count"]) == ([0, 8, 16], [0, 8], 6)
    trunk, tile = m["branches"]
    assert (trunk["name"], tile["name"], trunk["calls"], tile["calls"]) == ("trunk", "tile", 1, 6)
    assert trunk["inputs"] == [{"name": "z", "shape": [1, 16, 32, 24], "dtype": "f32"}]
    assert tile["outputs"] == [{"name": "image", "shape": [1, 3, 128, 128], "dtype": "f32"}]
    assert m["source"]["name"] == vae_file.name and m["fp16"]["ok"] and not pack.compiled()
    assert set(m["fp16"]["norm_scales"]) == {k for k in SafeTensorsFile(vae_file).keys()
                                             if k.endswith("gamma") and k.startswith("decoder.")}


def test_pack_checks(pack, vae_file, tmp_path, tiny_dit):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(pack.dir, bad)
    data = bytearray((bad / "onnx" / "tile.onnx").read_bytes())
    data[-1] ^= 1
    (bad / "onnx" / "tile.onnx").write_bytes(bytes(data))
    with pytest.raises(VaePackError, match=r"onnx/tile\.onnx \(sha256 differs"):
        load_vae_pack(bad)
    load_vae_pack(bad, check=False)
    m = json.loads((bad / "manifest.json").read_text())
    m["branches"][1]["inputs"][0]["shape"] = [1, 32, 16, 24]
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(VaePackError, match=r"branch tile: input/output shapes .* give \[\[1, 32, 16, 16\]"):
        load_vae_pack(bad, check=False)
    with pytest.raises(PackError, match="not a DiT pack"):
        load_pack(pack.dir)
    # every file name the manifest gives stays inside the pack folder (the rknn backend reads VAE manifests too)
    for model, key, name, words in [(0, "onnx", "../outside.onnx", "leaves the pack folder"),
                                    (1, "onnx", "/etc/passwd", "leaves the pack folder"),
                                    (1, "rknn", "rknn/../../x.rknn", "leaves the pack folder"),
                                    (0, "rknn", None, "is not a relative path")]:
        m = json.loads((pack.dir / "manifest.json").read_text())
        m["branches"][model][key] = {"file": name, "sha256": "0"} if key == "rknn" else name
        (bad / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(VaePackError, match=words):
            load_vae_pack(bad, check=False)
        with pytest.raises(PackError, match=words):
            load_branch_pack(bad, check=False)
    assert load_branch_pack(pack.dir).manifest["kind"] == "anima-vae-pack"
    dit_pack = tmp_path / "dit"
    from models.packs.pack import build_pack
    build_pack(tiny_dit, dit_pack, (64, 64), "fp32")
    with pytest.raises(VaePackError, match="not a VAE pack"):
        load_vae_pack(dit_pack)
    with pytest.raises(VaePackError, match="no manifest.json|not a complete VAE pack"):
        load_vae_pack(tmp_path)
    # another VAE file does not replace a pack unless asked
    other = tmp_path / "other.safetensors"
    write_vae("tiny", 1, other)
    out = tmp_path / "p"
    build_vae_pack(vae_file, out, (64, 64), threads=1)
    with pytest.raises(VaePackError, match="another file"):
        build_vae_pack(other, out, (64, 64), threads=1)
    assert load_vae_pack(out).manifest["source"]["name"] == vae_file.name
    build_vae_pack(other, out, (64, 64), overwrite=True, threads=1)
    assert load_vae_pack(out).manifest["source"]["name"] == "other.safetensors"
    # nor a pack of another size (a VAE pack serves one size: the DiT pack's)
    with pytest.raises(VaePackError, match="holds a pack for 64x64, this one is 64x32.*overwrite"):
        build_vae_pack(other, out, (64, 32), threads=1)
    assert load_vae_pack(out).height == 64
    build_vae_pack(other, out, (64, 32), overwrite=True, threads=1)
    assert load_vae_pack(out).height == 32
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []   # no temporaries left


def test_onnx_decode_matches_torch_tiled(pack, torch_vae):
    lat = _latent(32, 24, seed=7)
    res = PackDecoder(pack, make_backend("onnx", threads=1)).decode(lat)
    ref = torch_vae.decode(lat, tile=16, overlap=0.5)                       # the same tiling, in torch
    assert res.array.shape == ref.array.shape == (3, 256, 192) and res.image.shape == (256, 192, 3)
    assert np.abs(res.array - ref.array).max() <= 1e-5
    assert _psnr(res.array, ref.array) >= 100.0                              # FP32 vs FP32: far above 40 dB
    assert res.timings["tiles"] == 6 and res.timings["trunk"]["infer_s"] > 0 and res.timings["tile"]["init_s"] > 0
    from models.vae.api import to_uint8
    assert np.array_equal(res.image, to_uint8(res.array))
    # a latent of another resolution is a clear error
    with pytest.raises(ValueError, match=r"decodes 192x256 \(latent \[16, 32, 24\]\).*--resolution 256x256"):
        PackDecoder(pack, make_backend("onnx", threads=1)).decode(_latent(32, 32))


def test_standin_reads_4d_inputs_as_nhwc_unless_told(pack):
    """The stand-in behaves as RKNNLite: a 4-D input without data_format='nchw' is NHWC (a wrong-layout feed fails),
    so a backend that forgot data_format would fail here."""
    from models.runtime.backends.standin.rknnlite import RKNNLite
    from models.runtime.backends.rknn import output_as
    rk = RKNNLite()
    rk._onnx, rk._bytes = pack.model_path("trunk"), b"x"                     # skip the .rknn lookup
    assert rk.init_runtime() == 0
    z = np.random.default_rng(0).standard_normal((1, 16, 32, 24)).astype(np.float32)
    assert rk.inference(inputs=[z]) is None                                  # NCHW data, NHWC assumed
    (a,) = rk.inference(inputs=[z], data_format=["nchw"])
    (b,) = rk.inference(inputs=[z.transpose(0, 2, 3, 1)])                   # real NHWC data
    assert a.shape == (1, 32, 32, 24) and np.array_equal(a, b)
    # outputs: as they are, NHWC -> NCHW, or a reshape for non-4-D specs; anything else is an error
    y = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    assert output_as(y, [1, 2, 3, 4], "m", "y") is y
    assert np.array_equal(output_as(y.transpose(0, 2, 3, 1), [1, 2, 3, 4], "m", "y"), y)
    assert output_as(y, [6, 4], "m", "y").shape == (6, 4)
    with pytest.raises(BackendError, match=r"came back as \[1, 2, 3, 4\], expected \[1, 3, 4, 2\]"):
        output_as(y, [1, 3, 4, 2], "m", "y")                                  # neither NCHW nor its NHWC


def test_cli_pack_vae_and_decode(vae_file, tmp_path, capsys):
    out = tmp_path / "vae-pack"
    assert cli_main(["pack-vae", str(vae_file), "--out", str(out), "--resolution", "64x96", "--threads", "1"]) == 0
    assert "VAE pack" in capsys.readouterr().out
    lat = tmp_path / "lat.npy"
    np.save(lat, _latent(12, 8, seed=4))
    assert cli_main(["decode", "--vae-pack", str(out), "--latent", str(lat), "--out", str(tmp_path / "a.png"),
                     "--save-array", str(tmp_path / "a.npy"), "--threads", "1"]) == 0
    assert "(onnx)" in capsys.readouterr().out
    assert cli_main(["decode", "--vae", str(vae_file), "--latent", str(lat), "--out", str(tmp_path / "b.png"),
                     "--save-array", str(tmp_path / "b.npy"), "--threads", "1"]) == 0
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert a.shape == b.shape == (3, 96, 64) and np.abs(a - b).max() <= 1e-5
    from PIL import Image
    with Image.open(tmp_path / "a.png") as im:
        assert im.text["backend"] == "onnx" and im.text["vae_pack"] == "vae-pack"
    # clear errors, exit 2, nothing written
    cases = [(["--vae-pack", str(out), "--tile", "16"], "tiling is fixed"),
             (["--vae", str(vae_file), "--backend", "onnx"], "give --vae-pack"),
             (["--vae-pack", str(out), "--backend", "torch"], "give --vae FILE"),
             (["--vae-pack", str(out), "--backend", "rknn"], "not compiled for the NPU"),
             (["--vae-pack", str(tmp_path), "--backend", "onnx"], "not a complete VAE pack")]
    for extra, msg in cases:
        rc = cli_main(["decode", *extra, "--latent", str(lat), "--out", str(tmp_path / "x.png")])
        assert rc == 2 and msg in capsys.readouterr().err, extra
    np.save(tmp_path / "wrong.npy", _latent(16, 16))
    rc = cli_main(["decode", "--vae-pack", str(out), "--latent", str(tmp_path / "wrong.npy"), "--out",
                   str(tmp_path / "x.png")])
    assert rc == 2 and "build a pack for this resolution" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
    assert cli_main(["pack-vae", str(vae_file), "--out", str(tmp_path / "q"), "--resolution", "60x64"]) == 2
    assert "multiple of 8" in capsys.readouterr().err


def test_run_time_path_imports_neither_torch_nor_onnx(pack):
    """What a board runs (the VAE stage module, the pack decoder on ONNX Runtime) never imports torch or onnx."""
    code = ("import sys, numpy as np\n"
            "import stages.vae\n"
            "from models.vae.pack import load_vae_pack\n"
            "from models.vae.pack_decoder import PackDecoder\n"
            "from models.runtime.backends import make_branch_backend\n"
            f"d = PackDecoder(load_vae_pack({str(pack.dir)!r}), make_branch_backend('onnx', 1, {{}}))\n"
            "r = d.decode(np.zeros((16, 32, 24), np.float32))\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx', 'transformers'))\n"
            "print(r.image.shape, bad)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "(256, 192, 3) []"


def test_pack_vae_needs_no_torch(vae_file, tmp_path):
    """The host side of a pack (pack-vae: graphs, calibration on ONNX Runtime) runs where torch cannot be imported."""
    code = ("import sys\n"
            "sys.modules['torch'] = None\n"                   # any `import torch` now raises ImportError
            "from models.commands.cli import main\n"
            f"sys.exit(main(['pack-vae', {str(vae_file)!r}, '--out', {str(tmp_path / 'p')!r}, '--resolution', "
            "'64x64', '--threads', '1']))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert load_vae_pack(tmp_path / "p").latent_shape == (16, 8, 8)


def test_vae_stage_decodes_packs_on_onnx_runtime(pack, vae_file, tmp_path):
    """The real stage process with [stage.vae] backend = "onnx" and two packs (two image sizes): the PNG's pixels are
    the in-process decode's, the pack's per-model timings come back, a latent of a size without a pack is an ERROR
    naming the field (and the stage keeps serving), and the process never loaded torch or onnx."""
    from protocol.messages import RemoteError
    from vae_stage import VaeStage
    small = load_vae_pack(build_vae_pack(vae_file, tmp_path / "small", (64, 96), threads=1))
    lat, lat2 = _latent(32, 24, seed=11), _latent(12, 8, seed=12)
    want = PackDecoder(pack, make_backend("onnx", threads=1)).decode(lat).image
    want2 = PackDecoder(small, make_backend("onnx", threads=1)).decode(lat2).image
    with VaeStage(f'backend = "onnx"\nvae_pack = ["{pack.dir}", "{small.dir}"]') as st:
        assert st.ready.info["backend"] == "onnx" and st.ready.info["vae"] == f"{pack.dir}, {small.dir}"
        reply = st.decode(lat)
        assert (reply.width, reply.height) == (192, 256)
        assert np.array_equal(st.image(reply), want)
        assert reply.timings["tile_infer_s"] > 0 and reply.timings["trunk_load_s"] >= 0
        with pytest.raises(RemoteError, match="latent") as e:
            st.decode(_latent(24, 24))
        assert e.value.field == "latent" and "has 192x256, 64x96" in e.value.reply.message
        assert np.array_equal(st.image(st.decode(lat2)), want2)
        assert np.array_equal(st.image(st.decode(lat)), want)
        maps = st.mapped_files()
        assert "libtorch" not in maps and "onnx_cpp2py_export" not in maps and "onnxruntime" in maps


def test_vae_stage_refuses_a_bad_pack_setting(pack, tmp_path):
    from vae_stage import VaeStage
    # a bad setting is found when the config is read, a pack that cannot serve when the stage loads it: both exit 2
    # (a pack problem fails the same way every time: supervisord leaves the stage down and the job says why)
    for toml, msg, code in [('backend = "onnx"', "stage.vae.vae_pack: backend 'onnx' decodes a VAE pack", 2),
                            ('backend = "tpu"', "stage.vae.backend: 'tpu' is not one of torch, onnx", 2),
                            (f'backend = "rknn"\nvae_pack = "{pack.dir}"', "not compiled for the NPU", 2),
                            (f'backend = "onnx"\nvae_pack = "{tmp_path}"', "not a complete VAE pack", 2),
                            (f'backend = "onnx"\nvae_pack = ["{pack.dir}", "{pack.dir}"]', "are both 192x256", 2)]:
        with pytest.raises(RuntimeError, match=f"exited {code}") as e:
            with VaeStage(toml):
                pass
        assert msg in str(e.value)


def test_npu_estimate_arithmetic(pack):
    """The ESTIMATE's inputs against the reference figures worked out by hand (docs/board-figures.md: R5, FFN 21.99 s
    per forward of 28 passes; R6, 84-model lifecycle 13.96 + 12.90 + 4.84 s, for 3.99 GB)."""
    from models.vae.npu_estimate import describe, estimate, lifecycle_s_per_byte, throughputs
    ffn_gflop = 2 * 1024 * 2048 * 8192 * 2 / 1e9                              # 68.72: layer1 + layer2, one pass
    assert throughputs()["ffn"] == pytest.approx(ffn_gflop / (21.99 / 28)) == pytest.approx(87.50, abs=0.01)
    assert lifecycle_s_per_byte() == pytest.approx(31.70 / 3.99e9)
    est = estimate(pack.manifest)
    gflop = sum(b["gflop"] * b["calls"] for b in pack.manifest["branches"])  # trunk once, the tile 6 times
    assert est["gflop"] == pytest.approx(gflop) and est["calls"] == {"trunk": 1, "tile": 6}
    assert est["npu_s"] == pytest.approx(gflop / 87.50, rel=1e-3)
    assert est["model_bytes"] == sum(b["bytes"] for b in pack.manifest["branches"]) / 2    # uncompiled: FP16 weights
    assert est["total_s"] == pytest.approx(est["npu_s"] + est["model_bytes"] * 31.70 / 3.99e9)
    assert describe(est).startswith("ESTIMATE (modelled from reference board figures, not measured)")


def test_manifest_json_is_valid_and_names_the_tools(pack):
    m = json.loads((pack.dir / "manifest.json").read_text())
    assert m["tools"]["onnx"] and m["tools"]["onnxruntime"] and m["dtype"] == "fp32"
    assert m["fp16"]["calibration"]["seeds"] == [0, 1]
