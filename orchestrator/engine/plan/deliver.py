"""The last step (Deliver): each image copied to the prompt's `output` once all are decoded (a restart mid-batch finds
none of its own copies in the way), the report naming where each is."""
from __future__ import annotations

import logging
from pathlib import Path

from models.base.durable import atomic_write
from orchestrator.engine.job_files import batch_name
from orchestrator.engine.plan.build import decoded_latent_file
from orchestrator.engine.prompt_spec import output_file
from orchestrator.engine.stage_control import StageFailed

log = logging.getLogger("orchestrator.engine.plan")
BASE_SUFFIX = "_base"                        # hires.keep_base: NAME_base.png beside NAME.png at `output`


class DeliverStep:
    """The delivery of a job's runner (orchestrator.engine.plan.run.PlanRunner)."""

    def _step_deliver(self, step) -> None:
        images, bases = step.inputs[:self.batch], step.inputs[self.batch:]
        where = [self._deliver(self.dir / image, pos) for pos, image in enumerate(images)]
        self.report.image = where[0]
        if bases:                            # hires.keep_base: the first pass's images, next to the final ones
            self.report.base_images = [self._deliver(self.dir / base, pos, BASE_SUFFIX)
                                       for pos, base in enumerate(bases)]
        if self.batch > 1:
            self.report.images = [{"batch_index": pos, "seed": self.spec.seed, "image": w,
                                   "latent": str(self.dir / decoded_latent_file(self.spec, pos))}
                                  for pos, w in enumerate(where)]

    def _deliver(self, image: Path, pos: int = 0, suffix: str = "") -> str:
        """Copy the PNG to the prompt's `output` (a .png path, or a folder that gets JOB.png; `suffix` after the stem:
        NAME_base.png) -> where the image is.

        The copy is a file created exclusively next to the destination (atomic_write: no planted link is followed)
        and renamed over it only when the job says `overwrite`; otherwise an existing destination (a file, a link,
        anything) is kept and the job's image stays where it always is, in the job folder."""
        out = self.spec.output
        if not out:
            return str(image)
        dest = output_file(out, self.job.id)
        dest = dest.with_name(dest.stem + suffix + dest.suffix)
        if pos:                              # a batch's other images next to the first: NAME_1.png ...
            dest = dest.with_name(batch_name(dest.stem, dest.suffix, pos))
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(dest, image.read_bytes(), overwrite=self.spec.overwrite)
        except FileExistsError:
            note = f"output {dest} exists and the job does not say overwrite: kept; the image is {image}"
            log.warning("job %s: %s", self.job.id, note)
            self.report.delivery = {"output": str(dest), "written": False, "note": note}
            return str(image)
        except OSError as e:
            raise StageFailed("orchestrator", f"cannot write the image to output {dest}: {e} (the image is kept "
                                              f"at {image})") from None
        if pos == 0 and not suffix:          # a batch's record is its first image's, unless a later one was kept
            self.report.delivery = {"output": str(dest), "written": True}
        return str(dest)
