"""This project's job vs a running ComfyUI on the same model files: final latent cosine and pixel difference.

You run ComfyUI yourself (this script never starts, installs or builds it), on loopback, on the CPU, in float32,
with its models folder holding the same files as --models (diffusion_models/, text_encoders/, vae/), e.g.
    python main.py --listen 127.0.0.1 --port 8190 --cpu --force-fp32 --fp32-text-enc --fp32-vae --fp32-unet \\
        --deterministic --models-directory MODELS
and then
    .venv/bin/python bench/comfy_reference.py --comfyui http://127.0.0.1:8190 --models MODELS --pack PACK \\
        --combo euler/simple --combo er_sde/beta --out bench/out/comfy_reference.json
(add `--step-cache easycache --steps 14` for both sides with ComfyUI's EasyCache node, `--cfg 1` for one pass per call;
`--workflow all --extra-pack PACK384` sends every graph of bench/comfy_workflows.py's WORKFLOWS (--help names
them) unchanged to ComfyUI and to this project's HTTP front and compares every output node's PNGs; the last line is
`comfy_workflows images=N within_1=N worst=D`; with `--record FILE` ComfyUI's side also saves each graph's final
latent into FILE, a batch's as [B, 16, h, w])
For each sampler/scheduler combo it submits ComfyUI's API graph (UNETLoader, CLIPLoader, VAELoader, CLIPTextEncode
x2, EmptySD3LatentImage, ModelSamplingAuraFlow shift 3, KSampler, VAEDecode, SaveImage, SaveLatent), fetches the
latent and the PNG, computes the same job here in-process (the text encoder on torch, the DiT through the pack on
ONNX Runtime, the sampler, the VAE decoder) and prints one row per combo: the final latent's cosine and max
difference (model space) and the PNGs' max pixel difference; --out writes them as JSON. Every row is computed by the
pipeline's sampler (models.sampling.sampler.Sampler, what the scheduler stage runs); `euler` rows also by models.sampling.k_sampling in
ComfyUI's denoised form (the pipeline's Euler keeps its velocity form). The tokenizers must be ComfyUI's own
(its comfy/text_encoders/qwen25_tokenizer and t5_tokenizer/tokenizer.json) for the token ids to agree: point
--qwen-tokenizer / --t5-tokenizer at them, or copy them into the models folder's tokenizers/qwen and tokenizers/t5.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.sampling.k_sampling import SAMPLERS, cfg_denoised, ksampler_sigmas, new_ksampler  # noqa: E402
from models.sampling.denoise import model_call  # noqa: E402
from models.sampling.sampler import Sampler  # noqa: E402
from models.sampling.step_cache import CacheSettings  # noqa: E402
from models.setup.models_dir import add_model_arguments, paths_from_args  # noqa: E402
from models.sampling.noise import comfy_noise  # noqa: E402
from models.base.safetensors_io import SafeTensorsFile  # noqa: E402
from models.vae.latent import LATENT_MEAN, LATENT_STD  # noqa: E402


class ComfyError(RuntimeError):
    pass


def comfy_graph(files: dict, prompt: str, negative: str, seed: int, steps: int, cfg: float, sampler: str,
                scheduler: str, width: int, height: int, prefix: str, cache=None) -> dict:
    """ComfyUI's standard Anima text-to-image graph (bench/comfy_workflows.py txt2img) plus a SaveLatent of the
    KSampler's output; `cache` (a CacheSettings) puts its EasyCache or LazyCache node between ModelSamplingAuraFlow
    and the KSampler."""
    from bench.comfy_workflows import txt2img
    node = None if cache is None else {"node": cache.node, "reuse": cache.reuse_threshold,
                                       "start": cache.start_percent, "end": cache.end_percent}
    graph = txt2img(files, seed, width, height, steps=steps, cfg=cfg, sampler=sampler, scheduler=scheduler,
                    cache=node, prompt=prompt, negative=negative, prefix=prefix)
    graph["11"] = {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": "latents/" + prefix}}
    return graph


class ComfyClient:
    """The few ComfyUI HTTP endpoints this needs; loopback addresses only."""

    def __init__(self, url: str, timeout_s: float):
        host = urllib.parse.urlparse(url).hostname or ""
        if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
            raise SystemExit(f"--comfyui {url}: only a ComfyUI on this machine's loopback is used")
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return r.read()

    def check(self) -> dict:
        try:
            return json.loads(self.get("/system_stats"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise SystemExit(f"--comfyui {self.url}: no ComfyUI answers there ({e}); start it first") from None

    def run(self, graph: dict) -> dict:
        body = json.dumps({"prompt": graph, "client_id": uuid.uuid4().hex}).encode()
        req = urllib.request.Request(self.url + "/prompt", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                pid = json.loads(r.read())["prompt_id"]
        except urllib.error.HTTPError as e:
            raise ComfyError(f"ComfyUI refused the graph: {e.read().decode(errors='replace')[:800]}") from None
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout_s:
            hist = json.loads(self.get(f"/history/{pid}"))
            if pid in hist:
                h = hist[pid]
                if h.get("status", {}).get("status_str") != "success":
                    raise ComfyError(f"ComfyUI job failed: {json.dumps(h.get('status'))[:800]}")
                return h["outputs"]
            time.sleep(1.0)
        raise ComfyError(f"ComfyUI job {pid} did not finish in {self.timeout_s:.0f} s")

    def view(self, item: dict) -> bytes:
        q = urllib.parse.urlencode({k: item[k] for k in ("filename", "subfolder", "type")})
        return self.get("/view?" + q)

    def upload(self, name: str, data: bytes) -> dict:
        """POST /upload/image (multipart: image, overwrite) -> {name, subfolder, type}."""
        boundary = uuid.uuid4().hex
        body = (f'--{boundary}\r\nContent-Disposition: form-data; name="overwrite"\r\n\r\ntrue\r\n'
                f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n'
                f'Content-Type: image/png\r\n\r\n').encode() + data + f"\r\n--{boundary}--\r\n".encode()
        req = urllib.request.Request(self.url + "/upload/image", data=body,
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def images(self, outputs: dict) -> dict:
        """Every output node's PNGs of a finished graph (each SaveImage's, not only the last), as RGB arrays:
        {node id: [image per batch position]}, in node-id order."""
        order = sorted(outputs, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
        return {nid: [png_pixels(self.view(item)) for item in outputs[nid]["images"]] for nid in order
                if outputs[nid].get("images")}      # a SaveLatent (--record) has none


def comfy_latent(raw: bytes, tmp: Path) -> np.ndarray:
    """A SaveLatent file (safetensors, 'latent_tensor' [B, 16, 1, h, w] in VAE space) -> model space [16, h, w]
    (a batch of B > 1: [B, 16, h, w])."""
    tmp.write_bytes(raw)
    st = SafeTensorsFile(tmp)
    z = st.get("latent_tensor").reshape(-1, 16, *st.shape("latent_tensor")[-2:])
    mean = np.asarray(LATENT_MEAN, np.float32)[:, None, None]
    std = np.asarray(LATENT_STD, np.float32)[:, None, None]
    out = ((z - mean) / std).astype(np.float32)
    return out[0] if len(out) == 1 else out


def png_pixels(raw: bytes) -> np.ndarray:
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def project_latent(runner, cond, uncond, seed: int, steps: int, cfg: float, sampler: str, scheduler: str,
                   shape: tuple, today: bool, cache=None) -> tuple:
    """(final latent [16, h, w], model passes) of this project's job in-process (a step cache's reused calls and cfg
    1's missing unconditional pass make none)."""
    noise = comfy_noise(seed, shape)
    if today:
        s = Sampler(steps=steps, cfg=cfg, scheduler=scheduler, spectrum=None, sampler=sampler, cache=cache)
        st = s.sample(lambda x, sigma: model_call(runner, s, x, sigma, cond, uncond), latent=noise, seed=seed)
        return s.result(st), s.passes * sum(st.nfe)
    ks = new_ksampler(sampler, ksampler_sigmas(sampler, scheduler, steps), seed=seed, shape=shape)
    calls = [0]

    def model(x, sigma):
        calls[0] += 2
        v_c, v_u = runner.forward_cfg(x, sigma, cond, uncond)
        return cfg_denoised(x, sigma, v_c, v_u, cfg)
    return ks.sample(model, noise), calls[0]


