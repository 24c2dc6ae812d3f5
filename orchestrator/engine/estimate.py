"""A job priced before it runs: the MODELLED board seconds of a resolved prompt on a run folder's board settings
and packs (`orchestrator estimate`, `generate --estimate`, the page's line beside Generate, report.json's
`estimate`). Every figure comes from the board model (models/board: cost.toml through cost.py, the lifecycle policy
through timeline.py and auto.py), never from a clock:

    encode    the text encoder stage, start and weights included, the texts it runs (models/board/account.encoder_s:
              no negative prompt at cfg 1); 0 when every prompt pair is in the run folder's conditioning cache
    denoise   the job's model calls (its sampler's plan: Spectrum's forecast steps make none, a step of a two-call
              sampler two) x CFG passes per call (1 at cfg 1), on its pack (size, FP16 or INT8 layers, shards) under
              the executor's policy (`auto`: the one auto picks) on the `board_ram_gb` board; a hires fix adds its
              second pass on the pack of its size
    decode    the VAE: a VAE pack on the NPU (estimate) or the torch VAE on the CPU (reference figure R11), per image

The last line is an interface (other checks parse it):
    estimate job_s=S encode_s=S denoise_s=S decode_s=S calls=N passes=P [modelled]
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from models.board.cost import LABEL

log = logging.getLogger(__name__)
REFERENCE_NOTE = "no packs in the run folder: the official model at the job's size, the [board] defaults"


class EstimateError(ValueError):
    """A job the board model cannot price (its policy fits no modelled board, a size no pack serves)."""


@dataclass(frozen=True)
class BoardSettings:
    """The run folder's [stage.executor] settings the board model prices with (board-sim's; an rknn board's too)."""
    board_ram_gb: int = 8
    board_model: str = "full"
    board_cost: str | None = None
    policy: object = "auto"
    executor: dict = field(default_factory=dict)      # the whole table (parse_policy's resident_mb, dual_masks)
    vae: str = "npu"                                  # where the VAE decodes: npu (a VAE pack) or cpu (torch)
    ram_basis: str = "assumed"                        # where board_ram_gb comes from (models/board/account.board_ram)

    @classmethod
    def of_config(cls, cfg) -> "BoardSettings":
        """The run folder's settings; the board's RAM is board_ram_gb (board-sim), or read on the board itself
        (the rknn executor on an RK3588), or assumed (models/board/account.board_ram)."""
        from models.board.account import board_ram
        from models.runtime import probes
        ex = cfg.stage_settings("executor")
        vae = "cpu" if cfg.stage_settings("vae").get("backend", "torch") == "torch" else "npu"
        on_board = cfg.backend == "rknn" and probes.is_rk3588()
        ram, basis = board_ram(ex, probes.meminfo_kb().get("MemTotal") if on_board else None)
        return cls(ram, str(ex.get("board_model", "full")), ex.get("board_cost"), ex.get("policy", "auto"), ex, vae,
                   basis)


@dataclass(frozen=True)
class Estimate:
    encode_s: float
    denoise_s: float
    decode_s: float
    calls: int
    passes: int
    policy: str
    board_ram_gb: int
    size: tuple
    source: str
    notes: tuple = ()
    label: str = LABEL
    ram_basis: str = ""                               # BoardSettings.ram_basis: configured, read or assumed

    @property
    def job_s(self) -> float:
        return self.encode_s + self.denoise_s + self.decode_s

    def to_dict(self) -> dict:
        return {**asdict(self), "size": list(self.size), "notes": list(self.notes), "job_s": self.job_s}

    @classmethod
    def from_dict(cls, d: dict) -> "Estimate":
        keep = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**keep, "size": tuple(keep["size"]), "notes": tuple(keep.get("notes", ()))})

    def line(self) -> str:
        """THE last line (an interface: keep its format)."""
        return (f"estimate job_s={self.job_s:.1f} encode_s={self.encode_s:.1f} denoise_s={self.denoise_s:.1f} "
                f"decode_s={self.decode_s:.1f} calls={self.calls} passes={self.passes} [{self.label}]")

    def lines(self) -> list:
        w, h = self.size
        ram = f"{self.board_ram_gb} GB" + (f" ({self.ram_basis})" if self.ram_basis else "")
        out = [f"{self.label} RK3588 board ({self.source}), {ram}, policy {self.policy}, {w}x{h}",
               f"{self.label} encode {self.encode_s:.1f} s (text encoder stage, start and weights included)",
               f"{self.label} denoise {self.denoise_s:.1f} s: {self.calls} model calls x {self.passes} CFG "
               f"pass{'es' if self.passes > 1 else ''}",
               f"{self.label} decode {self.decode_s:.1f} s"]
        out += [f"{self.label} note: {n}" for n in self.notes]
        return out + [self.line()]


