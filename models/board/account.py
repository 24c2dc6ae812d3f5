"""Per-step rows of board time and the job projection built from them (the table bench/overhead.py and bench/board.py
print is bench/board_table.py; the job report's `board` block is here).

A row is one sampler step: step wall, pure NPU, visible lifecycle, host ops, transport, the rest; and the job
projection built from rows. Rows carry where their figures come from:
- `measured` (a real board through bench/board.py or `bench/overhead.py --backend rknn`): everything measured there;
- `modelled` (board-sim): inference, lifecycle and host ops were paced to the modelled board x time_scale and are
  shown in board seconds (paced / time_scale); pure NPU and tensor I/O come from the cost model; transport and the
  rest (sampler, state file, events) were measured on this machine and are added unscaled.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from models.board.cost import BOARD_RAMS_GB, LABEL, BoardModel, load_cost
from models.board.pace import scale_note
from models.board.ram import KIB_PER_GIB, board_size_gb

SPECTRUM_COMPUTED = 11            # of 20 steps (R8, docs/board-figures.md)
SPECTRUM_STEPS = 20
VAES = ("npu", "cpu")             # where a job's VAE decodes: a VAE pack on the NPU (the board bundle's default), or
                                  # the reference's stable-diffusion.cpp on the CPU


@dataclass
class StepRow:
    step: int
    computed: bool
    wall_s: float              # the step on the board (board seconds)
    npu_s: float               # pure NPU inference, every pass (the overhead ratio's denominator)
    lifecycle_s: float         # load/init/release the step waited for
    host_s: float              # host ops on the critical path
    transport_s: float         # measured here (board-sim) or on the board
    other_s: float             # sampler, state file, events: measured
    infer_s: float = 0.0       # inference on the critical path (NPU + tensor I/O; dual_core: overlapped)
    io_s: float = 0.0          # modelled tensor I/O (board-sim); 0 where not separable (a real board)

    @property
    def overhead_ratio(self) -> Optional[float]:
        return self.wall_s / self.npu_s if self.npu_s > 0 else None

    def to_dict(self) -> dict:
        return {**asdict(self), "overhead_ratio": self.overhead_ratio}


def rows_from_steps(steps: list, time_scale: float = 1.0, model: Optional[BoardModel] = None) -> list:
    """StepTimes (wire dicts, from DENOISED / report.json) -> board-second rows. With `model` (board-sim) the paced
    parts are divided by time_scale and pure NPU / tensor I/O come from the cost model; without it (a real board)
    the figures are taken as measured and pure NPU is the inference time."""
    rows = []
    for s in steps:
        infer, life, host, tr = (float(s.get(k, 0.0)) for k in ("infer_s", "lifecycle_s", "host_s", "transport_s"))
        other = max(0.0, float(s["wall_s"]) - infer - life - host - tr)
        computed = bool(s.get("computed", True)) and int(s.get("calls", 1)) > 0
        if model is None:              # measured: pure NPU is every pass's inference (npu_s when given; dual_core
            npu = float(s.get("npu_s", infer))      # overlaps the passes, so the critical path is less than their sum)
            rows.append(StepRow(int(s["step"]), computed, float(s["wall_s"]), npu, life, host, tr, other, infer))
            continue
        f = time_scale
        parts = model.step_parts() if computed else {"npu_s": 0.0, "io_s": 0.0}
        rows.append(StepRow(int(s["step"]), computed, (infer + life + host) / f + tr + other, parts["npu_s"],
                            life / f, host / f, tr, other, infer / f, parts["io_s"]))
    return rows


@dataclass
class Projection:
    """A 20-step Spectrum job from per-step rows: the first computed step (cold: resident contexts load in it),
    the later ones, forecast steps, plus encode and decode."""
    first_step_s: float
    step_s: float              # mean of the computed steps after the first (the first when there is no other)
    npu_step_s: float
    lifecycle_step_s: float
    host_step_s: float
    transport_step_s: float
    forecast_step_s: float
    denoise_s: float
    encode_s: float
    decode_s: float
    job_s: float
    decode_npu_s: float
    job_npu_vae_s: float
    computed: int = SPECTRUM_COMPUTED
    vae: str = "cpu"           # which of the two job figures is the job as configured

    @property
    def configured_job_s(self) -> float:
        """The job with the VAE as configured: on the NPU (estimate) or the reference's CPU decode."""
        return self.job_npu_vae_s if self.vae == "npu" else self.job_s

    @property
    def overhead_ratio(self) -> float:
        """Denoise wall / sum of pure NPU inference over the computed steps."""
        return self.denoise_s / (self.computed * self.npu_step_s) if self.npu_step_s else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "overhead_ratio": self.overhead_ratio}


