"""Prompt -> text context [512, context_dim] f32: tokenize, Qwen3 + LLM adapter (a compute backend), T5 weights,
padding.

No torch here. What is shared by every backend lives in this module and in models/text/tokenizers.py (tokenization of
the weighted prompt); only the Qwen3 + adapter compute differs:
    torch  models/text/compute_torch.py  transformers Qwen3Model + the torch adapter, from the model files (the host)
    onnx   models/text/compute_onnx.py   ONNX Runtime, from an encoder pack (`anima-models export-encoder`; the board)

    enc = TextEncoder.from_files(te, dit, qwen_tok_dir, t5_tok)      # torch
    enc = TextEncoder.from_pack("packs/encoder")                     # ONNX Runtime
    cond, uncond = enc.encode_pair("1girl, (blue eyes:1.2)", "")     # [512, Dc] f32 each
"""
from __future__ import annotations

import gc
import logging
import time
from typing import Optional, Protocol

import numpy as np

from models.text.tokenizers import PromptTokenizer, TokenizedPrompt

__all__ = ["BACKENDS", "CONTEXT_ROWS", "TextCompute", "TextEncoder", "TokenizedPrompt", "blend_sources", "context_from_rows"]

log = logging.getLogger(__name__)

CONTEXT_ROWS = 512          # text tokens the DiT's cross-attention sees (fixed: the NPU graphs have static shapes)
BACKENDS = ("torch", "onnx")


class TextCompute(Protocol):
    """Qwen3 + LLM adapter behind one interface (torch or ONNX Runtime)."""
    name: str
    qwen_vocab: int             # Qwen3 embedding rows
    adapter_vocab: int          # adapter embedding rows (T5 ids)
    context_dim: int            # adapter width = the DiT's context dim
    source_dim: int             # Qwen3 hidden width the adapter reads
    load_s: float

    def hidden_states(self, ids: list) -> np.ndarray: ...                       # [S] -> [S, source_dim] f32

    def adapter_rows(self, t5_ids: list, source: np.ndarray) -> np.ndarray: ...  # -> [T, context_dim] f32

    def lora_shapes(self) -> tuple: ...         # (AdapterConfig, Qwen3Shape): the layers a LoRA may change

    def set_lora(self, plan) -> None: ...       # merge a models.lora.LoraPlan (None: put the weights back)

    def close(self) -> None: ...


def context_from_rows(out: np.ndarray, weights: list, context_dim: int, rows: int = CONTEXT_ROWS) -> np.ndarray:
    """Adapter rows [T, Dc] x per-token T5 weights, zero rows after the last token: [rows, Dc] f32.

    ComfyUI pads to 512 rows and keeps every row of a longer prompt; `rows` is what the pack takes (512, or more for a
    long-context pack), and rows past it are dropped with a warning."""
    if rows < CONTEXT_ROWS:
        raise ValueError(f"rows {rows}: a context has at least {CONTEXT_ROWS} rows")
    out = out * np.asarray(weights, dtype=np.float32)[:, None]                  # out: [T, Dc] f32
    if out.shape[0] > rows:
        log.warning("prompt has %d T5 tokens; the context keeps the first %d (the rest is dropped), while "
                    "ComfyUI keeps every row: the picture will differ from ComfyUI's unless the prompt is at "
                    "most %d T5 tokens long or the pack takes a longer context (anima-models pack --context)",
                    out.shape[0], rows, rows)
        out = out[:rows]
    ctx = np.zeros((rows, context_dim), dtype=np.float32)                       # ctx: [rows, Dc] f32
    ctx[: out.shape[0]] = out
    return ctx


def blend_sources(to: np.ndarray, other: np.ndarray, weight: float) -> np.ndarray:
    """ComfyUI's ConditioningAverage on Qwen3 states: to x weight + other x (1 - weight), `other` cut to `to`'s rows
    or zero-padded to them; [S_to, D] f32 (float32 arithmetic, as torch multiplies a float32 tensor by a scalar)."""
    rows = np.zeros_like(to, dtype=np.float32)                                   # rows: [S_to, D] f32
    n = min(len(to), len(other))
    rows[:n] = other[:n]
    return (to.astype(np.float32) * np.float32(weight) + rows * np.float32(1.0 - weight)).astype(np.float32)


