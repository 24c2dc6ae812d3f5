"""How a job's phase and progress read, in one place: the CLI's line (`generate`, `submit --wait`, `status`) and the
page's (anima.progress `text`, orchestrator/http/views.py) say the same words for the same JobInfo:

    queued (2 ahead)
    encoding the prompt
    image 2/3 · hires pass · step 4/6 · block 13/28 self · ETA 0m20s
    decoding the image

The ETA is the scheduler's for the running sampling pass (stages/eta.py); "?" when it gave none.
"""
from __future__ import annotations

PHASES = {"encoding": "encoding the prompt", "denoising": "denoising", "decoding": "decoding the image"}
SEP = " · "


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = max(0, round(seconds))
    return f"{s // 60}m{s % 60:02d}s"


def where_text(info) -> str:
    """Which DENOISE of the job runs: "image 2/3", "hires pass", both, or "" (one image, its only pass)."""
    w = info.denoise_pass
    if w is None:
        return ""
    parts = ([f"image {w.image}/{w.images}"] if w.images > 1 else []) + (["hires pass"] if w.name == "hires" else [])
    return SEP.join(parts)


def step_text(info, blocks: int | None = None) -> str:
    """The running step: `image 2/3 · step 4/6 · block 13/28 self · ETA 0m20s` (a forecast step names no block)."""
    p = info.progress
    blocks = p.blocks or blocks
    if p.forecast:
        what = "forecast"
    else:
        what = f"block {p.block + 1}{f'/{blocks}' if blocks else ''} {p.branch}"
        what += f" ({p.cfg_pass})" if p.cfg_pass != "both" else ""
    where = where_text(info)
    return SEP.join(filter(None, [where, f"step {p.step}/{p.steps}", what, f"ETA {eta_text(p.eta_s)}"]))


def phase_text(info, blocks: int | None = None) -> str:
    """A job's phase in words: its state, the jobs ahead of a queued one, the step of a denoising one."""
    if info.state == "denoising" and info.progress is not None:
        return step_text(info, blocks)
    if info.state == "queued":
        return f"queued ({info.position} ahead)" if info.position else "queued"
    return PHASES.get(info.state, info.state)
