"""prompt.json's positive/negative entries (ComfyUI's ConditioningCombine, ConditioningSetTimestepRange): each
distinct conditioning (its text with its ConditioningZeroOut / ConditioningAverage, build.entry_conds) encoded once
(the conditioning cache first, keyed as a job with that prompt, its entry and an empty negative),
kept as cond_entry_K.npy and cond_entries.json (its token counts, written last); the denoise step hands the scheduler
every entry with its strength and window (DENOISE.conds, the contexts inline)."""
from __future__ import annotations

import json

from models.base.durable import atomic_write
from models.dit.partition import TEXT_TOKENS
from orchestrator.engine.job_files import ENTRIES_FILE
from orchestrator.engine.plan.build import cond_sides, conditioning_of, entry_conds, entry_file, entry_pair
from orchestrator.engine.plan.job_io import load_npy, load_text, save_npy
from orchestrator.engine.plan.steps import ENCODER
from orchestrator.engine.report import text_record
from orchestrator.engine.stage_control import StageFailed
from protocol import messages as m
from protocol.tensors import InlineFrames


class EntrySteps:
    """The entries' steps of a job's runner (orchestrator.engine.plan.run.PlanRunner)."""

    def _step_encode_entries(self) -> None:
        """EncodeText[entries]: every distinct conditioning's context from the cache or the encoder (brought up for the
        first the cache lacks), each kept at once (a resume after a kill re-encodes none already kept)."""
        if self.pack.text_tokens > TEXT_TOKENS:
            raise StageFailed("orchestrator", f"positive/negative entries need a pack of {TEXT_TOKENS} text rows; "
                                              f"this one has {self.pack.text_tokens}")
        counts = []
        for k, c in enumerate(entry_conds(self.spec)):
            entry = self._cached(c.text, "", self.pack, entry_pair(c))
            if entry is None:
                self._need_up(ENCODER)
                entry = self._encode_inline(c.text, "", self.pack, self.spec.loras, self.job.id, entry_pair(c))
                self._cache_put(c.text, "", self.pack, entry, entry_pair(c))
            save_npy(self.dir / entry_file(k), entry.cond)
            counts.append((entry.tokens_cond, entry.truncated))
        self._keep_entry_counts(counts)

    def _keep_entry_counts(self, counts: list) -> None:
        """cond_entries.json: each conditioning's T5 token count; the report's `text` names the first positive and
        first negative entry's."""
        texts = entry_conds(self.spec)
        record = {"texts": [{"tokens": int(n), "truncated": bool(t)} for n, t in counts]}
        atomic_write(self.dir / ENTRIES_FILE, json.dumps(record))
        self._entries_report(record, texts)

    def _entries_report(self, record: dict, texts: tuple) -> None:
        pos, neg = cond_sides(self.spec)
        first = record["texts"][texts.index(conditioning_of(pos[0]))]
        second = record["texts"][texts.index(conditioning_of(neg[0]))] if neg else {"tokens": 0, "truncated": False}
        self.report.text = text_record(first["tokens"], second["tokens"],
                                       any(t["truncated"] for t in record["texts"]), self.pack.text_tokens)

    def _entry_conds(self) -> tuple[dict, tuple]:
        """DENOISE's fields for a job with entries: {cond, uncond, conds, inline}'s contexts placed (the first
        positive and negative entry in the arena's cond/uncond slots, every entry inline in `conds`)."""
        texts = entry_conds(self.spec)
        contexts = [load_npy(self.dir / entry_file(k), self.pack.context_shape) for k in range(len(texts))]
        record = load_text(self.dir / ENTRIES_FILE)
        if record is None or any(c is None for c in contexts):
            raise StageFailed("orchestrator", "cond_entry*.npy / cond_entries.json are missing or unusable (resume "
                                              "the job)")
        self._entries_report(record, texts)
        pos, neg = cond_sides(self.spec)
        def context(e):
            return contexts[texts.index(conditioning_of(e))]
        self.arena.write(self.cond, context(pos[0]))                                        # [S, Dc] f32
        self.arena.write(self.uncond, context((neg or pos)[0]))
        frames, refs = InlineFrames(), []
        for side, entries in (("positive", pos), ("negative", neg)):
            for e in entries:                        # a frame each (a descriptor owns its frame)
                refs.append(m.CondPassRef(side=side, context=frames.add(context(e)),
                                          strength=e.strength, start=e.start, end=e.end))
        if not neg:                                  # cfg 1: the scheduler runs no negative pass; it needs a side
            refs.append(m.CondPassRef(side="negative", context=frames.add(context(pos[0]))))
        return {"conds": tuple(refs)}, tuple(frames.frames)
