"""The `torch` compute backend of the text encoder: transformers Qwen3Model (FP32) + the torch LLM adapter, read
from the model files. The host's path and the reference the ONNX export is checked against. LoRA (`set_lora`):
merged into the parameters in place in FP32, the originals kept and put back when the LoRAs change."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from models.text.adapter import load_adapter, run_adapter
from models.text.qwen3 import Qwen3TextEncoder


class TorchTextCompute:
    name = "torch"

    def __init__(self, qwen_path: str, dit_path: str, threads: Optional[int] = None):
        t0 = time.perf_counter()
        if threads:
            torch.set_num_threads(int(threads))
        self.adapter = load_adapter(dit_path)
        self.qwen = Qwen3TextEncoder(qwen_path)
        cfg = self.adapter.config
        if cfg.source_dim != self.qwen.shape.hidden:
            raise ValueError(f"text encoder {qwen_path} has hidden size {self.qwen.shape.hidden} but the LLM adapter "
                             f"in {dit_path} expects {cfg.source_dim} (cross_attn.k_proj columns): mismatched files")
        self.qwen_vocab, self.adapter_vocab = self.qwen.shape.vocab, cfg.vocab
        self.source_dim, self.context_dim = cfg.source_dim, cfg.width
        self._saved: list = []                           # [(parameter, its original)] while a LoRA is merged
        self.load_s = time.perf_counter() - t0

    def lora_shapes(self) -> tuple:
        """(AdapterConfig, Qwen3Shape): the layers a LoRA may change here."""
        return self.adapter.config, self.qwen.shape

    @torch.no_grad()
    def set_lora(self, plan) -> None:
        """Put back what a previous LoRA changed, then merge a LoraPlan's adapter and Qwen3 layers (None: none)."""
        for param, original in reversed(self._saved):
            param.copy_(original)
        self._saved = []
        if plan is None:
            return
        for place, module, prefix in (("te", self.qwen.model, "model."), ("adapter", self.adapter, "llm_adapter.")):
            for key in plan.keys(place):
                param = module.get_parameter(key[len(prefix):])
                self._saved.append((param, param.detach().clone()))
                param.copy_(torch.from_numpy(plan.merged(key, param.detach().numpy())))

    def hidden_states(self, ids: list) -> np.ndarray:
        return self.qwen.hidden_states(ids)                                  # [S, source_dim] f32

    def adapter_rows(self, t5_ids: list, source: np.ndarray) -> np.ndarray:
        return run_adapter(self.adapter, t5_ids, source)                     # [T, width] f32

    def close(self) -> None:
        if self.qwen is not None:
            self.qwen.close()
        self.qwen = self.adapter = None
