"""DiTCheckpoint: config detection (both prefixes, 40 blocks), leftovers ignored, and every bad-file message."""
from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pytest

from models.dit.config import PRESETS, DiTConfig, expected_dit_shapes
from models.dit.checkpoint import CheckpointError, DiTCheckpoint
from models.base.safetensors_io import SafeTensorsFile, bf16_to_f32, save_arrays
from models.dit.synth import dit_entries, param_count

# A small variant with 40 blocks (community merges have other block counts) and no adapter.
SMALL = DiTConfig(blocks=40, width=48, head_dim=16, heads=3, ffn_width=192, context_dim=24, lora_dim=8,
                  latent_channels=16)


def _small_arrays(cfg: DiTConfig = SMALL, prefix: str = "net.") -> dict:
    rng = np.random.default_rng(7)
    return {prefix + k: rng.standard_normal(s).astype(np.float32) for k, s in expected_dit_shapes(cfg).items()}


def _write_raw(path, tensors: dict) -> None:
    """safetensors file from {name: (dtype, shape, raw bytes)}: for dtypes the project writer refuses (F8)."""
    header, off, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _open_error(path) -> str:
    with pytest.raises(CheckpointError) as ei:
        DiTCheckpoint.open(path)
    return str(ei.value)


# -- good checkpoints ---------------------------------------------------------------------------------------------------
def test_tiny_net_prefix(tiny_dit):
    ck = DiTCheckpoint.open(tiny_dit)
    assert ck.config == PRESETS["tiny"]["dit"]
    assert ck.adapter_config == PRESETS["tiny"]["adapter"]
    assert all(not k.startswith("net.") for k in ck.keys())
    assert len([k for k in ck.keys() if k.startswith("llm_adapter.")]) == 118
    raw = SafeTensorsFile(tiny_dit)
    w = ck.get("blocks.3.mlp.layer1.weight")
    assert w.dtype == np.float32 and w.shape == (1024, 256)
    np.testing.assert_array_equal(w, bf16_to_f32(raw.raw("net.blocks.3.mlp.layer1.weight")))
    assert np.count_nonzero(w) == w.size
    assert ck.param_count() == param_count("tiny")
    with open(tiny_dit, "rb") as f:
        assert ck.sha256() == hashlib.sha256(f.read()).hexdigest()


def test_model_diffusion_model_prefix_same_weights(tmp_path, tiny_dit):
    from models.commands.cli import main
    p = tmp_path / "sub" / "b.safetensors"
    assert main(["synth", "dit", "--preset", "tiny", "--seed", "0", "--out", str(p),
                 "--prefix", "model.diffusion_model."]) == 0
    assert main(["synth", "dit", "--seed", "-1", "--out", str(tmp_path / "n.safetensors")]) == 2
    a, b = DiTCheckpoint.open(tiny_dit), DiTCheckpoint.open(p)
    assert b.config == a.config and sorted(b.keys()) == sorted(a.keys())
    for k in ("x_embedder.proj.1.weight", "blocks.27.cross_attn.k_proj.weight", "llm_adapter.out_proj.bias"):
        np.testing.assert_array_equal(a.get(k), b.get(k))
    assert a.sha256() != b.sha256()


def test_synth_deterministic_and_seeded():
    e0, e1 = dit_entries("tiny", 0), dit_entries("tiny", 1)
    idx = {e.name: i for i, e in enumerate(e0)}
    k = "net.blocks.5.self_attn.q_proj.weight"
    np.testing.assert_array_equal(e0[idx[k]].data(), dit_entries("tiny", 0)[idx[k]].data())
    assert not np.array_equal(e0[idx[k]].data(), e1[idx[k]].data())


