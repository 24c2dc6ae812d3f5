"""Latent operations between the passes and the VAE (the daemon alone, numpy, no stage): MixLatent, ComfyUI's
LatentComposite / LatentBlend of a pass's latent with the init image's (prompt.json's `latent_mix`,
models/sampling/latent_mix.py), written atomically: a resume mixes the same files the same way (bitwise)."""
from __future__ import annotations

from models.sampling.latent_mix import LatentMixError, mix_image
from orchestrator.engine.plan.job_io import load_npy, save_npy
from orchestrator.engine.stage_control import StageFailed


class LatentSteps:
    """The latent operations of a job's runner (orchestrator.engine.plan.run.PlanRunner)."""

    def _step_mix_latent(self, step) -> None:
        """MixLatent: latent[_N].npy and init_latent.npy -> mixed_latent[_N].npy, `onto` the samples_to/samples1."""
        shape, m = self.first_pack.latent_shape, self.spec.latent_mix
        result, image = (load_npy(self.dir / name, shape) for name in step.inputs)
        if result is None or image is None:
            lost = [name for name, a in zip(step.inputs, (result, image)) if a is None]
            raise StageFailed("orchestrator", f"{', '.join(lost)} missing or unusable (resume the job)")
        onto, other = (result, image) if m.onto == "result" else (image, result)
        try:
            mixed = mix_image(m.kind, onto, other, x=m.x, y=m.y, feather=m.feather, factor=m.factor)
        except LatentMixError as e:
            raise StageFailed("orchestrator", f"latent_mix: {e}") from None
        save_npy(self.dir / step.outputs[0], mixed)
