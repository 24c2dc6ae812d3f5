"""Before a job's steps run: room on its disk, its packs, its arena and its LoRAs checked again (anything may have
changed while it was queued); each failure is the job's, named, never the daemon's."""
from __future__ import annotations

import secrets
import shutil

from models.lora.choice import lora_short_hash
from models.packs.pack import PackError
from orchestrator.engine.job_arena import arena_pack, create_job_arena
from orchestrator.engine.loras import LoraRefused
from orchestrator.engine.stage_control import StageFailed
from protocol.arena import segment_name

OFF_THREAD_POLL_S = 0.05     # the daemon's clients wait at most this long more while a LoRA is read off its thread


def lora_places(layers: dict, lora_rank: int) -> dict:
    """Where a LoRA's layers ({place: count}, models.lora.targets.PLACES) are applied in the pipeline."""
    where = {"branch": f"executor: the LoRA-ready pack's low-rank inputs (rank {lora_rank}), written by the scheduler",
             "host": "scheduler: merged into FP32 copies of the pack's host weights",
             "adapter": "encoder: merged into the LLM adapter for this job",
             "te": "encoder: merged into the Qwen3 text encoder for this job"}
    return {place: where[place] for place in layers}


class JobChecks:
    """The checks and the arena of a job's runner (orchestrator.engine.plan.run.PlanRunner)."""

    def _check_disk(self) -> None:
        """A queued job may wait while the disk fills: before it starts, the queue's free-space floor holds again."""
        free_mb = shutil.disk_usage(self.dir).free / 2**20
        if free_mb < self.store.min_free_mb:
            raise StageFailed("orchestrator", f"only {free_mb:.0f} MB free in {self.dir}; a job needs at least "
                              f"{self.store.min_free_mb:.0f} MB (free some space, then `orchestrator resume "
                              f"{self.job.id}`)")

    def _check_packs(self) -> None:
        have = ", ".join(f"{w}x{h}" for w, h in self.d.packs)
        if self.pack is None:
            raise StageFailed("orchestrator", f"no model pack for {self.spec.width}x{self.spec.height} any more "
                              f"(the config changed after the job was queued); the sizes with a pack: {have}")
        if self.spec.hires is not None and self.hires_pack is None:
            w, h = self.spec.hires.size(self.spec.width, self.spec.height)
            raise StageFailed("orchestrator", f"no model pack for the hires pass's {w}x{h} any more (the config "
                              f"changed after the job was queued); the sizes with a pack: {have}")

    def _make_arena(self, init_slots: bool | None = None) -> None:
        # a fresh name per arena: a stage still serving a dead daemon's request for this job can never attach the
        # new arena under the old name and mix the two (its writes would land in the resumed job's latent)
        name = segment_name(self.d.rf.root, f"{self.job.id}_{secrets.token_hex(3)}")
        try:
            made = create_job_arena(name, arena_pack(self.pack.dir),               # manifest only
                                    self.img2img if init_slots is None else init_slots)
        except PackError as e:
            raise StageFailed("orchestrator", f"model pack {self.pack.dir}: {e}") from None
        except Exception as e:  # ArenaError: no space, a stale segment
            raise StageFailed("orchestrator", f"cannot create the job arena: {e}") from None
        self.arena, self.cond, self.uncond, self.latent = made.arena, made.cond, made.uncond, made.latent
        self.scratch = made.scratch
        self.image_slot, self.init_latent, self.noise_mask = made.image, made.init_latent, made.noise_mask

    def _check_loras(self) -> None:
        """The job's LoRAs checked again against its pack and the encoder (a file may have changed since submit),
        and recorded: what each changes where (report.json `loras`), the hashes the PNG names them by."""
        if not self.spec.loras:
            return

        def check_and_hash() -> tuple:
            uses, plan = self.d.loras.check(self.spec.loras, self.pack.size, self.pack.lora_rank)
            return uses, plan, [lora_short_hash(u.path) for u in uses]
        try:
            uses, plan, hashes = self._off_thread(check_and_hash)
        except LoraRefused as e:
            raise StageFailed("orchestrator", f"prompt.json field '{e.field}': {e.detail}") from None
        except OSError as e:
            raise StageFailed("orchestrator", f"LoRA {self.d.loras.told(e)}") from None
        for use, rep, short in zip(uses, plan, hashes):
            self.lora_hashes[use.name] = short
            self.report.loras.append({**rep, "short_hash": self.lora_hashes[use.name],
                                      "applied_in": lora_places(rep["layers"], self.pack.lora_rank)})

    def _off_thread(self, fn):
        """fn() on the daemon's LoRA workers (reading and hashing whole files), the daemon serving its clients and
        this job's cancel meanwhile (a cancelled job leaves the worker to finish on its own)."""
        work = self.d.lora_pool.submit(fn)
        while not work.done():
            self.d.pump(OFF_THREAD_POLL_S)
            self.control.check_cancel()
        return work.result()
