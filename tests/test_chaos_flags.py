"""bench/chaos.py's --lora / --lora-rank, without a pipeline: the LoRA-ready pack's rank is the sum of the files'
ranks (the blocks both update stack), each job's prompt.json names the file copied to loras/ with its strengths, and
bad values exit 2 naming the flag before anything is built; a job the daemon refuses is a failed trial, and the run
goes on."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import chaos  # noqa: E402
from orchestrator.cli import CliError  # noqa: E402
from models.lora.synth import write_lora  # noqa: E402


@pytest.fixture(scope="module")
def two_loras(tmp_path_factory):
    d = tmp_path_factory.mktemp("chaos-loras")
    a, b = d / "style.safetensors", d / "extra.safetensors"
    write_lora("tiny", 5, a, "kohya", rank=4, alpha=2.0, groups=("blocks", "te"))
    write_lora("tiny", 6, b, "comfy", rank=3, alpha=None, groups=("blocks",))
    return a, b


def test_lora_entries_and_the_packs_rank(two_loras):
    a, b = two_loras
    jobs, rank = chaos.lora_jobs([f"{a}:0.8:1.2", f"{b}:-0.5"], 0)
    assert rank == 4 + 3
    assert jobs == [(a, {"name": a.name, "strength": 0.8, "clip_strength": 1.2}),
                    (b, {"name": b.name, "strength": -0.5})]
    assert chaos.lora_jobs([str(a)], 9) == ([(a, {"name": a.name, "strength": 1.0})], 9)
    assert chaos.lora_jobs([], 0) == ([], 0)                  # default: a plain pack, jobs without loras


@pytest.mark.parametrize("args, words", [
    (["--lora", "/no/such.safetensors:0.5"], ["--lora", "no such file"]),
    (["--lora", "{a}", "--lora-rank", "3"], ["--lora-rank 3", "at least 4"]),
    (["--lora", "{a}", "--lora", "{a}:0.5"], ["--lora", "same name"]),
    (["--lora", "{cut}"], ["--lora", "LoRA"]),
])
def test_bad_lora_flags_exit_2_naming_the_flag(two_loras, tmp_path, capsys, args, words):
    a, _ = two_loras
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(a.read_bytes()[:1000])
    args = [x.format(a=a, cut=cut) for x in args]
    with pytest.raises(SystemExit) as e:
        chaos.main(["--stage", "vae", "--cache", str(tmp_path / "never-built"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert "Traceback" not in err and not (tmp_path / "never-built").exists()


class _RefusingPipe:
    """Stands in for tests.pipeline_harness.Pipeline where the daemon refuses every job at submit."""

    def __init__(self, message: str):
        self.message, self.submits = message, 0

    def wait_program(self, name, states):
        return None

    def submit(self, prompt):
        self.submits += 1
        raise CliError(self.message, 2)


def test_a_refused_job_is_a_failed_trial_not_a_traceback():
    pipe = _RefusingPipe("pipeline.toml changed since these stages started: restart scheduler")
    c = chaos.Chaos(pipe, seed=1, log=lambda *a: None)
    c.base = chaos.Baseline(job="j0", latent=np.zeros((1, 2)), computed=[1, 2], blocks=2, encoder_life_s=1.0,
                            vae_life_s=1.0, job_s=2.0)
    trials = [c.trial(stage, 0) for stage in ("scheduler", "vae")]
    assert pipe.submits == 2                                  # the second trial was still tried
    for t in trials:
        assert t.state == "refused" and not t.survived and not t.identical and t.killed_pid == 0
        assert "restart scheduler" in t.error and "refused" in t.line()
    assert chaos.summary_line(trials).startswith("survived=0/2 identical=0/2")