class TextEncoder:
    """Tokenizers + a compute backend, loaded once; `encode(prompt)` -> [512, context_dim] f32."""

    def __init__(self, compute: TextCompute, tokenizer: PromptTokenizer):
        self.compute, self.tokenizer = compute, tokenizer
        qtok = tokenizer.qwen
        if qtok.pad_id >= compute.qwen_vocab:
            raise ValueError(f"Qwen tokenizer {qtok.source} pad id {qtok.pad_id} is outside the text "
                             f"encoder's vocabulary ({compute.qwen_vocab})")
        self.context_dim = compute.context_dim
        self.backend = compute.name
        self.load_s = compute.load_s

    @classmethod
    def from_files(cls, qwen_path: str, dit_path: str, qwen_tokenizer_dir: str, t5_tokenizer_path_or_dir: str,
                   threads: Optional[int] = None) -> "TextEncoder":
        """The torch backend from the model files (Qwen3 safetensors, the DiT holding the adapter, tokenizers)."""
        from models.text.compute_torch import TorchTextCompute
        t0 = time.perf_counter()
        tok = PromptTokenizer.from_files(qwen_tokenizer_dir, t5_tokenizer_path_or_dir)
        enc = cls(TorchTextCompute(qwen_path, dit_path, threads=threads), tok)
        enc.load_s = time.perf_counter() - t0
        log.info("text encoder (torch) ready in %.2f s (context [%d, %d])", enc.load_s, CONTEXT_ROWS, enc.context_dim)
        return enc

    @classmethod
    def from_pack(cls, pack_dir: str, threads: Optional[int] = None, check: bool = True) -> "TextEncoder":
        """The ONNX Runtime backend from an encoder pack (graphs, tokenizer.json files, manifest with hashes)."""
        from models.text.compute_onnx import OnnxTextCompute
        from models.text.encoder_pack import load_encoder_pack
        t0 = time.perf_counter()
        pack = load_encoder_pack(pack_dir, check=check)
        tok = PromptTokenizer.from_files(str(pack.qwen_tokenizer), str(pack.t5_tokenizer))
        enc = cls(OnnxTextCompute(pack, threads=threads), tok)
        enc.load_s = time.perf_counter() - t0
        log.info("text encoder (onnx, %s) ready in %.2f s (context [%d, %d])", pack.dir, enc.load_s, CONTEXT_ROWS,
                 enc.context_dim)
        return enc

    def lora_shapes(self) -> tuple:
        """(AdapterConfig, Qwen3Shape) of the layers a LoRA may change here (models.lora.plan_text_loras plans
        against them; text/ never imports lora/, lora/ knows the text encoder's key layout)."""
        if self.compute is None:
            raise RuntimeError("TextEncoder is closed")
        return self.compute.lora_shapes()

    def set_lora(self, plan=None):
        """Apply a models.lora.LoraPlan (from plan_text_loras; None: none) to the adapter and Qwen3 from the next
        encode on; returns the plan. Names of the DiT's own layers are left to it."""
        if self.compute is None:
            raise RuntimeError("TextEncoder is closed")
        self.compute.set_lora(plan)
        return plan

    def tokenize(self, prompt: str) -> TokenizedPrompt:
        """Weighted segments as ComfyUI cuts them; Qwen ids and T5 ids + weights segment by segment."""
        return self.tokenizer.tokenize(prompt)

    def encode(self, prompt: str) -> np.ndarray:
        """prompt -> context [512, context_dim] f32: adapter rows x T5 weights, zero rows after the last token."""
        return self.encode_tokens(self.tokenize(prompt))

    def encode_tokens(self, tp: TokenizedPrompt, rows: int = CONTEXT_ROWS, zero_out: bool = False,
                      average: tuple | None = None) -> np.ndarray:
        """Tokenized prompt -> context [rows, context_dim] f32 (see context_from_rows). ComfyUI's conditioning
        operations act on the Qwen3 states the LLM adapter reads (the T5 ids and weights stay `tp`'s):
        `zero_out` (ConditioningZeroOut) zeroes them, `average` = (other TokenizedPrompt, weight)
        (ConditioningAverage) blends them with the other prompt's, after the zeroing."""
        if self.compute is None:
            raise RuntimeError("TextEncoder is closed")
        if rows < CONTEXT_ROWS:
            raise ValueError(f"rows {rows}: a context has at least {CONTEXT_ROWS} rows")
        t0 = time.perf_counter()
        self._check_ids(tp)
        source = self._source(tp, zero_out)                                      # source: [S, source_dim] f32
        if average is not None:
            source = blend_sources(source, self._source(average[0], False), average[1])
        out = self.compute.adapter_rows(tp.t5_ids, source)                       # out: [T, Dc] f32
        ctx = context_from_rows(out, tp.t5_weights, self.context_dim, rows)      # ctx: [rows, Dc] f32
        log.info("encoded prompt (%s): %d Qwen tokens, %d T5 tokens in %.2f s", self.backend, len(tp.qwen_ids),
                 len(tp.t5_ids), time.perf_counter() - t0)
        return ctx

    def _check_ids(self, tp: TokenizedPrompt) -> None:
        for ids, vocab, what in ((tp.qwen_ids, self.compute.qwen_vocab, "Qwen3 token id"),
                                 (tp.t5_ids, self.compute.adapter_vocab, "T5 token id")):
            bad = [i for i in ids if not 0 <= int(i) < vocab]
            if bad:
                raise ValueError(f"{what} {bad[0]} outside the vocabulary [0, {vocab})")

    def _source(self, tp: TokenizedPrompt, zero_out: bool) -> np.ndarray:
        """The Qwen3 hidden states the adapter reads, [S, source_dim] f32; zeroed: no Qwen3 pass (only S matters)."""
        self._check_ids(tp)
        if zero_out:
            return np.zeros((len(tp.qwen_ids), self.compute.source_dim), np.float32)
        # The empty prompt's single pad token is masked in the reference; a one-token causal attention whose only
        # key is masked with a finite bias still attends to it, so the unmasked forward gives the same states.
        return self.compute.hidden_states(tp.qwen_ids)

    def encode_pair(self, prompt: str, negative: str = "") -> tuple:
        """(cond, uncond), each [512, context_dim] f32."""
        return self.encode(prompt), self.encode(negative)

    def close(self) -> None:
        """Drop the models (the memory returns to the allocator); the object cannot encode afterwards."""
        if self.compute is not None:
            self.compute.close()
        self.compute = None
        gc.collect()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
