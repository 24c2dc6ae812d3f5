"""CLI pieces that need no daemon: progress line, timing table, stage names, key generation, run folder checks."""
import json
import stat

import pytest

from orchestrator.terminal import cli
from orchestrator.engine.report import JobReport, format_table, text_record
from orchestrator.engine.runfolder import RunFolder, init_run
from protocol import messages as m

ONE_PASS = m.DenoisePass(image=1, images=1)      # a job of one image, one sampling pass


def _info(state, progress=None, denoise_pass=None, position=0):
    return m.JobInfo(job="20260101-120000-a1b2c3", state=state, created=1.0, updated=2.0, progress=progress,
                     denoise_pass=denoise_pass, position=position)


def test_progress_line_shows_step_block_branch_and_eta():
    p = m.Progress(job="x", step=3, steps=10, block=12, branch="cross", cfg_pass="both", elapsed_s=20.0, eta_s=80.0,
                   blocks=28)
    line = cli._progress_line(_info("denoising", p))
    assert line.endswith("] step 3/10 · block 13/28 cross · ETA 1m20s"), line
    # no ETA from the stage: unknown, not a guess scaled from the steps so far (forecast steps made that swing)
    assert cli._progress_line(_info("denoising", p.replace(eta_s=None))).endswith("ETA ?")
    assert cli._progress_line(_info("encoding")).endswith(": encoding the prompt")
    assert cli._progress_line(_info("queued", position=2)).endswith(": queued (2 ahead)")


def test_progress_names_the_image_of_the_batch_and_the_hires_pass():
    from orchestrator.http.views import JobView
    p = m.Progress(job="x", step=4, steps=6, block=0, branch="self", elapsed_s=1.0, eta_s=5.0, blocks=2)
    cases = [(m.DenoisePass(image=2, images=3), "image 2/3 · step 4/6 · block 1/2 self · ETA 0m05s"),
             (m.DenoisePass(image=1, images=1, name="hires"), "hires pass · step 4/6"),
             (m.DenoisePass(image=3, images=3, name="hires"), "image 3/3 · hires pass · step 4/6"),
             (m.DenoisePass(image=1, images=1), "step 4/6")]
    for where, words in cases:
        info = _info("denoising", p, where)
        assert "] " + words in cli._progress_line(info), (where, cli._progress_line(info))
        fields = JobView.of(info).progress_fields()
        # the page's line (anima.progress `text`) is the CLI's, bar aside
        assert cli._progress_line(info).endswith("] " + fields["text"])
        assert (fields.get("image"), fields.get("images"), fields.get("pass")) == (where.image, where.images,
                                                                                   where.name)
    forecast = _info("denoising", p.replace(forecast=True), m.DenoisePass(image=2, images=3))
    assert cli._progress_line(forecast).endswith("] image 2/3 · step 4/6 · forecast · ETA 0m05s")


@pytest.mark.parametrize("state, position, words", [("queued", 0, "queued"), ("queued", 3, "queued (3 ahead)"),
                                                    ("encoding", 0, "encoding the prompt"),
                                                    ("denoising", 0, "denoising"),
                                                    ("decoding", 0, "decoding the image")])
def test_the_page_and_the_cli_say_a_phase_in_the_same_words(state, position, words):
    from orchestrator.http.views import JobView
    info = _info(state, position=position)
    assert cli._progress_line(info) == f"{info.job}: {words}"
    assert JobView.of(info).progress_fields()["text"] == words


def test_timing_table_lists_stages_and_branch_phases():
    r = JobReport("j", {"prompt": "a"})
    r.stages["encoder"].wall_s, r.stages["encoder"].peak_rss_mb = 3.5, 2500.0
    r.add_pass(ONE_PASS, {"computed_steps": [1, 2], "forecast_steps": [3], "branch_calls": 6, "host_s": 1.25,
                  "transport_s": 0.5, "branches": {"self": {"load_s": 1.0, "init_s": 2.0, "infer_s": 3.0,
                                                            "release_s": 0.25, "visible_s": 3.25, "calls": 2,
                                                            "cached": 1}}})
    d = r.to_dict()
    assert d["branches"]["self"] == {"load_s": 1.0, "init_s": 2.0, "infer_s": 3.0, "release_s": 0.25, "wait_s": 0.0,
                                     "visible_s": 3.25, "hidden_s": 0.0, "calls": 2, "cached": 1}
    assert d["branches"]["ffn"]["calls"] == 0 and d["teardown"]["encoder_running_during_denoise"] is False
    text = format_table(json.loads(json.dumps(d)))
    assert "encoder" in text and "2500" in text and "self" in text and "host ops 1.25 s" in text
    assert "6 branch calls, 2 computed steps (1 forecast)" in text


