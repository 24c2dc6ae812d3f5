"""LoRA jobs here vs a running ComfyUI on the same files: ComfyUI's LoraLoaderModelOnly / LoraLoader chains against
this project's run-time LoRA (text encoder merged per job, the DiT through a LoRA-ready pack's low-rank inputs):
final latent cosine and pixel difference per case.

You run ComfyUI yourself (this script never starts, installs or builds it), on loopback, on the CPU, in float32,
with its models folder holding the same files as --models (diffusion_models/, text_encoders/, vae/, tokenizers/ and
loras/), e.g.
    python main.py --listen 127.0.0.1 --port 8191 --cpu --force-fp32 --fp32-text-enc --fp32-vae --fp32-unet \\
        --deterministic --models-directory MODELS
then
    .venv/bin/python bench/lora_comfy_reference.py --comfyui http://127.0.0.1:8191 --models MODELS --pack PACK \\
        --make-loras [--record tests/data/lora/comfy_small_lora.npz] [--out bench/out/lora_comfy_reference.json]
--make-loras writes the synthetic LoRAs the cases name into MODELS/loras/ (models.lora.synth, from the models'
own key lists: a kohya LoRA with alpha != rank over the blocks, host layers, LLM adapter and Qwen3, and a
ComfyUI-layout one without alpha over the blocks and adapter; for `--case turbo|lokr|loha --cfg 1 --steps 8`, the
Turbo-LoRA form, a LoKr and a LoHa over the blocks and host layers). PACK: this project's pack of the same DiT at --size
with --lora-rank 12 or more (FP32 for a comparison at the 1e-5 level). The tokenizers must be ComfyUI's own (its
qwen25_tokenizer and t5_tokenizer/tokenizer.json in MODELS/tokenizers/qwen and /t5) for the token ids to agree.
--record writes ComfyUI's final latents, the conditioning this project's text encoder made with each case's LoRAs
and the job's settings: what tests/test_lora_comfy_model.py checks the DiT side against.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comfy_reference import ComfyClient, comfy_latent, cosine, png_pixels  # noqa: E402 - bench/'s one ComfyUI client
from models.lora import LoraUse, TargetTable, plan_loras, plan_text_loras  # noqa: E402
from models.setup.models_dir import add_model_arguments, paths_from_args  # noqa: E402
from models.sampling.noise import comfy_noise  # noqa: E402
from models.base.safetensors_io import SafeTensorsFile  # noqa: E402

# the synthetic LoRAs (file name -> layout, seed, rank, alpha, groups) and the cases: each a chain of
# (file, ComfyUI node, strength_model, strength_clip) from the loaders outwards
LORAS = {"kohya_a3.safetensors": ("kohya", 11, 8, 3.0, ("blocks", "host", "adapter", "te")),
         "comfy_noalpha.safetensors": ("comfy", 12, 4, None, ("blocks", "adapter")),
         "turbo.safetensors": ("turbo", 21, 8, None, ("blocks", "modulation", "adapter")),  # the published 508
         "lokr.safetensors": ("lokr", 22, 4, 2.0, ("blocks", "host")),
         "loha.safetensors": ("loha", 23, 4, 3.0, ("blocks", "host"))}
CASES = {"none": [],
         "model_only": [("kohya_a3.safetensors", "LoraLoaderModelOnly", 0.8, None)],
         "chained": [("kohya_a3.safetensors", "LoraLoader", 0.8, 1.3),
                     ("comfy_noalpha.safetensors", "LoraLoaderModelOnly", -0.6, None)],
         # the Turbo settings (--cfg 1 --steps 8); LoKr / LoHa take rank 16 at run time: a pack with --lora-rank 16
         "turbo": [("turbo.safetensors", "LoraLoaderModelOnly", 1.0, None)],
         "lokr": [("lokr.safetensors", "LoraLoaderModelOnly", 0.8, None)],
         "loha": [("loha.safetensors", "LoraLoaderModelOnly", -0.7, None)]}


def baked_runner(dit_path, uses, size, threads, out: Path):
    """A DiTRunner over an FP32 pack of the DiT with `uses` baked in (their strength_model; a LoraLoaderModelOnly
    chain's whole effect on the DiT)."""
    import shutil
    from models.packs.pack import build_pack
    from models.runtime.dit_runner import DiTRunner
    shutil.rmtree(out, ignore_errors=True)
    return DiTRunner(build_pack(dit_path, out, size, "fp32", loras=list(uses)), threads=threads)


def make_loras(paths, loras_dir: Path) -> None:
    """The cases' synthetic LoRAs for these model files (their own key lists), into MODELS/loras/."""
    from models.dit.checkpoint import strip_prefix
    from models.lora.synth import write_lora
    dit, te = SafeTensorsFile(paths.dit), SafeTensorsFile(paths.text_encoder)
    shapes = ({strip_prefix(k): dit.shape(k) for k in dit.keys()}, {k: te.shape(k) for k in te.keys()})
    loras_dir.mkdir(parents=True, exist_ok=True)
    for name, (layout, seed, rank, alpha, groups) in LORAS.items():
        write_lora(shapes, seed, loras_dir / name, layout, rank, alpha, groups)


def comfy_graph(files: dict, chain: list, prompt: str, negative: str, seed: int, steps: int, cfg: float,
                sampler: str, scheduler: str, width: int, height: int, prefix: str) -> dict:
    """ComfyUI's standard Anima text-to-image graph with the chain's LoRA loaders between the loaders and their
    users, plus a SaveLatent of the KSampler's output."""
    g = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": files["dit"], "weight_dtype": "default"}},
         "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": files["text_encoder"], "type": "stable_diffusion"}},
         "3": {"class_type": "VAELoader", "inputs": {"vae_name": files["vae"]}}}
    model, clip = ["1", 0], ["2", 0]
    for i, (name, node, sm, sc) in enumerate(chain):
        nid = str(20 + i)
        if node == "LoraLoader":
            g[nid] = {"class_type": node, "inputs": {"model": model, "clip": clip, "lora_name": name,
                                                     "strength_model": sm, "strength_clip": sc}}
            model, clip = [nid, 0], [nid, 1]
        else:
            g[nid] = {"class_type": node, "inputs": {"model": model, "lora_name": name, "strength_model": sm}}
            model = [nid, 0]
    g.update({
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": clip}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"text": negative, "clip": clip}},
        "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": width, "height": height, "batch_size": 1}},
        "7": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": model, "shift": 3.0}},
        "8": {"class_type": "KSampler", "inputs": {"model": ["7", 0], "positive": ["4", 0], "negative": ["5", 0],
                                                   "latent_image": ["6", 0], "seed": seed, "steps": steps, "cfg": cfg,
                                                   "sampler_name": sampler, "scheduler": scheduler, "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["3", 0]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}},
        "11": {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": "latents/" + prefix}}})
    return g


def uses_of(chain: list, loras_dir: Path) -> list:
    """A ComfyUI chain as this project's LoRA list: LoraLoaderModelOnly leaves the text encoder alone (strength 0)."""
    return [LoraUse(str(loras_dir / name), sm, sc if node == "LoraLoader" else 0.0, name) for name, node, sm, sc in chain]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/lora_comfy_reference.py", description=__doc__.split("\n")[0])
    p.add_argument("--comfyui", required=True, help="URL of a running ComfyUI on loopback, e.g. http://127.0.0.1:8191")
    p.add_argument("--pack", required=True, help="this project's LoRA-ready pack of the same DiT at --size")
    add_model_arguments(p)
    p.add_argument("--make-loras", action="store_true", help="write the cases' synthetic LoRAs into MODELS/loras/")
    p.add_argument("--case", action="append", default=None, choices=sorted(CASES), help="repeatable; default all")
    p.add_argument("--prompt", default="1girl, silver hair, blue eyes, (masterpiece:1.2)")
    p.add_argument("--negative", default="worst quality, low quality")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--sampler", default="euler")
    p.add_argument("--scheduler", default="simple")
    p.add_argument("--size", default="256x256", help="WIDTHxHEIGHT (the pack's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one ComfyUI job may take")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    p.add_argument("--record", default=None, help="write the test record (.npz)")
    p.add_argument("--baked", action="store_true", help="this project's DiT side from a pack per case with the "
                   "case's LoRAs baked in (FP32, `anima-models pack --lora`), not from --pack's run-time inputs")
    a = p.parse_args(argv)
    width, height = (int(v) for v in a.size.lower().split("x"))
    client = ComfyClient(a.comfyui, a.timeout)
    stats = client.check()
    paths = paths_from_args(a)
    loras_dir = Path(a.models) / "loras"
    if a.make_loras:
        make_loras(paths, loras_dir)
    files = {"dit": paths.dit.name, "text_encoder": paths.text_encoder.name, "vae": paths.vae.name}

    from models.dit.config import expected_dit_shapes
    from models.runtime.dit_runner import DiTRunner
    from models.sampling.sampler import Sampler
    from models.text.conditioning import TextEncoder
    from models.vae.api import VAE
    enc = TextEncoder.from_files(str(paths.text_encoder), str(paths.dit), str(paths.qwen_tokenizer),
                                 str(paths.t5_tokenizer), threads=a.threads)
    runner = DiTRunner(a.pack, threads=a.threads)
    dit_table = TargetTable(expected_dit_shapes(runner.cfg))
    vae = VAE.open(paths.vae, threads=a.threads)
    shape = (16, height // 8, width // 8)
    rows, rec = [], {}
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"lora_comfy_reference_{os.getpid()}.latent"
    for case in a.case or list(CASES):
        chain = CASES[case]
        prefix = f"anima_lora_{case}_{a.seed}"
        t0 = time.monotonic()
        out = client.run(comfy_graph(files, chain, a.prompt, a.negative, a.seed, a.steps, a.cfg, a.sampler,
                                     a.scheduler, width, height, prefix))
        comfy_s = time.monotonic() - t0
        z_ref = comfy_latent(client.view(out["11"]["latents"][0]), tmp)
        img_ref = png_pixels(client.view(out["10"]["images"][0]))
        t0 = time.monotonic()
        uses = uses_of(chain, loras_dir)
        enc.set_lora(plan_text_loras(uses, enc))
        cond, uncond = enc.encode_pair(a.prompt, a.negative)
        dit = baked_runner(paths.dit, uses, (width, height), a.threads, tmp.with_suffix(f".{case}")) if a.baked \
            else runner
        if not a.baked:
            runner.set_lora(plan_loras(uses, dit_table) if uses else None)
        s = Sampler(steps=a.steps, cfg=a.cfg, scheduler=a.scheduler, spectrum=None)
        z = s.sample(lambda x, sigma: dit.forward_cfg(x, sigma, cond, uncond), latent=comfy_noise(a.seed, shape)).latent
        if dit is not runner:
            dit.close()
        img = vae.decode(z, tile=None).image
        ours_s = time.monotonic() - t0
        diff = np.abs(img.astype(int) - img_ref.astype(int))
        row = {"case": case, "chain": [list(c) for c in chain], "latent_cos": cosine(z, z_ref),
               "latent_max_abs": float(np.abs(z - z_ref).max()), "pixel_max_diff": int(diff.max()),
               "pixels_off_by_more_than_1": int((diff > 1).sum()), "comfyui_s": round(comfy_s, 1),
               "project_s": round(ours_s, 1)}
        rows.append(row)
        rec[f"comfyui/{case}"] = z_ref
        for name, c in (("cond", cond), ("uncond", uncond)):
            rec[f"{name}/{case}"] = c[:int(np.abs(c).sum(1).nonzero()[0].max()) + 1]
        print(f"{case:12s} cos {row['latent_cos']:.9f}  max|dz| {row['latent_max_abs']:.2e}  max|dpixel| "
              f"{row['pixel_max_diff']:3d} ({row['pixels_off_by_more_than_1']} px > 1)  comfy {comfy_s:.0f} s, here "
              f"{ours_s:.0f} s", flush=True)
    tmp.unlink(missing_ok=True)
    enc.close()
    runner.close()
    job = {"prompt": a.prompt, "negative": a.negative, "seed": a.seed, "steps": a.steps, "cfg": a.cfg,
           "sampler": a.sampler, "scheduler": a.scheduler, "size": [width, height], "files": files,
           "loras": {k: list(v) for k, v in LORAS.items()}, "cases": {k: [list(c) for c in v] for k, v in CASES.items()}}
    if a.record:
        dit = SafeTensorsFile(paths.dit)
        from models.dit.checkpoint import strip_prefix
        job["dit_shapes"] = {strip_prefix(k): list(dit.shape(k)) for k in dit.keys()
                             if not strip_prefix(k).startswith("llm_adapter.")}
        rec["job"] = np.array(json.dumps(job))
        Path(a.record).parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(a.record, **rec)
        print(f"wrote test record {a.record}")
    if a.out:
        outp = Path(a.out)
        outp.parent.mkdir(parents=True, exist_ok=True)
        outp.write_text(json.dumps({"job": job, "comfyui": {"url": a.comfyui, "system": stats.get("system", {})},
                                    "rows": rows}, indent=1))
        print(f"wrote {outp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
