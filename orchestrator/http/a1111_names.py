"""The samplers and schedulers as A1111's web UI names them, and the ComfyUI names (models/sampling/sampler.py) they are.

Names from stable-diffusion-webui's modules/sd_samplers_kdiffusion.py (samplers_k_diffusion: label, function,
aliases), sd_samplers_timesteps.py (DDIM, UniPC), sd_samplers_lcm.py (LCM) and sd_schedulers.py (schedulers: name,
label, aliases). Before its 1.9 release A1111 folded the scheduler into the sampler's name ("DPM++ 2M Karras"); such
a name still selects the sampler and, when the request leaves `scheduler` at "automatic", the scheduler. Samplers A1111
does not have (er_sde, sa_solver ...) carry a label in A1111's style and their ComfyUI name as an alias. Readers: the
A1111 routes (orchestrator/http/a1111.py) and the PNG's `parameters` line (orchestrator/http/a1111_infotext.py).
"""
from __future__ import annotations

from typing import NamedTuple

from models.sampling.sampler import DEFAULT_SCHEDULER


class A1111Name(NamedTuple):
    label: str                  # what A1111 shows and writes in `Sampler:` / `Schedule type:`
    name: str                   # the ComfyUI name (prompt.json)
    aliases: tuple = ()


A1111_SAMPLERS = (
    A1111Name("DPM++ 2M", "dpmpp_2m", ("k_dpmpp_2m",)),
    A1111Name("DPM++ SDE", "dpmpp_sde", ("k_dpmpp_sde",)),
    A1111Name("DPM++ 2M SDE", "dpmpp_2m_sde", ("k_dpmpp_2m_sde",)),
    A1111Name("DPM++ 2S a", "dpmpp_2s_ancestral", ("k_dpmpp_2s_a",)),
    A1111Name("DPM++ 3M SDE", "dpmpp_3m_sde", ("k_dpmpp_3m_sde",)),
    A1111Name("Euler a", "euler_ancestral", ("k_euler_a", "k_euler_ancestral")),
    A1111Name("Euler", "euler", ("k_euler",)),
    A1111Name("LMS", "lms", ("k_lms",)),
    A1111Name("Heun", "heun", ("k_heun",)),
    A1111Name("DPM2", "dpm_2", ("k_dpm_2",)),
    A1111Name("DPM2 a", "dpm_2_ancestral", ("k_dpm_2_a",)),
    A1111Name("DDIM", "ddim", ()),
    A1111Name("UniPC", "uni_pc", ("unipc",)),
    A1111Name("LCM", "lcm", ("k_lcm",)),
    # not in A1111: labels in its style
    A1111Name("UniPC BH2", "uni_pc_bh2", ()),
    A1111Name("DDPM", "ddpm", ()),
    A1111Name("iPNDM", "ipndm", ()),
    A1111Name("Res Multistep", "res_multistep", ()),
    A1111Name("Gradient Estimation", "gradient_estimation", ()),
    A1111Name("ER SDE", "er_sde", ()),
    A1111Name("SA-Solver", "sa_solver", ()),
    A1111Name("SA-Solver PECE", "sa_solver_pece", ()),
)
A1111_SCHEDULERS = (
    A1111Name("Uniform", "normal", ("uniform",)),        # A1111's "uniform": the model's own sigmas, ComfyUI's normal
    A1111Name("Karras", "karras", ()),
    A1111Name("Exponential", "exponential", ()),
    A1111Name("SGM Uniform", "sgm_uniform", ("SGMUniform",)),
    A1111Name("KL Optimal", "kl_optimal", ()),
    A1111Name("Simple", "simple", ()),
    A1111Name("Normal", "normal", ()),
    A1111Name("DDIM", "ddim_uniform", ("ddim",)),
    A1111Name("Beta", "beta", ()),
    A1111Name("Linear Quadratic", "linear_quadratic", ()),   # not in A1111 (ComfyUI's)
)
AUTOMATIC = "automatic"         # A1111's "the sampler's own": here the pipeline's default scheduler
# what A1111 (or its forks) offers and this pipeline does not run, with the reason the refusal gives
UNSUPPORTED_SAMPLERS = {
    "restart": "Restart (A1111's restart sampler) is not one of ComfyUI's samplers",
    "dpm++ 2m sde heun": "DPM++ 2M SDE Heun (the Heun solver type) is not run here; DPM++ 2M SDE is (midpoint)",
    "dpm fast": "DPM fast is not run here", "dpm adaptive": "DPM adaptive is not run here",
    "plms": "PLMS is not run here", "ddim cfg++": "DDIM CFG++ is not run here",
}
UNSUPPORTED_SCHEDULERS = {"polyexponential": "Polyexponential", "align your steps": "Align Your Steps",
                          "align_your_steps": "Align Your Steps"}
