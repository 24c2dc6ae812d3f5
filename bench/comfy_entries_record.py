"""ComfyUI's final latents of the conditioning graphs (bench/comfy_workflows.py combine, combine-cfg1,
timestep-halves, combine-zero-average, hires-windows, combine-lazycache) beside this project's in-process job, and a small record of
them for a CI test without ComfyUI.

You run ComfyUI yourself, as for bench/comfy_reference.py (loopback, CPU, float32, the synthetic small bundle with
ComfyUI's own tokenizers); each graph is sent with a SaveLatent of its KSampler's output added (ComfyUI's cache reuses
the rest when the unchanged graph ran before). This project's side: the prompts encoded by its text encoder
(models.text.conditioning; an entry's ConditioningZeroOut / ConditioningAverage as the encoder stage applies them),
each entry a DiT pass through the pack (DiTRunner), mixed by models/sampling/cond_mix.py, the pipeline's sampler
(a hires graph's second pass on --hires-pack from the LatentUpscaleBy of the first). Prints per graph the final
latents' cosine and max difference and the DiT passes per step; --record writes ComfyUI's latents with this
project's context rows (tests/data/samplers/README.md); --reuse takes the graphs an earlier record holds from it.

    .venv/bin/python bench/comfy_entries_record.py --comfyui http://127.0.0.1:8192 --models MODELS --pack PACK256 \\
        --hires-pack PACK384 --record tests/data/samplers/comfy_small_entries.npz
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.comfy_reference import ComfyClient, comfy_latent, cosine  # noqa: E402
from bench.comfy_workflows import AVERAGE_WITH, NEGATIVE, PROMPT, SECOND_PROMPT, WORKFLOWS  # noqa: E402
from models.models_dir import add_model_arguments, paths_from_args  # noqa: E402

GRAPHS = ("combine-zero-average", "hires-windows", "combine-lazycache", "combine", "combine-cfg1", "timestep-halves")
TEXTS = {"prompt": PROMPT, "second": SECOND_PROMPT, "negative": NEGATIVE, "with": AVERAGE_WITH}


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
    from orchestrator.comfy_graph import graph_to_job
    spec = graph_to_job(graph).spec

    def side(name, plain):
        items = spec.get(name) or [{"text": spec[plain]}]
        return [(context_label(e), e.get("strength", 1.0), e.get("start", 0.0), e.get("end", 1.0)) for e in items]
    return side("positive", "prompt"), side("negative", "negative_prompt"), spec


def encode_entries(enc, graphs) -> dict:
    """{context label: this project's context} of every entry the graphs' jobs hold."""
    out = {}
    for graph in graphs:
        spec = __import__("orchestrator.comfy_graph", fromlist=["graph_to_job"]).graph_to_job(graph).spec
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


def _arguments(argv):
    p = argparse.ArgumentParser(prog="bench/comfy_entries_record.py", description=__doc__.split("\n")[0])
    p.add_argument("--comfyui", required=True)
    p.add_argument("--pack", required=True, help="this project's FP32 pack of the small DiT at --size")
    p.add_argument("--hires-pack", required=True, help="its FP32 pack at 1.5 x --size (the hires graph's second pass)")
    add_model_arguments(p)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--size", default="256x256")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--record", default=None, help="write ComfyUI's latents and the context rows here (.npz)")
    p.add_argument("--reuse", default=None, help="ComfyUI's latents of the graphs an earlier --record holds instead "
                                                 "of asking it again (this project's side computed anew)")
    return p.parse_args(argv)


def _comfy_latent(client, graph: dict, name: str, tmp: Path) -> np.ndarray:
    """ComfyUI's final latent of `graph`: a SaveLatent added on what its VAEDecode "9" decodes."""
    saving = {**graph, "30": {"class_type": "SaveLatent", "inputs": {"samples": graph["9"]["inputs"]["samples"],
                                                                    "filename_prefix": f"latents/{name}"}}}
    return comfy_latent(client.view(client.run(saving)["30"]["latents"][0]), tmp)


def main(argv=None) -> int:
    a = _arguments(argv)
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
        for k, c in contexts.items():        # the rows up to the last non-zero one (zeros after it up to 512)
            rec[f"context/{k}"] = c[:int(np.abs(c).sum(1).nonzero()[0].max()) + 1]
        Path(a.record).parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(a.record, **rec)
        print(f"wrote test record {a.record}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
