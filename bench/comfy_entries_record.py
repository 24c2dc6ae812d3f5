"""ComfyUI's final latents of the conditioning graphs (bench/comfy_workflows.py combine, combine-cfg1,
timestep-halves) beside this project's in-process job, and a small record of them for a CI test without ComfyUI.

You run ComfyUI yourself, as for bench/comfy_reference.py (loopback, CPU, float32, the synthetic small bundle with
ComfyUI's own tokenizers); each graph is sent with a SaveLatent of its KSampler's output added (ComfyUI's cache reuses
the rest when the unchanged graph ran before). This project's side: the prompts encoded by its text encoder
(models.text.conditioning), each entry a DiT pass through the pack (DiTRunner), mixed by models/sampling/cond_mix.py,
the pipeline's sampler. Prints per graph the final latents' cosine and max difference and the DiT passes per step;
--record writes ComfyUI's latents with this project's context rows (tests/data/conditioning/README.md).

    .venv/bin/python bench/comfy_entries_record.py --comfyui http://127.0.0.1:8192 --models MODELS --pack PACK256 \\
        --record tests/data/conditioning/comfy_small_entries.npz
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
from bench.comfy_workflows import NEGATIVE, PROMPT, SECOND_PROMPT, WORKFLOWS  # noqa: E402
from models.models_dir import add_model_arguments, paths_from_args  # noqa: E402

GRAPHS = ("combine", "combine-cfg1", "timestep-halves")
TEXTS = {"prompt": PROMPT, "second": SECOND_PROMPT, "negative": NEGATIVE}


def entries_of(graph: dict) -> tuple[list, list]:
    """([(text key, strength, start, end)] positive, negative) of a workflow graph, as the front maps it."""
    from orchestrator.comfy_graph import graph_to_job
    spec = graph_to_job(graph).spec
    key = {v: k for k, v in TEXTS.items()}

    def side(name, plain):
        items = spec.get(name) or [{"text": spec[plain]}]
        return [(key[e["text"]], e.get("strength", 1.0), e.get("start", 0.0), e.get("end", 1.0)) for e in items]
    return side("positive", "prompt"), side("negative", "negative_prompt"), spec


def project_latent(runner, contexts: dict, graph: dict) -> tuple[np.ndarray, list]:
    """This project's final latent for a graph and the DiT passes of each step."""
    from models.sampling.cond_mix import CondPass, Conditioning
    from models.sampling.noise import comfy_noise
    from models.sampling.sampler import Sampler
    pos, neg, spec = entries_of(graph)
    cond = Conditioning(*(tuple(CondPass(contexts[k], w, a, b) for k, w, a, b in side) for side in (pos, neg)))
    s = Sampler(steps=spec["steps"], cfg=spec["cfg"], scheduler=spec["scheduler"], sampler=spec["sampler"],
                spectrum=None)
    passes = []

    def model(x, sigma):
        v_c, v_u, ran = cond.call(runner, s, x, sigma)
        passes.append(ran)
        return v_c, v_u
    shape = (16, spec["height"] // 8, spec["width"] // 8)
    st = s.sample(model, latent=comfy_noise(spec["seed"], shape), seed=spec["seed"])
    return s.result(st), passes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/comfy_entries_record.py", description=__doc__.split("\n")[0])
    p.add_argument("--comfyui", required=True)
    p.add_argument("--pack", required=True, help="this project's FP32 pack of the small DiT at --size")
    add_model_arguments(p)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--size", default="256x256")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--record", default=None, help="write ComfyUI's latents and the context rows here (.npz)")
    p.add_argument("--reuse", default=None, help="ComfyUI's latents from an earlier --record instead of asking it "
                                                 "again (this project's side computed anew)")
    a = p.parse_args(argv)
    width, height = (int(v) for v in a.size.lower().split("x"))
    client, earlier = ComfyClient(a.comfyui, a.timeout), np.load(a.reuse) if a.reuse else None
    if earlier is None:
        client.check()
    paths = paths_from_args(a)
    files = {"dit": paths.dit.name, "text_encoder": paths.text_encoder.name, "vae": paths.vae.name}
    from models.runtime.dit_runner import DiTRunner
    from models.text.conditioning import TextEncoder
    enc = TextEncoder.from_files(str(paths.text_encoder), str(paths.dit), str(paths.qwen_tokenizer),
                                 str(paths.t5_tokenizer))
    first, negative = enc.encode_pair(PROMPT, NEGATIVE)
    second, _ = enc.encode_pair(SECOND_PROMPT, "")
    enc.close()
    contexts = {"prompt": first, "second": second, "negative": negative}
    runner = DiTRunner(a.pack)
    rec, tmp = {}, Path(os.environ.get("TMPDIR", "/tmp")) / f"comfy_cond_{os.getpid()}.latent"
    for name in GRAPHS:
        graph = WORKFLOWS[name][1](files, a.seed, width, height)
        saving = {**graph, "30": {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0],
                                                                        "filename_prefix": f"latents/{name}"}}}
        z_ref = earlier[f"comfyui/{name}"] if earlier is not None else \
            comfy_latent(client.view(client.run(saving)["30"]["latents"][0]), tmp)
        z, passes = project_latent(runner, contexts, graph)
        print(f"{name:16s} cos {cosine(z, z_ref):.9f}  max|dz| {float(np.abs(z - z_ref).max()):.2e}  "
              f"DiT passes per step {passes}", flush=True)
        rec[f"comfyui/{name}"] = z_ref
        rec[f"graph/{name}"] = np.array(json.dumps(graph))
    tmp.unlink(missing_ok=True)
    runner.close()
    if a.record:
        for k, c in contexts.items():        # the rows up to the last non-zero one (zeros after it up to 512)
            rec[f"context/{k}"] = c[:int(np.abs(c).sum(1).nonzero()[0].max()) + 1]
        Path(a.record).parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(a.record, **rec)
        print(f"wrote test record {a.record}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
