"""`orchestrator status JOB`: one job in detail (its prompt and settings, state, timings and images), as the daemon
reports it, or read from its folder (RUN/jobs/JOB/job.json and report.json) when the daemon does not answer: the
records are on disk, so a stopped pipeline still tells what its jobs were and where their images are."""
from __future__ import annotations

import json
import time

from orchestrator.engine.job_record import JobEntry, info_of
from orchestrator.engine.jobs import JobError, JobStore
from orchestrator.engine.runfolder import RunFolder
from protocol import messages as m

LABEL = 11          # the width of the labels column


def from_folder(rf: RunFolder, job_id: str) -> m.JobInfo:
    """The job as STATUS with `detail` would say it, from RUN/jobs/JOB/job.json (no progress, no queue position:
    those only the daemon knows). JobError naming the folder or the file when there is no such job to read."""
    if not rf.jobs.is_dir():
        raise JobError(f"no job folder {rf.jobs} (is {rf.root} a run folder?)")
    job = JobStore(rf.root).view(job_id)            # its id checked, every field of job.json checked
    return info_of(JobEntry.of(job), job)


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _line(label: str, value) -> str:
    return f"  {label + ':':<{LABEL}}{value}"


def settings_lines(spec: dict) -> list[str]:
    """The job's prompt and settings as its record keeps them (PromptSpec.to_dict(), the seed resolved)."""
    if not spec:
        return [_line("prompt", "(not recorded)")]
    seed = f"{spec.get('seed')}" + (" (random)" if spec.get("seed_random") else "")
    batch = f", batch {spec['batch']}" if (spec.get("batch") or 1) > 1 else ""
    spectrum = spec.get("spectrum")
    off = spectrum is False or (isinstance(spectrum, dict) and not spectrum.get("enabled", True))
    out = [_line("prompt", spec.get("prompt", "")),
           _line("negative", spec.get("negative_prompt") or "(none)"),
           _line("size", f"{spec.get('width')}x{spec.get('height')}{batch}"),
           _line("sampling", f"{spec.get('steps')} steps, cfg {spec.get('cfg')}, sampler {spec.get('sampler')}, "
                             f"scheduler {spec.get('scheduler')}, spectrum {'off' if off else 'on'}"),
           _line("seed", seed)]
    if spec.get("init_image"):
        mask = f", mask {spec['mask']}" if spec.get("mask") else ""
        mix = spec.get("init_mix")
        mix = f" with {mix['image']} ({mix['kind']})" if mix else ""
        out.append(_line("img2img", f"{spec['init_image']}{mix}{mask}, denoise {spec.get('denoise')}"))
    hires = spec.get("hires")
    if hires:
        size = f"{hires['width']}x{hires['height']}" if hires.get("width") else \
            f"x{hires['scale']}" if hires.get("scale") else "the first latent as it is"
        window = f", from step {hires['start_step']}" if hires.get("start_step") is not None else ""
        noise = "" if hires.get("add_noise", True) else ", no noise added"
        out.append(_line("hires", f"{size}, {hires.get('space')} {hires.get('method')}, denoise "
                                  f"{hires.get('denoise')}, steps {hires.get('steps') or spec.get('steps')}{window}"
                                  f"{noise}"))
    for lora in spec.get("loras") or ():
        out.append(_line("lora", f"{lora.get('name')} strength {lora.get('strength')}"))
    if spec.get("cache"):
        out.append(_line("cache", spec["cache"].get("kind")))
    return out


def timing_lines(info: m.JobInfo, report: dict | None) -> list[str]:
    """Created and last changed (job.json), then the job's wall time and its states' from report.json (measured)."""
    out = [_line("created", _when(info.created)), _line("updated", _when(info.updated))]
    if report:
        spent: dict[str, float] = {}
        for state, start, end in report.get("phases") or ():
            spent[state] = spent.get(state, 0.0) + float(end) - float(start)
        parts = ", ".join(f"{state} {s:.1f} s" for state, s in spent.items())
        out.append(_line("timings", f"job {float(report.get('wall_s', 0.0)):.1f} s" + (f" ({parts})" if parts else "")
                         + " measured"))
    return out


def detail_lines(info: m.JobInfo, report: dict | None, images: list[str], progress: str | None = None) -> list[str]:
    """Everything `status JOB` prints of one job; `progress`: the follow loop's line for a running job."""
    state = info.state + (f" ({info.position} ahead)" if info.state == "queued" else "")
    if info.error:
        state += f": {info.error_stage + ': ' if info.error_stage else ''}{info.error}"
    spec = json.loads(info.spec_json) if info.spec_json else {}
    out = [f"job {info.job}", _line("state", state)] + ([_line("progress", progress)] if progress else [])
    out += settings_lines(spec) + timing_lines(info, report)
    for i, path in enumerate(images):
        out.append(_line("image" if len(images) == 1 else f"image {i + 1}", path))
    if info.report:
        out.append(_line("report", info.report))
    return out
