"""The orchestrator's own settings: `[stage.orchestrator]` of the pipeline config (the table: stages/settings.py)."""
from __future__ import annotations

from dataclasses import dataclass

from stages.config import STAGE_SETTINGS, check_stage_table

_D = {k: s.default for k, s in STAGE_SETTINGS["orchestrator"].items()}    # [stage.orchestrator]: stages/config.py


@dataclass(frozen=True)
class OrchestratorSettings:
    max_queue: int = _D["max_queue"]
    min_free_mb: float = _D["min_free_mb"]
    stage_retries: int = _D["stage_retries"]
    start_timeout_s: float = _D["start_timeout_s"]
    stop_timeout_s: float = _D["stop_timeout_s"]
    encode_timeout_s: float = _D["encode_timeout_s"]
    denoise_timeout_s: float = _D["denoise_timeout_s"]
    decode_timeout_s: float = _D["decode_timeout_s"]
    sample_interval_s: float = _D["sample_interval_s"]
    hang_timeout_s: float = _D["hang_timeout_s"]
    timing_plot_timeout_s: float = _D["timing_plot_timeout_s"]

    @classmethod
    def from_table(cls, table: dict, where: str = "") -> "OrchestratorSettings":
        """From a `[stage.orchestrator]` table, checked against stages.settings.STAGE_SETTINGS (ConfigError)."""
        return cls(**check_stage_table("orchestrator", table, where))


def settings_from_config(cfg) -> OrchestratorSettings:
    return OrchestratorSettings.from_table(cfg.stage_settings("orchestrator"))
