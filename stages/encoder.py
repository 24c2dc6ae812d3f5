"""The text-encoder stage: prompt + negative → conditional and unconditional contexts [512, Dc] f32 in the job arena.

    python -m stages.encoder --config run/pipeline.toml

Started by the orchestrator for a job's encoding and stopped before denoising (it holds Qwen3 in FP32, ~2.5 GB at full
size). `[stage.encoder] backend` picks the compute:
    backend = "torch"      (default) the model files from the config's `models_dir` (ComfyUI layout), with optional
                           per-part overrides: dit, text_encoder, qwen_tokenizer, t5_tokenizer
    backend = "onnx"       ONNX Runtime on an encoder pack: pack = "DIR" (`anima-models export-encoder`; a relative
                           path resolves from the config file's folder). No torch: what the board runs.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from models.lora import LoraError, plan_text_loras
from models.lora.choice import lora_uses
from models.setup.models_dir import ModelsDirError
from models.text.conditioning import TextEncoder
from models.text.encoder_pack import EncoderPackError
from models.text.prompt_weights import PromptWeightError
from protocol import messages as m
from protocol.fields import ProtocolError
from stages.base import RequestFailed, exit_process, stage_main
from stages.config import ConfigError, PipelineConfig
from stages.preflight import encoder_files
from stages.tensor_io import ReplyTensors

log = logging.getLogger(__name__)

class EncoderLogic:
    """Loads the tokenizers, Qwen3 and the LLM adapter once (before READY); ENCODE fills two arena slots."""

    def __init__(self, config: PipelineConfig):
        settings = config.stage_settings("encoder")
        self.backend = settings["backend"]            # backend and pack checked when the config was read
        self.threads = int(settings.get("threads", config.threads))
        self.models_dir = config.models_dir           # a job's LoRAs are named under its loras/
        t0 = time.perf_counter()
        found = encoder_files(config)                 # ConfigError (exit 2, not retried) naming a missing file
        if self.backend == "onnx":
            self.source = found
            try:
                self.encoder = TextEncoder.from_pack(str(self.source), threads=self.threads)
            except EncoderPackError as e:            # a pack problem: exit 2, not retried (stage_main)
                raise ConfigError(f"{config.path}: stage.encoder.pack: {e}") from None
        else:
            self.source = found.text_encoder
            self.encoder = TextEncoder.from_files(str(found.text_encoder), str(found.dit), str(found.qwen_tokenizer),
                                                  str(found.t5_tokenizer), threads=self.threads)
        self.load_s = time.perf_counter() - t0

    def info(self) -> dict:
        return {"context_dim": self.encoder.context_dim, "threads": self.threads, "load_s": round(self.load_s, 3),
                "backend": self.backend, "source": str(self.source)}

    def on_encode(self, msg: m.Encode, ctx) -> m.Encoded:
        shape = (msg.rows, self.encoder.context_dim)
        for name in ("cond", "uncond"):
            d = getattr(msg, name)
            if d is not None and (d.dtype != "f32" or tuple(d.shape) != shape):
                raise ProtocolError(name, f"expected an f32 {list(shape)} slot, got {d.dtype} {list(d.shape)}")
        # 1) the job's LoRAs merged into the adapter and Qwen3 (none: the models' own weights are put back); the
        # next job's choice replaces them, and only a part whose LoRAs change is made again (models/text/compute_*)
        t0 = time.perf_counter()
        try:
            self.encoder.set_lora(plan_text_loras(lora_uses(msg.loras, self.models_dir), self.encoder))
        except (ModelsDirError, LoraError, EncoderPackError) as e:    # a pack exported without its weights' list
            raise RequestFailed(f"encoder: {e}", field="loras") from None
        lora_s = time.perf_counter() - t0
        # 2) tokenize and encode both prompts (each with its conditioning operations, when it has any)
        t0 = time.perf_counter()
        tc, cond = self._encode_side("prompt", msg.prompt, msg.prompt_entry, msg.rows)      # [S, Dc] f32
        ctx.check(msg.job)
        tu, uncond = self._encode_side("negative", msg.negative, msg.negative_entry, msg.rows)
        encode_s = time.perf_counter() - t0
        for field, c in (("prompt", cond), ("negative", uncond)):  # the scheduler would refuse it: say why here
            if not np.isfinite(c).all():
                raise RequestFailed(f"{field}: its context has NaN/Inf values (a weight too large for float32, or "
                                    "broken text-encoder weights)", field=field)
        # 3) into the arena slots (or inline for a remote encoder) and reply
        out = ReplyTensors(ctx, msg.arena)
        dc = out.put(cond, msg.cond, field="cond")
        du = out.put(uncond, msg.uncond, field="uncond")
        return m.reply_to(msg, m.Encoded, job=msg.job, cond=dc, uncond=du, tokens_cond=len(tc.t5_ids),
                          tokens_uncond=len(tu.t5_ids),
                          truncated=max(len(tc.t5_ids), len(tu.t5_ids)) > msg.rows,
                          timings={"load_s": self.load_s, "encode_s": encode_s, "lora_s": lora_s},
                          inline=out.inline)

    def _tokenize(self, field: str, text: str):
        try:
            return self.encoder.tokenize(text)
        except PromptWeightError as e:
            raise RequestFailed(str(e), code="bad_request", field=field) from None

    def _encode_side(self, field: str, text: str, entry, rows: int) -> tuple:
        """(tokens, context [rows, Dc] f32) of one sampler input: `text`, zeroed and/or averaged as `entry` says
        (ComfyUI's ConditioningZeroOut / ConditioningAverage; models/text/conditioning.py)."""
        tp = self._tokenize(field, text)
        if entry is None:
            return tp, self.encoder.encode_tokens(tp, rows)
        if entry.text != text:
            raise RequestFailed(f"{field}_entry.text differs from {field}", code="bad_request", field=f"{field}_entry")
        average = None
        if entry.average is not None:
            average = (self._tokenize(f"{field}_entry.average.text", entry.average.text), entry.average.weight)
        return tp, self.encoder.encode_tokens(tp, rows, zero_out=entry.zero_out, average=average)

    def close(self) -> None:
        self.encoder.close()


def main(argv=None) -> int:
    return stage_main("encoder", EncoderLogic, argv)


if __name__ == "__main__":
    exit_process(main())      # no final GC of torch's objects: a stop takes 0.1 s, not seconds
