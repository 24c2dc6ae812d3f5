"""The `onnx` compute backend of the text encoder: Qwen3 and the LLM adapter from an encoder pack, run with ONNX
Runtime on the CPU. Imports neither torch nor transformers nor onnx: this is what the board runs."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from models.text.encoder_pack import EncoderPack


class OnnxTextCompute:
    name = "onnx"

    def __init__(self, pack: EncoderPack, threads: Optional[int] = None):
        import onnxruntime as ort
        t0 = time.perf_counter()
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self.pack = pack
        self.qwen = ort.InferenceSession(str(pack.qwen3_onnx), sess_options=opts, providers=["CPUExecutionProvider"])
        self.adapter = ort.InferenceSession(str(pack.adapter_onnx), sess_options=opts,
                                            providers=["CPUExecutionProvider"])
        self.qwen_vocab, self.adapter_vocab = pack.qwen_vocab, pack.adapter_vocab
        self.source_dim, self.context_dim = pack.source_dim, pack.context_dim
        self.load_s = time.perf_counter() - t0

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