def test_report_says_latent_space_and_truncation():
    r = JobReport("j", {"prompt": "a"})
    r.text = text_record(20, 3, False)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["latent"]["space"] == "model" and "ComfyUI's SaveLatent stores latent * std + mean" in d["latent"]["note"]
    assert d["text"] == {"t5_tokens_prompt": 20, "t5_tokens_negative": 3, "context_rows": 512, "truncated": False}
    assert "truncated" not in format_table(d)
    r.text = text_record(700, 3, True)
    table = format_table(json.loads(json.dumps(r.to_dict())))
    assert "prompt truncated: prompt has 700 T5 tokens" in table and "ComfyUI keeps every row" in table
    assert "negative prompt has" not in table


def test_unknown_stage_is_a_usage_error(tmp_path, capsys):
    init_run(tmp_path / "run")
    assert cli.main(["--run", str(tmp_path / "run"), "restart", "nosuch"]) == 2
    assert "unknown stage 'nosuch'" in capsys.readouterr().err


def test_daemon_not_running_is_a_clear_error(tmp_path, capsys):
    init_run(tmp_path / "run")
    assert cli.main(["--run", str(tmp_path / "run"), "status"]) == 1
    assert "orchestrator daemon is not answering" in capsys.readouterr().err


def test_keys_generate_writes_0600_pairs(tmp_path, capsys):
    assert cli.main(["--run", str(tmp_path / "run"), "keys", "generate", "--dir", str(tmp_path / "k"),
                     "--name", "vae"]) == 0
    for name in ("vae.key", "vae.key_secret"):
        assert stat.S_IMODE((tmp_path / "k" / name).stat().st_mode) == 0o600
    import zmq.auth
    public, secret = zmq.auth.load_certificate(str(tmp_path / "k" / "vae.key_secret"))
    assert len(public) == 40 and len(secret) == 40
    # a second run must not silently replace a pair that stages are already paired with
    args = ["--run", str(tmp_path / "run"), "keys", "generate", "--dir", str(tmp_path / "k"), "--name", "vae"]
    assert cli.main(args) == 2
    assert "exists" in capsys.readouterr().err
    assert zmq.auth.load_certificate(str(tmp_path / "k" / "vae.key_secret")) == (public, secret)
    assert cli.main(args + ["--force"]) == 0
    assert zmq.auth.load_certificate(str(tmp_path / "k" / "vae.key_secret"))[0] != public


