"""img2img and inpaint through the real daemon and supervisord with stand-in stages (tests/orch_doubles.py): the
prompt's init_image / mask read from the upload folder and kept in the job folder at submit, VAE_ENCODE run by the
VAE stage (stopped before the denoise), DENOISE given the init latent, the noise mask at the latent's size and the
denoise; a job killed mid-way resumes from the same latent bitwise; bad inputs refused naming the field."""
from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrator.terminal.cli import CliError
from orchestrator.engine.inputs import save_upload
from tests.doubles_harness import Doubles
from tests.signals import signal_process

W, H = 64, 64


@pytest.fixture(scope="module")
def d():
    root = Path(tempfile.mkdtemp(prefix="anima-img2img-"))
    with Doubles.start(root, [(W, H)]) as d:
        yield d


@pytest.fixture(autouse=True)
def _flags(d):
    for name in ("double_step_s", "double_vae_encode_s", "double_vae_encoding", "double_encode_s", "double_encoding"):
        d.flag(name, None)


def _png(a: np.ndarray, mode: str) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(a, mode).save(buf, format="PNG")
    return buf.getvalue()


def _image(seed: int, w: int = W, h: int = H) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)          # [H, W, 3] u8


def _block_mask() -> np.ndarray:
    """255 on whole 8x8 blocks (the left half, and one block more): bilinear to the latent's size is then exactly
    the block's value, which the test computes by slicing instead."""
    m = np.zeros((H, W), np.uint8)
    m[:, : W // 2] = 255
    m[8:16, 40:48] = 255
    return m


def _upload(d, name: str, data: bytes) -> str:
    assert save_upload(d.rf.root, "input", "t", name, data, overwrite=True) == name
    return f"t/{name} [input]"



def _expected_init_latent(pixels: np.ndarray, channels: int) -> np.ndarray:
    """The double's encoder by another route: each 8x8 block's mean of 2 * pixel / 255 - 1, by loops over blocks."""
    x = pixels.astype(np.float64) / 255.0 * 2.0 - 1.0
    out = np.zeros((channels, H // 8, W // 8))
    for c in range(channels):
        for i in range(H // 8):
            for j in range(W // 8):
                out[c, i, j] = x[i * 8:(i + 1) * 8, j * 8:(j + 1) * 8, c % 3].mean()
    return out


def test_inpaint_job_encodes_the_kept_image_and_denoises_from_it(d):
    pixels, mask = _image(1), _block_mask()
    job = d.submit({"prompt": "a girl", "seed": 3, "steps": 3, "denoise": 0.6,
                    "init_image": _upload(d, "init.png", _png(pixels, "RGB")),
                    "mask": _upload(d, "mask.png", _png(mask, "L"))})
    jd = d.rf.jobs / job
    assert (jd / "init_image.png").exists() and (jd / "mask.png").exists()     # kept before SUBMITTED came back
    info = d.wait(job, ("done", "failed"))
    assert info.state == "done", info
    init = np.load(jd / "init_latent.npy")
    expected = _expected_init_latent(pixels, init.shape[0])
    assert np.abs(init - expected).max() < 1.01e-3                           # the double's jitter is below 1e-3
    noise_mask = mask[::8, ::8] / 255.0                                        # each block's value, latent size
    want = (2 * init + noise_mask[None].astype(np.float32) + np.float32(0.6)).astype(np.float32)
    np.testing.assert_array_equal(np.load(jd / "latent.npy"), want)
    report = json.loads((jd / "report.json").read_text())
    assert report["teardown"]["vae_running_during_denoise"] is False
    assert report["vae_encode_timings"]["encode_s"] > 0
    assert d.sup.info("vae").state != "RUNNING"


def test_orchestrator_killed_mid_denoise_resumes_from_the_same_latent(d):
    d.flag("double_step_s", "0.3")
    pixels = _image(3)
    job = d.submit({"prompt": "a girl", "seed": 5, "steps": 8, "denoise": 0.8,
                    "init_image": _upload(d, "resume.png", _png(pixels, "RGB")),
                    "mask": _upload(d, "resume_mask.png", _png(_block_mask(), "L"))})
    d.wait(job, ("denoising",), pred=lambda i: i.progress is not None and i.progress.step >= 2)
    before = np.load(d.rf.jobs / job / "init_latent.npy")
    old = d.sigkill("orchestrator")           # supervisord restarts it; the job resumes in place
    d.flag("double_step_s", "0.02")
    info = d.wait(job, ("done", "failed"), timeout_s=90)
    assert info.state == "done", info
    assert d.sup.info("orchestrator").pid != old
    jd = d.rf.jobs / job
    after = np.load(jd / "init_latent.npy")
    np.testing.assert_array_equal(after, before)              # not encoded again (the double's jitter would differ)
    mask = _block_mask()[::8, ::8] / 255.0
    want = (2 * before + mask[None].astype(np.float32) + np.float32(0.8)).astype(np.float32)
    np.testing.assert_array_equal(np.load(jd / "latent.npy"), want)


def test_vae_killed_mid_encode_is_asked_again(d):
    d.flag("double_vae_encode_s", "30")
    pixels = _image(4)
    job = d.submit({"prompt": "a girl", "seed": 6, "steps": 2,
                    "init_image": _upload(d, "killed.png", _png(pixels, "RGB"))})
    marker = d.rf.root / "double_vae_encoding"
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    signal_process(int(marker.read_text()))
    info = d.wait(job, ("done", "failed"), timeout_s=90)
    assert info.state == "done", info
    init = np.load(d.rf.jobs / job / "init_latent.npy")
    assert np.abs(init - _expected_init_latent(pixels, init.shape[0])).max() < 1.01e-3


def test_an_image_of_another_size_is_fitted_and_sampled_without_a_mask(d):
    from PIL import Image
    pixels = _image(5, w=W * 2, h=H)
    job = d.submit({"prompt": "a girl", "seed": 7, "steps": 2, "resize_mode": 0, "denoise": 0.5,
                    "init_image": _upload(d, "wide.png", _png(pixels, "RGB"))})
    assert d.wait(job, ("done", "failed")).state == "done"
    jd = d.rf.jobs / job
    kept = Image.open(jd / "init_image.png")
    ref = Image.fromarray(pixels, "RGB").resize((W, H), resample=Image.LANCZOS)     # A1111's "just resize"
    assert kept.size == (W, H)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(ref))
    assert not (jd / "mask.png").exists()                     # no mask: no noise mask reaches the scheduler
    init = np.load(jd / "init_latent.npy")
    np.testing.assert_array_equal(np.load(jd / "latent.npy"), (2 * init + np.float32(0.5)).astype(np.float32))


def test_a_kept_image_gone_before_its_encode_fails_the_job_naming_it(d):
    d.flag("double_encode_s", "2")                           # the text encoder holds the job in `encoding` a while
    job = d.submit({"prompt": "a girl", "seed": 8, "steps": 2,
                    "init_image": _upload(d, "gone.png", _png(_image(10), "RGB"))})
    marker = d.rf.root / "double_encoding"
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (d.rf.jobs / job / "init_image.png").unlink()
    info = d.wait(job, ("done", "failed"))
    assert info.state == "failed" and info.error_stage == "orchestrator", info
    assert "init_image.png cannot be read" in info.error and "Traceback" not in info.error, info.error


@pytest.mark.parametrize("fields, field, words", [
    ({"init_image": "t/nothing.png [input]"}, "init_image", "is not an uploaded image"),
    ({"init_image": "../../etc/passwd"}, "init_image", "'..'"),
    ({"init_image": "t/notimage.png [input]"}, "init_image", "notimage.png"),
    ({"init_image": "t/big.png [input]"}, "init_image", f"is 128x64 but the job is {W}x{H}"),
    ({"init_image": "t/ok.png [input]", "mask": "t/big.png [input]"}, "mask", f"is 128x64 but the job is {W}x{H}"),
    ({"mask": "t/ok.png [input]"}, "mask", "needs an init_image"),
    ({"init_image": "t/ok.png [input]", "denoise": 0}, "denoise", "(0, 1]"),
    ({"init_image": "t/ok.png [input]", "init_mix": {"image": "t/big.png [input]", "kind": "blend"}},
     "init_mix.image", f"is 128x64 but the job is {W}x{H}"),
    ({"init_image": "t/ok.png [input]", "init_mix": {"image": "t/nothing.png [input]", "kind": "blend"}},
     "init_mix.image", "is not an uploaded image"),
    ({"init_image": "t/ok.png [input]", "init_mix": {"image": "t/notimage.png [input]", "kind": "blend"}},
     "init_mix.image", "notimage.png"),
])
def test_bad_inputs_are_refused_naming_the_field_and_queue_nothing(d, fields, field, words):
    _upload(d, "notimage.png", b"this is not a PNG")
    _upload(d, "big.png", _png(_image(6, w=W * 2, h=H), "RGB"))
    _upload(d, "ok.png", _png(_image(7), "RGB"))
    before = sorted(p.name for p in d.rf.jobs.iterdir())
    with pytest.raises((CliError, ValueError)) as e:          # the daemon's answer, or the record's own check
        d.submit({"prompt": "a girl", "seed": 1, "steps": 2, **fields})
    assert f"'{field}'" in str(e.value) and words in str(e.value), str(e.value)
    assert sorted(p.name for p in d.rf.jobs.iterdir()) == before


def test_generate_uploads_its_files_and_runs_img2img(d, tmp_path, capsys):
    from orchestrator.terminal import cli
    pixels, mask = _image(8), _block_mask()
    (tmp_path / "start.png").write_bytes(_png(pixels, "RGB"))
    (tmp_path / "hole.png").write_bytes(_png(mask, "L"))
    rc = cli.main(["--run", str(d.rf.root), "generate", "a girl", "--seed", "9", "--steps", "2", "--json",
                   "--init-image", str(tmp_path / "start.png"), "--mask", str(tmp_path / "hole.png"),
                   "--denoise", "0.7"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    job = json.loads(out.out.strip().splitlines()[-1])["job"]
    jd = d.rf.jobs / job
    assert (d.rf.root / "input" / "cli" / "start.png").read_bytes() == (tmp_path / "start.png").read_bytes()
    spec = json.loads((jd / "job.json").read_text())["spec"]
    assert spec["init_image"] == "cli/start.png [input]" and spec["denoise"] == 0.7
    init = np.load(jd / "init_latent.npy")
    want = (2 * init + (mask[::8, ::8] / 255.0)[None].astype(np.float32) + np.float32(0.7)).astype(np.float32)
    np.testing.assert_array_equal(np.load(jd / "latent.npy"), want)


@pytest.mark.parametrize("extra, flag", [
    (["--init-image", "NOTIMAGE"], "--init-image"),
    (["--init-image", "MISSING"], "--init-image"),
    (["--init-image", "OK", "--denoise", "0"], "--denoise"),
    (["--mask", "OK"], "--mask"),
])
def test_generate_refuses_bad_img2img_options_naming_them(d, tmp_path, capsys, extra, flag):
    from orchestrator.terminal import cli
    (tmp_path / "NOTIMAGE").write_bytes(b"GIF89a not really")
    (tmp_path / "OK").write_bytes(_png(_image(9), "RGB"))
    args = [str(tmp_path / a) if a in ("NOTIMAGE", "MISSING", "OK") else a for a in extra]
    before = sorted(p.name for p in d.rf.jobs.iterdir())
    rc = cli.main(["--run", str(d.rf.root), "generate", "a girl", "--steps", "2", *args])
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and "Traceback" not in err, err
    assert sorted(p.name for p in d.rf.jobs.iterdir()) == before


def test_remote_vae_encodes_inline(tmp_path):
    """A tcp VAE (a second process on loopback, as on another machine): the init image goes to VAE_ENCODE inline and
    the latent comes back inline; supervisord's VAE is never started."""
    import socket
    import subprocess
    import sys
    from tests.doubles_harness import DOUBLES
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = tmp_path / "remote"
    remote.mkdir(mode=0o700)
    (remote / "remote.toml").write_text(f'run_dir = "{remote}"\n[endpoints]\nvae = "tcp://127.0.0.1:{port}"\n'
                                        "[security]\nallow_plaintext_loopback = true\n")
    vae = subprocess.Popen([sys.executable, str(DOUBLES), "vae", "--config", str(remote / "remote.toml")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = Path(tempfile.mkdtemp(prefix="anima-img2img-remote-"))
    try:
        extra = f'[endpoints]\nvae = "tcp://127.0.0.1:{port}"\n[security]\nallow_plaintext_loopback = true\n'
        with Doubles.start(root, [(W, H)], extra_toml=extra) as d:
            pixels = _image(11)
            job = d.submit({"prompt": "a girl", "seed": 2, "steps": 2, "denoise": 0.5,
                            "init_image": _upload(d, "remote.png", _png(pixels, "RGB"))})
            info = d.wait(job, ("done", "failed"), timeout_s=90)
            assert info.state == "done", f"{info}\n{d.logs()}"
            init = np.load(d.rf.jobs / job / "init_latent.npy")
            assert np.abs(init - _expected_init_latent(pixels, init.shape[0])).max() < 1.01e-3
            report = json.loads((d.rf.jobs / job / "report.json").read_text())
            assert report["stages"]["vae"]["remote"] is True
            assert d.sup.info("vae").start == 0                       # never started through supervisord
    finally:
        vae.terminate()
        vae.wait(timeout=20)


def test_latent_mix_after_a_killed_daemon_mixes_the_same_latents_bitwise(d):
    """latent_mix (LatentComposite of the init latent onto each result, 2 rows down, feathered): the daemon killed
    in image 1's pass; the resumed job keeps image 0's latent, then mixes each image's latent with the init latent in
    the daemon (mixed_latent[_1].npy, what ComfyUI's node gives: models.sampling.latent_mix) and decodes that; a
    blend before a second pass is the latent that pass starts from."""
    from models.sampling.latent_mix import mix_image
    d.flag("double_step_s", "0.3")
    job = d.submit({"prompt": "a girl", "seed": 9, "steps": 4, "denoise": 0.7, "batch": 2,
                    "init_image": _upload(d, "mix.png", _png(_image(9), "RGB")),
                    "latent_mix": {"kind": "composite", "x": 16, "feather": 16}})
    jd = d.rf.jobs / job
    d.wait(job, ("denoising",), pred=lambda i: (jd / "latent.npy").exists() and i.progress is not None
          and i.progress.step >= 1)
    first = (jd / "latent.npy").stat().st_mtime_ns
    d.sigkill("orchestrator")                                 # supervisord restarts it; the job resumes in place
    d.flag("double_step_s", "0.02")
    info = d.wait(job, ("done", "failed"), timeout_s=90)
    assert info.state == "done", info
    assert (jd / "latent.npy").stat().st_mtime_ns == first    # image 0's pass not run again
    init = np.load(jd / "init_latent.npy")
    from PIL import Image
    for suffix in ("", "_1"):
        latent = np.load(jd / f"latent{suffix}.npy")
        mixed = np.load(jd / f"mixed_latent{suffix}.npy")
        np.testing.assert_array_equal(mixed, mix_image("composite", latent, init, x=16, feather=16))
        assert np.array_equal(mixed[:, :2], latent[:, :2]) and not np.allclose(mixed[:, 2:], latent[:, 2:])
        with Image.open(jd / f"image{suffix}.png") as im:      # the double decodes int(latent[0]) % 256 per cell
            grey = np.asarray(im.convert("L"))[::8, ::8]
        np.testing.assert_array_equal(grey, (mixed[0].astype(np.int64) % 256).astype(np.uint8))
        assert not np.array_equal(grey, (latent[0].astype(np.int64) % 256).astype(np.uint8))   # not the pass's
    # before a second pass (chained on the same pack): the mixed latent is what it starts from (the double gives
    # 2 * start + denoise; not the unmixed one's)
    job = d.submit({"prompt": "a girl", "seed": 9, "steps": 2, "denoise": 0.7, "hires": {"denoise": 0.5},
                    "init_image": _upload(d, "mix.png", _png(_image(9), "RGB")),
                    "latent_mix": {"kind": "blend", "factor": 0.25, "onto": "image"}})
    assert d.wait(job, ("done", "failed"), timeout_s=90).state == "done"
    jd = d.rf.jobs / job
    mixed = np.load(jd / "mixed_latent.npy")
    np.testing.assert_array_equal(mixed, mix_image("blend", np.load(jd / "init_latent.npy"),
                                                   np.load(jd / "latent.npy"), factor=0.25))
    from models.vae.latent import denormalize, normalize
    start = normalize(denormalize(mixed))           # the chained KSampler's process_latent_out/in round trip
    np.testing.assert_array_equal(np.load(jd / "hires_latent.npy"), (2 * start + np.float32(0.5)).astype(np.float32))


def _until(d, done, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"never {what}\n{d.logs()}"
        time.sleep(0.02)


def test_init_mix_after_killed_daemons_starts_from_the_same_mixed_latent_bitwise(d):
    """init_mix (LatentComposite of init_image's latent onto another upload's before the first pass, 2 rows down,
    feathered; a batch of 2): the daemon killed inside the other upload's VAE_ENCODE, then inside image 1's Denoise.
    The first resume keeps init_encoded.npy (the double's fresh jitter would show a second encode), encodes the other
    upload and mixes; the second runs no encode and no MixStart again. init_latent.npy is ComfyUI's node on the two
    encoded latents (models.sampling.latent_mix), and each image's pass starts from it."""
    from models.sampling.latent_mix import mix_image
    job_fields = {"prompt": "a girl", "seed": 11, "steps": 4, "denoise": 0.7, "batch": 2,
                  "init_image": _upload(d, "mixa.png", _png(_image(21), "RGB")),
                  "init_mix": {"image": _upload(d, "mixb.png", _png(_image(22), "RGB")), "kind": "composite",
                               "onto": "image", "x": 16, "feather": 16}}
    d.flag("double_vae_encode_s", "1.0")
    job = d.submit(job_fields)
    jd, marker = d.rf.jobs / job, d.rf.root / "double_vae_encoding"
    assert (jd / "mix_image.png").exists()                    # kept at submit beside init_image.png
    _until(d, marker.exists, "inside the init image's VAE_ENCODE")
    marker.unlink()
    d.flag("double_vae_encode_s", "1.0")                      # the next one (the other upload's) is slow too
    _until(d, lambda: marker.exists() and (jd / "init_encoded.npy").exists(), "inside the other upload's encode")
    encoded = (jd / "init_encoded.npy").read_bytes()
    d.sigkill("orchestrator")
    d.flag("double_step_s", "0.3")
    _until(d, lambda: (jd / "latent.npy").exists() and (jd / "batch_1").exists(), "inside image 1's Denoise")
    start = (jd / "init_latent.npy").stat().st_mtime_ns
    d.close_client()
    d.sigkill("orchestrator")
    d.flag("double_step_s", "0.02")
    info = d.wait(job, ("done", "failed"), timeout_s=90)
    assert info.state == "done", info
    assert (jd / "init_encoded.npy").read_bytes() == encoded  # not encoded again after the first kill
    assert (jd / "init_latent.npy").stat().st_mtime_ns == start   # nor mixed again after the second
    a, b = np.load(jd / "init_encoded.npy"), np.load(jd / "mix_encoded.npy")
    for name, pixels in (("init_encoded", _image(21)), ("mix_encoded", _image(22))):
        assert np.abs(np.load(jd / f"{name}.npy") - _expected_init_latent(pixels, a.shape[0])).max() < 1.01e-3
    init = np.load(jd / "init_latent.npy")
    np.testing.assert_array_equal(init, mix_image("composite", b, a, x=16, feather=16))
    assert np.array_equal(init[:, :2], b[:, :2]) and not np.allclose(init[:, 2:], b[:, 2:])
    want = (2 * init + np.float32(0.7)).astype(np.float32)           # the double: 2 * start + denoise
    for suffix in ("", "_1"):
        np.testing.assert_array_equal(np.load(jd / f"latent{suffix}.npy"), want)
    plan = json.loads((jd / "report.json").read_text())["plan"]          # the last run's: no encode, no mix
    assert [(s["step"], s["ran"]) for s in plan if s["step"].startswith(("EncodeImage", "MixStart"))] == \
        [("EncodeImage", False), ("EncodeImage[mix]", False), ("MixStart", False)], plan
