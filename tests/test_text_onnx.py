"""The text encoder's ONNX Runtime backend (an encoder pack from `anima-models export-encoder`) against the torch one
(transformers Qwen3 + the torch adapter) on the tiny synthetic files: same token ids, same conditioning; the pack's
manifest guards its files; a spiece.model-only T5 folder is converted to tokenizer.json with the same ids.
Full size: bench/bench_encoder_backends.py."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from models.text import synth as text_synth

PROMPTS = ["1girl, solo, (blue eyes:1.2), long hair", "", "Kanaru 日本 猫 é — 1234\n\nnext line",
           "((masterpiece)), (worst quality:0.5), \\(text\\)", "girl, " * 270]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_dit):
    root = tmp_path_factory.mktemp("enc")
    te = root / "te.safetensors"
    text_synth.write_te("tiny", 3, te)
    text_synth.write_tokenizers("tiny", root / "tok")
    return {"te": te, "dit": tiny_dit, "qwen": root / "tok" / "qwen", "t5": root / "tok" / "t5", "root": root}


@pytest.fixture(scope="module")
def pack(files):
    from models.text.encoder_pack import build_encoder_pack
    return build_encoder_pack(files["te"], files["dit"], files["qwen"], files["t5"], files["root"] / "encpack")


@pytest.fixture(scope="module")
def encoders(files, pack):
    from models.text.conditioning import TextEncoder
    t = TextEncoder.from_files(str(files["te"]), str(files["dit"]), str(files["qwen"]), str(files["t5"]), threads=2)
    o = TextEncoder.from_pack(str(pack), threads=2)
    yield t, o
    t.close()
    o.close()


def _cos(a, b):
    return float((a.astype(np.float64) * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


def test_onnx_conditioning_equals_torch(encoders):
    t, o = encoders
    assert (t.backend, o.backend) == ("torch", "onnx") and t.context_dim == o.context_dim
    for p in PROMPTS:
        assert t.tokenize(p) == o.tokenize(p)
        a, b = t.encode(p), o.encode(p)                          # [512, Dc] f32 each
        n = min(len(t.tokenize(p).t5_ids), 512)
        assert b.shape == a.shape == (512, t.context_dim) and b.dtype == np.float32
        assert not b[n:].any() and np.all(np.abs(b[:n]).sum(1) > 0)
        assert _cos(a, b) >= 0.99999, p
        assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max(), p
    # a long-context pack's rows (the adapter graph's T is dynamic): every row of a 541-token prompt kept
    tp = t.tokenize("girl, " * 270)
    a, b = t.encode_tokens(tp, 1024), o.encode_tokens(tp, 1024)
    assert b.shape == (1024, t.context_dim) and np.all(np.abs(b[:len(tp.t5_ids)]).sum(1) > 0)
    assert len(tp.t5_ids) > 512 and _cos(a, b) >= 0.99999 and not b[len(tp.t5_ids):].any()
    # Qwen3 alone and the adapter alone, on the same inputs
    ids = [5, 17, 151643, 900, 33, 151935, 0, 64]
    ha, hb = t.compute.hidden_states(ids), o.compute.hidden_states(ids)
    assert np.abs(ha - hb).max() <= 1e-4 * np.abs(ha).max()
    src = np.random.default_rng(0).standard_normal((7, ha.shape[1])).astype(np.float32)
    ra, rb = t.compute.adapter_rows([3, 1, 999, 32127], src), o.compute.adapter_rows([3, 1, 999, 32127], src)
    assert np.abs(ra - rb).max() <= 1e-4 * np.abs(ra).max()


def test_onnx_bad_ids_and_shapes(encoders):
    _, o = encoders
    from models.text.tokenizers import TokenizedPrompt
    with pytest.raises(ValueError, match="T5 token id 32128 outside"):
        o.encode_tokens(TokenizedPrompt([5], False, [32128, 1], [1.0, 1.0], []))
    with pytest.raises(ValueError, match="Qwen3 token id 151936 outside"):
        o.encode_tokens(TokenizedPrompt([151936], False, [1], [1.0], []))
    with pytest.raises(ValueError, match="source must be"):
        o.compute.adapter_rows([1], np.ones((3, 7), np.float32))


def test_pack_manifest_guards_files(files, pack, tmp_path):
    from models.text.conditioning import TextEncoder
    from models.text.encoder_pack import EncoderPackError, build_encoder_pack, load_encoder_pack
    m = load_encoder_pack(pack).manifest
    assert m["kind"] == "anima-encoder-pack" and m["tokenizers"]["check"]["equal"]
    assert m["sources"]["dit"]["sha256"] and {f["file"] for f in m["files"]} >= {"qwen3.onnx", "qwen3.onnx.data"}
    bad = tmp_path / "bad"
    shutil.copytree(pack, bad)
    data = bytearray((bad / "adapter.onnx.data").read_bytes())
    data[4096] ^= 0xFF
    (bad / "adapter.onnx.data").write_bytes(bytes(data))
    with pytest.raises(EncoderPackError, match=r"adapter\.onnx\.data \(sha256 differs"):
        TextEncoder.from_pack(str(bad))
    (bad / "qwen3.onnx").unlink()
    with pytest.raises(EncoderPackError, match=r"qwen3\.onnx \(missing\)"):
        load_encoder_pack(bad, check=False)
    (bad / "manifest.json").write_text(json.dumps({"kind": "anima-dit-pack"}))
    with pytest.raises(EncoderPackError, match="not an encoder pack"):
        load_encoder_pack(bad)
    with pytest.raises(EncoderPackError, match="no such encoder pack"):
        load_encoder_pack(tmp_path / "nothing")
    # another text encoder's pack is not replaced without overwrite; the old one stays whole
    other = tmp_path / "other.safetensors"
    text_synth.write_te("tiny", 4, other)
    copy = tmp_path / "copy"
    shutil.copytree(pack, copy)
    with pytest.raises(EncoderPackError, match="other files"):
        build_encoder_pack(other, files["dit"], files["qwen"], files["t5"], copy)
    load_encoder_pack(copy)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".copy")]


def test_spiece_only_t5_is_converted_with_equal_ids(files, tmp_path):
    """A T5 folder holding only spiece.model (as some downloads do): the pack's tokenizer.json is converted by
    transformers and gives sentencepiece's ids; the torch path reads spiece.model itself."""
    from models.text.encoder_pack import CHECK_PROMPTS, build_encoder_pack, load_encoder_pack
    from models.text.tokenizers import T5Tokenizer
    t5 = tmp_path / "t5"
    t5.mkdir()
    shutil.copyfile(files["t5"] / "spiece.model", t5 / "spiece.model")
    out = build_encoder_pack(files["te"], files["dit"], files["qwen"], t5, tmp_path / "p")
    m = load_encoder_pack(out).manifest
    assert m["tokenizers"]["check"]["t5"] == "converted from spiece.model"
    assert m["tokenizers"]["check"]["source_t5"].endswith("spiece.model")
    sp, tj = T5Tokenizer(str(t5)), T5Tokenizer(str(out / "tokenizers" / "t5"))
    assert tj.source.endswith("tokenizer.json")
    for p in CHECK_PROMPTS + tuple(text_synth.training_corpus(50, seed=11)):
        assert tj.encode(p) == sp.encode(p)


