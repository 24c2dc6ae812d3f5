"""VAE encoder packs without the NPU compiler: the ONNX graphs against the torch encoder (itself checked against
diffusers in test_vae_encoder.py), the pack's tiled encode on ONNX Runtime, its manifest checks, and the VAE stage's
VAE_ENCODE through the real process, real ZeroMQ and a real shared-memory arena, bad requests included."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.runtime.backends import make_backend
from models.vae.encode import TorchEncoder
from models.vae.encoder_pack import build_vae_encoder_pack, calibration_image, load_vae_encoder_pack
from models.vae.pack_encoder import PackEncoder
from models.vae.pack import VaePackError
from models.vae.synth import write_vae
from protocol import messages as m
from protocol.arena import Arena, segment_name

RES = (192, 256)              # W x H -> latent 32 x 24 (h x w); tile 16, overlap 0.5 -> 3 x 2 = 6 tiles


@pytest.fixture(scope="module")
def vae_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vae-enc") / "tiny-vae.safetensors"
    write_vae("tiny", 0, path)
    return path


@pytest.fixture(scope="module")
def torch_enc(vae_file):
    return TorchEncoder.open(vae_file, threads=1)


@pytest.fixture(scope="module")
def pack(vae_file, tmp_path_factory):
    return load_vae_encoder_pack(build_vae_encoder_pack(vae_file, tmp_path_factory.mktemp("packs") / "enc", RES,
                                                        tile=16, threads=1))


def test_graphs_equal_the_torch_encoder(torch_enc):
    """features and head graphs in ONNX Runtime (FP32) vs VAEEncoder.features / .head, at an odd latent size."""
    import torch
    from models.vae.encoder_graphs import features_graph, head_graph
    from models.vae.fp16 import ort_session
    cfg, w = torch_enc.config, torch_enc.weights.tensors
    img = calibration_image(0, 88, 56)[None]                                  # [1, 3, 88, 56] -> latent 11 x 7
    with torch.inference_mode():
        feats = torch_enc.encoder.features(torch.from_numpy(img)).numpy()     # [1, 32, 11, 7]
        mean = torch_enc.encoder.head(torch.from_numpy(feats)).numpy()        # [1, 16, 11, 7]
    got = ort_session(features_graph(w, cfg, 11, 7)[0], 1).run(None, {"image": img})[0]
    assert got.shape == feats.shape and np.abs(got - feats).max() <= 1e-5 * np.abs(feats).max()
    got = ort_session(head_graph(w, cfg, 11, 7)[0], 1).run(None, {"feats": feats})[0]
    assert got.shape == mean.shape and np.abs(got - mean).max() <= 1e-5 * max(1.0, np.abs(mean).max())


def test_onnx_encode_matches_torch_tiled(pack, torch_enc):
    m_ = pack.manifest
    assert m_["kind"] == "anima-vae-encoder-pack" and m_["tiling"]["count"] == 6 and m_["fp16"]["ok"]
    assert [b["name"] for b in m_["branches"]] == ["features", "head"] and pack.latent_shape == (16, 32, 24)
    img = calibration_image(3, 256, 192)
    got = PackEncoder(pack, make_backend("onnx", threads=1)).encode(img)
    want = torch_enc.encode(img, tile=16, overlap=0.5).latent
    assert got.latent.shape == want.shape and np.abs(got.latent - want).max() <= 1e-5 * np.abs(want).max()
    assert got.timings["tiles"] == 6 and got.timings["features"]["infer_s"] > 0
    with pytest.raises(ValueError, match="encodes 192x256"):
        PackEncoder(pack, make_backend("onnx", threads=1)).encode(calibration_image(3, 128, 128))


def test_pack_checks(pack, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(pack.dir, bad)
    man = json.loads((bad / "manifest.json").read_text())
    man["tiling"]["rows"] = [0, 16]
    (bad / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(VaePackError, match="tiling rows/cols do not follow"):
        load_vae_encoder_pack(bad)
    (bad / "manifest.json").write_text((pack.dir / "manifest.json").read_text())
    (bad / "onnx" / "head.onnx").write_bytes(b"not onnx")
    with pytest.raises(VaePackError, match="head.onnx"):
        load_vae_encoder_pack(bad)
    with pytest.raises(VaePackError, match="VAE encoder pack"):
        load_vae_encoder_pack(tmp_path)


def _arena_encode(st, img: np.ndarray) -> tuple:
    """VAE_ENCODE with the image and the latent in a real shared-memory job arena; -> (reply, the latent read)."""
    name = segment_name(st.run, "j2")
    with Arena.create(name, 1 << 22) as arena:
        src = arena.alloc("image", "f32", img.shape)
        dst = arena.alloc("latent", "f32", (16, img.shape[1] // 8, img.shape[2] // 8))
        arena.write(src, img)
        reply = st.encode(None, job="j2", image_desc=src, arena=name, latent=dst, tile=m.TileSettings(tile=16))
        return reply, arena.read(dst, copy=True)


def test_vae_stage_encodes_through_the_arena_and_inline(vae_file, torch_enc):
    """The real stage process on the VAE file (torch): the latent written into the job arena's slot, or inline,
    equals the in-process encode with VAE_ENCODE's tiling; bad requests are ERROR replies naming the field, and the
    stage serves on."""
    from vae_stage import VaeStage
    img = calibration_image(2, 128, 192)                                      # latent 16 x 24
    want_tiled = torch_enc.encode(img, tile=16, overlap=0.5).latent
    want_whole = torch_enc.encode(img, tile=None).latent
    with VaeStage(f'vae = "{vae_file}"') as st:
        reply, got = _arena_encode(st, img)
        assert reply.latent.slot == "latent" and reply.timings["encode_s"] > 0 and reply.timings["load_s"] > 0
        assert np.array_equal(got, want_tiled)
        reply = st.encode(img, tile=m.TileSettings(enabled=False))
        from protocol.tensors import from_inline
        assert np.array_equal(from_inline(reply.latent, reply.inline), want_whole)
        _bad_requests(st, img)
        assert np.array_equal(_arena_encode(st, img)[1], want_tiled)          # still serving


def _bad_requests(st, img: np.ndarray) -> None:
    from protocol.messages import RemoteError
    from protocol.tensors import TensorDesc
    nan = img.copy()
    nan[1, 5, 7] = np.nan
    cases = [(img[:2], "image", r"expected f32 \[3, H, W\]"),
             (img.astype(np.float16), "image", "expected f32"),
             (img[:, :, :100], "image", "multiples of 8"),
             (nan, "image", "NaN"),
             ((img + 1) * 127.5, "image", r"expected \[-1, 1\]")]
    for bad, field, msg in cases:
        with pytest.raises(RemoteError, match=msg) as e:
            st.encode(np.ascontiguousarray(bad))
        assert e.value.field == field and e.value.reply.code == "bad_request", (msg, e.value.reply)
    with pytest.raises(RemoteError, match=r"expected f32 \[16, 16, 24\]") as e:
        st.encode(img, arena=segment_name(st.run, "j1"), latent=TensorDesc("f32", (16, 8, 8), slot="latent"))
    assert e.value.field == "latent"
    with pytest.raises(RemoteError, match="tile 4 is outside") as e:
        st.encode(img, tile=m.TileSettings(tile=4))
    assert e.value.field == "tile.tile"


def test_vae_stage_encodes_on_an_encoder_pack(pack, vae_file, tmp_path):
    """backend = "onnx" with a decoder pack and an encoder pack: the latent equals the in-process pack encode; an
    image of a size without an encoder pack is an ERROR naming the sizes there are."""
    from models.vae.pack import build_vae_pack
    from protocol.messages import RemoteError
    from protocol.tensors import from_inline
    from vae_stage import VaeStage
    dec = build_vae_pack(vae_file, tmp_path / "dec", RES, tile=16, threads=1)
    img = calibration_image(4, 256, 192)
    want = PackEncoder(pack, make_backend("onnx", threads=1)).encode(img).latent
    with VaeStage(f'backend = "onnx"\nvae_pack = "{dec}"\nvae_encoder_pack = "{pack.dir}"') as st:
        reply = st.encode(img)
        assert np.array_equal(from_inline(reply.latent, reply.inline), want)
        assert reply.timings["features_infer_s"] > 0 and reply.timings["head_infer_s"] > 0
        with pytest.raises(RemoteError, match="no VAE encoder pack for it .*has 192x256") as e:
            st.encode(calibration_image(4, 128, 128))
        assert e.value.field == "image"
        maps = st.mapped_files()
        assert "libtorch" not in maps and "onnx_cpp2py_export" not in maps


def _onnx_gflop(path: Path) -> float:
    """2 x multiply-adds of every Conv and MatMul of an ONNX graph, from its inferred shapes (independent of
    models.vae.flops); not the one-channel 1x1 convs that sum the squares for RMS norm (a norm, not a layer)."""
    import onnx
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    shapes.update({t.name: list(t.dims) for t in model.graph.initializer})
    total = 0
    for n in model.graph.node:
        if n.op_type == "Conv":
            cout, cin_g, kh, kw = shapes[n.input[1]]
            if cout == 1 and kh == kw == 1:
                continue
            total += 2 * int(np.prod(shapes[n.output[0]])) * cin_g * kh * kw
        elif n.op_type == "MatMul":
            a, b = shapes[n.input[0]], shapes[n.input[1]]
            total += 2 * int(np.prod(shapes[n.output[0]])) * a[-1]
            assert a[-1] == b[-2]
    return total / 1e9


def test_encoder_pack_records_its_flops_and_the_estimate_prices_them(pack):
    """Each model's gflop is what its ONNX graph computes (counted from the graph), and the NPU encode ESTIMATE at
    the default tiling is that count over the reference FFN throughput plus the FP16 weights' lifecycle."""
    from models.vae.npu_estimate import encode_estimate, estimate
    for b in pack.manifest["branches"]:
        assert b["gflop"] == pytest.approx(_onnx_gflop(pack.dir / b["onnx"]), abs=5e-4), b["name"]   # 3 decimals
    est = estimate(pack.manifest)
    assert est["calls"] == {"features": 6, "head": 1}
    from models.vae.keys import VAEConfig
    c = pack.manifest["config"]
    cfg = VAEConfig(c["z_dim"], c["base_dim"], tuple(c["dim_mult"]), c["num_res_blocks"], c["out_channels"])
    assert encode_estimate(cfg, *RES, tile=16)["gflop"] == pytest.approx(est["gflop"], rel=1e-3)   # the pack's tiling
    full = encode_estimate(cfg, 512, 512)
    assert full["estimate"] and full["calls"]["head"] == 1
    assert full["npu_s"] == pytest.approx(full["gflop"] / 87.50, rel=1e-3)
