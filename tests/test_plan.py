"""The job as a plan (orchestrator/engine/plan): each prompt shape's steps, written out and checked without a pipeline."""
import json
from pathlib import Path

import pytest

from models.sampling.denoise import STATE_FILE
from orchestrator.engine.job_files import JOB_FILES, names
from orchestrator.engine.plan.build import build_plan, hires_texts
from orchestrator.engine.plan.steps import (Decode, Deliver, Denoise, EncodeText, HiresDenoise, PixelStart, Plan, PlanError,
                                     SCHEDULER)
from orchestrator.engine.prompt_spec import parse_prompt_obj

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(512, 512), (768, 768)]


def _plan(**kw) -> Plan:
    return build_plan(_plan_spec(**kw))


def _plan_spec(**kw):
    obj = {**json.loads((ROOT / "examples" / "prompt.json").read_text()), **kw}
    for side, text in (("positive", "prompt"), ("negative", "negative_prompt")):
        if side in kw:                          # the entries say their side's text (prompt.json's rule: once)
            obj.pop(text, None)
    return parse_prompt_obj(obj, resolution=SIZES)


def _lines(plan: Plan) -> list[list[str]]:
    return [line.split() for line in plan.describe()]


def test_text_to_image_is_encode_denoise_decode_deliver():
    assert _lines(_plan()) == [
        ["encoding", "encoder", "EncodeText", "-", "->", "text.json", "cond.npy", "uncond.npy"],
        ["denoising", "scheduler", "Denoise[0]", "text.json", "cond.npy", "uncond.npy", "->", "latent.npy"],
        ["decoding", "vae", "Decode[0]", "latent.npy", "->", "image.png"],
        ["decoding", "-", "Deliver", "image.png", "->", "-"],
        ["decoding", "-", "Report", "image.png", "->", "report.json", "timing.png"]]


def test_img2img_encodes_its_image_once_and_inpaint_reads_the_mask():
    plain = _plan(init_image="a.png")
    assert [s.name for s in plain.steps] == ["EncodeText", "EncodeImage", "Denoise[0]", "Decode[0]", "Deliver", "Report"]
    assert plain.steps[1].inputs == ("init_image.png",) and plain.steps[1].outputs == ("init_latent.npy",)
    assert plain.steps[2].inputs[-1] == "init_latent.npy"
    inpaint = _plan(init_image="a.png", mask="m.png", grow_mask_by=6)
    assert inpaint.steps[1].inputs == ("init_image.png", "mask.png")         # VAEEncodeForInpaint greys under it
    assert inpaint.steps[2].inputs[-2:] == ("init_latent.npy", "mask.png")   # SetLatentNoiseMask
    assert _plan(init_image="a.png", mask="m.png").steps[1].inputs == ("init_image.png",)


def test_a_batch_is_one_denoise_and_one_decode_per_image_each_with_its_state():
    plan = _plan(batch=3)
    denoises = [s for s in plan.steps if isinstance(s, Denoise)]
    assert [(s.pos, s.outputs, s.scratch) for s in denoises] == [
        (0, ("latent.npy",), (STATE_FILE,)), (1, ("latent_1.npy",), (f"batch_1/{STATE_FILE}",)),
        (2, ("latent_2.npy",), (f"batch_2/{STATE_FILE}",))]
    assert [s.outputs for s in plan.steps if isinstance(s, Decode)] == [("image.png",), ("image_1.png",),
                                                                        ("image_2.png",)]
    assert plan.steps[-2] == Deliver(inputs=("image.png", "image_1.png", "image_2.png"))


def test_hires_in_latent_space_samples_again_from_each_first_latent():
    plan = _plan(batch=2, hires={"scale": 1.5})
    assert [s.name for s in plan.steps] == ["EncodeText", "Denoise[0]", "Denoise[1]", "HiresDenoise[0]",
                                            "HiresDenoise[1]", "Decode[0]", "Decode[1]", "Deliver", "Report"]
    second = plan.steps[4]
    assert second.inputs == ("text.json", "cond.npy", "uncond.npy", "latent_1.npy")    # the job's own contexts
    assert second.outputs == ("hires_latent_1.npy",) and second.scratch == (f"hires_1/{STATE_FILE}",)
    assert plan.steps[5].inputs == ("hires_latent.npy",)


