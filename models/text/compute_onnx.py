"""The `onnx` compute backend of the text encoder: Qwen3 and the LLM adapter from an encoder pack, run with ONNX
Runtime on the CPU. Imports neither torch nor transformers nor onnx: this is what the board runs.

LoRA (`set_lora`): the weights a LoRA changes are merged in FP32 from the pack's own data file and handed to ONNX
Runtime as initializers that replace the graph's when the session is made; only a part (Qwen3, the adapter) whose
LoRAs changed gets a new session."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from models.text.encoder_pack import EncoderPack, EncoderPackError

PARTS = {"qwen3": ("te", "qwen"), "adapter": ("adapter", "adapter")}   # graph -> (LoRA place, session attribute)


class OnnxTextCompute:
    name = "onnx"

    def __init__(self, pack: EncoderPack, threads: Optional[int] = None):
        t0 = time.perf_counter()
        self.pack, self.threads = pack, threads
        self._lora: dict = {part: () for part in PARTS}         # part -> what its session has merged
        self._held: dict = {part: [] for part in PARTS}         # part -> the OrtValues its session reads
        self.qwen = self._session(pack.qwen3_onnx, {})
        self.adapter = self._session(pack.adapter_onnx, {})
        self.qwen_vocab, self.adapter_vocab = pack.qwen_vocab, pack.adapter_vocab
        self.source_dim, self.context_dim = pack.source_dim, pack.context_dim
        self.load_s = time.perf_counter() - t0

    def _session(self, path, overrides: dict):
        import onnxruntime as ort
        opts = ort.SessionOptions()
        if self.threads:
            opts.intra_op_num_threads = int(self.threads)
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        for name, value in overrides.items():
            opts.add_initializer(name, value)
        return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])

    def lora_shapes(self) -> tuple:
        """(AdapterConfig, Qwen3Shape) from the pack's manifest: the layers a LoRA may change here."""
        from models.dit.config import AdapterConfig
        from models.text.qwen3 import Qwen3Shape
        m = self.pack.manifest
        qwen = Qwen3Shape(**{f: int(m["qwen3"][f]) for f in Qwen3Shape.__dataclass_fields__})
        adapter = AdapterConfig(**{f: int(m["adapter"][f]) for f in AdapterConfig.__dataclass_fields__})
        return adapter, qwen

    def set_lora(self, plan) -> None:
        """Merge a LoraPlan's adapter and Qwen3 layers (None: none); a part gets a new session only when what it
        has merged changes."""
        import onnxruntime as ort
        for part, (place, attr) in PARTS.items():
            keys = plan.keys(place) if plan is not None else []
            want = (tuple(keys), tuple((u.path, u.strength, u.te_strength) for u in plan.uses)) if keys else ()
            if want == self._lora[part]:
                continue
            graph = self.pack.manifest["graphs"][part]
            weights = graph.get("weights")
            if keys and not isinstance(weights, dict):
                raise EncoderPackError(f"{self.pack.dir}: this encoder pack was exported before LoRA support (its "
                                       f"manifest names no {part} weights): export it again to apply LoRAs")
            path = self.pack.dir / graph["onnx"]
            held = []
            if keys:
                data = np.memmap(str(path) + ".data", dtype=np.uint8, mode="r")
                for key in keys:
                    name, offset, shape, transposed = weights[key]
                    base = data[offset:offset + 4 * int(np.prod(shape))].view(np.float32).reshape(shape)
                    merged = plan.merged(key, base.T if transposed else base)              # [out, in] f32
                    held.append((name, ort.OrtValue.ortvalue_from_numpy(
                        np.ascontiguousarray(merged.T if transposed else merged))))
                del data
            setattr(self, attr, None)                                   # the old session's memory goes first
            setattr(self, attr, self._session(path, dict(held)))
            self._held[part], self._lora[part] = held, want

    def hidden_states(self, ids: list) -> np.ndarray:
        if len(ids) == 0:
            raise ValueError("Qwen3 input ids must not be empty (the empty prompt uses the single pad token)")
        x = np.asarray(list(ids), dtype=np.int64)                                      # x: [S] i64
        return self.qwen.run(["hidden"], {"input_ids": x})[0]                           # [S, source_dim] f32

    def adapter_rows(self, t5_ids: list, source: np.ndarray) -> np.ndarray:
        if source.ndim != 2 or source.shape[1] != self.source_dim:
            raise ValueError(f"adapter source must be [S, {self.source_dim}], got {list(source.shape)}")
        feed = {"t5_ids": np.asarray(list(t5_ids), dtype=np.int64),                   # [T] i64
                "source": np.ascontiguousarray(source, dtype=np.float32)}               # [S, source_dim] f32
        return self.adapter.run(["rows"], feed)[0]                                      # [T, width] f32

    def close(self) -> None:
        self.qwen = self.adapter = None
        self._held = {part: [] for part in PARTS}
