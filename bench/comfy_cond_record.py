"""ComfyUI's own conditioning nodes on Anima, recorded for the CI tests without ComfyUI; two records, one command each:

`ops`: ComfyUI's ConditioningZeroOut and ConditioningAverage contexts (tests/test_cond_ops_comfy.py). Run with
ComfyUI's venv (this imports a ComfyUI checkout's modules; nothing of ComfyUI is in this repository):
    /tmp/comfy_venv/bin/python bench/comfy_cond_record.py ops --comfyui-src COMFYUI_CHECKOUT --models MODELS \\
        --record tests/data/conditioning/comfy_small_cond_ops.npz
ComfyUI runs on the CPU in float32 (as its server with --cpu --force-fp32 --fp32-text-enc --fp32-unet):
CLIPTextEncode of each text, then ConditioningZeroOut / ConditioningAverage (nodes.py), then the Anima model's
extra_conds (comfy/model_base.py), which runs the LLM adapter on the conditioning tensor with its t5xxl_ids /
t5xxl_weights: the context the DiT reads, kept up to its last non-zero row. The record also keeps each text's token
ids and weights and its Qwen3 states (the conditioning tensor), so the test needs only the DiT's adapter.

`entries`: ComfyUI's final latents of the conditioning graphs (bench/comfy_workflows.py combine, combine-cfg1,
timestep-halves, combine-zero-average, hires-windows, combine-lazycache) beside this project's in-process job (tests/test_samplers_comfy_model.py). You run ComfyUI
yourself, as for bench/comfy_reference.py (loopback, CPU, float32); each graph is sent with a SaveLatent of its
KSampler's output added (ComfyUI's cache reuses the rest when the unchanged graph ran before). This project's side:
the prompts encoded by its text encoder (models.text.conditioning; an entry's ConditioningZeroOut /
ConditioningAverage as the encoder stage applies them), each entry a DiT pass through the pack (DiTRunner), mixed by
models/sampling/cond_mix.py, the pipeline's sampler (a hires graph's second pass on --hires-pack from the
LatentUpscaleBy of the first). Prints per graph the final latents'
cosine and max difference and the DiT passes per step; --record writes ComfyUI's latents with this project's context
rows (tests/data/samplers/README.md).
    .venv/bin/python bench/comfy_cond_record.py entries --comfyui http://127.0.0.1:8192 --models MODELS \\
        --pack PACK256 --hires-pack PACK384 --record tests/data/samplers/comfy_small_entries.npz

MODELS is the synthetic "small" bundle (`anima-models synth bundle --preset small --seed 0`) with ComfyUI's own
tokenizer files in tokenizers/ (docs/samplers.md "The reference").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.comfy_workflows import AVERAGE_WITH, NEGATIVE, PROMPT, SECOND_PROMPT, WORKFLOWS  # noqa: E402

WEIGHT = 0.6          # conditioning_to_strength of both averages
# ops: name -> (operation, conditioning_to text, conditioning_from text | None)
CASES = {"zero_negative": ("zero_out", "negative", None),
         "average_cut": ("average", "prompt", "with"),        # conditioning_from longer: cut to conditioning_to's
         "average_pad": ("average", "with", "prompt"),        # conditioning_from shorter: zero-padded
         "plain_prompt": ("plain", "prompt", None)}
GRAPHS = ("combine-zero-average", "hires-windows", "combine-lazycache", "combine", "combine-cfg1",
          "timestep-halves")                                   # entries
TEXTS = {"prompt": PROMPT, "second": SECOND_PROMPT, "negative": NEGATIVE, "with": AVERAGE_WITH}


def used_rows(ctx: np.ndarray) -> np.ndarray:
    """A context [512, Dc] up to its last non-zero row (zeros after it up to 512)."""
    return ctx[:int(np.abs(ctx).sum(1).nonzero()[0].max()) + 1]


def write_record(path, rec: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **rec)
    print(f"wrote {path} ({Path(path).stat().st_size} bytes)")


# ------------------------------------------------------------------ ops: ComfyUI's modules in its own venv

def comfy(src: str):
    sys.path.insert(0, src)
    import comfy.options
    comfy.options.enable_args_parsing()
    sys.argv = [sys.argv[0], "--cpu", "--force-fp32", "--fp32-text-enc", "--fp32-unet", "--deterministic"]
    import comfy.sd
    import nodes
    return comfy.sd, nodes


def record_ops(a) -> int:
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
        rec[f"{name}/context"] = used_rows(ctx)
        print(f"{name:14s} {op:9s} to={to} from={frm} context rows {len(rec[f'{name}/context'])} "
              f"max|x| {np.abs(ctx).max():.4f}")
    write_record(a.record, rec)
    return 0


# ------------------------------------------------------------------ entries: ComfyUI's server beside this project

def context_label(entry: dict) -> str:
    """The record's name of an entry's context: its text's key, "+zero" for ConditioningZeroOut, "+avg_KEY_W" for a
    ConditioningAverage with KEY's text at weight W."""
    key = {v: k for k, v in TEXTS.items()}
    label = key[entry["text"]] + ("+zero" if entry.get("zero_out") else "")
    avg = entry.get("average")
    return label + (f"+avg_{key[avg['text']]}_{avg['weight']:g}" if avg else "")