def test_hires_in_pixel_space_with_its_own_prompts():
    plan = _plan(hires={"scale": 1.5, "space": "pixel", "prompt": "sharp"})
    assert _lines(plan) == [
        ["encoding", "encoder", "EncodeText", "-", "->", "text.json", "cond.npy", "uncond.npy"],
        ["encoding", "encoder", "EncodeText[hires]", "-", "->", "hires_text.json", "hires_cond.npy",
         "hires_uncond.npy"],
        ["denoising", "scheduler", "Denoise[0]", "text.json", "cond.npy", "uncond.npy", "->", "latent.npy"],
        ["denoising", "vae", "PixelStart[0]", "latent.npy", "->", "hires_init.npy"],
        ["denoising", "scheduler", "HiresDenoise[0]", "hires_text.json", "hires_cond.npy", "hires_uncond.npy",
         "latent.npy", "hires_init.npy", "->", "hires_latent.npy"],
        ["decoding", "vae", "Decode[0]", "hires_latent.npy", "->", "image.png"],
        ["decoding", "-", "Deliver", "image.png", "->", "-"],
        ["decoding", "-", "Report", "image.png", "->", "report.json", "timing.png"]]
    assert plan.steps[3].scratch == ("first.png",)


def test_the_second_pass_has_its_own_prompts_only_when_they_differ():
    spec = parse_prompt_obj({"prompt": "a", "negative_prompt": "b", "seed": 1, "hires": {"scale": 1.5, "prompt": "a"}},
                            resolution=SIZES)
    assert hires_texts(spec) is None
    assert not any(isinstance(s, EncodeText) and s.hires for s in build_plan(spec).steps)
    assert hires_texts(parse_prompt_obj({"prompt": "a", "seed": 1, "hires": {"scale": 1.5, "negative_prompt": "x"}},
                                        resolution=SIZES)) == ("a", "x")


SHAPES = [{}, {"init_image": "a.png", "mask": "m.png", "grow_mask_by": 4}, {"batch": 4},
          {"hires": {"scale": 1.5}}, {"batch": 2, "hires": {"scale": 1.5, "space": "pixel", "negative_prompt": "x"}},
          {"init_image": "a.png", "batch": 2, "hires": {"scale": 1.5, "space": "pixel"}},
          {"batch": 2, "hires": {"scale": 1.5, "keep_base": True}},
          {"init_image": "a.png", "batch": 2, "latent_mix": {"kind": "blend", "onto": "image", "factor": 0.3}},
          {"init_image": "a.png", "latent_mix": {"kind": "composite", "x": 8}, "hires": {"scale": 1.5}},
          {"batch": 2, "hires": {"scale": 1.5, "space": "pixel", "keep_base": True}},
          {"init_image": "a.png", "batch": 2, "init_mix": {"image": "b.png", "kind": "composite", "x": 8},
           "hires": {"scale": 1.5}}]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: ",".join(s) or "txt2img")
def test_every_plan_is_a_dag_of_the_job_folders_files(shape):
    """Each step reads only what an earlier step wrote (or the job's kept inputs), every name is one of JOB_FILES',
    the states only go forward, and every image's first-pass file is read by the step after it."""
    plan = _plan(**shape)
    known = {n for f in JOB_FILES for n in names(f)}
    for i, step in enumerate(plan.steps):
        assert set(step.inputs + step.outputs) <= known, step
        assert all(plan.steps.index(p) < i for p in plan.producers(step))
        assert all(s.rsplit("/", 1)[-1] in known for s in step.scratch), step
    order = ["encoding", "denoising", "decoding"]
    assert [order.index(s.phase) for s in plan.steps] == sorted(order.index(s.phase) for s in plan.steps)
    denoisers = [s for s in plan.steps if s.stage == SCHEDULER]
    assert all(isinstance(s, (Denoise, HiresDenoise)) for s in denoisers)
    assert len([s for s in plan.steps if isinstance(s, PixelStart)]) == (
        shape.get("batch", 1) if shape.get("hires", {}).get("space") == "pixel" else 0)