SCHEDULER_SUFFIXES = {"karras": "karras", "exponential": "exponential"}     # "DPM++ 2M Karras" style names

_SAMPLER_OF = {n.lower(): s for s in A1111_SAMPLERS for n in (s.label, s.name, *s.aliases)}
_SCHEDULER_OF = {n.lower(): s for s in A1111_SCHEDULERS for n in (s.label, s.name, *s.aliases)}


class A1111NameError(ValueError):
    """A name A1111's API would not resolve here; `field` is the request field, the message names what there is."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def sampler_label(name: str) -> str:
    return next(s.label for s in A1111_SAMPLERS if s.name == name)


def scheduler_label(name: str) -> str:
    return next(s.label for s in A1111_SCHEDULERS if s.name == name and s.label != "Uniform")


def resolve(sampler: str, scheduler: str | None) -> tuple[str, str]:
    """(ComfyUI sampler, ComfyUI scheduler) of a txt2img's sampler_name and scheduler (None: automatic); A1111NameError
    naming the field and the names there are otherwise."""
    key = sampler.strip().lower()
    implied = None
    if key not in _SAMPLER_OF:
        base, _, suffix = key.rpartition(" ")
        if suffix in SCHEDULER_SUFFIXES and base in _SAMPLER_OF:
            key, implied = base, SCHEDULER_SUFFIXES[suffix]
    if key not in _SAMPLER_OF:
        why = UNSUPPORTED_SAMPLERS.get(key)
        raise A1111NameError("sampler_name", f"{sampler!r:.80} is not available" + (f" ({why})" if why else "")
                         + "; samplers: " + ", ".join(s.label for s in A1111_SAMPLERS))
    sched_key = (scheduler or AUTOMATIC).strip().lower()
    if sched_key == AUTOMATIC:
        sched = implied or DEFAULT_SCHEDULER
    elif sched_key in _SCHEDULER_OF:
        sched = _SCHEDULER_OF[sched_key].name
        if implied and implied != sched:
            raise A1111NameError("scheduler", f"{scheduler!r:.80} contradicts sampler_name {sampler!r:.80}, which "
                                              f"implies {scheduler_label(implied)}; give one of them")
    else:
        why = UNSUPPORTED_SCHEDULERS.get(sched_key)
        raise A1111NameError("scheduler", f"{scheduler!r:.80} is not available" + (f" ({why} is not run here)" if why
                         else "") + "; schedulers: Automatic, " + ", ".join(s.label for s in A1111_SCHEDULERS))
    return _SAMPLER_OF[key].name, sched


def samplers_list() -> list[dict]:
    """`GET /sdapi/v1/samplers` (A1111's SamplerItem: name, aliases, options)."""
    return [{"name": s.label, "aliases": [s.name, *s.aliases] if s.label != s.name else list(s.aliases),
             "options": {}} for s in A1111_SAMPLERS]


def schedulers_list() -> list[dict]:
    """`GET /sdapi/v1/schedulers` (A1111's SchedulerItem: name, label, aliases, default_rho, need_inner_model)."""
    out = [{"name": AUTOMATIC, "label": "Automatic", "aliases": None, "default_rho": -1, "need_inner_model": False}]
    for s in A1111_SCHEDULERS:
        name = s.aliases[0] if s.label == "Uniform" else s.name
        out.append({"name": name, "label": s.label, "aliases": list(s.aliases) or None,
                    "default_rho": 7.0 if s.name == "karras" else -1, "need_inner_model": s.name != "karras"})
    return out