def passes_of(cfg: float) -> int:
    """CFG passes per model call: ComfyUI runs no unconditional pass at cfg 1 (the sampler's rule)."""
    from models.sampling.sampler import cfg_passes
    return cfg_passes(cfg)


def _first_sampler(spec):
    from models.sampling.img2img import LatentPlan, LatentSampler
    plan = LatentPlan(denoise=float(spec.denoise), denoise_steps=spec.denoise_steps, start_step=spec.start_step,
                      last_step=spec.end_step, force_full_denoise=not spec.leftover_noise, add_noise=spec.add_noise,
                      masked=spec.mask is not None)
    return LatentSampler(steps=spec.steps, cfg=spec.cfg, scheduler=spec.scheduler, spectrum=spec.spectrum,
                         sampler=spec.sampler, cache=spec.cache, plan=plan)


def first_pass_calls(spec) -> int:
    """Model calls of one image's first pass: its sampler's plan over the window it samples."""
    return len(_first_sampler(spec).plan())


def entry_sweeps(spec, s=None) -> tuple[int, int] | None:
    """A job with positive/negative entries (each active entry a DiT pass, two per branch load: models/sampling/
    cond_mix.py): (branch sweeps of one image's first pass, or of sampler `s`'s pass, the most passes of a call),
    each call's entries taken at its step's sigma; None for a job without entries."""
    from models.sampling.cond_mix import CondPass, PASSES_PER_LOAD, active_passes
    from orchestrator.engine.plan.build import cond_sides
    sides = cond_sides(spec)
    if sides is None:
        return None
    s = s or _first_sampler(spec)
    pos, neg = ([CondPass(None, e.strength, e.start, e.end) for e in side] for side in sides)
    sweeps = most = 0
    for step in s.plan():
        sigma = float(s.sigmas[step - 1])
        k = len(active_passes(pos, sigma, s.shift)) + (len(active_passes(neg, sigma, s.shift)) if s.passes > 1 else 0)
        sweeps, most = sweeps + -(-k // PASSES_PER_LOAD), max(most, k)
    return sweeps, most


def hires_calls(spec) -> tuple:
    """(model calls, CFG passes) of one image's hires second pass (its own settings, else the job's)."""
    return len(hires_sampler(spec).plan()), passes_of(spec.cfg if spec.hires.cfg is None else spec.hires.cfg)


def hires_sampler(spec):
    """The sampler of one image's hires second pass (its own settings, else the job's)."""
    from models.sampling.img2img import LatentPlan, LatentSampler
    from models.sampling.sampler import spectrum_refusal
    from models.sampling.spectrum import SpectrumSettings
    h = spec.hires
    sampler = h.sampler or spec.sampler
    cfg = spec.cfg if h.cfg is None else h.cfg
    spectrum = spec.spectrum if spectrum_refusal(sampler) is None else SpectrumSettings(enabled=False)
    s = LatentSampler(steps=h.steps or spec.steps, cfg=cfg, scheduler=h.scheduler or spec.scheduler,
                      spectrum=spectrum, sampler=sampler, cache=spec.cache,
                      plan=LatentPlan(denoise=float(h.denoise), start_step=h.start_step, last_step=h.end_step,
                                      force_full_denoise=not h.leftover_noise, add_noise=h.add_noise))
    return s


def board_model_for(pack_dir, size, board: BoardSettings):
    """The board model of a pack (None: the official model at `size`) on the run folder's cost file."""
    from models.board.cost import COST_FILE, BoardModel, CostModelError, Shape, load_cost
    try:
        if pack_dir is not None:
            return BoardModel.for_pack(pack_dir, board.board_model, board.board_cost)
        path = board.board_cost or COST_FILE
        cost = load_cost(path)
        return BoardModel(Shape.at_resolution(*size, cost), cost, path)
    except (CostModelError, ValueError, OSError) as e:
        raise EstimateError(f"the board model cannot price {size[0]}x{size[1]}: {e}") from None


def evaluation(pack_dir, size, calls: int, passes: int, board: BoardSettings) -> tuple:
    """(the board model's Evaluation of the executor's policy, the policy's name, the model) of `calls` model calls on
    a pack (None: the official model at `size`, on the pack `pack --shards N` the board model picks, as
    bench/overhead.py --analytic prices it; a pack: as it was built, its shards from its manifest)."""
    from models.board import auto
    from models.packs.memory_fit import for_auto
    from models.board.policy import PolicyError, parse_policy
    model = board_model_for(pack_dir, size, board)
    budget = model.context_budget_mib(board.board_ram_gb)
    kw = {"computed_steps": max(1, calls), "passes": passes}
    try:
        if isinstance(board.policy, str) and board.policy.strip().lower() == "auto":
            if pack_dir is None:
                n, cuts, e = auto.choose_pack(model, budget, memory=for_auto(size), **kw)
                model = auto.sharded_model(model, n, cuts) if n > 1 else model
            else:
                e = auto.choose(model, budget, memory=for_auto(size), **kw)[0]
            name = f"auto: {e.policy.name}"
        else:
            e = auto.evaluate(model, parse_policy(board.policy, board.executor), budget, **kw)
            name = e.policy.name if e is not None else str(board.policy)
    except (PolicyError, ValueError) as err:
        raise EstimateError(f"policy {board.policy!r:.80} on the {LABEL} {board.board_ram_gb} GB board: {err}") \
            from None
    if e is None:
        raise EstimateError(f"policy {board.policy!r:.80} does not fit the {LABEL} {board.board_ram_gb} GB board")
    return e, name, model


def denoise_on(pack_dir, size, calls: int, passes: int, board: BoardSettings) -> tuple:
    """(board seconds, the policy's name, the model) of `calls` model calls on a pack under the executor's policy."""
    e, name, model = evaluation(pack_dir, size, calls, passes, board)
    return (e.denoise_s if calls else 0.0), name, model


def shard_note(model, size, calls: int, passes: int, board: BoardSettings, denoise_s: float) -> list:
    """A note when the job's pack is one graph per branch and `auto` would denoise faster on a sharded build of it
    (`pack --shards N`, the board model's choice, as bench/overhead.py --analytic prices it); the pack is priced as
    it is, since that is what the board runs. None for a LoRA-ready pack (shards take no low-rank inputs)."""
    from models.board import auto
    from models.packs.memory_fit import for_auto
    if (model.shape.shards > 1 or model.shape.lora_rank or not calls or not isinstance(board.policy, str)
            or board.policy.strip().lower() != "auto"):
        return []
    budget = model.context_budget_mib(board.board_ram_gb)
    key = (model.shape, str(model.path), _stamp(model.path), budget, tuple(size), calls, passes)
    choice = _SHARD_CHOICES.get(key)
    if choice is None:
        n, _, e = auto.choose_pack(model, budget, memory=for_auto(size), computed_steps=calls, passes=passes)
        choice = _SHARD_CHOICES[key] = (n, e.denoise_s, e.policy.name)
        while len(_SHARD_CHOICES) > SHARD_CHOICES_KEPT:
            _SHARD_CHOICES.popitem(last=False)
    n, best_s, name = choice
    if n <= 1 or best_s >= denoise_s:
        return []
    return [f"this pack is not sharded: built with `anima-models pack --shards {n}` the denoise would be "
            f"{best_s:.1f} s ({name})"]


# auto.choose_pack's answers (shards, denoise s, policy) by the pack's shape, the cost file (its path and stat), the
# budget, size, calls and passes: the search simulates thousands of steps (~7 s a job on a busy 2-core machine, in
# every job's report and every estimate) and gives the same answer for the same inputs
_SHARD_CHOICES: OrderedDict = OrderedDict()
SHARD_CHOICES_KEPT = 64


def _stamp(path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def estimate_spec(spec, packs: dict, board: BoardSettings, cached: bool = False) -> Estimate:
    """The estimate of a resolved PromptSpec on `packs` ({(width, height): pack folder or None}: None prices the
    official model at that size) under `board`. `cached`: every prompt pair of the job is in the run folder's
    conditioning cache (prompts_cached), so its encode is 0 s: no encoder start, load or run."""
    from models.board.account import encoder_s, job_figures
    from orchestrator.engine.plan.build import entry_texts
    size = (spec.width, spec.height)
    if size not in packs:
        raise EstimateError(f"{size[0]}x{size[1]} has no model pack")
    batch, notes = int(spec.batch), []
    calls, passes = first_pass_calls(spec) * batch, passes_of(spec.cfg)
    sweeps = entry_sweeps(spec)
    if sweeps is None:
        denoise, policy, model = denoise_on(packs[size], size, calls, passes, board)
    else:                       # entries: a branch sweep per two passes, priced as a CFG pair's call
        denoise, policy, model = denoise_on(packs[size], size, sweeps[0] * batch, min(2, sweeps[1]) or 1, board)
        passes = sweeps[1]
        notes.append(f"positive/negative entries: up to {sweeps[1]} DiT passes a call, {sweeps[0] * batch} branch "
                     "sweeps of two passes (a sweep of one priced as two)")
    notes += shard_note(model, size, calls, passes, board, denoise)
    encodes = 1
    final = model
    if spec.hires is not None:
        second = spec.hires.size(*size)
        if second not in packs:
            raise EstimateError(f"the hires pass at {second[0]}x{second[1]} has no model pack")
        h_calls, h_passes = hires_calls(spec)
        h_sweeps = entry_sweeps(spec, hires_sampler(spec))       # entries: the first pass's, as there
        h_s, _, final = denoise_on(packs[second], second, *((h_calls * batch, h_passes) if h_sweeps is None else
                                                            (h_sweeps[0] * batch, min(2, h_sweeps[1]) or 1)), board)
        denoise, calls = denoise + h_s, calls + h_calls * batch
        encodes += spec.hires.prompt is not None or spec.hires.negative_prompt is not None
        if spec.hires.space == "pixel":
            notes.append("the pixel hires path's extra decode and encode of the first pass are not priced")
    if spec.init_image is not None:
        what = "init_image's and init_mix.image's VAE encodes are" if spec.init_mix else "the init image's VAE encode is"
        notes.append(f"{what} not priced (the board model has no figure for it)")
    if spec.cache is not None:
        notes.append(f"{spec.cache.node} may reuse some model calls: priced as if every call ran")
    if spec.negative_prompt.strip() and spec.negative_ignored():
        notes.append("cfg 1: the negative prompt changes nothing and is not encoded")
    key = "decode_npu_s" if board.vae == "npu" else "decode_s"
    decode = job_figures(final)[key] * batch
    if spec.hires is not None and spec.hires.keep_base and spec.hires.space == "latent":
        # each first pass decoded too, at its size, in the final decodes' VAE session (no lifecycle of its own);
        # the pixel path decodes it anyway
        decode += job_figures(model, vae_up=True)[key] * batch
    if cached:
        notes.append("every prompt is in the conditioning cache: no encoder start, load or run")
    what = "a board's own calibration" if model.measured else "reference board and peer figures"
    if all(p is None for p in packs.values()):
        notes.append(REFERENCE_NOTE)
    if entry_texts(spec):                  # each entry's text in an ENCODE of its own, with an empty negative
        encode = encoder_s(model, 1, len(entry_texts(spec)))
    else:
        encode = encoder_s(model, 1 if spec.negative_ignored() else 2, encodes)
    encode = 0.0 if cached else encode
    return Estimate(encode_s=encode, denoise_s=denoise, decode_s=decode, calls=calls,
                    passes=passes, policy=policy, board_ram_gb=board.board_ram_gb, size=size,
                    source=f"{model.source}, {what}", notes=tuple(notes), ram_basis=board.ram_basis)


def estimate_with_config(spec, cfg, packs: dict | None = None, cached: bool | None = None) -> Estimate:
    """The estimate on a pipeline config's board settings and packs (`packs`: the daemon's PackInfo by size, read
    from the config's pack folders when not given); `cached`: prompts_cached as seen earlier (None: looked at now)."""
    if packs is None:
        from orchestrator.engine.packs import read_packs
        packs = read_packs(cfg.packs)
    if cached is None:
        cached = prompts_cached(spec, cfg, packs)
    return estimate_spec(spec, {size: Path(p.dir) for size, p in packs.items()}, BoardSettings.of_config(cfg),
                         cached=cached)


def prompts_cached(spec, cfg, packs: dict) -> bool:
    """Whether every prompt pair the job would send the encoder (its first pass's; a hires pass's own, on the pack
    of its size) is in the run folder's conditioning cache (orchestrator/engine/cond_cache.py), under the same key the job
    looks it up by. `packs`: PackInfo by size."""
    from orchestrator.engine.cond_cache import CondCache, all_cached
    first = packs.get((spec.width, spec.height))
    if first is None:
        return False
    from orchestrator.engine.plan.build import hires_texts, prompt_pairs
    if hires_texts(spec) is not None and packs.get(spec.hires.size(spec.width, spec.height)) is None:
        return False
    pairs = [(prompt, negative, pack.text_tokens, entries)
             for prompt, negative, pack, entries in prompt_pairs(spec, packs)]
    cache = CondCache(cfg.run_dir, cfg.settings("orchestrator").cond_cache_mb)
    return all_cached(cfg, cache, spec.loras, pairs)


def safe_prompts_cached(spec, cfg, packs: dict) -> bool | None:
    """prompts_cached, or None when it cannot be told (safe_estimate then looks again, and logs why)."""
    try:
        return prompts_cached(spec, cfg, packs)
    except Exception:  # noqa: BLE001 - the estimate is a note beside the job: never its failure
        return None


def safe_estimate(spec, cfg, packs: dict | None = None, cached: bool | None = None) -> dict | None:
    """estimate_with_config as report.json keeps it; None when the board model cannot price the job. The estimate is
    what a report shows beside the measured times: whatever goes wrong pricing it is logged, and the job runs all the
    same."""
    try:
        return estimate_with_config(spec, cfg, packs, cached).to_dict()
    except (EstimateError, ValueError, OSError) as e:
        log.info("no estimate for this job: %s", e)
    except Exception:                       # a bug in the pricing must not fail a job that would otherwise run
        log.exception("the board model failed to price this job")
    return None