def test_a_plan_that_is_not_a_dag_is_refused():
    with pytest.raises(PlanError, match=r"Denoise\[0\] reads \['cond.npy'\]"):
        Plan((Denoise(inputs=("cond.npy",), outputs=("latent.npy",)),))
    with pytest.raises(PlanError, match="writes \\['latent.npy'\\] again"):
        Plan((Denoise(outputs=("latent.npy",)), Denoise(outputs=("latent.npy",))))


# ---------------------------------------------------------------- which steps a resume runs (no pipeline)

def _runner(tmp_path, plan: Plan, text_tokens: int = 512):
    from types import SimpleNamespace

    from orchestrator.engine.plan.run import PlanRunner
    r = PlanRunner.__new__(PlanRunner)
    r.dir, r.plan = tmp_path, plan
    r.settings = SimpleNamespace(timing_plot_timeout_s=120.0)
    r.first_pack = SimpleNamespace(context_shape=(4, 3), latent_shape=(2, 4, 4), text_tokens=text_tokens)
    r.hires_pack = SimpleNamespace(context_shape=(4, 3), latent_shape=(2, 6, 6), text_tokens=text_tokens)
    return r


def _keep(folder: Path, name: str, shape: tuple) -> None:
    import numpy as np
    np.save(folder / name, np.zeros(shape, np.float32), allow_pickle=False)


def test_a_resume_runs_only_the_steps_whose_outputs_are_not_whole(tmp_path):
    """A batch of 2 with a hires fix, killed in image 1's second pass: image 0's second latent and image 1's first are
    whole, so only image 1's second pass runs (its first latent and the contexts read again, not made), then both
    decodes; image 0's first latent and its sampler state are not needed."""
    plan = _plan(batch=2, hires={"scale": 1.5})
    r = _runner(tmp_path, plan)
    for name in ("cond.npy", "uncond.npy"):
        _keep(tmp_path, name, (4, 3))
    _keep(tmp_path, "latent_1.npy", (2, 4, 4))
    _keep(tmp_path, "hires_latent.npy", (2, 6, 6))
    todo, missing = r._steps_to_run()
    assert [s.name for s in todo] == ["HiresDenoise[1]", "Decode[0]", "Decode[1]", "Deliver", "Report"]
    assert missing[todo[0]] == ["hires_latent_1.npy"]
    (tmp_path / "image.png").write_bytes(b"png")          # decoded before the kill: not decoded again
    assert [s.name for s in r._steps_to_run()[0]] == ["HiresDenoise[1]", "Decode[1]", "Deliver", "Report"]


def test_a_torn_or_wrong_file_is_made_again_with_what_it_needs(tmp_path):
    r = _runner(tmp_path, _plan())
    _keep(tmp_path, "cond.npy", (4, 3))
    _keep(tmp_path, "uncond.npy", (4, 3))
    _keep(tmp_path, "latent.npy", (2, 4, 5))                              # another pack's shape
    assert [s.name for s in r._steps_to_run()[0]] == ["Denoise[0]", "Decode[0]", "Deliver", "Report"]
    (tmp_path / "cond.npy").write_bytes((tmp_path / "cond.npy").read_bytes()[:-5])     # cut short: a power cut
    todo, missing = r._steps_to_run()
    assert [s.name for s in todo] == ["EncodeText", "Denoise[0]", "Decode[0]", "Deliver", "Report"]
    assert missing[todo[0]] == ["cond.npy"] and missing[todo[1]] == ["latent.npy"]
    _keep(tmp_path, "cond.npy", (4, 3))
    _keep(tmp_path, "latent.npy", (2, 4, 4))
    assert [s.name for s in r._steps_to_run()[0]] == ["Decode[0]", "Deliver", "Report"]
    # a long-context pack's mask needs the token counts: without text.json the contexts are not whole
    (tmp_path / "latent.npy").unlink()
    long = _runner(tmp_path, _plan(), text_tokens=1024)
    assert [s.name for s in long._steps_to_run()[0]] == ["EncodeText", "Denoise[0]", "Decode[0]", "Deliver", "Report"]
    (tmp_path / "text.json").write_text('{"t5_tokens_prompt": 3}')
    assert [s.name for s in long._steps_to_run()[0]] == ["Denoise[0]", "Decode[0]", "Deliver", "Report"]


