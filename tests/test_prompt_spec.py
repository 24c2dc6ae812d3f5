"""prompt.json validation: malformed files exit 2 with a message naming the field, and nothing is queued."""
import json
import math
import re
from pathlib import Path

import pytest

from orchestrator.terminal import cli
from orchestrator.engine.prompt_spec import (MAX_FILE_BYTES, PromptError, PromptSpec, SpectrumSettings, load_prompt,
                                      parse_prompt_bytes)

RES = (512, 512)  # the (pretend) pack's resolution


def _j(**kw) -> str:
    return json.dumps({"prompt": "a girl", **kw})


# (id, file content (str or bytes), regex the message must contain: the field, or what is wrong with the file)
MALFORMED = [
    ("trailing-comma", '{"prompt": "a",}', r"invalid JSON at line 1"),
    ("empty-file", "", r"invalid JSON"),
    ("not-json", "prompt = a girl", r"invalid JSON"),
    ("top-array", "[1, 2]", r"top level must be a JSON object, got array"),
    ("top-string", '"a girl"', r"top level must be a JSON object, got string"),
    ("top-null", "null", r"top level must be a JSON object, got null"),
    ("nan", '{"prompt": "a", "cfg": NaN}', r"NaN is not valid JSON"),
    ("infinity", '{"prompt": "a", "cfg": Infinity}', r"Infinity is not valid JSON"),
    ("minus-infinity", '{"prompt": "a", "steps": -Infinity}', r"-Infinity is not valid JSON"),
    ("too-large", _j(negative_prompt="x" * (MAX_FILE_BYTES + 10)), r"the limit is 65536"),
    ("not-utf8", b'{"prompt": "\xff\xfe"}', r"not UTF-8"),
    ("deep-nesting", '{"prompt": "a", "spectrum": ' + "[" * 20000 + "]" * 20000 + "}",
     r"nested too deeply|field 'spectrum'"),
    ("missing-prompt", '{"steps": 20}', r"field 'prompt': is required"),
    ("prompt-number", '{"prompt": 5}', r"field 'prompt': must be a string, got integer"),
    ("prompt-blank", '{"prompt": "   "}', r"field 'prompt': must not be empty"),
    ("prompt-too-long", json.dumps({"prompt": "x" * 5000}), r"field 'prompt': is 5000 characters"),
    ("prompt-nul", '{"prompt": "a\\u0000b"}', r"field 'prompt': must not contain NUL"),
    ("duplicate-key", '{"prompt": "a", "prompt": "b"}', r"field 'prompt': appears twice"),
    ("unknown-field", _j(colour="red"), r"field 'colour': unknown field"),
    ("negative-list", _j(negative_prompt=["x"]), r"field 'negative_prompt': must be a string, got array"),
    ("seed-negative", _j(seed=-1), r"field 'seed': must be in 0\.\."),
    ("seed-2^64", _j(seed=2**64), r"field 'seed': must be in 0\.\."),
    ("seed-float", _j(seed=1.5), r"field 'seed': must be an integer"),
    ("seed-string", _j(seed="42"), r"field 'seed': must be an integer.*string"),
    ("steps-zero", _j(steps=0), r"field 'steps': must be in 1\.\.200, got 0"),
    ("steps-too-many", _j(steps=201), r"field 'steps': must be in 1\.\.200, got 201"),
    ("steps-bool", _j(steps=True), r"field 'steps': must be an integer.*boolean"),
    ("steps-float", _j(steps=20.0), r"field 'steps': must be an integer.*number"),
    ("cfg-low", _j(cfg=0.5), r"field 'cfg': must be in \[1\.0, 30\.0\]"),
    ("cfg-high", _j(cfg=31), r"field 'cfg': must be in \[1\.0, 30\.0\]"),
    ("cfg-string", _j(cfg="4"), r"field 'cfg': must be a number"),
    ("width-not-16", _j(width=500), r"field 'width': must be a multiple of 16"),
    ("width-negative", _j(width=-512), r"field 'width': must be in 16\.\."),
    ("height-zero", _j(height=0), r"field 'height': must be in 16\.\."),
    ("width-not-pack", _j(width=1024), r"field 'width': 1024x\S* has no model pack; the sizes with a pack: 512x512"),
    ("height-not-pack", _j(height=768), r"field 'height': \*x768 has no model pack"),
    ("sampler", _j(sampler="Euler a"), r"field 'sampler': must be one of 'euler', 'ddim', 'euler_ancestral'.*'er_sde'"),
    ("scheduler", _j(scheduler="Karras"), r"field 'scheduler': must be one of 'simple', 'sgm_uniform', 'karras'"),
    ("spectrum-heun", _j(sampler="heun", spectrum=True), r"field 'spectrum': Spectrum does not apply to sampler 'heun'"),
    ("spectrum-pece", _j(sampler="sa_solver_pece", spectrum={"w": 0.5}),
     r"field 'spectrum': Spectrum does not apply to sampler 'sa_solver_pece'"),
    ("spectrum-string", _j(spectrum="yes"), r"field 'spectrum': must be true, false or an object"),
    ("spectrum-w", _j(spectrum={"w": 2}), r"field 'spectrum\.w': must be in \[0\.0, 1\.0\]"),
    ("spectrum-m", _j(spectrum={"m": 0}), r"field 'spectrum\.m': must be in 1\.\.8"),
    ("spectrum-unknown", _j(spectrum={"order": 3}), r"field 'spectrum\.order': unknown setting"),
    ("spectrum-stop-zero", _j(spectrum={"stop": 0}), r"field 'spectrum\.stop': must be greater than 0"),
    ("spectrum-warmup-float", _j(spectrum={"warmup": 1.5}), r"field 'spectrum\.warmup': must be an integer"),
    ("spectrum-enabled-str", _j(spectrum={"enabled": "no"}), r"field 'spectrum\.enabled': must be true or false"),
    ("output-number", _j(output=7), r"field 'output': must be a non-empty path string"),
    ("output-missing-dir", _j(output="/nonexistent-anima-dir/sub/x.png"), r"field 'output': directory .* does not"),
    ("output-is-file", None, r"field 'output': .* exists and is not a directory"),  # content built in the test
    # past Python's int-from-string limit (4300 digits) int() raises a bare ValueError: the field must be named anyway
    ("seed-5000-digits", '{"prompt": "a", "seed": ' + "9" * 5000 + "}", r"field 'seed': .*integer of 5000 digits"),
    ("steps-5000-digits", '{"prompt": "a", "steps": -' + "1" * 5000 + "}", r"field 'steps': .*5000 digits"),
    ("cfg-5000-digits", '{"prompt": "a", "cfg": ' + "1" * 5000 + "}", r"field 'cfg': must be a number"),
    ("spectrum-m-digits", '{"prompt": "a", "spectrum": {"m": ' + "7" * 4400 + "}}", r"field 'spectrum\.m'"),
    # a file name over 255 bytes made Path.is_dir raise OSError (ENAMETOOLONG)
    ("output-name-too-long", _j(output="/tmp/" + "x" * 300 + ".png"), r"field 'output': .*File name too long"),
    ("output-dir-too-long", _j(output="/tmp/" + "y" * 300), r"field 'output': .*File name too long"),
    # lone surrogates are not Unicode text: they failed later in the encoder (and in every codec)
    ("prompt-lone-surrogate", '{"prompt": "a\\ud800b"}', r"field 'prompt': holds a lone surrogate \(U\+D800"),
    ("negative-lone-surrogate", '{"prompt": "a", "negative_prompt": "\\udfff"}', r"field 'negative_prompt': .*U\+DFFF"),
    ("output-lone-surrogate", '{"prompt": "a", "output": "/tmp/\\udc80.png"}', r"field 'output': holds a lone"),
    ("key-lone-surrogate", '{"prompt": "a", "\\ud800": 1}', r"field '\\ud800': unknown field"),
    ("overwrite-string", _j(overwrite="yes"), r"field 'overwrite': must be true or false"),
    ("output-exists", None, r"field 'output': .*exists; .*overwrite"),  # content built in the test
    # a partial denoise builds int(steps / denoise) sigmas: bounded before it is built (1e-7 at 8 steps took 1.8 GB;
    # with a start_step the check itself built it and numpy's "Maximum allowed size exceeded" named no field)
    ("denoise-schedule", _j(steps=8, denoise=1e-7), r"field 'denoise': .*limit is 10000 \(ComfyUI's KSampler"),
    ("denoise-schedule-start", _j(steps=8, denoise=1e-300, start_step=2), r"field 'denoise': .*at least steps / 10000"),
    ("denoise-subnormal", _j(steps=8, denoise=5e-324), r"field 'denoise': .*limit is 10000"),
    ("hires-denoise-schedule", _j(steps=30, hires={"scale": 1.5, "denoise": 1e-7}), r"field 'hires.denoise': .*10000"),
    # steps left to the pack's record: the bound is checked once they are known, not divided into None
    ("denoise-schedule-unset-steps", json.dumps({"prompt": "a", "denoise": 1e-7}), r"field 'denoise': .*at 30 steps"),
    ("hires-denoise-unset-steps", json.dumps({"prompt": "a", "hires": {"scale": 1.5, "denoise": 1e-9}}),
     r"field 'hires.denoise': .*at 30 steps"),
]