def run_workflows(a, client: ComfyClient, files: dict, width: int, height: int) -> list:
    """Each --workflow's graph, unchanged, on ComfyUI and on this project's HTTP front (--front, or a supervisord
    pipeline started here on --pack and --extra-pack): one row per image, the PNGs' pixel difference."""
    from bench.comfy_workflows import WORKFLOWS, input_images
    names = list(WORKFLOWS) if "all" in a.workflow else a.workflow
    pipe = None
    if a.front:
        front = ComfyClient(a.front, a.timeout)
    else:
        from tests.pipeline_harness import Pipeline
        if not a.models:
            raise SystemExit("--workflow without --front starts a pipeline on a models folder: give --models")
        extra = tuple(str(Path(x).resolve()) for x in a.extra_pack)
        pipe = Pipeline.start(Path(a.models).resolve(), Path(a.pack).resolve(), packs=extra, threads=a.threads or 2,
                              branch_timeout_s=600.0, start_timeout_s=600.0)    # a stage's start on a loaded host
        front = ComfyClient(pipe.http_url(), a.timeout)
    rows, latents = [], {}
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"comfy_reference_{os.getpid()}.latent"
    try:
        front.check()
        for name, data in input_images(width, height).items():
            for side in (client, front):
                got = side.upload(name, data)
                if got.get("name") != name:
                    raise SystemExit(f"{side.url} stored the upload {name} as {got}: the graphs name it {name}")
        for name in names:
            what, build = WORKFLOWS[name]
            graph = build(files, a.seed, width, height)
            t0 = time.monotonic()
            ref_out = client.run(_saving_latent(graph) if a.record else graph)
            ref = client.images(ref_out)
            comfy_s = time.monotonic() - t0
            if a.record:
                latents[f"comfyui_workflow/{name}"] = comfy_latent(client.view(ref_out["99"]["latents"][0]), tmp)
            t0 = time.monotonic()
            ours = front.images(front.run(graph))
            ours_s = time.monotonic() - t0
            counts = ({k: len(v) for k, v in ref.items()}, {k: len(v) for k, v in ours.items()})
            if counts[0] != counts[1]:
                raise SystemExit(f"{name}: ComfyUI's images per output node {counts[0]}, this front's {counts[1]}")
            pairs = [(nid, i, img, ref[nid][i]) for nid in ref for i, img in enumerate(ours[nid])]
            for nid, i, img, img_ref in pairs:
                same_size = img.shape == img_ref.shape
                d = np.abs(img.astype(int) - img_ref.astype(int)) if same_size else None
                row = {"workflow": name, "what": what, "node": nid, "image": i, "size": list(img.shape[1::-1]),
                       "comfyui_size": list(img_ref.shape[1::-1]),
                       "pixel_max_diff": int(d.max()) if same_size else None,
                       "pixels_off_by_more_than_1": int((d > 1).sum()) if same_size else None,
                       "pixel_mean_abs_diff": round(float(d.mean()), 4) if same_size else None,
                       "comfyui_s": round(comfy_s, 1), "project_s": round(ours_s, 1)}
                rows.append(row)
                verdict = ("sizes differ" if not same_size else
                           "within 1" if row["pixel_max_diff"] <= 1 else "DIFFERENT")
                print(f"{name:17s} node {nid:>3s} image {i}  {row['size'][0]}x{row['size'][1]}  max|dpixel| "
                      f"{row['pixel_max_diff']}  ({row['pixels_off_by_more_than_1']} px > 1, mean "
                      f"{row['pixel_mean_abs_diff']})  {verdict}  comfy {comfy_s:.0f} s, front {ours_s:.0f} s",
                      flush=True)
    finally:
        tmp.unlink(missing_ok=True)
        if pipe is not None:
            pipe.stop()
    if a.record:
        job = {"seed": a.seed, "size": [width, height], "files": files, "workflows": names}
        np.savez_compressed(a.record, job=np.array(json.dumps(job)), **latents)
        print(f"wrote test record {a.record}")
    return rows


