"""The encoder's steps (EncodeText): a job's contexts from the conditioning cache or the encoder stage, kept in the
job folder (text.json first, then cond.npy / uncond.npy; hires_* for the second pass's own prompts), and while the
encoder is up the queued jobs' prompts encoded ahead into the cache."""
from __future__ import annotations

import json
import logging

import numpy as np

from models.base.durable import atomic_write
from models.dit.partition import TEXT_TOKENS
from orchestrator.engine.cond_cache import CondEntry, cache_key, encoder_identity, lora_identity
from orchestrator.engine.job_files import (COND_FILE, HIRES_COND_FILE, HIRES_TEXT_FILE, HIRES_UNCOND_FILE, TEXT_FILE,
                                    UNCOND_FILE)
from orchestrator.engine.plan.build import hires_texts, prompt_pairs
from orchestrator.engine.plan.job_io import load_npy, load_text, save_npy
from orchestrator.engine.plan.steps import ENCODER
from orchestrator.engine.report import text_record
from orchestrator.engine.stage_control import StageFailed
from protocol import messages as m
from protocol.tensors import from_inline

log = logging.getLogger("orchestrator.engine.plan")


class TextSteps:
    """The encoder's steps of a job's runner (orchestrator.engine.plan.run.PlanRunner) and the contexts they keep."""

    def _load_contexts(self) -> bool:
        """The job folder's contexts (and their T5 token counts) into the arena and the report; False when any is
        missing or unusable (the counts only matter to a long-context pack: they set its mask)."""
        arrays = [load_npy(self.dir / f"{name}.npy", self.pack.context_shape) for name in ("cond", "uncond")]
        text = self._load_text(TEXT_FILE)
        if any(a is None for a in arrays) or (text is None and self.pack.text_tokens > TEXT_TOKENS):
            return False
        self.arena.write(self.cond, arrays[0])                                               # [S, Dc] f32
        self.arena.write(self.uncond, arrays[1])
        self.report.text = text or {}
        return True

    def _hires_texts(self) -> tuple[str, str] | None:
        """The second pass's (prompt, negative) when it has its own (hires.prompt / negative_prompt), else None."""
        return hires_texts(self.spec)

    def _hires_contexts(self) -> tuple | None:
        """(cond, uncond, text) of the second pass's own prompts from the job folder, or None when any is unusable."""
        arrays = [load_npy(self.dir / f"hires_{name}.npy", self.hires_pack.context_shape)
                  for name in ("cond", "uncond")]
        text = self._load_text(HIRES_TEXT_FILE)
        if any(a is None for a in arrays) or (text is None and self.hires_pack.text_tokens > TEXT_TOKENS):
            return None
        return arrays[0], arrays[1], text or {}

    def _load_text(self, name: str) -> dict | None:
        return load_text(self.dir / name)

    def _step_encode_text(self, step) -> None:
        """EncodeText: the first pass's prompts (or, `step.hires`, the second pass's own) from the conditioning cache,
        else from the encoder (brought up for the first prompt the cache lacks, once for the run of encode steps; a
        job that needs nothing encoded starts no encoder: report `encoder_started`)."""
        if step.mixed:
            self._step_encode_entries()
        elif step.hires:
            if self._hires_contexts() is None and not self._hires_from_cache(step.entries):
                self._need_up(ENCODER)
                self._encode_hires(step.entries)
        elif not self._load_contexts() and not self._first_from_cache(step.entries):
            self._need_up(ENCODER)
            self._encode_first(step.entries)

    # ------------------------------------------------------------ the conditioning cache (orchestrator/engine/cond_cache.py)

    def _cond_key(self, loras, prompt: str, negative: str, rows: int, entries: tuple = (None, None)) -> str | None:
        """The cache key of one ENCODE, or None when it cannot be known here (cache off, a remote encoder whose
        files this machine cannot see, a file gone: then the encoder answers as before)."""
        if not self.d.cond_cache.on or self.cfg.is_remote("encoder"):
            return None
        try:
            if self._encoder_id is None:         # once per job: a file changed between jobs is a new encoder
                self._encoder_id = encoder_identity(self.cfg)
            return cache_key(prompt, negative, rows, lora_identity(loras, self.cfg.models_dir), self._encoder_id,
                             entries)
        except Exception as e:  # noqa: BLE001 - OSError, ModelsDirError: the encoder stage says it better
            log.info("job %s: conditioning not cached: %s", self.job.id, e)
            return None

    def _cached(self, prompt: str, negative: str, pack, entries: tuple = (None, None)) -> CondEntry | None:
        key = self._cond_key(self.spec.loras, prompt, negative, pack.text_tokens, entries)
        return None if key is None else self.d.cond_cache.get(key, pack.context_shape)

    def _first_from_cache(self, entries: tuple) -> bool:
        entry = self._cached(self.spec.prompt, self.spec.negative_prompt, self.pack, entries)
        if entry is None:
            return False
        self.arena.write(self.cond, entry.cond)                                              # [S, Dc] f32
        self.arena.write(self.uncond, entry.uncond)
        self._keep_first(entry)
        return True

    def _hires_from_cache(self, entries: tuple) -> bool:
        entry = self._cached(*self._hires_texts(), self.hires_pack, entries)
        if entry is not None:
            self._keep_hires(entry)
        return entry is not None

    def _encode_queued(self) -> None:
        """While the encoder is up: every queued job's prompts that the cache lacks, encoded into it (first pass and a
        hires pass's own). Best effort: a prompt the encoder refuses is left for its own job to report."""
        if not self.d.cond_cache.on:
            return
        for job in self.store.pending():
            if job.id == self.job.id or job.cancel_requested or job.id in self.d.cancel_requests:
                continue
            try:
                spec = job.prompt()
            except Exception:  # noqa: BLE001 - its own flow reports a prompt that no longer reads
                continue
            for prompt, negative, pack, entries in prompt_pairs(spec, self.d.packs):
                key = self._cond_key(spec.loras, prompt, negative, pack.text_tokens, entries)
                if key is None or self.d.cond_cache.get(key, pack.context_shape) is not None:
                    continue
                try:
                    entry = self._encode_inline(prompt, negative, pack, spec.loras, job.id, entries)
                except StageFailed as e:
                    log.info("job %s: queued job %s's prompts not encoded ahead: %s", self.job.id, job.id, e)
                    return
                self.d.cond_cache.put(key, entry)

    # ------------------------------------------------------------ the encoder

    def _encode_inline(self, prompt: str, negative: str, pack, loras, job_id: str,
                       entries: tuple = (None, None)) -> CondEntry:
        """One ENCODE answered inline (the rows of `pack`, which this job's arena slots may not have)."""
        msg = m.Encode(job=job_id, prompt=prompt, negative=negative, rows=pack.text_tokens, loras=loras,
                       prompt_entry=entries[0], negative_entry=entries[1])
        reply = m.expect(self.control.call("encoder", msg, self.settings.encode_timeout_s), m.Encoded, "encoder")
        arrays = [from_inline(d, reply.inline) if d.inline else None for d in (reply.cond, reply.uncond)]
        if any(a is None or tuple(a.shape) != tuple(pack.context_shape) for a in arrays):
            raise StageFailed("encoder", f"ENCODED for {job_id}'s prompts is not inline {list(pack.context_shape)}")
        cond, uncond = (np.ascontiguousarray(a, dtype=np.float32) for a in arrays)
        return CondEntry(cond, uncond, reply.tokens_cond, reply.tokens_uncond, reply.truncated)

    def _encode_hires(self, entries: tuple) -> None:
        """hires.prompt / negative_prompt -> hires_cond.npy, hires_uncond.npy (inline: the hires pack's rows, which
        the first arena's slots may not have) and hires_text.json, the counts first (a resume reads all three)."""
        prompt, negative = self._hires_texts()
        entry = self._encode_inline(prompt, negative, self.hires_pack, self.spec.loras, self.job.id, entries)
        self._keep_hires(entry)
        self._cache_put(prompt, negative, self.hires_pack, entry, entries)

    def _keep_hires(self, entry: CondEntry) -> None:
        text = text_record(entry.tokens_cond, entry.tokens_uncond, entry.truncated, self.hires_pack.text_tokens)
        atomic_write(self.dir / HIRES_TEXT_FILE, json.dumps(text))
        save_npy(self.dir / HIRES_COND_FILE, entry.cond)
        save_npy(self.dir / HIRES_UNCOND_FILE, entry.uncond)

    def _cache_put(self, prompt: str, negative: str, pack, entry: CondEntry, entries: tuple = (None, None)) -> None:
        key = self._cond_key(self.spec.loras, prompt, negative, pack.text_tokens, entries)
        if key is not None:
            self.d.cond_cache.put(key, entry)

    def _encode_first(self, entries: tuple) -> None:
        remote = self.cfg.is_remote("encoder")
        # cfg 1 everywhere: no unconditional pass reads the negative prompt's context, so it is not encoded
        ignored = self.spec.negative_ignored()
        negative = "" if ignored else self.spec.negative_prompt
        msg = m.Encode(job=self.job.id, prompt=self.spec.prompt, negative=negative,
                       arena=None if remote else self.arena.name, cond=None if remote else self.cond,
                       uncond=None if remote else self.uncond, rows=self.pack.text_tokens, loras=self.spec.loras,
                       prompt_entry=entries[0], negative_entry=None if ignored else entries[1])
        reply = m.expect(self.control.call("encoder", msg, self.settings.encode_timeout_s), m.Encoded, "encoder")
        for mine, theirs in ((self.cond, reply.cond), (self.uncond, reply.uncond)):
            if theirs.inline:
                self.arena.write(mine, from_inline(theirs, reply.inline))
            elif theirs.slot != mine.slot:
                raise StageFailed("encoder", f"ENCODED points at slot {theirs.slot!r}, expected {mine.slot!r}")
        entry = CondEntry(self.arena.read(self.cond), self.arena.read(self.uncond), reply.tokens_cond,
                          reply.tokens_uncond, reply.truncated)
        self._keep_first(entry)
        self._cache_put(self.spec.prompt, self.spec.negative_prompt, self.pack, entry, entries)
        self.report.encoder_timings = dict(reply.timings)

    def _keep_first(self, entry: CondEntry) -> None:
        """The first pass's contexts and token counts into the report and the job folder (text.json first: a resume
        reads both)."""
        self.report.text = text_record(entry.tokens_cond, entry.tokens_uncond, entry.truncated, self.pack.text_tokens)
        atomic_write(self.dir / TEXT_FILE, json.dumps(self.report.text))
        save_npy(self.dir / COND_FILE, entry.cond)
        save_npy(self.dir / UNCOND_FILE, entry.uncond)