def test_keep_base_on_the_latent_path_decodes_each_first_latent_beside_the_final_images():
    plan = _plan(batch=2, hires={"scale": 1.5, "keep_base": True})
    assert [s.name for s in plan.steps] == ["EncodeText", "Denoise[0]", "Denoise[1]", "HiresDenoise[0]",
                                            "HiresDenoise[1]", "Decode[base 0]", "Decode[base 1]", "Decode[0]",
                                            "Decode[1]", "Deliver", "Report"]
    bases = [s for s in plan.steps if isinstance(s, Decode) and s.base]
    assert [(s.inputs, s.outputs) for s in bases] == [(("latent.npy",), ("base.png",)),
                                                      (("latent_1.npy",), ("base_1.png",))]
    # one VAE session: every decode is one run of consecutive VAE steps, after the last DENOISE
    stages = [s.stage for s in plan.steps]
    assert stages[5:9] == ["vae"] * 4 and "scheduler" not in stages[5:]
    assert plan.steps[-2].inputs == ("image.png", "image_1.png", "base.png", "base_1.png")


def test_keep_base_on_the_pixel_path_keeps_the_pixel_starts_decode_as_base_png():
    plan = _plan(hires={"scale": 1.5, "space": "pixel", "method": "lanczos", "keep_base": True})
    start = next(s for s in plan.steps if isinstance(s, PixelStart))
    assert (start.outputs, start.scratch) == (("hires_init.npy", "base.png"), ())
    assert not any(isinstance(s, Decode) and s.base for s in plan.steps)       # no second decode of the latent
    assert plan.steps[-2].inputs == ("image.png", "base.png")
    plain = next(s for s in _plan(hires={"scale": 1.5, "space": "pixel", "method": "lanczos"}).steps
                 if isinstance(s, PixelStart))
    assert (plain.outputs, plain.scratch) == (("hires_init.npy",), ("first.png",))


def test_base_images_are_kept_results_and_the_daemons_temporaries():
    from orchestrator.engine.job_files import BASE_IMAGE_FILE, DAEMON_FILES
    base = next(f for f in JOB_FILES if f.name == BASE_IMAGE_FILE)
    assert base.kept and base.per_image
    assert {"base.png", "base_1.png"} <= DAEMON_FILES            # a daemon start clears their temporaries


def test_a_resume_decodes_a_base_image_only_when_it_is_not_whole(tmp_path):
    """Latent path, killed while decoding: a whole base.png is not decoded again; a lost one is decoded from the kept
    first latent alone (no second pass again); with that latent lost too, the first pass runs again for it."""
    r = _runner(tmp_path, _plan(hires={"scale": 1.5, "keep_base": True}))
    for name in ("cond.npy", "uncond.npy"):
        _keep(tmp_path, name, (4, 3))
    _keep(tmp_path, "latent.npy", (2, 4, 4))
    _keep(tmp_path, "hires_latent.npy", (2, 6, 6))
    assert [s.name for s in r._steps_to_run()[0]] == ["Decode[base 0]", "Decode[0]", "Deliver", "Report"]
    (tmp_path / "base.png").write_bytes(b"png")
    assert [s.name for s in r._steps_to_run()[0]] == ["Decode[0]", "Deliver", "Report"]
    (tmp_path / "base.png").unlink()
    (tmp_path / "image.png").write_bytes(b"png")
    assert [s.name for s in r._steps_to_run()[0]] == ["Decode[base 0]", "Deliver", "Report"]
    (tmp_path / "latent.npy").unlink()
    assert [s.name for s in r._steps_to_run()[0]] == ["Denoise[0]", "Decode[base 0]", "Deliver", "Report"]


