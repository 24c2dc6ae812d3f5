"""Latent operations of the daemon alone (numpy, no stage), ComfyUI's LatentComposite / LatentBlend
(models/sampling/latent_mix.py): MixStart, before the first pass, of the two uploads' latents into the init latent
(prompt.json's `init_mix`); MixLatent, between the passes and the VAE, of a pass's latent with the init image's
(`latent_mix`). Written atomically: a resume mixes the same files the same way (bitwise)."""
from __future__ import annotations

from models.sampling.latent_mix import LatentMixError, mix_image
from orchestrator.engine.plan.job_io import load_npy, save_npy
from orchestrator.engine.stage_control import StageFailed


class LatentSteps:
    """The latent operations of a job's runner (orchestrator.engine.plan.run.PlanRunner)."""

    def _mixed(self, step, shape: tuple, field: str, m, first_is_onto: bool):
        """The two latent files `step` reads (each [C, H/8, W/8] of `shape`) mixed as `m` (a LatentMix / InitMix)
        says, the first one samples_to / samples1 when `first_is_onto`."""
        a, b = (load_npy(self.dir / name, shape) for name in step.inputs)
        if a is None or b is None:
            lost = [name for name, x in zip(step.inputs, (a, b)) if x is None]
            raise StageFailed("orchestrator", f"{', '.join(lost)} missing or unusable (resume the job)")
        onto, other = (a, b) if first_is_onto else (b, a)
        try:
            return mix_image(m.kind, onto, other, x=m.x, y=m.y, feather=m.feather, factor=m.factor)
        except LatentMixError as e:
            raise StageFailed("orchestrator", f"{field}: {e}") from None

    def _step_mix_start(self, step) -> None:
        """MixStart: init_encoded.npy and mix_encoded.npy -> init_latent.npy, `onto` the samples_to/samples1."""
        m = self.spec.init_mix
        save_npy(self.dir / step.outputs[0],
                 self._mixed(step, self.first_pack.latent_shape, "init_mix", m, m.onto == "init_image"))

    def _step_mix_latent(self, step) -> None:
        """MixLatent: latent[_N].npy and init_latent.npy -> mixed_latent[_N].npy, `onto` the samples_to/samples1."""
        m = self.spec.latent_mix
        save_npy(self.dir / step.outputs[0],
                 self._mixed(step, self.first_pack.latent_shape, "latent_mix", m, m.onto == "result"))
