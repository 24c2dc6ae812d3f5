"""`anima-models synth te|vae|bundle` through the command line: what each writes is what the loaders read (the
shapes the tables name), a function of the seed alone, and the bundle is a models folder the pipeline resolves."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from models.commands.cli import main
from models.base.safetensors_io import SafeTensorsFile


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_synth_te_writes_the_qwen3_table_as_a_function_of_the_seed(tmp_path, capsys):
    from models.text.synth import te_shapes
    a, b, c = (tmp_path / n for n in ("a.safetensors", "b.safetensors", "c.safetensors"))
    for out, seed in ((a, 0), (b, 0), (c, 1)):
        assert main(["synth", "te", "--preset", "tiny", "--seed", str(seed), "--out", str(out)]) == 0
        assert f"wrote synthetic te (tiny, seed {seed}) to {out}" in capsys.readouterr().out
    f = SafeTensorsFile(a)
    assert {k: tuple(f.shape(k)) for k in f.keys()} == {k: tuple(s) for k, s in te_shapes("tiny").items()}
    assert {f.dtype(k) for k in f.keys()} == {"BF16"}
    norm = f.get("model.norm.weight")                            # 1 + 0.1 N: a norm weight near 1
    assert abs(float(norm.mean()) - 1.0) < 0.1 and np.isfinite(norm).all()
    assert _sha(a) == _sha(b) != _sha(c)
    assert main(["synth", "te", "--seed", "-1", "--out", str(tmp_path / "n.safetensors")]) == 2


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_synth_vae_is_a_vae_the_decoder_loads(tmp_path, capsys, layout):
    from models.vae.checkpoint import load_vae
    from models.vae.synth import vae_entries
    out = tmp_path / f"vae-{layout}.safetensors"
    assert main(["synth", "vae", "--preset", "tiny", "--seed", "3", "--out", str(out), "--layout", layout]) == 0
    assert "wrote synthetic vae" in capsys.readouterr().out
    f = SafeTensorsFile(out)
    assert sorted(f.keys()) == sorted(e.name for e in vae_entries("tiny", 3, layout))
    weights = load_vae(out)                                      # detects the layout, keeps the decoder
    assert weights is not None
    again = tmp_path / "again.safetensors"
    assert main(["synth", "vae", "--preset", "tiny", "--seed", "3", "--out", str(again), "--layout", layout]) == 0
    assert _sha(out) == _sha(again)


def test_synth_bundle_is_a_models_folder_and_is_kept_when_complete(tmp_path, capsys):
    from models.setup.models_dir import resolve_models
    out = tmp_path / "models"
    assert main(["synth", "bundle", "--preset", "tiny", "--seed", "0", "--out", str(out)]) == 0
    paths = resolve_models(out, {})
    for part in ("dit", "text_encoder", "vae", "qwen_tokenizer", "t5_tokenizer"):
        assert getattr(paths, part).exists(), part
    first = {p: (p.stat().st_mtime_ns, _sha(p)) for p in (paths.dit, paths.text_encoder, paths.vae)}
    capsys.readouterr()
    assert main(["synth", "bundle", "--preset", "tiny", "--seed", "0", "--out", str(out)]) == 0    # complete: kept
    assert {p: (p.stat().st_mtime_ns, _sha(p)) for p in first} == first
    with pytest.raises(SystemExit) as e:                                                            # not a preset
        main(["synth", "bundle", "--preset", "huge", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err


def test_the_help_names_every_subcommand(capsys):
    """Reported: `anima-models --help` described 8 subcommands and left out bundle, info and export-encoder."""
    from models.commands.cli import COMMANDS
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    described = text.split("offline model tooling: ", 1)[1].split(" positional arguments")[0]
    assert [c.strip() for c in described.split(",")] == list(COMMANDS)
    assert {"bundle", "info", "export-encoder"} <= set(COMMANDS)