def project(rows: list, encode_s: float, decode_s: float, decode_npu_s: float,
            computed: int = SPECTRUM_COMPUTED, steps: int = SPECTRUM_STEPS, vae: str = "cpu") -> Projection:
    comp = [r for r in rows if r.computed]
    if not comp:
        raise ValueError("no computed step to project from")
    later = comp[1:] or comp
    mean = lambda xs: sum(xs) / len(xs)          # noqa: E731
    fc = [r.wall_s for r in rows if not r.computed]
    step = mean([r.wall_s for r in later])
    forecast = mean(fc) if fc else 0.0
    denoise = comp[0].wall_s + (computed - 1) * step + (steps - computed) * forecast
    return Projection(comp[0].wall_s, step, mean([r.npu_s for r in later]), mean([r.lifecycle_s for r in later]),
                      mean([r.host_s for r in later]), mean([r.transport_s for r in later]), forecast, denoise,
                      encode_s, decode_s, encode_s + denoise + decode_s, decode_npu_s,
                      encode_s + denoise + decode_npu_s, computed, check_vae(vae))


def check_vae(vae: str) -> str:
    if vae not in VAES:
        raise ValueError(f"vae {vae!r}: choose one of {', '.join(VAES)}")
    return vae


def _job_figure(model: BoardModel, key: str) -> float:
    """A cost.toml [job] figure of the model's cost file; the project's own where a board's calibration made before
    the figure existed lacks it."""
    j = model.cost["job"]
    return float(j[key] if key in j else load_cost()["job"][key])


STAYS_UP_RULE_GB = 8          # at or under this RAM nothing heavy is up beside the DiT while it denoises
ASSUMED_RAM_GB = 8            # the board priced when nothing says which: the smallest, the project's target
def board_ram(settings: dict, mem_total_kib: Optional[float] = None) -> tuple:
    """(GB, basis) of the board the model prices: `board_ram_gb` when the settings give it (board-sim); else the
    machine's MemTotal when the caller read it on the board itself (None elsewhere: an x86 run is no board); else
    ASSUMED_RAM_GB. `basis` says which, for the log and doctor."""
    if settings.get("board_ram_gb") is not None:
        return int(settings["board_ram_gb"]), "configured: [stage.executor] board_ram_gb"
    if mem_total_kib is None:
        return ASSUMED_RAM_GB, "assumed: board_ram_gb not set and not on the RK3588 board"
    gib = mem_total_kib / KIB_PER_GIB
    gb = board_size_gb(mem_total_kib)
    if gb not in BOARD_RAMS_GB:          # a 4 GB board, or less: priced as the smallest modelled one
        return ASSUMED_RAM_GB, (f"read: MemTotal {gib:.2f} GiB, under the smallest modelled board: priced as the "
                                f"{ASSUMED_RAM_GB} GB one")
    return gb, f"read: MemTotal {gib:.2f} GiB"


def resident_mib(model: BoardModel, stage: str) -> float:
    """What an on-demand stage holds while up (MODELLED, cost.toml [job]): the NPU VAE's scales with the picture as
    its time does; the encoder's is its weights, whatever the size."""
    if stage == "vae":
        return _job_figure(model, "vae_npu_resident_mib_estimate") * model.shape.tokens / model.ref.tokens
    if stage == "encoder":
        return _job_figure(model, "encoder_resident_mib_estimate")
    raise ValueError(f"stage {stage!r}: encoder or vae")


def stays_up_while_denoising(model: BoardModel, ram_gb: float, budget_mib: float, used_mib: float,
                             stage: str = "vae") -> bool:
    """Whether an on-demand stage (the NPU VAE, the encoder) may stay up while the DiT denoises (MODELLED): never on
    an 8 GB board (the rule the pipeline keeps: the encoder and the VAE are down before DENOISE), else when its
    resident memory fits in the board's context budget beside what the DiT policy's contexts take (`used_mib`)."""
    if ram_gb <= STAYS_UP_RULE_GB:
        return False
    return budget_mib - used_mib >= resident_mib(model, stage)


def fit_together(model: BoardModel, budget_mib: float, stages) -> bool:
    """Whether on-demand stages may be up at once while nothing denoises (MODELLED): their resident memory together
    within the context budget (the DiT's contexts are not counted: no call is out)."""
    return sum(resident_mib(model, s) for s in stages) <= budget_mib


