"""Synthetic Qwen3 text encoder (real `model.*` key names, bf16) and locally trained Qwen/T5 tokenizers."""
from __future__ import annotations

import io
import json
import logging
import math
import os
import zlib

import numpy as np

from models.dit.config import PRESETS
from models.base.safetensors_io import TensorEntry, write_safetensors
from models.text.tokenizers import QWEN_PAD_ID, QWEN_PAD_TOKEN

log = logging.getLogger(__name__)

# Qwen3 text-encoder shapes per preset. "full" is Qwen3-0.6B-Base; "tiny" has hidden = the tiny adapter's source_dim;
# "small" is Qwen3-0.6B-Base too (ComfyUI builds its Anima text encoder with that fixed config).
TE_PRESETS = {
    "full": dict(vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072),
    "tiny": dict(vocab=151936, hidden=PRESETS["tiny"]["adapter"].source_dim, layers=2, heads=4, kv_heads=2,
                 head_dim=16, intermediate=192),
    "small": dict(vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072),
}
# Tokenizer training sizes per preset (corpus lines, Qwen BPE vocab, T5 unigram vocab).
TOKENIZER_PRESETS = {"tiny": dict(lines=3000, qwen_vocab=2000, t5_vocab=1000),
                     "small": dict(lines=3000, qwen_vocab=2000, t5_vocab=1000),
                     "full": dict(lines=20000, qwen_vocab=8000, t5_vocab=4000)}
QWEN_EXTRA_SPECIALS = {151644: "<|im_start|>", 151645: "<|im_end|>"}


def _rng(seed: int, key: str) -> np.random.Generator:
    """One generator per tensor: values do not depend on the order tensors are produced in."""
    return np.random.default_rng([int(seed), zlib.crc32(key.encode("utf-8"))])


def te_shapes(preset: str) -> dict:
    """{key: shape} of a Qwen3 text encoder file (keys `model.*`, no lm_head), in writing order."""
    if preset not in TE_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(TE_PRESETS)}")
    p = TE_PRESETS[preset]
    h, q, kv, i = p["hidden"], p["heads"] * p["head_dim"], p["kv_heads"] * p["head_dim"], p["intermediate"]
    s = {"model.embed_tokens.weight": (p["vocab"], h)}
    for n in range(p["layers"]):
        b = f"model.layers.{n}."
        s[b + "input_layernorm.weight"] = (h,)
        s[b + "self_attn.q_proj.weight"] = (q, h)
        s[b + "self_attn.k_proj.weight"] = (kv, h)
        s[b + "self_attn.v_proj.weight"] = (kv, h)
        s[b + "self_attn.o_proj.weight"] = (h, q)
        s[b + "self_attn.q_norm.weight"] = (p["head_dim"],)
        s[b + "self_attn.k_norm.weight"] = (p["head_dim"],)
        s[b + "post_attention_layernorm.weight"] = (h,)
        s[b + "mlp.gate_proj.weight"] = (i, h)
        s[b + "mlp.up_proj.weight"] = (i, h)
        s[b + "mlp.down_proj.weight"] = (h, i)
    s["model.norm.weight"] = (h,)
    return s


def _te_tensor(seed: int, key: str, shape: tuple) -> np.ndarray:
    """Norm weights 1 + 0.1 N; embeddings N(0, 1); linears N(0, 1/fan_in) (unit gain, activations stay O(1))."""
    a = _rng(seed, key).standard_normal(shape, dtype=np.float32)      # a: shape f32
    if len(shape) == 1:
        a *= np.float32(0.1)
        a += np.float32(1.0)
    elif not key.endswith("embed_tokens.weight"):
        a *= np.float32(1.0 / math.sqrt(shape[1]))
    return a


def write_te(preset: str, seed: int, out) -> None:
    """Write a synthetic Qwen3 text encoder (bf16) to `out`, one tensor at a time."""
    shapes = te_shapes(preset)
    entries = [TensorEntry(k, "BF16", tuple(s), (lambda k=k, s=s: _te_tensor(seed, k, s))) for k, s in shapes.items()]
    n = sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values())
    log.info("writing synthetic Qwen3 text encoder preset=%s seed=%d (%d tensors, %d parameters) to %s",
             preset, seed, len(entries), n, os.fspath(out))
    write_safetensors(out, entries, metadata={"format": "pt", "anima_synthetic": f"te:{preset}:{seed}"})


