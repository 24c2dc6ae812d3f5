"""Prompt -> text context [512, context_dim] f32: tokenizers, Qwen3 (FP32), LLM adapter, T5 weights, zero padding."""
from __future__ import annotations

import gc
import logging
import time
from typing import Optional

import numpy as np
import torch

from models.text.adapter import load_adapter, run_adapter
from models.text.qwen3 import Qwen3TextEncoder
from models.text.tokenizers import PromptTokenizer, TokenizedPrompt

__all__ = ["CONTEXT_ROWS", "TextEncoder", "TokenizedPrompt"]

log = logging.getLogger(__name__)

CONTEXT_ROWS = 512          # text tokens the DiT's cross-attention sees (fixed: the NPU graphs have static shapes)


class TextEncoder:
    """Loads the tokenizers, Qwen3 and the LLM adapter once; `encode(prompt)` -> [512, context_dim] f32."""

    def __init__(self, qwen_path: str, dit_path: str, qwen_tokenizer_dir: str, t5_tokenizer_path_or_dir: str,
                 threads: Optional[int] = None):
        t0 = time.perf_counter()
        if threads:
            torch.set_num_threads(int(threads))
        self.tokenizer = PromptTokenizer.from_files(qwen_tokenizer_dir, t5_tokenizer_path_or_dir)
        self.adapter = load_adapter(dit_path)
        self.qwen = Qwen3TextEncoder(qwen_path)
        cfg = self.adapter.config
        if cfg.source_dim != self.qwen.shape.hidden:
            raise ValueError(f"text encoder {qwen_path} has hidden size {self.qwen.shape.hidden} but the LLM adapter "
                             f"in {dit_path} expects {cfg.source_dim} (cross_attn.k_proj columns): mismatched files")
        qtok = self.tokenizer.qwen
        if qtok.pad_id >= self.qwen.shape.vocab:
            raise ValueError(f"Qwen tokenizer {qtok.source} pad id {qtok.pad_id} is outside the text "
                             f"encoder's vocabulary ({self.qwen.shape.vocab})")
        self.context_dim = cfg.width
        self.load_s = time.perf_counter() - t0
        log.info("text encoder ready in %.2f s (context [%d, %d])", self.load_s, CONTEXT_ROWS, self.context_dim)

    def tokenize(self, prompt: str) -> TokenizedPrompt:
        """Weighted segments as ComfyUI cuts them; Qwen ids and T5 ids + weights segment by segment."""
        return self.tokenizer.tokenize(prompt)

    def encode(self, prompt: str) -> np.ndarray:
        """prompt -> context [512, context_dim] f32: adapter rows x T5 weights, zero rows after the last token."""
        return self.encode_tokens(self.tokenize(prompt))

    def encode_tokens(self, tp: TokenizedPrompt, rows: int = CONTEXT_ROWS) -> np.ndarray:
        """Tokenized prompt -> context [rows, context_dim] f32: adapter rows x T5 weights, zero rows after the last
        token. ComfyUI pads to 512 rows and keeps every row of a longer prompt; `rows` is what the pack takes (512,
        or more for a long-context pack), and rows past it are dropped with a warning."""
        if self.qwen is None:
            raise RuntimeError("TextEncoder is closed")
        if rows < CONTEXT_ROWS:
            raise ValueError(f"rows {rows}: a context has at least {CONTEXT_ROWS} rows")
        t0 = time.perf_counter()
        # The empty prompt's single pad token is masked in the reference; a one-token causal attention whose only
        # key is masked with a finite bias still attends to it, so the unmasked forward gives the same states.
        source = self.qwen.hidden_states(tp.qwen_ids)                         # source: [S, source_dim] f32
        out = run_adapter(self.adapter, tp.t5_ids, source)                    # out: [T, Dc] f32
        out *= np.asarray(tp.t5_weights, dtype=np.float32)[:, None]
        if out.shape[0] > rows:
            log.warning("prompt has %d T5 tokens; the context keeps the first %d (the rest is dropped), while "
                        "ComfyUI keeps every row: the picture will differ from ComfyUI's unless the prompt is at "
                        "most %d T5 tokens long or the pack takes a longer context (anima-models pack --context)",
                        out.shape[0], rows, rows)
            out = out[:rows]
        ctx = np.zeros((rows, self.context_dim), dtype=np.float32)           # ctx: [rows, Dc] f32
        ctx[: out.shape[0]] = out
        log.info("encoded prompt: %d Qwen tokens, %d T5 tokens in %.2f s", len(tp.qwen_ids), len(tp.t5_ids),
                 time.perf_counter() - t0)
        return ctx

    def encode_pair(self, prompt: str, negative: str = "") -> tuple:
        """(cond, uncond), each [512, context_dim] f32."""
        return self.encode(prompt), self.encode(negative)

    def close(self) -> None:
        """Drop the models (the memory returns to the allocator); the object cannot encode afterwards."""
        if self.qwen is not None:
            self.qwen.close()
        self.qwen = None
        self.adapter = None
        gc.collect()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