def test_a_pixel_resume_reads_the_kept_base_and_encodes_only_what_is_lost(tmp_path):
    r = _runner(tmp_path, _plan(hires={"scale": 1.5, "space": "pixel", "method": "lanczos", "keep_base": True}))
    _keep(tmp_path, "latent.npy", (2, 4, 4))
    _keep(tmp_path, "hires_latent.npy", (2, 6, 6))
    (tmp_path / "image.png").write_bytes(b"png")
    assert [s.name for s in r._steps_to_run()[0]] == ["PixelStart[0]", "Deliver", "Report"]    # base.png lost: made again
    (tmp_path / "base.png").write_bytes(b"png")
    assert [s.name for s in r._steps_to_run()[0]] == ["Deliver", "Report"]


def test_entries_encode_each_distinct_text_once_and_the_denoise_reads_them_all():
    plan = _plan(positive=[{"text": "a girl", "end": 0.5}, {"text": "a car", "start": 0.5},
                           {"text": "a girl", "strength": 2.0}], negative=[{"text": "blurry"}], cfg=4.0)
    assert _lines(plan)[:2] == [
        ["encoding", "encoder", "EncodeText[entries]", "-", "->", "cond_entry.npy", "cond_entry_1.npy",
         "cond_entry_2.npy", "cond_entries.json"],
        ["denoising", "scheduler", "Denoise[0]", "cond_entry.npy", "cond_entry_1.npy", "cond_entry_2.npy",
         "cond_entries.json", "->", "latent.npy"]]
    # at cfg 1 no negative is encoded (no pass reads it); a side left out is its plain prompt
    assert plan_texts(cfg=1.0, positive=[{"text": "a"}, {"text": "b"}], negative=[{"text": "c"}]) == ("a", "b")
    assert plan_texts(cfg=4.0, negative_prompt="n", positive=[{"text": "a"}, {"text": "b"}]) == ("a", "b", "n")


def plan_texts(**kw) -> tuple:
    from orchestrator.engine.plan.build import entry_texts
    return entry_texts(_plan_spec(**kw))


def test_every_entry_file_is_in_the_job_files_table():
    table = {n for f in JOB_FILES for n in names(f)}
    plan = _plan(positive=[{"text": str(i)} for i in range(8)], negative=[{"text": f"n{i}"} for i in range(8)])
    assert set(plan.steps[0].outputs) <= table and "cond_entry_15.npy" in plan.steps[0].outputs


def test_latent_mix_mixes_each_pass_latent_with_the_init_latent_before_its_decode(tmp_path):
    """LatentComposite / LatentBlend (latent_mix): a MixLatent per image in the daemon (no stage) after the passes,
    its mixed_latent[_N].npy what Decode reads; a resume with the mixed latent whole only decodes."""
    plan = _plan(init_image="a.png", batch=2, latent_mix={"kind": "composite", "x": 64, "feather": 16})
    assert _lines(plan)[4:7] == [
        ["denoising", "-", "MixLatent[0]", "latent.npy", "init_latent.npy", "->", "mixed_latent.npy"],
        ["denoising", "-", "MixLatent[1]", "latent_1.npy", "init_latent.npy", "->", "mixed_latent_1.npy"],
        ["decoding", "vae", "Decode[0]", "mixed_latent.npy", "->", "image.png"]]
    r = _runner(tmp_path, plan)
    for name in ("init_latent.npy", "latent.npy", "latent_1.npy", "mixed_latent.npy"):
        _keep(tmp_path, name, (2, 4, 4))
    assert [s.name for s in r._steps_to_run()[0]] == ["MixLatent[1]", "Decode[0]", "Decode[1]", "Deliver", "Report"]
    from orchestrator.engine.job_files import DAEMON_FILES
    assert {"mixed_latent.npy", "mixed_latent_7.npy"} <= DAEMON_FILES      # a daemon start removes their temporaries
    (tmp_path / "latent_1.npy").unlink()          # image 1's pass again (its contexts too), then its mix
    assert [s.name for s in r._steps_to_run()[0]] == ["EncodeText", "Denoise[1]", "MixLatent[1]", "Decode[0]",
                                                       "Decode[1]", "Deliver", "Report"]


