"""ComfyUI's own ConditioningZeroOut and ConditioningAverage on Anima, recorded for tests/test_cond_ops_comfy.py.

Run with ComfyUI's venv (this imports a ComfyUI checkout's modules; nothing of ComfyUI is in this repository):
    /tmp/comfy_venv/bin/python bench/comfy_cond_record.py --comfyui-src COMFYUI_CHECKOUT --models MODELS \\
        --out tests/data/conditioning/comfy_small_cond_ops.npz

MODELS is the synthetic "small" bundle (`anima-models synth bundle --preset small --seed 0`) with ComfyUI's own
tokenizer files in tokenizers/ (docs/samplers.md "The reference"). ComfyUI runs on the CPU in float32 (as its server
with --cpu --force-fp32 --fp32-text-enc --fp32-unet): CLIPTextEncode of each text, then ConditioningZeroOut /
ConditioningAverage (nodes.py), then the Anima model's extra_conds (comfy/model_base.py), which runs the LLM adapter
on the conditioning tensor with its t5xxl_ids / t5xxl_weights: the context the DiT reads, kept up to its last
non-zero row. The record also keeps each text's token ids and weights and its Qwen3 states (the conditioning tensor),
so the test needs only the DiT's adapter.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.comfy_workflows import AVERAGE_WITH, NEGATIVE, PROMPT  # noqa: E402

WEIGHT = 0.6          # conditioning_to_strength of both averages
# name -> (operation, conditioning_to text, conditioning_from text | None)
CASES = {"zero_negative": ("zero_out", "negative", None),
         "average_cut": ("average", "prompt", "with"),        # conditioning_from longer: cut to conditioning_to's
         "average_pad": ("average", "with", "prompt"),        # conditioning_from shorter: zero-padded
         "plain_prompt": ("plain", "prompt", None)}


def comfy(src: str):
    sys.path.insert(0, src)
    import comfy.options
    comfy.options.enable_args_parsing()
    sys.argv = [sys.argv[0], "--cpu", "--force-fp32", "--fp32-text-enc", "--fp32-unet", "--deterministic"]
    import comfy.sd
    import nodes
    return comfy.sd, nodes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--comfyui-src", required=True)
    p.add_argument("--models", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import torch
    sd, nodes = comfy(a.comfyui_src)
    models = Path(a.models)
    te = next((models / "text_encoders").glob("*.safetensors"))
    dit = next((models / "diffusion_models").glob("*.safetensors"))
    clip = sd.load_clip([str(te)], clip_type=sd.CLIPType.STABLE_DIFFUSION)
    model = sd.load_diffusion_model(str(dit))
    texts = {"prompt": PROMPT, "negative": NEGATIVE, "with": AVERAGE_WITH}
    conds = {k: nodes.CLIPTextEncode().encode(clip, t)[0] for k, t in texts.items()}
    rec = {"job": np.array(json.dumps({"texts": texts, "weight": WEIGHT, "cases": CASES, "dit": dit.name,
                                       "text_encoder": te.name}))}
    for k, c in conds.items():
        tokens = clip.tokenize(texts[k])
        rec[f"{k}/qwen_ids"] = np.array([t[0] for t in tokens["qwen3_06b"][0]], np.int64)
        rec[f"{k}/t5_ids"] = c[0][1]["t5xxl_ids"].numpy().astype(np.int64)
        rec[f"{k}/t5_weights"] = c[0][1]["t5xxl_weights"].numpy().astype(np.float32)
        rec[f"{k}/states"] = c[0][0][0].float().numpy()                        # [S, 1024] f32
    for name, (op, to, frm) in CASES.items():
        if op == "zero_out":
            c = nodes.ConditioningZeroOut().zero_out(conds[to])[0]
        elif op == "average":
            c = nodes.ConditioningAverage().addWeighted(conds[to], conds[frm], WEIGHT)[0]
        else:
            c = conds[to]
        with torch.inference_mode():
            out = model.model.extra_conds(cross_attn=c[0][0], t5xxl_ids=c[0][1]["t5xxl_ids"],
                                          t5xxl_weights=c[0][1]["t5xxl_weights"], device="cpu")
        ctx = out["c_crossattn"].cond[0].float().numpy()                          # [512, Dc] f32
        rows = int(np.abs(ctx).sum(1).nonzero()[0].max()) + 1
        rec[f"{name}/context"] = ctx[:rows]
        print(f"{name:14s} {op:9s} to={to} from={frm} context rows {rows} max|x| {np.abs(ctx).max():.4f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **rec)
    print(f"wrote {a.out} ({Path(a.out).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