def entries_of(graph: dict) -> tuple[list, list, dict]:
    """([(context label, strength, start, end)] positive, negative, the job) of a workflow graph, as the front maps
    it."""
    from orchestrator.http.comfy_graph import graph_to_job
    spec = graph_to_job(graph).spec

    def side(name, plain):
        items = spec.get(name) or [{"text": spec[plain]}]
        return [(context_label(e), e.get("strength", 1.0), e.get("start", 0.0), e.get("end", 1.0)) for e in items]
    return side("positive", "prompt"), side("negative", "negative_prompt"), spec


def encode_entries(enc, graphs) -> dict:
    """{context label: this project's context} of every entry the graphs' jobs hold."""
    from orchestrator.http.comfy_graph import graph_to_job
    out = {}
    for graph in graphs:
        spec = graph_to_job(graph).spec
        for name, plain in (("positive", "prompt"), ("negative", "negative_prompt")):
            for e in spec.get(name) or [{"text": spec[plain]}]:
                avg = e.get("average")
                out[context_label(e)] = enc.encode_tokens(
                    enc.tokenize(e["text"]), zero_out=bool(e.get("zero_out")),
                    average=None if avg is None else (enc.tokenize(avg["text"]), avg["weight"]))
    return out


def _mixed_pass(runner, cond, s, passes: list, **start) -> np.ndarray:
    """One sampling pass, each call through cond.call (its DiT passes appended to `passes`); `start`: sample()'s."""
    def model(x, sigma):
        v_c, v_u, ran = cond.call(runner, s, x, sigma)
        passes.append(ran)
        return v_c, v_u
    return s.result(s.sample(model, **start))


