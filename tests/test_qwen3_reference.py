"""Qwen3 through `transformers` (models/text/qwen3.py) against a float64 numpy forward written from the spec.

Independent of transformers' configuration handling: RoPE θ 1e6 is written here, so a transformers release that does
not understand the `rope_parameters` argument (θ silently back at its 10,000 default) fails this test. It is also the
test `scripts/transformers_floor.sh` runs against candidate transformers releases.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from models.base.safetensors_io import SafeTensorsFile
from models.text import synth as text_synth

THETA = 1e6


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_qwen3(get, p: dict, ids: list) -> np.ndarray:
    """float64 Qwen3 forward: [S] ids -> final hidden states after the last RMSNorm, [S, hidden]."""
    H, KV, hd = p["heads"], p["kv_heads"], p["head_dim"]
    S = len(ids)
    freqs = THETA ** (-np.arange(hd // 2) * 2.0 / hd)
    turn = np.exp(1j * np.arange(S)[:, None, None] * freqs)              # [S, 1, hd/2]

    def rope(x):                                                          # pairs (k, k + hd/2) as complex numbers
        z = (x[..., : hd // 2] + 1j * x[..., hd // 2:]) * turn
        return np.concatenate([z.real, z.imag], -1)

    causal = np.triu(np.full((S, S), -np.inf), 1)
    x = get("model.embed_tokens.weight")[ids]
    for n in range(p["layers"]):
        b = f"model.layers.{n}."
        h = _rms(x, get(b + "input_layernorm.weight"))
        q = rope(_rms((h @ get(b + "self_attn.q_proj.weight").T).reshape(S, H, hd), get(b + "self_attn.q_norm.weight")))
        k = rope(_rms((h @ get(b + "self_attn.k_proj.weight").T).reshape(S, KV, hd), get(b + "self_attn.k_norm.weight")))
        v = (h @ get(b + "self_attn.v_proj.weight").T).reshape(S, KV, hd)
        kv_of = np.arange(H) // (H // KV)                                 # query head -> its key/value head
        logits = np.einsum("shd,thd->hst", q, k[:, kv_of]) / math.sqrt(hd) + causal
        a = np.exp(logits - logits.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hst,thd->shd", a, v[:, kv_of]).reshape(S, H * hd) @ get(b + "self_attn.o_proj.weight").T
        h = _rms(x, get(b + "post_attention_layernorm.weight"))
        g = h @ get(b + "mlp.gate_proj.weight").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ get(b + "mlp.up_proj.weight").T)) @ get(b + "mlp.down_proj.weight").T
    return _rms(x, get("model.norm.weight"))


@pytest.fixture(scope="module")
def te_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("te") / "qwen_3_06b_base-tiny.safetensors"
    text_synth.write_te("tiny", 5, path)
    return path


def test_qwen3_matches_numpy_reference(te_file):
    from models.text.qwen3 import Qwen3TextEncoder
    st = SafeTensorsFile(te_file)
    get = lambda k: st.get(k).astype(np.float64)      # noqa: E731
    ids = [5, 17, 151643, 900, 33, 151935, 0, 64, 1200, 7, 7, 7, 99, 3000, 151000, 12]
    want = np_qwen3(get, text_synth.TE_PRESETS["tiny"], ids)
    got = Qwen3TextEncoder(str(te_file)).hidden_states(ids)
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.abs(got - want).max()
    assert err <= 1e-4 * np.abs(want).max(), err
    # The check has teeth: θ = 10,000 (what an old transformers falls back to) is far outside that tolerance.
    global THETA
    keep, THETA = THETA, 1e4
    try:
        wrong = np_qwen3(get, text_synth.TE_PRESETS["tiny"], ids)
    finally:
        THETA = keep
    assert np.abs(got - wrong).max() > 100 * err
