"""img2img + inpaint through the REAL stages (tiny bundle, 128x128 pack): the prompt's uploads read and kept by the
daemon, the VAE stage's real encoder run on the kept image (VAE_ENCODE), the scheduler's LatentSampler from that
latent with the noise mask, denoise and latent_fill; the final latent against in-process computation (models.vae's TorchEncoder,
models.sampling.img2img's LatentSampler and the DiT runner on the same pack and threads)."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from models.setup.models_dir import resolve_models
from models.packs.pack import load_pack
from models.sampling import latent_ops as lo
from models.sampling.denoise import denoise
from models.sampling.img2img import LatentPlan, LatentSampler, start_or_resume_latent
from orchestrator.engine.inputs import save_upload
from tests.pipeline_harness import reference_runner

THREADS = 1
JOB = {"prompt": "1girl, silver hair", "negative_prompt": "worst quality", "seed": 77, "steps": 3, "cfg": 4.0,
       "sampler": "euler_ancestral", "scheduler": "karras", "spectrum": False, "denoise": 0.6}


@pytest.fixture(scope="module")
def pipe(default_pipeline):
    assert default_pipeline.toml_args["threads"] == THREADS
    return default_pipeline


@pytest.fixture(scope="module")
def runner(pipeline_assets):
    """The references' DiT runner on the pipeline's pack and threads, shared by the module's three jobs."""
    r = reference_runner(pipeline_assets[1], threads=THREADS)
    yield r
    r.close()


def _png(a: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a, mode).save(buf, format="PNG")
    return buf.getvalue()