def project_latent(runners, contexts: dict, graph: dict, hires_mixed: bool = True) -> tuple[np.ndarray, list]:
    """This project's final latent for a graph and the DiT passes of each step (`runners`: the first pass's and
    the hires pass's; `hires_mixed` False: the second pass with the first positive entry alone, what it would be
    without the entries there)."""
    from models.sampling.cond_mix import CondPass, Conditioning
    from models.sampling.img2img import LatentPlan, LatentSampler, start_or_resume_latent
    from models.sampling.latent_ops import common_upscale
    from models.sampling.noise import comfy_noise
    from models.sampling.sampler import Sampler
    from models.sampling.step_cache import CacheSettings
    from models.vae.latent import denormalize, normalize
    pos, neg, spec = entries_of(graph)
    cond = Conditioning(*(tuple(CondPass(contexts[k], w, a, b) for k, w, a, b in side) for side in (pos, neg)))
    cache = None if spec.get("cache") is None else CacheSettings(**spec["cache"])      # LazyCache
    s = Sampler(steps=spec["steps"], cfg=spec["cfg"], scheduler=spec["scheduler"], sampler=spec["sampler"],
                spectrum=None, cache=cache)
    passes, shape = [], (16, spec["height"] // 8, spec["width"] // 8)
    z = _mixed_pass(runners[0], cond, s, passes, latent=comfy_noise(spec["seed"], shape), seed=spec["seed"])
    h = spec.get("hires")
    if h:
        size = (round(shape[1] * h["scale"]), round(shape[2] * h["scale"]))
        up = normalize(common_upscale(denormalize(z)[None], size[1], size[0], h["method"])[0])
        s2 = LatentSampler(steps=h["steps"], cfg=spec["cfg"], scheduler=spec["scheduler"], sampler=spec["sampler"],
                           spectrum=None, plan=LatentPlan(denoise=float(h["denoise"])))
        alone = cond if hires_mixed else Conditioning(cond.positive[:1], cond.negative)
        z = _mixed_pass(runners[1], alone, s2, passes,
                        state=start_or_resume_latent(s2, spec["seed"], (16, *size), image=up))
    return z, passes


def _comfy_latent(client, graph: dict, name: str, tmp: Path) -> np.ndarray:
    """ComfyUI's final latent of `graph`: a SaveLatent added on what its VAEDecode "9" decodes."""
    saving = {**graph, "30": {"class_type": "SaveLatent", "inputs": {"samples": graph["9"]["inputs"]["samples"],
                                                                    "filename_prefix": f"latents/{name}"}}}
    from bench.comfy_reference import comfy_latent
    return comfy_latent(client.view(client.run(saving)["30"]["latents"][0]), tmp)


def record_entries(a) -> int:
    from bench.comfy_reference import ComfyClient, cosine
    from models.setup.models_dir import paths_from_args
    width, height = (int(v) for v in a.size.lower().split("x"))
    client, earlier = ComfyClient(a.comfyui, a.timeout), dict(np.load(a.reuse)) if a.reuse else {}
    paths = paths_from_args(a)
    files = {"dit": paths.dit.name, "text_encoder": paths.text_encoder.name, "vae": paths.vae.name}
    from models.runtime.dit_runner import DiTRunner
    from models.text.conditioning import TextEncoder
    enc = TextEncoder.from_files(str(paths.text_encoder), str(paths.dit), str(paths.qwen_tokenizer),
                                 str(paths.t5_tokenizer))
    graphs = {name: WORKFLOWS[name][1](files, a.seed, width, height) for name in GRAPHS}
    contexts = encode_entries(enc, graphs.values())
    enc.close()
    runners = (DiTRunner(a.pack), DiTRunner(a.hires_pack))
    rec, tmp = {}, Path(os.environ.get("TMPDIR", "/tmp")) / f"comfy_cond_{os.getpid()}.latent"
    for name, graph in graphs.items():
        z_ref = earlier.get(f"comfyui/{name}")
        if z_ref is None:
            z_ref = _comfy_latent(client, graph, name, tmp)
        z, passes = project_latent(runners, contexts, graph)
        print(f"{name:22s} cos {cosine(z, z_ref):.9f}  max|dz| {float(np.abs(z - z_ref).max()):.2e}  "
              f"DiT passes per step {passes}", flush=True)
        rec[f"comfyui/{name}"] = z_ref
        rec[f"graph/{name}"] = np.array(json.dumps(graph))
    tmp.unlink(missing_ok=True)
    for r in runners:
        r.close()
    if a.record:
        write_record(a.record, {**rec, **{f"context/{k}": used_rows(c) for k, c in contexts.items()}})
    return 0


def main(argv=None) -> int:
    from models.setup.models_dir import add_model_arguments
    p = argparse.ArgumentParser(prog="bench/comfy_cond_record.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("ops", help="ConditioningZeroOut / ConditioningAverage contexts, ComfyUI's modules in its venv")
    o.add_argument("--comfyui-src", required=True)
    o.add_argument("--models", required=True)
    o.add_argument("--record", required=True)
    e = sub.add_parser("entries", help="the conditioning graphs' final latents, a running ComfyUI beside this project")
    e.add_argument("--comfyui", required=True)
    e.add_argument("--pack", required=True, help="this project's FP32 pack of the small DiT at --size")
    e.add_argument("--hires-pack", required=True, help="its FP32 pack at 1.5 x --size (the hires graph's second pass)")
    add_model_arguments(e)
    e.add_argument("--seed", type=int, default=7)
    e.add_argument("--size", default="256x256")
    e.add_argument("--timeout", type=float, default=3600.0)
    e.add_argument("--record", default=None, help="write ComfyUI's latents and the context rows here (.npz)")
    e.add_argument("--reuse", default=None, help="ComfyUI's latents from an earlier --record instead of asking it "
                                                 "again (this project's side computed anew)")
    a = p.parse_args(argv)
    return record_ops(a) if a.what == "ops" else record_entries(a)


if __name__ == "__main__":
    raise SystemExit(main())