def test_latent_mix_with_a_second_pass_is_its_start_and_the_final_latent_is_decoded():
    plan = _plan(init_image="a.png", latent_mix={"kind": "blend"}, hires={"denoise": 0.5, "keep_base": True})
    assert [s.name for s in plan.steps] == ["EncodeText", "EncodeImage", "Denoise[0]", "MixLatent[0]",
                                            "HiresDenoise[0]", "Decode[base 0]", "Decode[0]", "Deliver", "Report"]
    assert plan.steps[4].inputs[-1] == "mixed_latent.npy" and plan.steps[6].inputs == ("hires_latent.npy",)
    assert plan.steps[5].inputs == ("latent.npy",)       # the base image is the first KSampler's, unmixed


def test_init_mix_encodes_both_uploads_and_mixes_them_into_the_start_latent(tmp_path):
    """init_mix (LatentComposite / LatentBlend before the first KSampler): both uploads encoded in one VAE session
    (init_encoded.npy, mix_encoded.npy), MixStart in the daemon writes init_latent.npy, which every first pass reads;
    a resume with init_latent.npy whole encodes nothing, one with only it lost mixes again without encoding."""
    plan = _plan(init_image="a.png", batch=2,
                 init_mix={"image": "b.png", "kind": "blend", "factor": 0.3, "onto": "image"})
    assert _lines(plan)[1:5] == [
        ["encoding", "vae", "EncodeImage", "init_image.png", "->", "init_encoded.npy"],
        ["encoding", "vae", "EncodeImage[mix]", "mix_image.png", "->", "mix_encoded.npy"],
        ["encoding", "-", "MixStart", "init_encoded.npy", "mix_encoded.npy", "->", "init_latent.npy"],
        ["denoising", "scheduler", "Denoise[0]", "text.json", "cond.npy", "uncond.npy", "init_latent.npy", "->",
         "latent.npy"]]
    from orchestrator.engine.job_files import DAEMON_FILES
    assert {"init_encoded.npy", "mix_encoded.npy", "mix_image.png"} <= DAEMON_FILES   # temporaries go at a start
    r = _runner(tmp_path, plan)
    for name in ("init_encoded.npy", "mix_encoded.npy", "init_latent.npy", "latent.npy"):
        _keep(tmp_path, name, (2, 4, 4))
    assert [s.name for s in r._steps_to_run()[0]] == ["EncodeText", "Denoise[1]", "Decode[0]", "Decode[1]",
                                                       "Deliver", "Report"]
    (tmp_path / "init_latent.npy").unlink()       # the mix again from the kept latents (no encode), for image 1
    assert [s.name for s in r._steps_to_run()[0]][:3] == ["EncodeText", "MixStart", "Denoise[1]"]


# ---------------------------------------------------------------- the Report step

def test_the_report_is_the_plans_last_step_and_reads_the_images_it_names():
    plan = _plan(batch=2, hires={"scale": 1.5, "keep_base": True})
    report = plan.steps[-1]
    assert report.name == "Report" and report.stage is None and report.phase == "decoding"
    assert report.inputs == ("image.png", "image_1.png", "base.png", "base_1.png")
    assert report.outputs == ("report.json", "timing.png")