def test_run_folder_must_be_private_and_short(tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    with pytest.raises(ValueError, match="must be 0700"):
        RunFolder(d).check()
    with pytest.raises(ValueError, match="too long for unix sockets"):
        RunFolder(tmp_path / ("x" * 120)).check()
    from tests.doubles_harness import fake_pack
    rf = init_run(tmp_path / "run", pack_dir=fake_pack(tmp_path / "pack"))     # init refuses a pack that is not there
    assert 'pack_dir = "' in rf.pipeline_toml.read_text()
    from stages.config import load_config
    assert load_config(rf.pipeline_toml).run_dir == rf.root


def test_init_with_several_packs(tmp_path, capsys):
    """`init --pack P1 --pack P2`: the first is the default (pack_dir), the others `packs`; every process reads the
    same list; two packs of one size are refused before anything is written."""
    from stages.config import load_config
    from tests.doubles_harness import fake_pack
    a, b, c = fake_pack(tmp_path / "a", 64, 64), fake_pack(tmp_path / "b", 64, 32), fake_pack(tmp_path / "c", 64, 64)
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--pack", str(a), "--pack", str(b)]) == 0
    cfg = load_config(run / "pipeline.toml")
    assert cfg.pack_dir == a and cfg.packs == (a, b)
    from orchestrator.engine.packs import pack_sizes
    assert pack_sizes(RunFolder.resolve(run).pipeline_toml) == [(64, 64), (64, 32)]
    other = tmp_path / "run2"
    capsys.readouterr()
    assert cli.main(["--run", str(other), "init", "--pack", str(a), "--pack", str(c)]) == 2
    err = capsys.readouterr().err
    assert "are both 64x64; keep one pack per image size" in err and not other.exists()
    # submit checks a prompt against the packs' sizes (no daemon needed to refuse it)
    f = tmp_path / "p.json"
    f.write_text('{"prompt": "a", "width": 128, "height": 128}')
    assert cli.main(["--run", str(run), "submit", str(f)]) == 2
    assert "128x128 has no model pack; the sizes with a pack: 64x64, 64x32" in capsys.readouterr().err


def test_init_again_says_what_it_kept_and_force_keeps_the_old_file(tmp_path, capsys):
    """Reported: `init` on an existing run folder exited 0 printing as if it wrote the files, changing nothing, and
    `--force` silently dropped hand edits (port, models_dir). Now every file's fate is printed; --force keeps the
    replaced file beside the new one and names the settings that differ."""
    from tests.doubles_harness import fake_pack
    a = fake_pack(tmp_path / "a", 64, 64)
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--pack", str(a)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {run / 'pipeline.toml'}" in out and f"wrote {run / 'supervisord.conf'}" in out
    assert cli.main(["--run", str(run), "init", "--pack", str(a)]) == 0
    assert f"kept {run / 'pipeline.toml'} (already as init writes it)" in capsys.readouterr().out
    toml = run / "pipeline.toml"
    edited = toml.read_text().replace("[stage.http]\n", "[stage.http]\nport = 8190\n", 1)
    assert edited != toml.read_text()
    toml.write_text(edited)
    assert cli.main(["--run", str(run), "init", "--pack", str(a)]) == 0
    out = capsys.readouterr().out
    assert f"kept {toml} as it is (yours; --force writes it again" in out and toml.read_text() == edited
    assert cli.main(["--run", str(run), "init", "--pack", str(a), "--force"]) == 0
    out = capsys.readouterr().out
    assert f"replaced {toml}; the previous one is pipeline.toml.before-init: stage.http.port differ" in out
    assert (run / "pipeline.toml.before-init").read_text() == edited and "port = 8190" not in toml.read_text()


def test_submit_stdin_limits_and_generate_names_options(tmp_path, capsys, monkeypatch):
    """Checked before any daemon is asked: too much or nothing on stdin, and generate's options by name."""
    import io
    from orchestrator.engine.prompt_spec import MAX_FILE_BYTES
    run = init_run(tmp_path / "run")
    big = json.dumps({"prompt": "a" * 10, "negative_prompt": " " * MAX_FILE_BYTES}).encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(big)))
    assert cli.main(["--run", str(run.root), "submit", "-"]) == 2
    assert f"standard input holds more than {MAX_FILE_BYTES} bytes" in capsys.readouterr().err
    assert cli.main(["--run", str(run.root), "generate", "a", "--seed", str(2**64)]) == 2
    assert "error: --seed: must be in 0.." in capsys.readouterr().err
    assert cli.main(["--run", str(run.root), "generate", "a", "--cfg", "inf"]) == 2
    assert "error: --cfg: must be in [1.0, 30.0], got inf" in capsys.readouterr().err
    assert cli.main(["--run", str(run.root), "generate", "a", "--negative", "x\udcff"]) == 2
    assert "error: --negative: not valid UTF-8 text" in capsys.readouterr().err
    assert cli.main(["--run", str(run.root), "generate", "a", "--lora", "style:0.8:500"]) == 2
    assert "error: --lora: LoRA style: clip_strength must be a number in [-100, 100], got 500.0" in \
        capsys.readouterr().err
    assert cli.main(["--run", str(run.root), "generate", "a", "--lora", ":0.8"]) == 2
    assert "error: --lora: --lora ':0.8': expected FILE[:STRENGTH[:CLIP_STRENGTH]]" in capsys.readouterr().err