def test_40_block_variant_fp16_with_leftovers(tmp_path):
    arrays = _small_arrays(prefix="model.diffusion_model.")
    arrays["model.diffusion_model.pos_embedder.seq"] = np.arange(4, dtype=np.float32)
    arrays["model.diffusion_model.accum_video_sample_counter"] = np.zeros(1, np.float32)
    arrays["model.diffusion_model.blocks.0.self_attn._extra_state"] = np.zeros(3, np.float32)
    p = tmp_path / "v40.safetensors"
    save_arrays(p, arrays, dtype="F16")
    ck = DiTCheckpoint.open(p)
    assert ck.config == SMALL and ck.config.blocks == 40
    assert ck.adapter_config is None
    assert not any("pos_embedder" in k or "accum" in k or "_extra_state" in k for k in ck.keys())
    np.testing.assert_array_equal(ck.get("blocks.39.mlp.layer2.weight"),
                                  arrays["model.diffusion_model.blocks.39.mlp.layer2.weight"].astype(np.float16))
    hw = ck.host_weights()
    assert len(hw) == 4 + 6 * 40 + 3 and all(v.dtype == np.float32 for v in hw.values())
    assert set(ck.branch_weights(39, "cross")) == {"q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                   "output_proj.weight", "q_norm.weight", "k_norm.weight"}


def test_full_preset_parameter_count_from_header(tmp_path):
    # Writing the real 4.18 GB file takes ~100 s wall on the shared 2-core machine (measured), so the header that
    # write_safetensors would write for the declared entries is written with a sparse body of the declared size;
    # the count and every shape check then come from that header through the normal reader.
    entries = dit_entries("full", 0, prefix="net.")
    header, off = {}, 0
    for e in entries:
        n = int(np.prod(e.shape, dtype=np.int64)) * 2
        assert e.dtype == "BF16"
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    p = tmp_path / "full-header.safetensors"
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
    os.truncate(p, 8 + len(h) + off)                       # sparse: no 4 GB on disk
    st = SafeTensorsFile(p)
    assert sum(int(np.prod(st.shape(k), dtype=np.int64)) for k in st.keys()) == 2_091_068_928
    ck = DiTCheckpoint.open(p)
    assert ck.config == PRESETS["full"]["dit"] and ck.adapter_config == PRESETS["full"]["adapter"]
    assert ck.param_count() == 2_091_068_928 == param_count("full")
    assert sum(1 for k in st.keys() if k.startswith("net.llm_adapter.")) == 118


# -- bad checkpoints: each gets its message ---------------------------------------------------------------------------
def test_missing_key(tmp_path):
    a = _small_arrays()
    del a["net.blocks.17.mlp.layer2.weight"]
    p = tmp_path / "m.safetensors"
    save_arrays(p, a)
    msg = _open_error(p)
    assert "missing key 'blocks.17.mlp.layer2.weight'" in msg and str(p) in msg


def test_wrong_shape(tmp_path):
    a = _small_arrays()
    a["net.blocks.3.cross_attn.v_proj.weight"] = np.ones((48, 25), np.float32)
    p = tmp_path / "s.safetensors"
    save_arrays(p, a)
    msg = _open_error(p)
    assert "'net.blocks.3.cross_attn.v_proj.weight' has shape [48, 25], expected [48, 24]" in msg
    assert str(p) in msg


def test_fp8_weight_scale(tmp_path):
    a = {k: ("F32", v.shape, v.tobytes()) for k, v in _small_arrays().items()}
    w = "net.blocks.0.mlp.layer1.weight"
    a[w] = ("F8_E4M3", (192, 48), bytes(192 * 48))
    a["net.blocks.0.mlp.layer1.weight_scale"] = ("F32", (), np.float32(0.5).tobytes())
    p = tmp_path / "fp8.safetensors"
    _write_raw(p, a)
    msg = _open_error(p)
    assert "weight_scale" in msg and "quantized" in msg and str(p) in msg


def test_fp8_dtype_without_scale(tmp_path):
    a = {k: ("F32", v.shape, v.tobytes()) for k, v in _small_arrays().items()}
    a["net.blocks.2.self_attn.q_proj.weight"] = ("F8_E5M2", (48, 48), bytes(48 * 48))
    p = tmp_path / "f8.safetensors"
    _write_raw(p, a)
    msg = _open_error(p)
    assert "'net.blocks.2.self_attn.q_proj.weight'" in msg and "quantized dtype F8_E5M2" in msg


def test_integer_dtype_unsupported(tmp_path):
    a = _small_arrays()
    p = tmp_path / "i.safetensors"
    st = {k: ("F32", v.shape, v.tobytes()) for k, v in a.items()}
    st["net.final_layer.linear.weight"] = ("I32", (64, 48), bytes(64 * 48 * 4))
    _write_raw(p, st)
    assert "unsupported dtype I32" in _open_error(p)


def test_gguf(tmp_path):
    p = tmp_path / "anima-Q8_0.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(64))
    msg = _open_error(p)
    assert "GGUF" in msg and str(p) in msg


def test_truncated(tmp_path, tiny_dit):
    p = tmp_path / "t.safetensors"
    data = tiny_dit.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    msg = _open_error(p)
    assert "truncated" in msg and str(p) in msg


def test_not_safetensors(tmp_path):
    p = tmp_path / "notes.safetensors"
    p.write_text("this is a text file, not a checkpoint at all\n" * 10)
    msg = _open_error(p)
    assert "not a safetensors file" in msg and str(p) in msg
    e = tmp_path / "empty.safetensors"
    e.write_bytes(b"")
    assert "not a safetensors file" in _open_error(e)


def test_missing_file(tmp_path):
    assert "cannot open" in _open_error(tmp_path / "nope.safetensors")


def test_text_encoder_file(tmp_path):
    p = tmp_path / "qwen_3_06b_base.safetensors"
    save_arrays(p, {"model.embed_tokens.weight": np.ones((32, 8), np.float32),
                    "model.layers.0.self_attn.q_proj.weight": np.ones((8, 8), np.float32),
                    "model.norm.weight": np.ones(8, np.float32)}, dtype="BF16")
    msg = _open_error(p)
    assert "text encoder" in msg and "not an Anima DiT" in msg and str(p) in msg


@pytest.mark.parametrize("keys,what", [
    (["conv2.weight", "decoder.conv1.weight", "decoder.head.0.gamma", "encoder.conv1.weight"], "VAE (Wan 2.1"),
    (["post_quant_conv.weight", "decoder.conv_in.weight", "decoder.norm_out.gamma"], "diffusers"),
])
def test_vae_file(tmp_path, keys, what):
    p = tmp_path / "qwen_image_vae.safetensors"
    save_arrays(p, {k: np.ones((4, 4), np.float32) for k in keys})
    msg = _open_error(p)
    assert "VAE" in msg and what in msg and str(p) in msg


def test_cli_info_and_errors(tmp_path, tiny_dit, capsys):
    from models.commands.cli import main
    assert main(["info", str(tiny_dit)]) == 0
    out = capsys.readouterr().out
    assert "Anima DiT" in out and "'blocks': 28" in out and "36,216,832" in out and "BF16 x685" in out
    bad = tmp_path / "x.safetensors"
    bad.write_text("hello")
    assert main(["info", str(bad)]) == 2
    assert "not a safetensors file" in capsys.readouterr().err
