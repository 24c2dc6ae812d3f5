"""Prompt -> text context [512, context_dim] f32: tokenizers, Qwen3 (FP32), LLM adapter, T5 weights, zero padding."""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from models.text.adapter import load_adapter, run_adapter
from models.text.prompt_weights import clean_text, parse_weights, t5_ids_and_weights
from models.text.qwen3 import Qwen3TextEncoder
from models.text.tokenizers import load_tokenizers

log = logging.getLogger(__name__)

CONTEXT_ROWS = 512          # text tokens the DiT's cross-attention sees (fixed: the NPU graphs have static shapes)


@dataclass
class TokenizedPrompt:
    qwen_ids: List[int]         # raw clean prompt; [pad] for an empty prompt
    qwen_masked: bool           # True when qwen_ids is the single masked pad token (empty prompt)
    t5_ids: List[int]           # EOS (1) appended
    t5_weights: List[float]     # one per T5 id


class TextEncoder:
    """Loads the tokenizers, Qwen3 and the LLM adapter once; `encode(prompt)` -> [512, context_dim] f32."""

    def __init__(self, qwen_path: str, dit_path: str, qwen_tokenizer_dir: str, t5_tokenizer_path_or_dir: str,
                 threads: Optional[int] = None):
        t0 = time.perf_counter()
        if threads:
            torch.set_num_threads(int(threads))
        self.qwen_tok, self.t5_tok = load_tokenizers(qwen_tokenizer_dir, t5_tokenizer_path_or_dir)
        self.adapter = load_adapter(dit_path)
        self.qwen = Qwen3TextEncoder(qwen_path)
        cfg = self.adapter.config
        if cfg.source_dim != self.qwen.shape.hidden:
            raise ValueError(f"text encoder {qwen_path} has hidden size {self.qwen.shape.hidden} but the LLM adapter "
                             f"in {dit_path} expects {cfg.source_dim} (cross_attn.k_proj columns): mismatched files")
        if self.qwen_tok.pad_id >= self.qwen.shape.vocab:
            raise ValueError(f"Qwen tokenizer {self.qwen_tok.source} pad id {self.qwen_tok.pad_id} is outside the text "
                             f"encoder's vocabulary ({self.qwen.shape.vocab})")
        self.context_dim = cfg.width
        self.load_s = time.perf_counter() - t0
        log.info("text encoder ready in %.2f s (context [%d, %d])", self.load_s, CONTEXT_ROWS, self.context_dim)

    def tokenize(self, prompt: str) -> TokenizedPrompt:
        """Weight syntax parsed; Qwen ids of the clean text, T5 ids + weights chunk by chunk."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        chunks = parse_weights(prompt)
        qwen_ids = self.qwen_tok.encode(clean_text(chunks))
        masked = not qwen_ids
        if masked:
            qwen_ids = [self.qwen_tok.pad_id]
        t5_ids, t5_weights = t5_ids_and_weights(chunks, self.t5_tok)
        return TokenizedPrompt(qwen_ids, masked, t5_ids, t5_weights)

    def encode(self, prompt: str) -> np.ndarray:
        """prompt -> context [512, context_dim] f32: adapter rows x T5 weights, zero rows after the last token."""
        if self.qwen is None:
            raise RuntimeError("TextEncoder is closed")
        t0 = time.perf_counter()
        tp = self.tokenize(prompt)
        # The empty prompt's single pad token is masked in the reference; a one-token causal attention whose only
        # key is masked with a finite bias still attends to it, so the unmasked forward gives the same states.
        source = self.qwen.hidden_states(tp.qwen_ids)                         # source: [S, source_dim] f32
        rows = run_adapter(self.adapter, tp.t5_ids, source)                   # rows: [T, Dc] f32
        rows *= np.asarray(tp.t5_weights, dtype=np.float32)[:, None]
        if rows.shape[0] > CONTEXT_ROWS:
            log.warning("prompt has %d T5 tokens; the context keeps the first %d (the rest is dropped)",
                        rows.shape[0], CONTEXT_ROWS)
            rows = rows[:CONTEXT_ROWS]
        ctx = np.zeros((CONTEXT_ROWS, self.context_dim), dtype=np.float32)  # ctx: [512, Dc] f32
        ctx[: rows.shape[0]] = rows
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