def test_serve_exits_2_only_for_a_bad_config(tmp_path, monkeypatch, capsys, caplog):
    """supervisord leaves a program down after exit 2 (exitcodes=2): a bad config or pack is 2, but the daemon breaking
    while it serves (a ValueError or OSError from deep inside) is 1, so it is started again."""
    import orchestrator.engine.daemon
    from models.packs.pack import PackError
    from stages.config import ConfigError
    init_run(tmp_path / "run")
    args = ["--run", str(tmp_path / "run"), "serve", "--config", str(tmp_path / "run" / "pipeline.toml")]
    for error, code in ((ConfigError("pipeline.toml: stage.x: bad"), 2), (PackError("no pack"), 2),
                        (ValueError("Exceeds the limit (4300 digits)"), 1), (OSError(36, "File name too long"), 1),
                        (RuntimeError("broken"), 1)):
        def fail(rf, path, *_, error=error):        # *_: the PNG formats serve is handed
            raise error
        monkeypatch.setattr(orchestrator.engine.daemon, "serve", fail)
        caplog.clear()
        assert cli.main(args) == code, error
        said = capsys.readouterr().err if code == 2 else caplog.text
        assert str(error).split(":")[0] in said, said


def test_prune_numbers_out_of_range_are_usage_errors(tmp_path, capsys):
    """`--older-than 9999...9d` and `--keep 9999...9` ended in a ProtocolError traceback; they are exit 2 naming the
    option and the range, before the daemon is asked."""
    run = tmp_path / "run"
    for args, says in ((["--keep", "9" * 30], "--keep 99999"), (["--older-than", "9" * 30 + "d"], "--older-than 99999"),
                       (["--older-than", "9" * 400], "--older-than 99999")):
        assert cli.main(["--run", str(run), "prune", *args]) == 2
        err = capsys.readouterr().err
        assert says in err and ("out of range" in err or "not finite" in err), err


def test_a_reader_that_goes_away_is_not_an_error(tmp_path):
    """Reported: `orchestrator stages | head` ended in a Broken pipe error (and Python's second one at exit)."""
    import subprocess
    import sys
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init"]) == 0
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.terminal.cli", "--run", str(run), "init"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()                                   # gone before the first line
    err = p.stderr.read().decode()
    assert p.wait(60) == 0, err
    assert "Broken pipe" not in err and "BrokenPipeError" not in err, err


def test_run_goes_before_or_after_the_subcommand(tmp_path, capsys):
    """Reported: `orchestrator doctor --run R` was "unrecognized arguments" (only `--run R doctor` worked)."""
    run = tmp_path / "run"
    assert cli.main(["init", "--run", str(run)]) == 0
    assert (run / "pipeline.toml").is_file() and f"run folder {run}" in capsys.readouterr().out
    other = tmp_path / "other"
    assert cli.main(["--run", str(other), "init", "--run", str(run)]) == 0       # after the subcommand wins
    assert f"run folder {run}" in capsys.readouterr().out and not other.exists()


def test_generate_hires_and_batch_options_become_prompt_json_fields(tmp_path, capsys, monkeypatch):
    """--hires SCALE|WxH and its --hires-* options, --batch: the prompt.json `hires` and `batch` the job is queued
    with; a bad one is exit 2 naming the option (checked before any daemon is asked)."""
    import sys
    from tests.doubles_harness import fake_pack
    rf = init_run(tmp_path / "run", python=sys.executable)
    a, b = fake_pack(tmp_path / "p64", 64, 64), fake_pack(tmp_path / "p96", 96, 96)
    rf.pipeline_toml.write_text(f'run_dir = "."\npack_dir = "{a}"\npacks = ["{b}"]\nthreads = 1\n')
    queued = []
    monkeypatch.setattr(cli, "_queue", lambda args, rf, prompt, spec, **kw: queued.append(spec) or 0)
    base = ["--run", str(rf.root), "generate", "a girl", "--seed", "3"]
    assert cli.main([*base, "--batch", "2", "--hires", "1.5", "--hires-steps", "4", "--hires-denoise", "0.4",
                     "--hires-pixel", "--hires-sampler", "dpmpp_2m", "--hires-scheduler", "karras", "--hires-cfg",
                     "5", "--hires-seed", "9", "--hires-prompt", "a tall girl", "--hires-negative", "blurry",
                     "--hires-keep-base"]) == 0
    spec = queued.pop()
    assert spec.batch == 2
    assert spec.hires.to_dict() == {"scale": 1.5, "width": None, "height": None, "method": "lanczos",
                                    "space": "pixel", "steps": 4, "denoise": 0.4, "prompt": "a tall girl",
                                    "negative_prompt": "blurry", "sampler": "dpmpp_2m", "scheduler": "karras",
                                    "cfg": 5.0, "seed": 9, "start_step": None, "end_step": None, "add_noise": True,
                                    "leftover_noise": False,
                                    "keep_base": True}
    assert cli.main([*base, "--hires", "96x96", "--hires-method", "bislerp"]) == 0
    h = queued.pop().hires
    assert (h.width, h.height, h.scale, h.method, h.space, h.keep_base) == (96, 96, None, "bislerp", "latent", False)
    for extra, words in ((["--hires-steps", "3"], "--hires-steps: needs --hires SCALE|WxH"),
                         (["--hires-keep-base"], "--hires-keep-base: needs --hires SCALE|WxH"),
                         (["--hires", "big"], "--hires: 'big': expected a scale (1.5) or WxH"),
                         (["--hires", "2"], "--hires: the second pass at 128x128 has no model pack"),
                         (["--hires", "1.5", "--hires-denoise", "0"], "--hires-denoise: must be in (0, 1]"),
                         (["--hires", "1.5", "--hires-denoise", "1e-7"], "--hires-denoise: denoise 1e-07 at"),
                         (["--denoise", "1e-300"], "--denoise: denoise 1e-300 at"),
                         (["--hires", "1.5", "--hires-pixel", "--hires-method", "bislerp"], "--hires-method: bislerp"),
                         (["--hires", "1.5", "--hires-sampler", "nope"], "--hires-sampler: must be one of"),
                         (["--batch", "9"], "--batch: must be in 1..8, got 9")):
        assert cli.main([*base, *extra]) == 2, extra
        assert words in capsys.readouterr().err, extra
    assert queued == []