def test_encode_command_onnx(files, pack, encoders, tmp_path, capsys):
    from models.commands.cli import main
    out = tmp_path / "ctx.npz"
    assert main(["encode", "--backend", "onnx", "--pack", str(pack), "--prompt", "(red:1.2) dress",
                 "--negative", "lowres", "--out", str(out), "--threads", "2"]) == 0
    t, _ = encoders
    with np.load(out) as z:
        assert _cos(z["cond"], t.encode("(red:1.2) dress")) >= 0.99999
        assert _cos(z["uncond"], t.encode("lowres")) >= 0.99999
    assert "(onnx;" in capsys.readouterr().out
    assert main(["encode", "--backend", "onnx", "--prompt", "x", "--out", str(out)]) == 2
    assert "--pack" in capsys.readouterr().err


def test_export_command_and_stage_settings(files, pack, tmp_path, capsys):
    from models.commands.cli import main
    from stages.config import load_config
    from stages.encoder import EncoderLogic
    assert main(["export-encoder", "--text-encoder", str(files["te"]), "--dit", str(files["dit"]),
                 "--qwen-tokenizer", str(files["qwen"]), "--t5-tokenizer", str(files["t5"]),
                 "--out", str(tmp_path / "cli-pack")]) == 0
    assert "tokenizers checked" in capsys.readouterr().out
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text('threads = 1\n[stage.encoder]\nbackend = "onnx"\npack = "cli-pack"\n')   # relative to the file
    logic = EncoderLogic(load_config(cfg))
    assert logic.info()["backend"] == "onnx" and logic.info()["source"] == str(tmp_path / "cli-pack")
    logic.close()
    cfg.write_text('[stage.encoder]\nbackend = "onnx"\n')
    with pytest.raises(ValueError, match="stage.encoder.pack"):
        EncoderLogic(load_config(cfg))
    cfg.write_text('[stage.encoder]\nbackend = "tensorflow"\n')
    with pytest.raises(ValueError, match="stage.encoder.backend"):
        EncoderLogic(load_config(cfg))
    cfg.write_text('[stage.encoder]\nbackend = "onnx"\npack = "missing"\n')
    with pytest.raises(ValueError, match="no such encoder pack"):
        EncoderLogic(load_config(cfg))