def test_a_resume_skips_the_report_when_whole_and_writes_it_again_when_a_step_it_reads_ran(tmp_path):
    r = _runner(tmp_path, _plan())
    _keep(tmp_path, "latent.npy", (2, 4, 4))
    (tmp_path / "image.png").write_bytes(b"png")
    written = json.dumps({"job": "j", "plan": [{"step": "Deliver", "ran": True}, {"step": "Report", "ran": True}]})
    assert [s.name for s in r._steps_to_run()[0]] == ["Deliver", "Report"]        # no report yet
    (tmp_path / "report.json").write_text(written)
    assert [s.name for s in r._steps_to_run()[0]] == ["Deliver", "Report"]        # timing.png not drawn yet
    (tmp_path / "timing.png").write_bytes(b"png")
    assert [s.name for s in r._steps_to_run()[0]] == ["Deliver"]                  # whole: skipped
    r.settings.timing_plot_timeout_s = 0.0
    (tmp_path / "timing.png").unlink()
    assert [s.name for s in r._steps_to_run()[0]] == ["Deliver"]                  # not drawn here: whole without
    (tmp_path / "report.json").write_text(written[:-9])                          # torn
    assert [s.name for s in r._steps_to_run()[0]] == ["Deliver", "Report"]
    # a failed job's report (written where it stopped, e.g. Deliver could not write `output`) is not the step's
    (tmp_path / "report.json").write_text(written.replace('"ran": true}]', '"ran": false}]'))
    assert [s.name for s in r._steps_to_run()[0]] == ["Deliver", "Report"]
    (tmp_path / "report.json").write_text(written)
    (tmp_path / "image.png").unlink()                                             # decoded again: a stale record
    assert [s.name for s in r._steps_to_run()[0]] == ["Decode[0]", "Deliver", "Report"]


def test_the_report_step_writes_the_phase_it_runs_in_and_which_steps_ran(tmp_path, monkeypatch):
    """report.json from the Report step: the decoding phase it runs in closed (as the runner's end wrote it before),
    the plan's steps with which ran in this run, the token counts read back from text.json when no step of this
    run set them (a resume that skipped the encoder and the denoiser), and the estimate priced here, once, with the
    conditioning cache as the job found it at its start (its own encode fills the cache meanwhile)."""
    from types import SimpleNamespace

    from orchestrator.engine.report import JobReport
    plan = _plan()
    r = _runner(tmp_path, plan)
    r.settings.timing_plot_timeout_s = 0.0
    priced = []
    monkeypatch.setattr("orchestrator.engine.plan.report_step.safe_estimate",
                        lambda spec, cfg, packs, cached: priced.append((spec, cached)) or {"label": "modelled"})
    r.spec, r.cfg, r.d, r.prompts_cached = "spec", None, SimpleNamespace(packs={}), False
    r.report, r.job = JobReport("j", {"prompt": "a"}), SimpleNamespace(id="j")
    r.report.phases = [["denoising", 0.0, 1.0]]
    r._phase, r._ran = ["decoding", 1.0], {plan.steps[2], plan.steps[3]}
    (tmp_path / "text.json").write_text('{"t5_tokens_prompt": 3, "t5_tokens_negative": 1}')
    r._step_report(plan.steps[-1])
    rep = json.loads((tmp_path / "report.json").read_text())
    assert [p[0] for p in rep["phases"]] == ["denoising", "decoding"] and rep["phases"][1][1] == 1.0
    assert [(p["step"], p["stage"], p["ran"]) for p in rep["plan"]] == [
        ("EncodeText", "encoder", False), ("Denoise[0]", "scheduler", False), ("Decode[0]", "vae", True),
        ("Deliver", None, True), ("Report", None, True)]
    assert rep["text"] == {"t5_tokens_prompt": 3, "t5_tokens_negative": 1}
    assert rep["estimate"] == {"label": "modelled"} and priced == [("spec", False)]
    r._write_report()                                     # written again (a failure after): not priced again
    assert len(priced) == 1
    assert r.report.finished is not None and r._phase is None
    r._close_phase()                                      # the runner's own close after the step: nothing more
    assert [p[0] for p in r.report.phases] == ["denoising", "decoding"]
