"""bench/chaos.py's job kinds: the prompt of each (txt2img, img2img, latent and pixel hires, batch, split), img2img's init
image, a job's results compared bitwise, and the branch calls the executor served for a job (its trace file).

    prompt = job_prompt("hires_pixel", base)            # a second pass at HIRES_SCALE on the hires_size() pack
    differing(job_outputs(job_dir), baseline_outputs)   # [] when every latent and image is bitwise the reference
    served = TraceCount(trace_path, job, trace_size(trace_path)); served() -> calls so far
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

JOB_KINDS = ("txt2img", "img2img", "hires_latent", "hires_pixel", "batch", "split")
PACK_SIZE = (128, 128)
HIRES_SCALE = 1.25           # 128 -> 160: the hires kinds' second pass on a pack of its own
INIT_IMAGE = ("chaos", "init.png")          # img2img's upload (RUN/input/chaos/init.png)


def job_prompt(kind: str, base: dict, hires_scale: float = HIRES_SCALE) -> dict:
    """The prompt.json of a job kind, from the txt2img one."""
    if kind == "txt2img":
        return dict(base)
    if kind == "img2img":
        return {**base, "init_image": f"{INIT_IMAGE[0]}/{INIT_IMAGE[1]} [input]", "resize_mode": 1, "denoise": 0.6}
    if kind in ("hires_latent", "hires_pixel"):
        space = kind.removeprefix("hires_")
        return {**base, "hires": {"scale": hires_scale, "space": space, "denoise": 0.5,
                                  "method": "bislerp" if space == "latent" else "lanczos"}}
    if kind == "batch":
        return {**base, "batch": 2}
    if kind == "split":             # split sampling: the first half with its leftover noise, the second chained on it
        steps = base.get("steps") or 30
        half = max(1, steps // 2)
        return {**base, "end_step": half, "leftover_noise": True,
                "hires": {"steps": steps, "denoise": 1.0, "start_step": half, "add_noise": False, "cfg": 1.5}}
    raise ValueError(f"job kind {kind!r}: choose one of {', '.join(JOB_KINDS)}")


def hires_size(scale: float = HIRES_SCALE) -> tuple[int, int]:
    """The hires kinds' second-pass pack size (width, height) for a first pass on PACK_SIZE."""
    return int(PACK_SIZE[0] * scale), int(PACK_SIZE[1] * scale)


def init_png(size: tuple[int, int] = PACK_SIZE) -> bytes:
    """img2img's init image: seeded noise over a gradient, at the pack's size."""
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    noise = np.random.default_rng(45).integers(0, 64, (h, w, 3))
    pixels = (np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) % 192], -1) + noise).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def job_outputs(job_dir: Path) -> dict[str, np.ndarray]:
    """A job's final results: every latent (latent*.npy, hires_latent*.npy) and every image's pixels (image*.png)."""
    out = {p.name: np.load(p) for pat in ("latent*.npy", "hires_latent*.npy") for p in sorted(job_dir.glob(pat))}
    for p in sorted(job_dir.glob("image*.png")):
        with Image.open(p) as im:
            out[p.name] = np.asarray(im)
    return out


def differing(got: dict, want: dict) -> list[str]:
    """Names of the results that are missing, extra or not bitwise equal."""
    return sorted(k for k in got.keys() | want.keys()
                  if k not in got or k not in want or got[k].shape != want[k].shape
                  or not np.array_equal(got[k], want[k]))


class TraceCount:
    """Branch calls the executor has served for one job so far: its trace file (JSON lines) read on from an offset."""

    def __init__(self, path: Path, job: str, offset: int):
        self.path, self.job, self.offset = path, job, offset
        self.served, self.last, self._rest = 0, None, b""

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.served
        self.offset += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()                          # a line being written: read whole next time
        for line in lines:
            rec = json.loads(line)
            if rec["job"] == self.job:
                self.served += 1
                self.last = rec
        return self.served


def trace_size(path: Path) -> int:
    """The trace file's size now: where a job submitted next starts in it."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