# -- tokenizers -----------------------------------------------------------------------------------------------------
_TAGS = ("girl boy solo smile long hair short hair blue eyes red eyes white dress school uniform outdoors indoors "
         "sky cloud tree flower cherry blossoms night city street rain snow sunset masterpiece best quality "
         "highly detailed looking at viewer upper body full body sitting standing holding sword cat ears "
         "hat ribbon twintails ponytail blush open mouth closed eyes background simple background scenery "
         "the a of and with in on at by from under over near wearing score_9 newest year 2025 safe").split()
_SYLLABLES = "ka ki ku ke ko sa shi su se so ta chi tsu te to na ni nu ne no ha hi fu he ho ma mi mu me mo ya yu yo ra ri ru re ro wa n".split()


def training_corpus(lines: int, seed: int = 0) -> list:
    """Deterministic prompt-like text: tags, invented names, numbers, punctuation, weight syntax, some non-ASCII."""
    rng = np.random.default_rng(seed)
    names = ["".join(rng.choice(_SYLLABLES, size=int(rng.integers(2, 5)))) for _ in range(300)]
    extra = ["(", ")", ":", ",", ".", "!", "?", "1girl", "2boys", "1.2", "0.8", "—", "é", "日本", "猫", "ü", "\n"]
    out = []
    for _ in range(lines):
        words = []
        for _ in range(int(rng.integers(4, 24))):
            r = rng.random()
            if r < 0.6:
                words.append(str(rng.choice(_TAGS)))
            elif r < 0.8:
                words.append(str(rng.choice(names)).capitalize() if rng.random() < 0.3 else str(rng.choice(names)))
            elif r < 0.9:
                words.append(str(int(rng.integers(0, 2000))))
            else:
                words.append(str(rng.choice(extra)))
        out.append(", ".join(" ".join(words[i:i + 3]) for i in range(0, len(words), 3)))
    return out


def _write_qwen(corpus: list, vocab_size: int, out_dir: str) -> None:
    import tokenizers as tk
    from models.text.tokenizers import QWEN_SPLIT_PATTERN

    tok = tk.Tokenizer(tk.models.BPE())
    tok.normalizer = tk.normalizers.NFC()
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    doc = json.loads(tok.to_str())
    vocab, merges = doc["model"]["vocab"], doc["model"]["merges"]
    if max(vocab.values()) >= QWEN_PAD_ID:
        raise ValueError(f"trained Qwen vocabulary too large ({len(vocab)})")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for m in merges:
            f.write((" ".join(m) if isinstance(m, list) else m) + "\n")
    specials = {QWEN_PAD_ID: QWEN_PAD_TOKEN, **QWEN_EXTRA_SPECIALS}
    cfg = {"added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                             "single_word": False, "special": True} for i, t in specials.items()},
           "bos_token": None, "eos_token": QWEN_PAD_TOKEN, "pad_token": QWEN_PAD_TOKEN, "unk_token": None,
           "model_max_length": 131072, "tokenizer_class": "Qwen2Tokenizer", "clean_up_tokenization_spaces": False}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    # tokenizer.json: the same definition through our own vocab.json + merges.txt reader (one source of truth).
    from models.text.tokenizers import qwen_tokenizer_json_from_bpe_files
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(qwen_tokenizer_json_from_bpe_files(out_dir))


def _write_t5(corpus: list, vocab_size: int, out_dir: str) -> None:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=vocab_size, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0, num_threads=1,
        minloglevel=2)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "spiece.model"), "wb") as f:
        f.write(model.getvalue())
    # tokenizer.json converted by transformers from the same sentencepiece model (as the Hugging Face T5 repos ship).
    from transformers import T5Tokenizer
    T5Tokenizer.from_pretrained(out_dir, extra_ids=100).save_pretrained(out_dir)


def write_tokenizers(preset: str, out_dir, seed: int = 0) -> None:
    """Write `out_dir/qwen/{vocab.json,merges.txt,tokenizer_config.json,tokenizer.json}` and
    `out_dir/t5/{spiece.model,tokenizer.json,...}`, trained on generated text (a few seconds for "tiny")."""
    if preset not in TOKENIZER_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(TOKENIZER_PRESETS)}")
    p = TOKENIZER_PRESETS[preset]
    out_dir = os.fspath(out_dir)
    corpus = training_corpus(p["lines"], seed)
    log.info("training tokenizers preset=%s on %d generated lines into %s", preset, len(corpus), out_dir)
    _write_qwen(corpus, p["qwen_vocab"], os.path.join(out_dir, "qwen"))
    _write_t5(corpus, p["t5_vocab"], os.path.join(out_dir, "t5"))
