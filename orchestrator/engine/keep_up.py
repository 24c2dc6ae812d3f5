"""Which on-demand stages (the encoder, the VAE) stay up after a use: `[stage.orchestrator] keep_up`.

    never    stopped after each use (its phase of the job)
    idle     left up after a use while nothing denoises: stopped before the next DENOISE (this job's or the next
             one's), and before the other on-demand stage starts when the two do not fit the board's memory
             together; a use before then finds it up and starts nothing (the VAE that decoded job N encodes job
             N+1's init image when N+1's prompts are cached; an encoder left up encodes the next job's prompts)
    always   up through the denoise too, where the board model says it fits beside the DiT policy's contexts
             (models/board/account.stays_up_while_denoising: never on an 8 GB board); else as `idle`
    auto     (the default) the board model's per-RAM policy: `always` for a stage that fits beside the DiT, else
             `idle` (so on the 8 GB board: `idle`, nothing beside the DiT while it denoises). The RAM is
             [stage.executor] board_ram_gb (board-sim); on the board itself (the rknn executor on an RK3588) the
             machine's MemTotal; else 8 GB, assumed. The policy's record (report.json keep_up, the log) says which.

The rule the pipeline keeps whatever the setting: on an 8 GB board neither stage is up while the DiT denoises.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MODES = ("auto", "never", "idle", "always")
STAGES = ("encoder", "vae")


@dataclass(frozen=True)
class KeepUp:
    """One job's resolved policy: {stage: never | idle | always}, and whether the two may be up at once while
    nothing denoises."""
    modes: dict = field(default_factory=lambda: {s: "never" for s in STAGES})
    together: bool = False
    why: str = "never"

    def after_use(self, stage: str) -> bool:
        """Leave `stage` up when its phase is done."""
        return self.modes.get(stage, "never") != "never"

    def while_denoising(self, stage: str) -> bool:
        return self.modes.get(stage, "never") == "always"

    def to_stop_before(self, starting: str, live) -> list:
        """The held stages (of `live`) to stop before `starting` comes up: the others this policy keeps up, unless
        both fit together."""
        return [] if self.together else [s for s in STAGES if s != starting and s in live and self.after_use(s)]


NEVER = KeepUp()


def resolve(setting: str, cfg, pack_dir, size: tuple) -> KeepUp:
    """`setting` (MODES) for a job on `pack_dir` (None: the official model) at `size`, on the run folder's board
    settings ([stage.executor] policy; the board's RAM configured, read on the board, or assumed:
    estimate.BoardSettings.of_config): the board model decides what fits (modelled)."""
    if setting == "never":
        return NEVER
    from models.board.account import STAYS_UP_RULE_GB, fit_together, stays_up_while_denoising
    from orchestrator.engine.estimate import BoardSettings, board_model_for, evaluation
    board = BoardSettings.of_config(cfg)
    model = board_model_for(pack_dir, size, board)
    budget = model.context_budget_mib(board.board_ram_gb)
    # the DiT policy's memory (its evaluation) matters only where a stage may be up beside it
    used = budget if board.board_ram_gb <= STAYS_UP_RULE_GB else evaluation(pack_dir, size, 1, 2, board)[0].memory_mib
    modes = {}
    for stage in STAGES:
        fits = stays_up_while_denoising(model, board.board_ram_gb, budget, used, stage)
        modes[stage] = "always" if fits and setting in ("auto", "always") else "idle"
        if setting == "always" and not fits:
            log.info("keep_up always: the %s does not fit beside the DiT on the %d GB board (modelled): idle",
                     stage, board.board_ram_gb)
    why = (f"{setting}: " + ", ".join(f"{s} {m}" for s, m in modes.items())
           + f" ({board.board_ram_gb} GB board, {board.ram_basis})")
    log.info("keep_up %s", why)
    return KeepUp(modes, fit_together(model, budget, STAGES), why)


def for_job(daemon, job) -> KeepUp:
    """The policy of a job (its pack by its size); `never` when it cannot be worked out (the job's own flow reports a
    prompt or pack problem)."""
    setting = getattr(daemon.settings, "keep_up", "never")
    if setting == "never":
        return NEVER
    try:
        spec = job.prompt()
        size = (spec.width, spec.height)
        pack = daemon.packs.get(size)
        return resolve(setting, daemon.cfg, None if pack is None else pack.dir, size)
    except Exception as e:  # noqa: BLE001 - EstimateError, a pack gone: the stages are stopped after each use
        log.info("job %s: keep_up %s not applied (%s): stages stopped after each use", job.id, setting, e)
        return NEVER