def _saving_latent(graph: dict) -> dict:
    """The graph with a SaveLatent "99" of the LATENT its VAEDecode "9" decodes (an output of its own: the image
    is the graph's as it is)."""
    samples = graph["9"]["inputs"]["samples"]
    return {**graph, "99": {"class_type": "SaveLatent", "inputs": {"samples": samples,
                                                                    "filename_prefix": "latents/anima_ref_wf"}}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/comfy_reference.py", description=__doc__.split("\n")[0],
                                epilog="ComfyUI is not started, installed or built by this script: run it yourself "
                                       "(see the module docstring for the flags that make it comparable).")
    p.add_argument("--comfyui", required=True, help="URL of a running ComfyUI on loopback, e.g. http://127.0.0.1:8190")
    p.add_argument("--pack", required=True, help="this project's model pack of the same DiT at --size")
    add_model_arguments(p)
    p.add_argument("--combo", action="append", default=None, metavar="SAMPLER/SCHEDULER",
                   help="repeatable; default euler/simple and euler/sgm_uniform")
    p.add_argument("--prompt", default="1girl, silver hair, blue eyes, (masterpiece:1.2)")
    p.add_argument("--negative", default="worst quality, low quality")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--size", default="256x256", help="WIDTHxHEIGHT (the pack's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one ComfyUI job may take")
    p.add_argument("--out", default=None, help="JSON file for the rows (and the latents as .npz next to it)")
    p.add_argument("--record", default=None, help="write a test record (.npz): ComfyUI's final latents, the job's "
                   "settings and its conditioning rows, what tests/test_samplers_comfy_model.py checks against; "
                   "with --workflow: each graph's final latent on ComfyUI (a SaveLatent added there)")
    p.add_argument("--step-cache", choices=("easycache", "lazycache"), default=None,
                   help="both sides with ComfyUI's EasyCache or LazyCache node (its default percents)")
    p.add_argument("--reuse-threshold", type=float, default=0.2, help="the cache node's reuse_threshold")
    from bench.comfy_workflows import WORKFLOWS
    p.add_argument("--workflow", action="append", default=None, metavar="NAME",
                   help="repeatable, or 'all': send bench/comfy_workflows.py's graph NAME unchanged to ComfyUI and to "
                        f"this project's HTTP front and compare the images ({', '.join(WORKFLOWS)})")
    p.add_argument("--front", default=None, help="--workflow: URL of this project's running HTTP front on loopback; "
                   "default: a supervisord pipeline started here on --pack (and --extra-pack), stopped at the end")
    p.add_argument("--extra-pack", action="append", default=[], metavar="PACK",
                   help="--workflow: another pack for the started pipeline (the hires fix's 384x384 pass)")
    a = p.parse_args(argv)
    cache = None if a.step_cache is None else CacheSettings(kind=a.step_cache, reuse_threshold=a.reuse_threshold)

    if a.workflow:
        bad = [w for w in a.workflow if w != "all" and w not in WORKFLOWS]
        if bad:
            raise SystemExit(f"--workflow {bad[0]}: expected 'all' or one of {list(WORKFLOWS)}")
        width, height = (int(v) for v in a.size.lower().split("x"))
        client = ComfyClient(a.comfyui, a.timeout)
        stats = client.check()
        paths = paths_from_args(a)
        files = {"dit": paths.dit.name, "text_encoder": paths.text_encoder.name, "vae": paths.vae.name}
        rows = run_workflows(a, client, files, width, height)
        if a.out:
            outp = Path(a.out)
            outp.parent.mkdir(parents=True, exist_ok=True)
            outp.write_text(json.dumps({"job": {"seed": a.seed, "size": [width, height], "files": files,
                                                "pack": a.pack, "extra_packs": a.extra_pack,
                                                "comfyui": {"url": a.comfyui, "system": stats.get("system", {})}},
                                        "rows": rows}, indent=1))
            print(f"wrote {outp}")
        off = [r for r in rows if r["pixel_max_diff"] is None or r["pixel_max_diff"] > 1]
        print(f"comfy_workflows images={len(rows)} within_1={len(rows) - len(off)} "
              f"worst={max((r['pixel_max_diff'] or 0) for r in rows) if rows else 0}")
        return 1 if off else 0

    combos = [c.split("/", 1) for c in (a.combo or ["euler/simple", "euler/sgm_uniform"])]
    for c in combos:
        if len(c) != 2 or c[0] not in SAMPLERS:
            raise SystemExit(f"--combo {'/'.join(c)}: expected SAMPLER/SCHEDULER with SAMPLER one of {list(SAMPLERS)}")
        ksampler_sigmas(c[0], c[1], a.steps)                   # an unknown scheduler fails here, naming the ones there are
    width, height = (int(v) for v in a.size.lower().split("x"))
    client = ComfyClient(a.comfyui, a.timeout)
    stats = client.check()
    paths = paths_from_args(a)
    files = {"dit": paths.dit.name, "text_encoder": paths.text_encoder.name, "vae": paths.vae.name}

    from models.runtime.dit_runner import DiTRunner
    from models.text.conditioning import TextEncoder
    from models.vae.api import VAE
    enc = TextEncoder.from_files(str(paths.text_encoder), str(paths.dit), str(paths.qwen_tokenizer),
                                 str(paths.t5_tokenizer), threads=a.threads)
    cond, uncond = enc.encode_pair(a.prompt, a.negative)
    enc.close()
    runner = DiTRunner(a.pack, threads=a.threads)
    vae = VAE.open(paths.vae, threads=a.threads)
    shape = (16, height // 8, width // 8)

    rows, latents = [], {}
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"comfy_reference_{os.getpid()}.latent"
    for sampler, scheduler in combos:
        prefix = f"anima_ref_{sampler}_{scheduler}_{a.seed}"
        t0 = time.monotonic()
        out = client.run(comfy_graph(files, a.prompt, a.negative, a.seed, a.steps, a.cfg, sampler, scheduler,
                                     width, height, prefix, cache))
        comfy_s = time.monotonic() - t0
        z_ref = comfy_latent(client.view(out["11"]["latents"][0]), tmp)
        img_ref = png_pixels(client.view(out["10"]["images"][0]))
        for today in ((True, False) if sampler == "euler" and cache is None else (True,)):
            t0 = time.monotonic()
            z, calls = project_latent(runner, cond, uncond, a.seed, a.steps, a.cfg, sampler, scheduler, shape, today,
                                      cache)
            ours_s = time.monotonic() - t0
            img = vae.decode(z, tile=None).image
            row = {"sampler": sampler, "scheduler": scheduler, "project": "pipeline sampler" if today else "k_sampling",
                   "latent_cos": cosine(z, z_ref), "latent_max_abs": float(np.abs(z - z_ref).max()),
                   "pixel_max_diff": int(np.abs(img.astype(int) - img_ref.astype(int)).max()),
                   "pixels_off_by_more_than_1": int((np.abs(img.astype(int) - img_ref.astype(int)) > 1).sum()),
                   "model_calls": calls, "comfyui_s": round(comfy_s, 1), "project_s": round(ours_s, 1)}
            rows.append(row)
            latents[f"{sampler}/{scheduler}/{row['project']}"] = z
            print(f"{sampler:16s} {scheduler:16s} {row['project']:16s} cos {row['latent_cos']:.9f}  "
                  f"max|dz| {row['latent_max_abs']:.2e}  max|dpixel| {row['pixel_max_diff']:3d}  "
                  f"({row['pixels_off_by_more_than_1']} px > 1)  calls {calls}  "
                  f"comfy {comfy_s:.0f} s, here {ours_s:.0f} s", flush=True)
        latents[f"{sampler}/{scheduler}/comfyui"] = z_ref
    tmp.unlink(missing_ok=True)
    runner.close()
    if a.record:
        rec = {"cond": cond[:int(np.abs(cond).sum(1).nonzero()[0].max()) + 1],
               "uncond": uncond[:int(np.abs(uncond).sum(1).nonzero()[0].max()) + 1],
               "job": np.array(json.dumps({"seed": a.seed, "steps": a.steps, "cfg": a.cfg, "size": [width, height],
                                           "prompt": a.prompt, "negative": a.negative, "files": files,
                                           "cache": None if cache is None else cache.to_dict()}))}
        rec.update({f"comfyui/{k.split('/')[0]}/{k.split('/')[1]}": v for k, v in latents.items()
                    if k.endswith("/comfyui")})
        np.savez_compressed(a.record, **rec)
        print(f"wrote test record {a.record}")
    if a.out:
        outp = Path(a.out)
        outp.parent.mkdir(parents=True, exist_ok=True)
        job = {"prompt": a.prompt, "negative": a.negative, "seed": a.seed, "steps": a.steps, "cfg": a.cfg,
               "size": [width, height], "files": files, "pack": a.pack,
               "comfyui": {"url": a.comfyui, "system": stats.get("system", {})}}
        outp.write_text(json.dumps({"job": job, "rows": rows}, indent=1))
        np.savez_compressed(outp.with_suffix(".npz"), **latents)
        print(f"wrote {outp} and {outp.with_suffix('.npz')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
