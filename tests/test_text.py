"""Text conditioning: Qwen3 loader vs transformers, tokenizers, LLM adapter (numpy reference + structure), prompt
weights, context shape/padding/truncation/empty prompt, `anima-models encode`."""
from __future__ import annotations

import logging
import math
import os
import shutil

import numpy as np
import pytest
import torch

from models.dit.config import DIT_PREFIXES, PRESETS
from models.base.safetensors_io import SafeTensorsFile, TensorEntry, save_arrays, write_safetensors
from models.text import synth as text_synth


# ---- fixtures ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def te_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("te") / "qwen_3_06b_base-tiny.safetensors"
    text_synth.write_te("tiny", 3, path)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    text_synth.write_tokenizers("tiny", out)
    return out


@pytest.fixture(scope="module")
def encoder(te_file, tiny_dit, tok_dir):
    from models.text.conditioning import TextEncoder
    enc = TextEncoder.from_files(str(te_file), str(tiny_dit), str(tok_dir / "qwen"), str(tok_dir / "t5"), threads=2)
    yield enc
    enc.close()


SAMPLES = ["1girl, solo, (blue eyes:1.2), long hair", "", " ", "Kanaru 日本 猫 é — 1234\n\nnext line",
           "it's don't we'll", "Hello<|endoftext|>World", "  spaced   out  "]


