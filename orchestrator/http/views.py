"""A job as the front shows it: the daemon's JobInfo with its spec and origin decoded, and the names a ComfyUI client
sees for it (node ids, loader file names)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from orchestrator.http.comfy_graph import CANONICAL_IDS, ModelNames, job_nodes, job_to_graph
from orchestrator.engine.job_record import FINISHED, STAGES
from orchestrator.engine.progress_text import phase_text
from protocol import messages as m

STATE_ROLE = {"encoding": "positive", "denoising": "sampler", "decoding": "decode"}   # the node a state "executes"


def model_names(pipeline: m.Pipeline | None) -> ModelNames:
    """Loader file names from the daemon: the packs' checkpoints, the models folder's text encoder and VAE; the
    packs' sizes (the default first)."""
    if pipeline is None:
        return ModelNames()
    unet = tuple(dict.fromkeys(p.source_name for p in pipeline.packs if p.source_name))
    return ModelNames(unet=unet, clip=tuple(filter(None, [pipeline.models.get("text_encoder")])),
                      vae=tuple(filter(None, [pipeline.models.get("vae")])), lora=tuple(pipeline.loras),
                      sizes=tuple((p.width, p.height) for p in pipeline.packs))


@dataclass(frozen=True)
class JobView:
    info: m.JobInfo
    spec: dict = field(default_factory=dict)
    origin: dict = field(default_factory=dict)

    @classmethod
    def of(cls, info: m.JobInfo) -> "JobView":
        def obj(text: str) -> dict:
            try:
                v = json.loads(text) if text else {}
            except ValueError:
                return {}
            return v if isinstance(v, dict) else {}
        return cls(info, obj(info.spec_json), obj(info.origin))

    @property
    def id(self) -> str:
        return self.info.job

    @property
    def state(self) -> str:
        return self.info.state

    @property
    def running(self) -> bool:
        return self.state in STAGES

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    @property
    def api(self) -> str:
        return str(self.origin.get("api", "cli"))

    @property
    def client_id(self) -> str | None:
        cid = self.origin.get("client_id")
        return cid if isinstance(cid, str) and cid else None

    @property
    def prompt_id(self) -> str:
        """The ComfyUI prompt it is a chain of: the id of its first chain's job (its own for a graph of one chain
        and for jobs from elsewhere)."""
        pid = self.origin.get("prompt_id") if self.api == "comfyui" else None
        return pid if isinstance(pid, str) and pid else self.id

    @property
    def chain(self) -> tuple[int, int]:
        """(its place among the prompt's independent chains, how many there are): (0, 1) for one chain."""
        k, n = self.origin.get("chain", 0), self.origin.get("chains", 1)
        ok = isinstance(k, int) and isinstance(n, int) and 0 <= k < n
        return (k, n) if ok and self.api == "comfyui" else (0, 1)

    @property
    def nodes(self) -> dict[str, str]:
        """Role -> node id: the client's ids for a ComfyUI job, else the canonical graph's."""
        nodes = self.origin.get("nodes") if self.api == "comfyui" else None
        return {**CANONICAL_IDS, **nodes} if isinstance(nodes, dict) else job_nodes(self.spec)

    @property
    def number(self) -> int:
        """ComfyUI's queue `number` for it: its creation time in ms (orders like the queue)."""
        return int(self.info.created * 1000)

    def graph(self, names: ModelNames) -> dict:
        """The API graph: as the client sent it (ComfyUI jobs), else the job's own (comfy_graph.job_to_graph)."""
        g = self.origin.get("graph")
        if self.api == "comfyui" and isinstance(g, dict):
            return g
        if "width" not in self.spec:
            return {}
        return job_to_graph(self.spec, names=names)

    def progress_fields(self, blocks: int | None = None) -> dict:
        """The page's live fields: state, step, block, branch, ETA, which image and pass, and `text`: the phase in
        the CLI's words (orchestrator/engine/progress_text.py)."""
        p, w = self.info.progress, self.info.denoise_pass
        out = {"job": self.id, "state": self.state, "position": self.info.position,
               "text": phase_text(self.info, blocks)}
        if p is not None and self.state == "denoising":
            out.update(step=p.step, steps=p.steps, block=p.block, blocks=p.blocks or blocks, branch=p.branch,
                       forecast=p.forecast, elapsed_s=round(p.elapsed_s, 3),
                       eta_s=None if p.eta_s is None else round(p.eta_s, 1),
                       **({"image": w.image, "images": w.images, "pass": w.name} if w is not None else {}))
        return out
