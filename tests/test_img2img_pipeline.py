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

from models.models_dir import resolve_models
from models.packs.pack import load_pack
from models.runtime.dit_runner import DiTRunner
from models.sampling import latent_ops as lo
from models.sampling.denoise import denoise
from models.sampling.img2img import LatentPlan, LatentSampler, start_or_resume_latent
from orchestrator.inputs import save_upload

THREADS = 1
JOB = {"prompt": "1girl, silver hair", "negative_prompt": "worst quality", "seed": 77, "steps": 3, "cfg": 4.0,
       "sampler": "euler_ancestral", "scheduler": "karras", "spectrum": False, "denoise": 0.6}


@pytest.fixture(scope="module")
def pipe(default_pipeline):
    assert default_pipeline.toml_args["threads"] == THREADS
    return default_pipeline


def _png(a: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a, mode).save(buf, format="PNG")
    return buf.getvalue()


def test_inpaint_job_equals_in_process_encode_and_sampling(pipe, pipeline_assets):
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
    ref = s.result(denoise(DiTRunner(pack, threads=THREADS), s, state, cond, uncond))
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