def test_inpaint_job_equals_in_process_encode_and_sampling(pipe, pipeline_assets, runner):
    models, pack_dir = pipeline_assets
    pack = load_pack(pack_dir)
    g, c = pack.geometry, pack.config
    shape = (c.latent_channels, g.latent_h, g.latent_w)
    yy, xx = np.mgrid[0:g.height, 0:g.width]
    pixels = np.stack([xx * 2, yy * 2, (xx + yy) % 256], -1).astype(np.uint8)        # [H, W, 3] a smooth picture
    mask = np.zeros((g.height, g.width), np.uint8)
    mask[:, g.width // 2:] = 255                                                   # repaint the right half
    save_upload(pipe.rf.root, "input", "e2e", "init.png", _png(pixels, "RGB"), overwrite=True)
    save_upload(pipe.rf.root, "input", "e2e", "mask.png", _png(mask, "L"), overwrite=True)
    # latent_fill (A1111's inpainting_fill 2) rides along: the masked part starts from the seed's noise
    job = pipe.submit({**JOB, "init_image": "e2e/init.png [input]", "mask": "e2e/mask.png [input]",
                       "latent_fill": "noise"})
    info = pipe.wait(job, timeout_s=600)
    assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
    jd = pipe.job_dir(job)

    # the encoder: the stage's latent is the torch encoder's on the same pixels (2 * p / 255 - 1)
    from models.vae.encode import TorchEncoder
    image = (pixels.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(2, 0, 1)
    vae = resolve_models(models, {"vae": None}, need=("vae",)).vae
    want_init = TorchEncoder.open(vae, threads=THREADS).encode(image).latent
    init = np.load(jd / "init_latent.npy")
    assert init.shape == shape
    np.testing.assert_allclose(init, want_init, rtol=0, atol=1e-5)

    # the sampling: from that latent, ComfyUI's noise mask at the latent's size, denoise 0.6
    noise_mask = lo.prepare_mask(mask.astype(np.float32) / 255.0, (1,) + shape)[0]
    s = LatentSampler(steps=3, cfg=4.0, sampler="euler_ancestral", scheduler="karras", spectrum=None,
                      plan=LatentPlan(denoise=0.6, masked=True))
    cond, uncond = np.load(jd / "cond.npy"), np.load(jd / "uncond.npy")
    state = start_or_resume_latent(s, 77, shape, image=init, mask=noise_mask, fill="noise")
    ref = s.result(denoise(runner, s, state, cond, uncond))
    latent = np.load(jd / "latent.npy")
    np.testing.assert_array_equal(latent, ref)
    keep = noise_mask == 0
    np.testing.assert_allclose(latent[keep], init[keep], atol=1e-4)             # the left half is the init latent
    report = pipe.report(job)
    assert report["teardown"]["vae_running_during_denoise"] is False
    assert report["vae_encode_timings"]["encode_s"] > 0
    own = json.loads(Image.open(info.image).text["anima"])
    assert own["denoise"] == 0.6 and own["init_image"] == "e2e/init.png [input]"
    print(f"\nimg2img job: report wall {report['wall_s']:.1f} s, encode {report['vae_encode_timings']['encode_s']:.2f} s")


def test_pixel_hires_job_through_the_real_vae_equals_in_process_decode_scale_encode_and_sampling(pipe,
                                                                                                  pipeline_assets,
                                                                                                  runner):
    """prompt.json hires space "pixel" on the one pack (scale 1: the second pass on the same pack, its own arena with
    the init slot): the real VAE stage decodes the first latent (inline, first.png), the image goes through
    ImageScaleBy's lanczos (at scale 1: Pillow's LANCZOS to the same size) and the real VAE_ENCODE (inline), and the
    second pass samples from that latent with its own prompt (encoded in the first pass's encoder session), sampler,
    scheduler, cfg and seed."""
    from models.vae.api import VAE
    from models.vae.encode import TorchEncoder
    models, pack_dir = pipeline_assets
    pack = load_pack(pack_dir)
    g, c = pack.geometry, pack.config
    shape = (c.latent_channels, g.latent_h, g.latent_w)
    hires = {"scale": 1.0, "space": "pixel", "method": "lanczos", "steps": 2, "denoise": 0.5,
             "sampler": "euler", "scheduler": "simple", "cfg": 3.0, "seed": 5, "prompt": "1girl, red hair"}
    job = pipe.submit({**JOB, "steps": 2, "denoise": 1.0, "hires": hires})
    info = pipe.wait(job, timeout_s=600)
    assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
    jd = pipe.job_dir(job)
    vae = resolve_models(models, {"vae": None}, need=("vae",)).vae
    first = np.load(jd / "latent.npy")
    want_px = VAE.open(vae, threads=THREADS).decode(first).image                      # [H, W, 3] u8
    with Image.open(jd / "first.png") as im:
        got_px = np.asarray(im.convert("RGB"))
    np.testing.assert_array_equal(got_px, want_px)
    scaled = np.asarray(Image.fromarray(want_px).resize((g.width, g.height), resample=Image.Resampling.LANCZOS))
    image = (scaled.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(2, 0, 1)
    start = TorchEncoder.open(vae, threads=THREADS).encode(image).latent
    np.testing.assert_allclose(np.load(jd / "hires_init.npy"), start, rtol=0, atol=1e-5)
    s = LatentSampler(steps=2, cfg=3.0, sampler="euler", scheduler="simple", spectrum=None,
                      plan=LatentPlan(denoise=0.5))
    cond, uncond = np.load(jd / "hires_cond.npy"), np.load(jd / "hires_uncond.npy")
    assert not np.array_equal(cond, np.load(jd / "cond.npy"))                    # its own prompt's context
    np.testing.assert_array_equal(uncond, np.load(jd / "uncond.npy"))           # the same negative, encoded again
    state = start_or_resume_latent(s, 5, shape, image=np.load(jd / "hires_init.npy"))
    ref = s.result(denoise(runner, s, state, cond, uncond))
    np.testing.assert_array_equal(np.load(jd / "hires_latent.npy"), ref)
    report = pipe.report(job)
    assert report["teardown"] == {**report["teardown"], "vae_running_during_denoise": False,
                                  "encoder_running_during_denoise": False}
    with Image.open(info.image) as im:
        assert "Hires upscale: 1.0, Hires steps: 2, Hires upscaler: Lanczos, Hires sampler: Euler, " \
               "Hires schedule type: Simple, Hires CFG Scale: 3.0, Hires prompt: \"1girl, red hair\", Hires seed: 5," \
               in im.text["parameters"]
    print(f"\npixel hires job: report wall {report['wall_s']:.1f} s")


def test_split_sampling_job_equals_in_process_chained_windows(pipe, pipeline_assets, runner):
    """ComfyUI's split sampling as prompt.json says it (a ComfyUI graph of two chained KSamplerAdvanced maps onto
    it): the first pass steps 0..2 of 4 returning its leftover noise (cfg 4), the second (its own sampler, cfg 1.5)
    from step 2 to the end adding no noise, on the first latent as it is (through the LATENT's VAE space and back,
    as ComfyUI's next KSampler takes it). Reference: both windows run in process, the second from the first's
    latent."""
    from models.vae.latent import denormalize, normalize
    models, pack_dir = pipeline_assets
    pack = load_pack(pack_dir)
    g, c = pack.geometry, pack.config
    shape = (c.latent_channels, g.latent_h, g.latent_w)
    second = {"steps": 4, "denoise": 1.0, "start_step": 2, "add_noise": False, "cfg": 1.5, "sampler": "dpmpp_2m"}
    job = pipe.submit({**JOB, "steps": 4, "denoise": 1.0, "end_step": 2, "leftover_noise": True, "hires": second})
    info = pipe.wait(job, timeout_s=600)
    assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
    jd = pipe.job_dir(job)
    cond, uncond = np.load(jd / "cond.npy"), np.load(jd / "uncond.npy")
    s1 = LatentSampler(steps=4, cfg=4.0, sampler="euler_ancestral", scheduler="karras", spectrum=None,
                       plan=LatentPlan.advanced(True, 0, 2, True))
    first = s1.result(denoise(runner, s1, start_or_resume_latent(s1, 77, shape), cond, uncond))
    np.testing.assert_array_equal(np.load(jd / "latent.npy"), first)
    s2 = LatentSampler(steps=4, cfg=1.5, sampler="dpmpp_2m", scheduler="karras", spectrum=None,
                       plan=LatentPlan.advanced(False, 2, 10000, False))
    state = start_or_resume_latent(s2, 77, shape, image=normalize(denormalize(first)))
    np.testing.assert_array_equal(np.load(jd / "hires_latent.npy"), s2.result(denoise(runner, s2, state, cond,
                                                                                       uncond)))
    assert not np.array_equal(np.load(jd / "hires_latent.npy"), first)
    assert {"Denoising strength: 1.0", "Hires steps: 4", "Hires CFG Scale: 1.5"} <= {
        p.strip() for p in Image.open(info.image).text["parameters"].split(",")}