# ---- Qwen3 -----------------------------------------------------------------------------------------------------
def test_qwen3_equals_transformers_from_pretrained(te_file, tmp_path):
    """Our meta-device loader with the config derived from shapes vs transformers' own loading of the same file."""
    from transformers import Qwen3Config, Qwen3Model
    from models.text.qwen3 import Qwen3TextEncoder

    enc = Qwen3TextEncoder(str(te_file))
    s = enc.shape
    assert (s.vocab, s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate) == \
        (151936, 64, 2, 4, 2, 16, 192)
    # transformers' way: a config written by hand (the real Qwen3-0.6B-Base values at tiny widths) + from_pretrained.
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    os.symlink(te_file, hf_dir / "model.safetensors")
    Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}).save_pretrained(hf_dir)
    ref = Qwen3Model.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = [5, 17, 151643, 900, 33, 151935, 0, 64]
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()      # [8, 64]
    got = enc.hidden_states(ids)
    assert got.shape == (8, 64) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(want).max() > 0.1
    # Causal: the first rows do not depend on later tokens.
    got2 = enc.hidden_states(ids[:3] + [7, 7])
    np.testing.assert_allclose(got2[:3], got[:3], atol=1e-5)
    assert np.abs(got2[3:] - got[3:5]).max() > 1e-3
    # Empty prompt: one pad token masked (finite-bias masking, eager attention) = our unmasked single-token forward.
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        masked = ref(input_ids=torch.tensor([[151643]]), attention_mask=torch.tensor([[0]])).last_hidden_state[0]
    np.testing.assert_allclose(enc.hidden_states([151643]), masked.numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        enc.hidden_states([151936])


def test_qwen3_file_errors(te_file, tiny_dit, tmp_path):
    from models.text.qwen3 import Qwen3TextEncoder, TextEncoderFileError

    with pytest.raises(TextEncoderFileError, match="DiT"):
        Qwen3TextEncoder(str(tiny_dit))
    vae = tmp_path / "vae.safetensors"
    save_arrays(vae, {"decoder.conv1.weight": np.zeros((4, 4, 3, 3, 3), np.float32), "conv2.weight": np.zeros(2)})
    with pytest.raises(TextEncoderFileError, match="VAE"):
        Qwen3TextEncoder(str(vae))
    st = SafeTensorsFile(te_file)
    gone = "model.layers.1.mlp.up_proj.weight"
    cut = tmp_path / "cut.safetensors"
    write_safetensors(cut, [TensorEntry(k, "BF16", st.shape(k), st.raw(k)) for k in st.keys() if k != gone])
    with pytest.raises(TextEncoderFileError, match=gone.replace(".", r"\.")):
        Qwen3TextEncoder(str(cut))


def test_te_shapes_match_loader_expectations():
    from models.text.qwen3 import Qwen3Shape, expected_shapes
    full = Qwen3Shape(vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072)
    assert text_synth.te_shapes("full") == expected_shapes(full)
    assert sum(math.prod(s) for s in text_synth.te_shapes("full").values()) == 596_049_920   # 1.19 GB in bf16
    assert text_synth.TE_PRESETS["tiny"]["hidden"] == PRESETS["tiny"]["adapter"].source_dim
    assert "lm_head.weight" not in text_synth.te_shapes("full")


# ---- tokenizers ---------------------------------------------------------------------------------------------------
def test_qwen_tokenizer_ids_and_both_file_forms(tok_dir, tmp_path):
    from transformers import AutoTokenizer, Qwen2Tokenizer
    from models.text.tokenizers import QWEN_PAD_ID, QwenTokenizer

    full = QwenTokenizer(str(tok_dir / "qwen"))
    assert full.source.endswith("tokenizer.json") and full.pad_id == QWEN_PAD_ID == 151643
    bare = tmp_path / "bare"           # only vocab.json + merges.txt, as some users have them
    bare.mkdir()
    for f in ("vocab.json", "merges.txt"):
        shutil.copy(tok_dir / "qwen" / f, bare / f)
    from_bpe = QwenTokenizer(str(bare))
    assert from_bpe.source.endswith("vocab.json") and from_bpe.pad_id == 151643
    hf = AutoTokenizer.from_pretrained(str(tok_dir / "qwen"))
    # transformers' own Qwen2 pipeline built from vocab.json + merges.txt alone (it numbers its specials itself)
    hf_bpe = Qwen2Tokenizer(vocab=str(bare / "vocab.json"), merges=str(bare / "merges.txt"))
    for text in SAMPLES + text_synth.training_corpus(20, seed=9):
        ids = full.encode(text)
        assert ids == from_bpe.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
        if "<|" not in text:
            assert ids == hf_bpe(text, add_special_tokens=False)["input_ids"], text
        assert all(0 <= i < 151936 for i in ids)
        assert full.decode(ids) == text
    assert full.encode("") == []
    assert full.encode("<|endoftext|>") == [151643]


def test_t5_tokenizer_ids_and_both_file_forms(tok_dir):
    from transformers import AutoTokenizer
    from models.text.tokenizers import T5Tokenizer

    tj = T5Tokenizer(str(tok_dir / "t5"))
    sp = T5Tokenizer(str(tok_dir / "t5" / "spiece.model"))
    assert tj.source.endswith("tokenizer.json")
    hf = AutoTokenizer.from_pretrained(str(tok_dir / "t5"))
    assert (hf.pad_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2)
    for text in SAMPLES + text_synth.training_corpus(20, seed=9):
        ids = tj.encode_with_eos(text)
        assert ids[-1] == 1 and 1 not in ids[:-1]
        assert ids == sp.encode_with_eos(text) == hf(text)["input_ids"], text
        assert all(0 <= i < 32128 for i in ids)
    assert tj.encode_with_eos("") == [1]


def test_tokenizer_missing_files_are_named(tmp_path):
    from models.text.tokenizers import QwenTokenizer, T5Tokenizer, TokenizerFilesError
    with pytest.raises(TokenizerFilesError, match="vocab.json"):
        QwenTokenizer(str(tmp_path))
    (tmp_path / "vocab.json").write_text('{"a": 0}')
    with pytest.raises(TokenizerFilesError, match="merges.txt"):
        QwenTokenizer(str(tmp_path))
    with pytest.raises(TokenizerFilesError, match="neither tokenizer.json nor spiece.model"):
        T5Tokenizer(str(tmp_path))
    with pytest.raises(TokenizerFilesError, match="not found"):
        T5Tokenizer(str(tmp_path / "nope.model"))
    (tmp_path / "spiece.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerFilesError, match="cannot load"):
        T5Tokenizer(str(tmp_path))


# ---- LLM adapter ---------------------------------------------------------------------------------------------------
def _gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _np_adapter(get, cfg, ids, src):
    """float64 numpy reference written from the spec; RoPE as complex rotation of (x_k, x_{k+hd/2}) pairs."""
    hd, H = cfg.head_dim, cfg.heads
    freqs = 10000.0 ** (-np.arange(hd // 2) * 2.0 / hd)

    def rope(x):                         # x: [n, H, hd] -> rotated, positions 0..n-1
        z = (x[..., : hd // 2] + 1j * x[..., hd // 2:]) * np.exp(1j * np.arange(x.shape[0])[:, None, None] * freqs)
        return np.concatenate([z.real, z.imag], -1)

    def attn(p, x, s):
        q = _rms((x @ get(p + "q_proj.weight").T).reshape(len(x), H, hd), get(p + "q_norm.weight"))
        k = _rms((s @ get(p + "k_proj.weight").T).reshape(len(s), H, hd), get(p + "k_norm.weight"))
        v = (s @ get(p + "v_proj.weight").T).reshape(len(s), H, hd)
        q, k = rope(q), rope(k)
        logits = np.einsum("nhd,mhd->hnm", q, k) / math.sqrt(hd)
        a = np.exp(logits - logits.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        return np.einsum("hnm,mhd->nhd", a, v).reshape(len(x), H * hd) @ get(p + "o_proj.weight").T

    x = get("embed.weight")[ids]
    for i in range(cfg.blocks):
        b = f"blocks.{i}."
        h = _rms(x, get(b + "norm_self_attn.weight"))
        x = x + attn(b + "self_attn.", h, h)
        x = x + attn(b + "cross_attn.", _rms(x, get(b + "norm_cross_attn.weight")), src)
        h = _rms(x, get(b + "norm_mlp.weight")) @ get(b + "mlp.0.weight").T + get(b + "mlp.0.bias")
        x = x + _gelu(h) @ get(b + "mlp.2.weight").T + get(b + "mlp.2.bias")
    return _rms(x @ get("out_proj.weight").T + get("out_proj.bias"), get("norm.weight"))


@pytest.fixture(scope="module")
def adapter(tiny_dit):
    from models.text.adapter import load_adapter
    return load_adapter(str(tiny_dit))


def test_adapter_matches_numpy_reference(adapter, tiny_dit):
    from models.text.adapter import run_adapter
    cfg = adapter.config
    assert cfg == PRESETS["tiny"]["adapter"]
    st = SafeTensorsFile(tiny_dit)
    get = lambda k: st.get("net.llm_adapter." + k).astype(np.float64)   # noqa: E731
    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.integers(0, 32128, 9)] + [1]
    src = rng.standard_normal((6, cfg.source_dim)).astype(np.float32)
    got = run_adapter(adapter, ids, src)
    want = _np_adapter(get, cfg, ids, src.astype(np.float64))
    assert got.shape == (10, cfg.width) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-4
    assert np.abs(want).max() > 0.5


def test_adapter_structure(adapter):
    """Relative positions only, counted separately; RoPE on source keys; no causal or padding mask."""
    cfg = adapter.config
    rng = np.random.default_rng(1)
    ids = torch.tensor([int(i) for i in rng.integers(0, 32128, 7)] + [1])
    src = torch.from_numpy(rng.standard_normal((5, cfg.source_dim)).astype(np.float32))
    with torch.no_grad():
        base = adapter(ids, src)
        shifted = adapter(ids, src, target_start=11, source_start=11)     # same offset: same relative positions
        src_only = adapter(ids, src, target_start=0, source_start=4)      # source counted from 4: different
        perm = adapter(ids, src[torch.tensor([4, 2, 0, 1, 3])])          # permuted source rows: RoPE sees order
        later_id = adapter(torch.cat([ids[:-2], torch.tensor([77, 1])]), src)
        later_src = adapter(ids, torch.cat([src[:-1], src[-1:] * -1.0]))
        longer_src = adapter(ids, torch.cat([src, torch.zeros(3, cfg.source_dim)]))   # zero rows take part
    assert base.shape == (8, cfg.width)
    assert (shifted - base).abs().max() < 1e-4
    assert (src_only - base).abs().max() > 1e-3
    assert (perm - base).abs().max() > 1e-3
    assert (later_id[0] - base[0]).abs().max() > 1e-4         # row 0 sees a later token: no causal mask
    assert (later_src[0] - base[0]).abs().max() > 1e-4        # ... and the last source row
    assert (longer_src[0] - base[0]).abs().max() > 1e-4       # zero-padded source rows are not masked out


def test_adapter_prefix_and_errors(adapter, tiny_dit, te_file, tmp_path):
    from models.text.adapter import AdapterFileError, load_adapter, run_adapter
    st = SafeTensorsFile(tiny_dit)
    other = tmp_path / "comfy.safetensors"            # later releases: model.diffusion_model. prefix
    assert DIT_PREFIXES[0] == "model.diffusion_model."
    write_safetensors(other, [TensorEntry("model.diffusion_model." + k[len("net."):], "BF16", st.shape(k), st.raw(k))
                              for k in st.keys() if k.startswith("net.llm_adapter.")])
    b = load_adapter(str(other))
    src = np.ones((3, adapter.config.source_dim), np.float32)
    np.testing.assert_array_equal(run_adapter(b, [3, 1], src), run_adapter(adapter, [3, 1], src))
    with pytest.raises(AdapterFileError, match="text encoder"):
        load_adapter(str(te_file))
    bad = tmp_path / "bad.safetensors"
    write_safetensors(bad, [TensorEntry(k, "BF16", st.shape(k), st.raw(k)) for k in st.keys()
                            if k != "net.llm_adapter.blocks.2.cross_attn.v_proj.weight"])
    with pytest.raises(AdapterFileError, match=r"net\.llm_adapter\.blocks\.2\.cross_attn\.v_proj\.weight"):
        load_adapter(str(bad))
    with pytest.raises(ValueError, match="outside the adapter vocabulary"):
        run_adapter(adapter, [32128], src)
    with pytest.raises(ValueError, match="source"):
        run_adapter(adapter, [1], np.ones((3, 7), np.float32))


# ---- conditioning ------------------------------------------------------------------------------------------------
def test_context_shape_padding_and_weights(encoder):
    tp = encoder.tokenize("blue eyes, long hair")
    n = len(tp.t5_ids)
    ctx = encoder.encode("blue eyes, long hair")
    assert ctx.shape == (512, PRESETS["tiny"]["adapter"].width) and ctx.dtype == np.float32
    assert np.all(np.abs(ctx[:n]).sum(1) > 0) and not ctx[n:].any()
    weighted = encoder.encode("(blue eyes, long hair:1.5)")
    assert encoder.tokenize("(blue eyes, long hair:1.5)").t5_ids == tp.t5_ids
    np.testing.assert_allclose(weighted[: n - 1], 1.5 * ctx[: n - 1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weighted[n - 1], ctx[n - 1], rtol=1e-5, atol=1e-6)    # EOS keeps weight 1
    cond, uncond = encoder.encode_pair("blue eyes, long hair", "")
    np.testing.assert_array_equal(cond, ctx)
    np.testing.assert_array_equal(uncond, encoder.encode(""))


def test_weighted_prompt_conditioning_equals_per_segment_ids(encoder, tok_dir):
    """The context of a weighted prompt is the one computed from each segment's own ids (transformers' tokenizers
    applied segment by segment, as ComfyUI does), not from the joined clean text's ids."""
    from transformers import Qwen2Tokenizer, T5TokenizerFast
    from models.text.tokenizers import TokenizedPrompt
    qwen_hf = Qwen2Tokenizer(vocab=str(tok_dir / "qwen" / "vocab.json"), merges=str(tok_dir / "qwen" / "merges.txt"))
    t5_hf = T5TokenizerFast.from_pretrained(str(tok_dir / "t5"))
    segments = [("1girl, solo, ", 1.0), ("smile", 1.2), (", cherry blossoms", 1.0), ("((a", 1.0 * 1.1)]
    prompt = "1girl, solo, (smile:1.2), cherry blossoms(((a)"
    qwen = [i for t, _ in segments for i in qwen_hf(t, add_special_tokens=False)["input_ids"]]
    t5 = [(i, w) for t, w in segments for i in t5_hf(t)["input_ids"][:-1]]
    ref = TokenizedPrompt(qwen, False, [i for i, _ in t5] + [1], [w for _, w in t5] + [1.0], segments)
    got = encoder.encode(prompt)
    np.testing.assert_array_equal(got, encoder.encode_tokens(ref))
    joined = "".join(t for t, _ in segments)
    assert qwen_hf(joined, add_special_tokens=False)["input_ids"] != qwen        # the cut matters for these ids ...
    one_go = TokenizedPrompt(qwen_hf(joined, add_special_tokens=False)["input_ids"], False, ref.t5_ids,
                             ref.t5_weights, [])
    assert np.abs(encoder.encode_tokens(one_go) - got).max() > 1e-3              # ... and for the context


def test_empty_prompt(encoder):
    from models.text.adapter import run_adapter
    tp = encoder.tokenize("")
    assert tp.qwen_ids == [151643] and tp.qwen_masked and tp.t5_ids == [1] and tp.t5_weights == [1.0]
    ctx = encoder.encode("")
    assert np.abs(ctx[0]).sum() > 0 and not ctx[1:].any()
    want = run_adapter(encoder.compute.adapter, [1], encoder.compute.qwen.hidden_states([151643]))
    np.testing.assert_array_equal(ctx[0], want[0])
    assert not encoder.tokenize("(x)").qwen_masked


def test_long_prompt_truncated_with_warning(encoder, caplog):
    prompt = "girl, " * 270
    assert len(encoder.tokenize(prompt).t5_ids) > 512
    with caplog.at_level(logging.WARNING, logger="models.text.conditioning"):
        ctx = encoder.encode(prompt)
    assert ctx.shape[0] == 512 and np.all(np.abs(ctx).sum(1) > 0)
    assert any("first 512" in r.getMessage() for r in caplog.records)


def test_mismatched_files_and_close(te_file, tiny_dit, tok_dir, tmp_path, monkeypatch):
    from models.text.conditioning import TextEncoder
    monkeypatch.setitem(text_synth.TE_PRESETS, "narrow", dict(text_synth.TE_PRESETS["tiny"], hidden=32, vocab=151936))
    narrow = tmp_path / "narrow.safetensors"
    text_synth.write_te("narrow", 0, narrow)
    with pytest.raises(ValueError, match="hidden size 32 .* expects 64"):
        TextEncoder.from_files(str(narrow), str(tiny_dit), str(tok_dir / "qwen"), str(tok_dir / "t5"))
    enc = TextEncoder.from_files(str(te_file), str(tiny_dit), str(tok_dir / "qwen"), str(tok_dir / "t5"))
    enc.close()
    with pytest.raises(RuntimeError, match="closed"):
        enc.encode("x")


# ---- anima-models encode ------------------------------------------------------------------------------------------
def test_encode_command(encoder, te_file, tiny_dit, tok_dir, tmp_path, capsys):
    from models.commands.cli import main
    models = tmp_path / "models"
    for sub in ("diffusion_models", "text_encoders", "tokenizers"):
        (models / sub).mkdir(parents=True)
    os.symlink(tiny_dit, models / "diffusion_models" / "anima-tiny.safetensors")
    os.symlink(te_file, models / "text_encoders" / "qwen_3_06b_base.safetensors")
    os.symlink(tok_dir / "qwen", models / "tokenizers" / "qwen")
    os.symlink(tok_dir / "t5", models / "tokenizers" / "t5")
    out = tmp_path / "ctx.npz"
    assert main(["encode", "--models", str(models), "--prompt", "(red:1.2) dress", "--negative", "lowres",
                 "--out", str(out), "--threads", "2"]) == 0
    with np.load(out) as z:
        assert sorted(z.files) == ["cond", "context", "uncond"]
        np.testing.assert_array_equal(z["cond"], encoder.encode("(red:1.2) dress"))
        np.testing.assert_array_equal(z["uncond"], encoder.encode("lowres"))
        np.testing.assert_array_equal(z["context"], z["cond"])
    # a T5 tokenizer file given directly, the other parts from the folder
    out2 = tmp_path / "ctx2.npz"
    assert main(["encode", "--models", str(models), "--t5-tokenizer", str(tok_dir / "t5" / "spiece.model"),
                 "--prompt", "(red:1.2) dress", "--out", str(out2)]) == 0
    with np.load(out2) as z:
        np.testing.assert_array_equal(z["cond"], encoder.encode("(red:1.2) dress"))
    capsys.readouterr()
    os.unlink(models / "text_encoders" / "qwen_3_06b_base.safetensors")
    assert main(["encode", "--models", str(models), "--prompt", "x", "--out", str(out)]) == 2
    assert "text_encoders/" in capsys.readouterr().err
    assert main(["encode", "--models", str(models), "--qwen", str(tiny_dit), "--prompt", "x",
                 "--out", str(out)]) == 2
    assert "DiT" in capsys.readouterr().err


def test_encoder_stage_refuses_what_it_cannot_encode_as_error_replies(tiny_bundle, tmp_path):
    """ENCODE of `(a:1e39)` (past the daemon's check, e.g. from another client) gave an Inf context the scheduler then
    died on; it is refused here, naming the prompt. A weight syntax error in the negative prompt was labelled
    `prompt` with an error code the protocol has not (the ERROR reply itself failed to build)."""
    from protocol import messages as m
    from stages.base import RequestFailed
    from stages.config import load_config
    from stages.encoder import EncoderLogic
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(f'models_dir = "{tiny_bundle}"\nthreads = 1\n')
    logic = EncoderLogic(load_config(cfg))
    ctx = type("Ctx", (), {"check": lambda self, job: None})()
    try:
        ok = logic.on_encode(m.Encode(job="j", prompt="(a:99)", negative="x"), ctx)
        assert all(np.isfinite(np.frombuffer(f, np.float32)).all() for f in ok.inline)
        for prompt, negative, field, says in (("(a:1e39)", "", "prompt", "NaN/Inf"),
                                              ("x", "(b:-1e39)", "negative", "NaN/Inf"),
                                              ("x", "lowres embedding:", "negative", "not followed by a name")):
            with pytest.raises(RequestFailed, match=says) as e:
                logic.on_encode(m.Encode(job="j", prompt=prompt, negative=negative), ctx)
            reply = m.error_reply(1, e.value.code, str(e.value), field=e.value.field)
            assert (reply.code, reply.field) == ("failed" if says == "NaN/Inf" else "bad_request", field), reply
    finally:
        logic.close()
