"""One sampler step's figures on the scheduler's critical path (DENOISED.steps, report.json `steps`): wall, the
executor's inference and the lifecycle the scheduler waited for (models.runtime.phase_times.PhaseTimes of every call), the host
ops not hidden behind an inference, their own compute here, transport. The rest of the wall (sampler, state file,
events) is `wall - infer - lifecycle - host - transport`.
"""
from __future__ import annotations

from protocol import messages as m


def step_times(step: int, wall_s: float, timing=None, *, transport_s: float = 0.0, calls: int = 0,
               host_work_s: float | None = None, clocks_shared: bool = True, nfe: int = 1) -> m.StepTimes:
    """`timing`: the step's forward (models.runtime.dit_runner.ForwardTiming), None for a Spectrum forecast. `host_work_s`:
    the host ops' own compute when they were held to a modelled board's time (board-sim), else their wall. `nfe`: the
    step's model calls (a forward each, both CFG passes); 0 for a forecast."""
    if timing is None:
        return m.StepTimes(step=step, computed=False, wall_s=wall_s, nfe=0)
    calls_t = [t for _, _, t in timing.branches]
    infer = sum(t.total_s - t.visible_s for t in calls_t)       # the inference on the call's critical path
    hidden = timing.host_hidden_s if clocks_shared else 0.0
    return m.StepTimes(step=step, computed=True, wall_s=wall_s, infer_s=infer,
                       lifecycle_s=sum(t.visible_s for t in calls_t), host_s=max(0.0, timing.host_s - hidden),
                       host_work_s=timing.host_s if host_work_s is None else host_work_s, transport_s=transport_s,
                       calls=calls, nfe=nfe)
