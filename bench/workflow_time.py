"""Board time of each workflow (MODELLED): text-to-image, img2img / inpaint at a denoise as ComfyUI and as A1111
count its steps, and a hires pass (latent and pixel), for the samplers people run.

    .venv/bin/python bench/workflow_time.py [--board-ram 8] [--json bench/out/workflow-time.json]

Nothing here ran on a board. Every figure comes from the board model (models/board: the reference board's and the
peers' figures, docs/board-figures.md) and the two VAE ESTIMATES (models/vae/npu_estimate.py):
- the model calls of a pass are the real sampler's (models.sampling.img2img.LatentSampler over the plan the job
  would run: ComfyUI's denoise sigmas or A1111's img2img count; Spectrum's computed steps from its own rule;
  a two-call sampler's steps counted as its calls), priced by `auto` at that size (board_auto.choose_pack:
  the sharded packs weighed, the size's activation memory checked), CFG 2 passes a call;
- the encoder is the cost table's estimate (39 s); the NPU VAE decode the cost table's 512x512 estimate scaled by
  the pixels (models/board/account.job_figures); the NPU VAE encode (img2img's VAE_ENCODE, a hires pixel pass)
  `encode_estimate` at the default tiling.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.board import auto as board_auto  # noqa: E402
from models.board.account import job_figures  # noqa: E402
from models.board.cost import LABEL, BoardModel, Shape  # noqa: E402
from models.base.durable import atomic_write  # noqa: E402
from models.packs.memory_fit import for_auto  # noqa: E402
from models.sampling import spectrum as sp  # noqa: E402
from models.sampling.img2img import LatentPlan, LatentSampler  # noqa: E402
from models.vae.npu_estimate import encode_estimate  # noqa: E402
from models.vae.synth import VAE_PRESETS  # noqa: E402

OUT = ROOT / "bench" / "out" / "workflow-time.json"
SAMPLERS = (("euler", "sgm_uniform", 20, True), ("euler", "sgm_uniform", 20, False), ("er_sde", "beta", 30, False),
            ("heun", "sgm_uniform", 20, False))
BASE, HIRES = (512, 512), (768, 768)        # a hires pass 512x512 -> 768x768 (LatentUpscaleBy 1.5)


@dataclass(frozen=True)
class Workflow:
    name: str
    size: tuple = BASE                      # the first pass
    denoise: float = 1.0                    # the first pass from an image (None: text-to-image)
    counting: str = "comfyui"
    image: bool = False
    hires: str | None = None                # "latent" | "pixel": a second pass at HIRES
    hires_steps: int = 0                    # 0: the job's
    hires_denoise: float = 0.5


WORKFLOWS = (
    Workflow("text-to-image 512x512"),
    Workflow("img2img / inpaint 512x512, denoise 0.6, ComfyUI's count (KSampler, prompt.json)", denoise=0.6, image=True),
    Workflow("img2img / inpaint 512x512, denoise 0.6, A1111's count (/sdapi/v1/img2img)", denoise=0.6,
             counting="a1111", image=True),
    Workflow("img2img / inpaint 512x512, denoise 0.3, A1111's count", denoise=0.3, counting="a1111", image=True),
    Workflow("hires 512x512 -> 768x768 latent, second pass the job's steps, denoise 0.5", hires="latent"),
    Workflow("hires 512x512 -> 768x768 latent, second pass 10 steps, denoise 0.5", hires="latent", hires_steps=10),
    Workflow("hires 512x512 -> 768x768 pixel (decode, ImageScale, encode), job's steps, 0.5", hires="pixel"),
    Workflow("img2img 1024x1024, denoise 0.6, A1111's count", size=(1024, 1024), denoise=0.6, counting="a1111",
             image=True),
)


def model_calls(sampler: str, scheduler: str, steps: int, spectrum: bool, denoise: float = 1.0,
                counting: str = "comfyui") -> int:
    """The model calls one pass makes: the sampler's steps over the plan, Spectrum's computed ones where it is on."""
    s = LatentSampler(steps=steps, cfg=4.0, sampler=sampler, scheduler=scheduler, spectrum=None,
                      plan=LatentPlan(denoise=denoise, denoise_steps=counting))
    if spectrum:
        return len(sp.plan(sp.SpectrumSettings(), s.steps)[0])
    return sum(s.nfe(i) for i in range(s.steps))


class Prices:
    """The modelled seconds of a pass's calls at a size, and the VAE's, cached per size."""

    def __init__(self, ram: int):
        self.ram, self._models, self._denoise = ram, {}, {}

    def model(self, size) -> BoardModel:
        if size not in self._models:
            self._models[size] = BoardModel(Shape.at_resolution(*size))
        return self._models[size]

    def denoise_s(self, size, calls: int) -> tuple:
        """(seconds, the policy auto picks) for `calls` model calls at `size` (CFG: 2 passes a call)."""
        if (size, calls) not in self._denoise:          # auto weighs every pack and policy: seconds a size
            m = self.model(size)
            n, cuts, e = board_auto.choose_pack(m, m.context_budget_mib(self.ram), memory=for_auto(size),
                                                computed_steps=calls, passes=2)
            self._denoise[size, calls] = e.denoise_s, e.policy.name
        return self._denoise[size, calls]

    def decode_s(self, size) -> float:
        return job_figures(self.model(size))["decode_npu_s"]

    @staticmethod
    def encode_s(size) -> float:
        return encode_estimate(VAE_PRESETS["full"], *size)["total_s"]


def price(w: Workflow, sampler: tuple, prices: Prices) -> dict:
    name, scheduler, steps, spectrum = sampler
    parts = {"encoder": job_figures(prices.model(w.size))["encode_s"]}
    if w.image:
        parts["vae encode"] = prices.encode_s(w.size)
    calls = [model_calls(name, scheduler, steps, spectrum, w.denoise, w.counting)]
    parts["denoise"], policy = prices.denoise_s(w.size, calls[0])
    out_size = w.size
    if w.hires:
        if w.hires == "pixel":
            parts["vae decode (first pass)"] = prices.decode_s(w.size)
            parts["vae encode (second size)"] = prices.encode_s(HIRES)
        calls.append(model_calls(name, scheduler, w.hires_steps or steps, spectrum, w.hires_denoise))
        parts["denoise (second pass)"], policy2 = prices.denoise_s(HIRES, calls[1])
        policy += f" / {policy2}"
        out_size = HIRES
    parts["vae decode"] = prices.decode_s(out_size)
    return {"workflow": w.name, "sampler": f"{name}/{scheduler}", "steps": steps, "spectrum": spectrum,
            "model_calls": calls, "parts_s": {k: round(v, 2) for k, v in parts.items()},
            "job_s": round(sum(parts.values()), 1), "policy": policy}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--board-ram", type=int, default=8, choices=(8, 16, 32))
    ap.add_argument("--json", default=str(OUT))
    args = ap.parse_args(argv)
    prices, rows = Prices(args.board_ram), []
    print(f"{'workflow':<86} {'sampler':<18} {'steps':>5} {'Spectrum':>8} {'calls':>8} {'job s':>8}  "
          f"[{LABEL}, {args.board_ram} GB board, auto; VAE encode/decode ESTIMATES]")
    for w in WORKFLOWS:
        for s in SAMPLERS:
            r = price(w, s, prices)
            rows.append(r)
            calls = "+".join(str(c) for c in r["model_calls"])
            print(f"{w.name:<86} {r['sampler']:<18} {r['steps']:>5} {'on' if r['spectrum'] else 'off':>8} "
                  f"{calls:>8} {r['job_s']:>8.1f}  [{LABEL}]")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, (json.dumps({"modelled": True, "board_ram_gb": args.board_ram, "rows": rows}, indent=1)
                       + "\n").encode())
    print(f"json: {out}  [{LABEL}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
