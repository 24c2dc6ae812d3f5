"""ConditioningZeroOut and ConditioningAverage on Anima against ComfyUI's own (tests/data/conditioning/
comfy_small_cond_ops.npz, made by bench/comfy_cond_record.py ops: ComfyUI's CLIPTextEncode, its conditioning nodes and
its Anima model's extra_conds, which run the LLM adapter, on the synthetic "small" bundle).

The record keeps ComfyUI's Qwen3 states and token ids for each text, so these tests need only the DiT's LLM adapter:
they rebuild the same synthetic checkpoint and run this project's encoder path (the encoder stage's
`_encode_side`, models.text.conditioning.TextEncoder) with the recorded states in place of the Qwen3 pass.
A zeroed negative is not a zero context (the adapter still reads the negative's T5 ids), and an average blends the
Qwen3 states (not the contexts) with conditioning_to's T5 ids: an implementation that zeroed or averaged the
context instead fails here.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from models.text.conditioning import CONTEXT_ROWS, TextEncoder, blend_sources
from models.text.tokenizers import TokenizedPrompt
from protocol.prompt import CondAverage, CondEntry

REC = np.load(Path(__file__).parent / "data" / "conditioning" / "comfy_small_cond_ops.npz")
JOB = json.loads(str(REC["job"]))
QWEN_PAD = 151643


class RecordedQwen:
    """The real LLM adapter of the synthetic DiT; Qwen3's states are ComfyUI's recorded ones (looked up by ids)."""
    name = "recorded"
    qwen_vocab = 151936
    load_s = 0.0

    def __init__(self, dit_path):
        from models.text.adapter import load_adapter
        self.adapter = load_adapter(dit_path)
        self.adapter_vocab, self.source_dim = self.adapter.config.vocab, self.adapter.config.source_dim
        self.context_dim = self.adapter.config.width
        self.states = {tuple(REC[f"{k}/qwen_ids"].tolist()): REC[f"{k}/states"] for k in JOB["texts"]}
        self.qwen_calls = 0

    def hidden_states(self, ids):
        self.qwen_calls += 1
        return self.states[tuple(int(i) for i in ids)]

    def adapter_rows(self, t5_ids, source):
        from models.text.adapter import run_adapter
        return run_adapter(self.adapter, t5_ids, source)


def _tokens(k: str) -> TokenizedPrompt:
    return TokenizedPrompt(REC[f"{k}/qwen_ids"].tolist(), False, REC[f"{k}/t5_ids"].tolist(),
                           REC[f"{k}/t5_weights"].tolist(), [])


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from models.dit.synth import dit_entries
    from models.base.safetensors_io import write_safetensors
    d = tmp_path_factory.mktemp("small_adapter")
    # the bundle's DiT's LLM adapter (each tensor's values depend only on the seed and its name)
    write_safetensors(d / "anima-small.safetensors", [e for e in dit_entries("small", 0, prefix="net.")
                                                      if e.name.startswith("net.llm_adapter.")])
    return TextEncoder(RecordedQwen(d / "anima-small.safetensors"),
                       SimpleNamespace(qwen=SimpleNamespace(pad_id=QWEN_PAD, source="recorded")))


def _stage(encoder):
    """The encoder stage's logic around `encoder`, its tokenizer giving the recorded ids for the recorded texts."""
    from stages.encoder import EncoderLogic
    logic = object.__new__(EncoderLogic)
    logic.encoder = encoder
    by_text = {t: _tokens(k) for k, t in JOB["texts"].items()}
    encoder.tokenize = lambda text: by_text[text]
    return logic


def _want(case: str) -> np.ndarray:
    want = np.zeros((CONTEXT_ROWS, REC[f"{case}/context"].shape[1]), np.float32)
    want[:len(REC[f"{case}/context"])] = REC[f"{case}/context"]
    return want


def _close(got: np.ndarray, want: np.ndarray) -> float:
    err = float(np.abs(got - want).max())
    assert err <= 1e-4 * float(np.abs(want).max()), f"max |difference| {err:.3e} with ComfyUI's context"
    return err


def test_a_plain_prompt_is_comfyuis_context(encoder):
    """The check the others stand on: the recorded states through this adapter give ComfyUI's plain context."""
    _close(encoder.encode_tokens(_tokens("prompt")), _want("plain_prompt"))


def test_a_zeroed_negative_is_comfyuis_and_runs_no_qwen3(encoder):
    texts = JOB["texts"]
    logic = _stage(encoder)
    calls = encoder.compute.qwen_calls
    _, got = logic._encode_side("negative", texts["negative"], CondEntry(text=texts["negative"], zero_out=True),
                                CONTEXT_ROWS)
    assert encoder.compute.qwen_calls == calls                       # only the token count matters
    want = _want("zero_negative")
    assert np.abs(want).max() > 0.1                                  # not a zero context in ComfyUI either
    _close(got, want)
    _, plain = logic._encode_side("negative", texts["negative"], None, CONTEXT_ROWS)
    assert np.abs(plain - want).max() > 0.1                          # and not the plain negative's


@pytest.mark.parametrize("case", ["average_cut", "average_pad"])
def test_an_average_is_comfyuis(encoder, case):
    """conditioning_to's states x weight + conditioning_from's (cut, or zero-padded, to its length) x (1 - weight),
    through the adapter with conditioning_to's T5 ids."""
    _, to, frm = JOB["cases"][case]
    texts = JOB["texts"]
    entry = CondEntry(text=texts[to], average=CondAverage(text=texts[frm], weight=JOB["weight"]))
    _, got = _stage(encoder)._encode_side("prompt", texts[to], entry, CONTEXT_ROWS)
    _close(got, _want(case))


def test_blend_sources_cuts_and_pads_as_comfyui():
    to, other = np.ones((3, 2), np.float32), np.arange(10, dtype=np.float32).reshape(5, 2)
    np.testing.assert_array_equal(blend_sources(to, other, 0.25), 0.25 + 0.75 * other[:3])
    short = other[:1]
    np.testing.assert_array_equal(blend_sources(to, short, 0.5), 0.5 + 0.5 * np.vstack([short, np.zeros((2, 2))]))


def test_the_stage_refuses_an_entry_for_another_text(encoder):
    from stages.base import RequestFailed
    texts = JOB["texts"]
    with pytest.raises(RequestFailed, match="negative_entry.text differs"):
        _stage(encoder)._encode_side("negative", texts["negative"], CondEntry(text=texts["prompt"], zero_out=True),
                                     CONTEXT_ROWS)