def _content(case_id, content, tmp_path):
    if case_id == "output-is-file":
        f = tmp_path / "afile.txt"
        f.write_text("x")
        content = _j(output=str(f))
    if case_id == "output-exists":
        f = tmp_path / "taken.png"
        f.write_bytes(b"someone's image")
        content = _j(output=str(f))
    return content


@pytest.mark.parametrize("case_id,content,pattern", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_is_rejected_with_the_field(case_id, content, pattern, tmp_path):
    content = _content(case_id, content, tmp_path)
    with pytest.raises(PromptError, match=pattern) as e:
        parse_prompt_bytes(content, resolution=RES)
    assert str(e.value).startswith("prompt.json: ")


@pytest.mark.parametrize("case_id,content,pattern", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_cli_submit_exits_2_and_queues_nothing(case_id, content, pattern, tmp_path, capsys):
    content = _content(case_id, content, tmp_path)
    run = tmp_path / "run"
    f = tmp_path / "prompt.json"
    f.write_bytes(content.encode() if isinstance(content, str) else content)
    rc = cli.main(["--run", str(run), "submit", str(f), "--resolution", "512x512"])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.search(pattern, err), err
    assert "Traceback" not in err
    assert not (run / "jobs").exists() or not any((run / "jobs").iterdir())


def test_enough_cases():
    assert len(MALFORMED) >= 30


def test_valid_minimal_gets_defaults_and_a_recorded_random_seed():
    a = parse_prompt_bytes('{"prompt": "a girl"}', resolution=RES)
    b = parse_prompt_bytes('{"prompt": "a girl", "seed": null}')
    assert a.seed_random and b.seed_random and 0 <= a.seed < 2**64
    assert (a.width, a.height) == RES and b.width is None
    assert a.steps == 30 and a.cfg == 4.0 and a.sampler == "euler" and a.scheduler == "sgm_uniform"
    assert a.spectrum == SpectrumSettings() and a.spectrum.enabled
    assert a.output is None and a.negative_prompt == ""


def test_valid_full_round_trips_through_to_dict(tmp_path):
    text = json.dumps({"prompt": "a girl", "negative_prompt": "blurry", "seed": 2**64 - 1, "steps": 20, "cfg": 5,
                       "width": 512, "height": 512, "sampler": "euler", "scheduler": "simple",
                       "spectrum": {"w": 0.5, "m": 4, "warmup": 2}, "output": str(tmp_path / "out.png")})
    spec = parse_prompt_bytes(text, resolution=RES)
    assert spec.seed == 2**64 - 1 and not spec.seed_random and spec.cfg == 5.0 and isinstance(spec.cfg, float)
    assert spec.spectrum == SpectrumSettings(w=0.5, m=4, warmup=2)
    assert spec.output == str(tmp_path / "out.png")
    again = PromptSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec


def test_spectrum_false_and_relative_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "imgs").mkdir()
    spec = parse_prompt_bytes(_j(spectrum=False, output="imgs"))
    assert not spec.spectrum.enabled and spec.output == str(tmp_path / "imgs")
    new_dir = parse_prompt_bytes(_j(output="new"))       # a directory that does not exist yet, parent writable
    assert new_dir.output == str(tmp_path / "new")


def test_overwrite_lets_an_existing_output_be_named(tmp_path):
    f = tmp_path / "taken.png"
    f.write_bytes(b"old")
    spec = parse_prompt_bytes(_j(output=str(f), overwrite=True))
    assert spec.overwrite is True and spec.output == str(f)
    assert PromptSpec.from_dict(spec.to_dict()).overwrite is True
    assert parse_prompt_bytes(_j()).overwrite is False
    (tmp_path / "link.png").symlink_to(tmp_path / "nowhere.png")      # a dangling link is there too
    with pytest.raises(PromptError, match="exists"):
        parse_prompt_bytes(_j(output=str(tmp_path / "link.png")))


def test_cli_sends_the_record_it_checked(tmp_path, monkeypatch, inproc_daemon):
    """The file is read once: the CLI once checked it, then read it again to send (a swapped file slipped through).
    The daemon (in this process) queues exactly the record that was checked."""
    f = tmp_path / "p.json"
    f.write_text(_j(seed=5))
    reads = []
    real_open, real_path_open = open, Path.open

    def counting_open(path, *a, **kw):
        if str(path) == str(f):
            reads.append(path)
        return real_open(path, *a, **kw)

    def counting_path_open(self, *a, **kw):
        if str(self) == str(f):
            reads.append(self)
        return real_path_open(self, *a, **kw)
    monkeypatch.setattr("builtins.open", counting_open)
    monkeypatch.setattr(Path, "open", counting_path_open)       # read_text/read_bytes open through it
    rf = inproc_daemon.daemon.rf
    assert cli.main(["--run", str(rf.root), "submit", str(f)], connect=inproc_daemon.connect) == 0
    from orchestrator.engine.prompt_spec import parse_prompt_text, resolve_prompt
    (job,) = inproc_daemon.daemon.store.pending()
    size = [(inproc_daemon.daemon.pack.width, inproc_daemon.daemon.pack.height)]
    assert job.spec == resolve_prompt(parse_prompt_text(_j(seed=5)), base_dir=Path.cwd(), resolution=size).to_dict()
    assert job.spec["seed"] == 5 and len(reads) == 1


def test_load_prompt_reports_unreadable_file(tmp_path):
    with pytest.raises(PromptError, match="cannot read"):
        load_prompt(tmp_path / "nope.json")
    with pytest.raises(PromptError, match="cannot read"):
        load_prompt(tmp_path)
    assert math.isfinite(load_prompt_ok(tmp_path).cfg)


def load_prompt_ok(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(_j(cfg=7.5))
    return load_prompt(f)


def test_console_script_exit_code(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    f = tmp_path / "p.json"
    f.write_text('{"prompt": "a", "steps": 0}')
    exe = Path(sys.executable).parent / "orchestrator"
    r = subprocess.run([str(exe), "--run", str(tmp_path / "run"), "submit", str(f), "--resolution", "512x512"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "field 'steps'" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""
