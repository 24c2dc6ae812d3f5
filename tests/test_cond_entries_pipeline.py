"""prompt.json's positive/negative entries (ComfyUI's ConditioningCombine / ConditioningSetTimestepRange, an entry
through ConditioningAverage, the negative through ConditioningZeroOut) under a real supervisord with the REAL stages
on the embedded tiny bundle: each distinct conditioning encoded once (cond_entry_K.npy), each active entry a DiT pass
of its own, the sides mixed as ComfyUI's calc_cond_batch, in the first pass and in a second pass chained on its
latent (a hires fix without a size: ComfyUI's second KSampler fed the same conditionings); the scheduler SIGKILLed
mid first pass and again mid second pass resumes each to the in-process latent bitwise (models.sampling.cond_mix
over a DiTRunner from the job's contexts)."""
from __future__ import annotations

import numpy as np

from models.packs.pack import load_pack
from models.sampling.cond_mix import CondPass, Conditioning
from models.sampling.denoise import STATE_FILE, make_sampler, start_or_resume
from models.sampling.img2img import LatentPlan, LatentSampler, start_or_resume_latent
from models.sampling.spectrum import SpectrumSettings
from models.vae.latent import denormalize, normalize
from tests.pipeline_harness import reference_runner

THREADS = 1
JOB_TIMEOUT_S = 600.0
PROMPT = {"prompt": "1girl, silver hair", "negative_prompt": "worst quality", "seed": 77, "steps": 4, "cfg": 4.0,
          "sampler": "euler", "scheduler": "simple", "spectrum": {"warmup": 1},
          "positive": [{"text": "1girl, silver hair", "end": 0.5},
                       {"text": "a red car", "start": 0.5, "average": {"text": "1girl, silver hair", "weight": 0.6}},
                       {"text": "1girl, silver hair", "strength": 0.5}],
          "negative": [{"text": "worst quality", "zero_out": True}],
          "hires": {"steps": 2, "denoise": 0.5}}


def _reference(pack_dir, job_dir):
    """The job in process: the same samplers, the first's state from the seed, the second's from the first latent
    (a KSampler's LATENT taken back by the next), each call through Conditioning.call."""
    pack = load_pack(pack_dir)
    g, c = pack.geometry, pack.config
    ctx = [np.load(job_dir / ("cond_entry.npy" if k == 0 else f"cond_entry_{k}.npy")) for k in range(3)]
    # the distinct conditionings in the job's order: the plain text, the averaged one, the zeroed-out negative
    pos = tuple(CondPass(ctx[k], e.get("strength", 1.0), e.get("start", 0.0), e.get("end", 1.0))
                for k, e in zip((0, 1, 0), PROMPT["positive"]))
    cond = Conditioning(pos, (CondPass(ctx[2]),))
    shape = (c.latent_channels, g.latent_h, g.latent_w)
    sampler = make_sampler(4, 4.0, "simple", SpectrumSettings(warmup=1), "euler")
    runner = reference_runner(pack, threads=THREADS)
    final = sampler.sample(lambda x, sigma: cond.call(runner, sampler, x, sigma)[:2],
                           state=start_or_resume(sampler, PROMPT["seed"], shape))
    first = sampler.result(final)
    second = LatentSampler(steps=2, cfg=4.0, scheduler="simple", spectrum=SpectrumSettings(warmup=1), sampler="euler",
                           plan=LatentPlan(denoise=0.5))
    state = start_or_resume_latent(second, PROMPT["seed"], shape, image=normalize(denormalize(first)))
    last = second.sample(lambda x, sigma: cond.call(runner, second, x, sigma)[:2], state=state)
    return first, final, second.result(last), last


def test_entries_run_a_pass_each_and_a_killed_scheduler_resumes_bitwise(default_pipeline, pipeline_assets):
    pipe = default_pipeline
    assert pipe.toml_args["threads"] == THREADS
    job = pipe.submit(PROMPT)
    job_dir = pipe.job_dir(job)
    pipe.wait(job, ("denoising",), JOB_TIMEOUT_S, poll_s=0.05,
              pred=lambda i: i.progress is not None and (i.progress.step, i.progress.block) >= (2, 1))
    pipe.kill("scheduler")
    pipe.wait(job, ("denoising",), JOB_TIMEOUT_S, poll_s=0.05,       # the second pass saved a step: kill it there
              pred=lambda i: (job_dir / "hires" / STATE_FILE).exists())
    pipe.kill("scheduler")
    info = pipe.wait(job, timeout_s=JOB_TIMEOUT_S)
    assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
    assert sorted(p.name for p in job_dir.glob("cond_entry*.npy")) == ["cond_entry.npy", "cond_entry_1.npy",
                                                                       "cond_entry_2.npy"]
    latent, final, hires, last = _reference(pipeline_assets[1], job_dir)
    np.testing.assert_array_equal(np.load(job_dir / "latent.npy"), latent)
    np.testing.assert_array_equal(np.load(job_dir / "hires_latent.npy"), hires)
    r = pipe.report(job)
    first, second = r["passes"]
    assert (first["pass"], second["pass"]) == ("first", "hires")
    assert first["resumed_from"] >= 1 and second["resumed_from"] >= 1        # each pass resumed after its kill
    assert r["computed_steps"] == final.computed + last.computed and final.computed == [1, 2, 4]
    blocks = load_pack(pipeline_assets[1]).config.blocks
    # sigmas 1, 0.9, (0.75 forecast), 0.5: steps 1-2 run entries 0 and 2 + the negative (2 sweeps), step 4 entries
    # 1 and 2 + the negative (2 sweeps); each sweep is one BRANCH per branch (3 per block); a pass's calls are
    # its resumed DENOISE's, from the step after the saved one
    assert first["branch_calls"] == 3 * blocks * 2 * len([s for s in (1, 2, 4) if s > first["resumed_from"]])
