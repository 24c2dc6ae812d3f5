"""bench/chaos.py's --lora / --lora-rank, without a pipeline: the LoRA-ready pack's rank is the sum of the files'
ranks (the blocks both update stack), each job's prompt.json names the file copied to loras/ with its strengths, and
bad values exit 2 naming the flag before anything is built; a job the daemon refuses is a failed trial, and the run
goes on; the job kinds' prompts, the trace counting that places scheduler/executor kills and the bitwise comparison
of a job's results."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import chaos  # noqa: E402
from bench import chaos_jobs  # noqa: E402
from protocol.prompt import PromptFile  # noqa: E402
from orchestrator.terminal.cli import CliError  # noqa: E402
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

    def __init__(self, message: str, root: Path):
        self.message, self.submits, self.root = message, 0, root    # root: the run folder (no trace file in it)

    def wait_program(self, name, states):
        return None

    def submit(self, prompt):
        self.submits += 1
        raise CliError(self.message, 2)


def test_a_refused_job_is_a_failed_trial_not_a_traceback(tmp_path):
    pipe = _RefusingPipe("pipeline.toml changed since these stages started: restart scheduler", tmp_path)
    c = chaos.Chaos(pipe, seed=1, log=lambda *a: None)
    c.bases["txt2img"] = chaos.Baseline(kind="txt2img", job="j0", outputs={"latent.npy": np.zeros((1, 2))}, calls=2,
                                        alive_s={"encoder": 1.0, "vae": 1.0}, job_s=2.0)
    trials = [c.trial(stage, 0) for stage in ("scheduler", "vae")]
    assert pipe.submits == 2                                  # the second trial was still tried
    for t in trials:
        assert t.state == "refused" and not t.survived and not t.identical and t.killed_pid == 0
        assert "restart scheduler" in t.error and "refused" in t.line()
    assert chaos.summary_line(trials).startswith("survived=0/2 identical=0/2")


@pytest.mark.parametrize("kind", chaos_jobs.JOB_KINDS)
def test_every_job_kind_is_a_prompt_the_daemon_takes(kind):
    spec = PromptFile.from_data(chaos_jobs.job_prompt(kind, chaos.PROMPT))
    assert spec.prompt == chaos.PROMPT["prompt"] and spec.seed == chaos.PROMPT["seed"]
    assert (spec.init_image is not None) == (kind == "img2img") and spec.batch == (2 if kind == "batch" else 1)
    if kind.startswith("hires_"):
        # the pack the bench builds for the second pass is the size the daemon asks for
        assert spec.hires.size(*chaos_jobs.PACK_SIZE) == chaos_jobs.hires_size() == (160, 160)
        assert spec.hires.space == kind.removeprefix("hires_")
    elif kind == "split":                   # the second pass chained on the first latent, on the same pack
        assert not spec.hires.upscaled and spec.hires.size(*chaos_jobs.PACK_SIZE) == chaos_jobs.PACK_SIZE
        assert (spec.end_step, spec.leftover_noise, spec.hires.start_step, spec.hires.add_noise) == (2, True, 2, False)   # 4 steps split in half
    else:
        assert spec.hires is None


def test_trace_count_reads_on_from_where_it_was_and_counts_only_whole_lines_of_its_job(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"job": "old", "step": 1, "block": 0, "branch": "self"}\n')
    served = chaos_jobs.TraceCount(trace, "j1", chaos_jobs.trace_size(trace))
    assert served() == 0
    with trace.open("a") as f:
        f.write('{"job": "j1", "step": 1, "block": 0, "branch": "self"}\n{"job": "j2", "step": 1, "block": 0, '
                '"branch": "self"}\n{"job": "j1", "step": 1, "bl')
    assert served() == 1 and served.last["branch"] == "self"          # the torn line waits for its end
    with trace.open("a") as f:
        f.write('ock": 1, "branch": "cross"}\n')
    assert served() == 2 and served.last == {"job": "j1", "step": 1, "block": 1, "branch": "cross"}
    assert chaos_jobs.TraceCount(tmp_path / "none.jsonl", "j1", 0)() == 0
    assert chaos_jobs.trace_size(tmp_path / "none.jsonl") == 0


def test_differing_names_missing_extra_and_changed_results(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    want = {"latent.npy": a, "image.png": np.zeros((4, 4, 3), np.uint8)}
    assert chaos_jobs.differing({k: v.copy() for k, v in want.items()}, want) == []
    flipped = a.copy()
    flipped.view(np.uint32)[0, 0] ^= 1                                  # one bit of one value
    assert chaos_jobs.differing({**want, "latent.npy": flipped}, want) == ["latent.npy"]
    assert chaos_jobs.differing({"latent.npy": a}, want) == ["image.png"]
    assert chaos_jobs.differing({**want, "latent_1.npy": a}, want) == ["latent_1.npy"]
    assert chaos_jobs.differing({**want, "latent.npy": a.reshape(3, 2)}, want) == ["latent.npy"]
    # what job_outputs collects from a job folder: latents and the images' pixels, nothing else
    from PIL import Image
    np.save(tmp_path / "latent.npy", a)
    np.save(tmp_path / "hires_latent.npy", a)
    np.save(tmp_path / "init_latent.npy", a)
    Image.fromarray(np.full((4, 4, 3), 7, np.uint8)).save(tmp_path / "image_1.png")
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "init_image.png")
    got = chaos_jobs.job_outputs(tmp_path)
    assert sorted(got) == ["hires_latent.npy", "image_1.png", "latent.npy"] and got["image_1.png"].max() == 7


def test_table_counts_identical_trials_per_kind_and_stage():
    t = [chaos.Trial("vae", 0, 1, kind="img2img", identical=True), chaos.Trial("vae", 1, 2, kind="img2img"),
         chaos.Trial("executor", 0, 3, kind="batch", identical=True)]
    assert chaos.table(t).splitlines() == ["| kind | executor | vae | all |", "|---|---|---|---|",
                                            "| img2img | 0/0 | 1/2 | 1/2 |", "| batch | 1/1 | 0/0 | 1/1 |",
                                            "| all | 1/1 | 1/2 | 2/3 |"]
