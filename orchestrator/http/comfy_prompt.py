"""A ComfyUI prompt as the daemon's jobs: a graph of independent chains runs as one job per chain (queued in the
graph's order), each job's origin naming the prompt (`prompt_id`: its first chain's job id) and its place
(`chain`, `chains`). A prompt runs from its first job's start to its last job's end; /queue, /history and the
WebSocket speak of prompts, the daemon of jobs."""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.http.views import JobView


@dataclass(frozen=True)
class PromptView:
    """The jobs of one prompt seen so far, in chain order (some may not be listed: see `whole`)."""

    parts: tuple[JobView, ...]

    @property
    def id(self) -> str:
        return self.parts[0].prompt_id

    @property
    def first(self) -> JobView:
        return self.parts[0]

    @property
    def whole(self) -> bool:
        """Every chain's job is here."""
        n = self.parts[0].chain[1]
        return sorted(p.chain[0] for p in self.parts) == list(range(n))

    @property
    def running(self) -> bool:
        """Running as ComfyUI counts it (its listed jobs being the active ones): a chain runs, or an earlier chain
        has ended and a later one waits its turn."""
        return any(p.running for p in self.parts) or min(p.chain[0] for p in self.parts) > 0

    @property
    def finished(self) -> bool:
        return self.whole and all(p.finished for p in self.parts)

    @property
    def state(self) -> str:
        """done when every chain is; else how the first chain that did not end done ended (failed, cancelled)."""
        return next((p.state for p in self.parts if p.state != "done"), "done")


def group(jobs) -> list[PromptView]:
    """JobViews grouped by prompt, in the order each prompt's first listed job comes (oldest first for a STATUS)."""
    by: dict[str, list[JobView]] = {}
    for job in jobs:
        by.setdefault(job.prompt_id, []).append(job)
    return [PromptView(tuple(sorted(parts, key=lambda p: p.chain[0]))) for parts in by.values()]


def same_second(job_id: str, other: str) -> bool:
    """Whether `other` was made no earlier than the second of `job_id` (job ids start with their time: a chain's
    job is queued after its prompt's first)."""
    return other[:15] >= job_id[:15]


async def prompt_parts(link, first: JobView) -> PromptView:
    """Every job of the prompt whose first chain's job is `first`, looked up newest first down to its second."""
    parts = {first.id: first}
    n = first.chain[1]
    if n > 1:
        async for page in link.status_pages(detail=True):
            for job in map(JobView.of, page):
                if job.prompt_id == first.id:
                    parts[job.id] = job
            if len(parts) >= n or not page or not same_second(first.id, page[0].job):
                break
    return group(parts.values())[0]