def encoder_s(model: BoardModel, passes: int = 2, pairs: int = 1) -> float:
    """The encoder stage's seconds for one job (MODELLED, cost.toml [job]): its start and weights
    (encoder_load_s_estimate), then its compute, which is linear in the tokens it runs (models/text runs a prompt's
    own tokens, no padding): the estimate's two texts of encoder_prompt_tokens_estimate tokens at cfg > 1; at cfg 1
    (`passes` 1) the pipeline sends no negative prompt (orchestrator/flow.py: no unconditional pass reads it), so
    the encoder runs the prompt and the empty text's single token. `pairs`: prompt pairs encoded in the one start
    (a hires pass's own prompts are a second pair)."""
    load, tokens = _job_figure(model, "encoder_load_s_estimate"), _job_figure(model, "encoder_prompt_tokens_estimate")
    per_token = (_job_figure(model, "encoder_s_estimate") - load) / (2 * tokens)
    return load + pairs * per_token * (2 * tokens if passes > 1 else tokens + 1)


def job_figures(model: BoardModel, warm: bool = False, vae_up: bool = False, passes: int = 2) -> dict:
    """Encode and decode on the board (MODELLED): the reference's sd.cpp CPU VAE (R11, a 512x512 picture) and the two
    estimates, the decodes scaled by the picture's size. The VAE is convolutions (and tiles of a fixed size), so
    its work is linear in the pixels: tokens x 256 (one image token is 16x16 pixels). The encoder's work is the
    prompt's, whatever the size (encoder_s: the job's CFG `passes` say whether the negative prompt is encoded).
    `warm`: the prompts' conditioning comes from the run folder's cache (no encoder start, load or run); `vae_up`:
    the NPU VAE stayed up since the last job (stays_up_while_denoising): no lifecycle."""
    j = model.cost["job"]
    size = model.shape.tokens / model.ref.tokens
    npu = j["vae_npu_s_estimate"] - (j["vae_npu_lifecycle_s_estimate"] if vae_up else 0.0)
    return {"encode_s": 0.0 if warm else encoder_s(model, passes), "decode_s": j["vae_cpu_s"] * size,
            "decode_npu_s": npu * size}


def board_section(passes: list, time_scale: float, settings: dict) -> dict:
    """report.json's `board` block for a board-sim job: modelled board seconds apart from what was measured here.
    `passes`: [(StepTimes wire dicts, BoardModel)] per sampling pass, each priced on its own pack's model (a hires
    pass runs a larger pack)."""
    model = passes[0][1]
    rows = [r for steps, pass_model in passes for r in rows_from_steps(steps, time_scale, pass_model)]
    steps = [s for pass_steps, _ in passes for s in pass_steps]
    comp = [r for r in rows if r.computed]
    tot = lambda k: sum(getattr(r, k) for r in rows)      # noqa: E731
    what = "a board's own calibration" if model.measured else "reference board and peer figures"
    out = {"label": LABEL, "source": f"{model.source} ({what})", "time_scale": time_scale,
           "board_ram_gb": settings.get("board_ram_gb", 8), "board_model": settings.get("board_model", "full"),
           "modelled": {"denoise_s": tot("wall_s") - tot("transport_s") - tot("other_s"),
                        "npu_s": tot("npu_s"), "io_s": tot("io_s"), "inference_s": tot("infer_s"),
                        "lifecycle_visible_s": tot("lifecycle_s"), "host_s": tot("host_s")},
           "measured_here": {"transport_s": tot("transport_s"), "other_s": tot("other_s"),
                             "host_work_s": sum(float(s.get("host_work_s", 0.0)) for s in steps)},
           "denoise_board_s": tot("wall_s"),
           "steps": [r.to_dict() for r in rows]}
    npu = tot("npu_s")
    out["overhead_ratio"] = tot("wall_s") / npu if npu and comp else None
    return out


def format_board_section(b: dict) -> list:
    m, h = b["modelled"], b["measured_here"]
    note = f"{LABEL} ({b['source']}; board-sim, {b['board_ram_gb']} GB, {scale_note(b['time_scale'])})"
    ratio = f"{b['overhead_ratio']:.3f}" if b.get("overhead_ratio") else "-"
    return [f"board denoise {b['denoise_board_s']:.2f} s, overhead_ratio {ratio}: {note}",
            f"  board NPU {m['npu_s']:.2f} s + tensor I/O {m['io_s']:.2f} s (inference on the critical path "
            f"{m['inference_s']:.2f} s), lifecycle visible {m['lifecycle_visible_s']:.2f} s, board host ops "
            f"{m['host_s']:.2f} s: {note}",
            f"  measured on this machine: transport {h['transport_s']:.3f} s, scheduling and sampler "
            f"{h['other_s']:.3f} s, host ops here {h['host_work_s']:.3f} s (inside the paced board host time)"]