def test_init_add_pack_keeps_every_edit(tmp_path, capsys):
    """Reported: `init --pack A --pack B` on an existing run folder wrote nothing and `--force` dropped the user's
    edits (the port). `init --add-pack` adds the pack to pipeline.toml as an edit of its text: the hand-edited port and
    comments stay byte for byte, the pack is the daemon's next size, a second pack of one size is refused."""
    from stages.config import load_config
    from tests.doubles_harness import fake_pack
    a, b, c = fake_pack(tmp_path / "a", 64, 64), fake_pack(tmp_path / "b", 64, 32), fake_pack(tmp_path / "c", 32, 32)
    dup = fake_pack(tmp_path / "dup", 64, 32)
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--pack", str(a)]) == 0
    toml = run / "pipeline.toml"
    edited = toml.read_text().replace("[stage.http]\n", "[stage.http]\nport = 8190   # mine\n", 1)
    toml.write_text(edited)
    capsys.readouterr()
    assert cli.main(["--run", str(run), "init", "--add-pack", str(b)]) == 0
    assert f"added {b.resolve()} to {toml}" in capsys.readouterr().out
    text = toml.read_text()
    assert text == edited.replace(f"pack_dir = \"{a.resolve()}\"\n",
                                  f"pack_dir = \"{a.resolve()}\"\npacks = [\"{b.resolve()}\"]\n", 1)
    cfg = load_config(toml)
    assert cfg.packs == (a.resolve(), b.resolve()) and cfg.stage["http"].port == 8190
    assert cli.main(["--run", str(run), "init", "--add-pack", str(c), "--add-pack", str(b)]) == 0
    assert load_config(toml).packs == (a.resolve(), b.resolve(), c.resolve())
    assert "port = 8190   # mine\n" in toml.read_text()
    before = toml.read_text()
    assert cli.main(["--run", str(run), "init", "--add-pack", str(dup)]) == 2
    assert "are both 64x32; keep one pack per image size" in capsys.readouterr().err and toml.read_text() == before
    toml.write_text(before.replace("packs = [", "packs = [\n", 1))            # a shape it does not edit
    assert cli.main(["--run", str(run), "init", "--add-pack", str(fake_pack(tmp_path / "d", 96, 96))]) == 2
    assert "is not a one-line list" in capsys.readouterr().err
    assert cli.main(["--run", str(tmp_path / "none"), "init", "--add-pack", str(b)]) == 2
    assert "does not exist; make the run folder first" in capsys.readouterr().err
    bare = tmp_path / "bare"                               # init with no pack: its commented pack_dir takes the first
    assert cli.main(["--run", str(bare), "init"]) == 0
    assert cli.main(["--run", str(bare), "init", "--add-pack", str(a), "--add-pack", str(b)]) == 0
    assert load_config(bare / "pipeline.toml").packs == (a.resolve(), b.resolve())
    assert "# pack_dir" not in (bare / "pipeline.toml").read_text()
