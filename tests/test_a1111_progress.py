"""GET /sdapi/v1/progress covers the whole A1111 request, as A1111's shared.state does: a batch's images and a hires
pass are jobs of one count (job_no / job_count), the steps are the running pass's, and `progress` only grows from the
first image's first step to the last image's hires pass (before: it started again at 0 for each image and pass).
The handler is fed the JobInfo values the daemon reports while such a request runs."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from models.dit.partition import KINDS
from orchestrator.http.a1111 import progress
from orchestrator.http.common import FRONT
from orchestrator.http.views import JobView
from protocol import messages as m

BLOCKS = 2


class _Tracker:
    """The front's tracker as /progress reads it: the running job and its pack's blocks."""

    def __init__(self, job: JobView):
        self.job = job

    async def fresh(self):
        return {self.job.id: self.job}

    def running(self):
        return self.job

    def blocks_of(self, job):
        return BLOCKS


def _view(job: str, state: str, spec: dict, origin: dict, where=None, step=None, steps=None, block=0, branch="self"):
    p = None if step is None else m.Progress(job=job, step=step, steps=steps, block=block, branch=branch,
                                               elapsed_s=1.0, eta_s=3.0, blocks=BLOCKS)
    info = m.JobInfo(job=job, state=state, created=1.0, updated=2.0, progress=p, denoise_pass=where)
    return JobView(info, spec, origin)


def _answer(view: JobView) -> dict:
    req = SimpleNamespace(app={FRONT: SimpleNamespace(tracker=_Tracker(view))})
    return json.loads(asyncio.run(progress(req)).text)


def _request_run(images: int, steps: int, hires_steps: int) -> list[tuple[JobView, tuple]]:
    """Every look a client may take at a txt2img request of `images` images (each its own job) with a hires pass:
    (view, (image, pass index, step, block, branch)) in the order the daemon runs them."""
    spec = {"prompt": "a girl", "steps": steps, "hires": {"scale": 1.5, "steps": hires_steps}}
    looks = []
    for k in range(1, images + 1):
        job, origin = f"20260101-000000-job{k}", {"api": "a1111", "image": k, "images": images}
        looks.append((_view(job, "encoding", spec, origin), (k, 0, 0, 0, "")))
        looks.append((_view(job, "denoising", spec, origin), (k, 0, 0, 0, "")))     # before its first branch
        for pass_no, (name, n) in enumerate([("first", steps), ("hires", hires_steps)]):
            where = m.DenoisePass(image=1, images=1, name=name)
            for s in range(1, n + 1):
                for b in range(BLOCKS):
                    for kind in KINDS:
                        looks.append((_view(job, "denoising", spec, origin, where, s, n, b, kind),
                                      (k, pass_no, s, b, kind)))
        looks.append((_view(job, "decoding", spec, origin), (k, 1, hires_steps, BLOCKS, "")))
    return looks


def test_progress_covers_every_image_and_the_hires_pass_of_the_request():
    images, steps, hires_steps = 3, 4, 2
    answers = [(_answer(v), where) for v, where in _request_run(images, steps, hires_steps)]
    fracs = [a["progress"] for a, _ in answers]
    assert fracs == sorted(fracs) and fracs[0] < 0.05 and 0.95 < fracs[-1] < 1, fracs
    for a, (k, pass_no, s, b, kind) in answers:
        st = a["state"]
        assert st["job_count"] == images * 2, st                    # each image's first and hires pass
        assert st["job_no"] == (k - 1) * 2 + pass_no, (st, k, pass_no)
        if kind:                                                     # denoising: the running pass's step
            n = steps if pass_no == 0 else hires_steps
            assert (st["sampling_step"], st["sampling_steps"]) == (s, n)
            # A1111's fraction: the jobs done, plus the running one's share (its steps done, this step's branches)
            share = (s - 1 + ((b * len(KINDS) + KINDS.index(kind) + 1) / (len(KINDS) * BLOCKS))) / n
            want = min(0.99, (st["job_no"] + share) / st["job_count"])
            assert abs(a["progress"] - round(want, 4)) < 1e-9, (a, k, pass_no, s, b, kind)
    # the second image's hires pass at its last step's last branch: 3 of the 6 passes done before it, and it whole
    last_hires = [a for a, w in answers if w[:3] == (2, 1, hires_steps) and w[3:] == (BLOCKS - 1, KINDS[-1])][0]
    assert last_hires["progress"] == round(4 / 6, 4) and last_hires["state"]["job_no"] == 3


def test_a_batch_job_from_elsewhere_counts_its_own_images():
    """One job of batch 3 (a ComfyUI or CLI job: its origin says nothing of an A1111 request): its images are the
    count; an origin that is not A1111's does not move it."""
    spec = {"prompt": "a girl", "steps": 4, "batch": 3}
    for origin in ({"api": "comfyui", "client_id": "c"}, {"api": "comfyui", "image": 5, "images": 9}):
        where = m.DenoisePass(image=2, images=3)
        a = _answer(_view("20260101-000000-b", "denoising", spec, origin, where, 3, 4, BLOCKS - 1, KINDS[-1]))
        assert (a["state"]["job_no"], a["state"]["job_count"]) == (1, 3), a
        assert a["progress"] == round((1 + 3 / 4) / 3, 4), a
        enc = _answer(_view("20260101-000000-b", "encoding", spec, origin))
        assert (enc["state"]["job_no"], enc["state"]["job_count"]) == (0, 3) and enc["progress"] < 0.01, enc
