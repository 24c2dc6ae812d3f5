"""ComfyUI's JSON shapes for jobs: WebSocket messages, `/history` entries, `/queue` items (as ComfyUI's server.py and
execution.py write them; see docs/http.md for the fields)."""
from __future__ import annotations

from orchestrator.http.comfy_graph import base_outputs, output_nodes
from orchestrator.http.comfy_nodes import ModelNames
from orchestrator.http.comfy_prompt import PromptView
from orchestrator.http.views import STATE_ROLE, JobView
from orchestrator.engine.job_files import batch_name

STAGE_ROLE = {"encoder": "positive", "scheduler": "sampler", "executor": "sampler", "vae": "decode"}  # a failure's node


def ts(t: float) -> int:
    return int(t * 1000)        # ComfyUI's message timestamps are in ms


def image_files(job: JobView, stem: str = "image") -> list[str]:
    """The job folder's PNGs: image.png, then a batch's image_1.png ... (orchestrator.engine.job_files.batch_name); `stem`
    base: a hires fix's first pass images (hires.keep_base)."""
    n = job.spec.get("batch", 1) if isinstance(job.spec.get("batch"), int) else 1
    return [batch_name(stem, ".png", pos) for pos in range(n)]


def images(job: JobView, node: str | None = None) -> list[dict]:
    """The images output node `node` shows (None: the job's final ones): its final images, or its first pass's for a
    SaveImage on that (base.png ...)."""
    stem = "base" if node is not None and node in base_outputs(job.nodes) else "image"
    return [{"filename": name, "subfolder": job.id, "type": "output"} for name in image_files(job, stem)] \
        if job.state == "done" else []


def status(queue_remaining: int) -> dict:
    return {"status": {"exec_info": {"queue_remaining": queue_remaining}}}


def executing(job: JobView, node: str | None) -> tuple[str, dict]:
    return "executing", {"node": node, "display_node": node, "prompt_id": job.prompt_id}


def start(job: JobView) -> list[tuple[str, dict]]:
    """A prompt's start, when its first chain's job starts (a later chain's start is its nodes' `executing`)."""
    if job.chain[0]:
        return []
    t = ts(job.info.updated)
    return [("execution_start", {"prompt_id": job.prompt_id, "timestamp": t}),
            ("execution_cached", {"nodes": [], "prompt_id": job.prompt_id, "timestamp": t})]


def state_node(job: JobView) -> str | None:
    role = STATE_ROLE.get(job.state)
    return job.nodes[role] if role else None


def progress(job: JobView) -> tuple[str, dict] | None:
    p = job.info.progress
    if p is None or job.state != "denoising":
        return None
    node = job.nodes["sampler"]
    return "progress", {"value": p.step, "max": p.steps, "prompt_id": job.prompt_id, "node": node}


def _node_type(job: JobView, node: str, names: ModelNames) -> str:
    g = job.graph(names)
    return str(g.get(node, {}).get("class_type", ""))


def end(job: JobView, names: ModelNames) -> list[tuple[str, dict]]:
    """What ComfyUI sends when a job ends: each output node's images (SaveImage, PreviewImage) as it executes; then,
    when the prompt ends (its last chain done, or this chain failed or was interrupted: ComfyUI runs nothing after
    a node's error), success, error or interruption and `executing` with node None."""
    t = ts(job.info.updated)
    out: list[tuple[str, dict]] = []
    if job.state == "done":
        for save in output_nodes(job.nodes):
            out += [executing(job, save),
                    ("executed", {"node": save, "display_node": save, "output": {"images": images(job, save)},
                                  "prompt_id": job.prompt_id})]
        if job.chain[0] < job.chain[1] - 1:
            return out                               # the next chain runs on
        out.append(("execution_success", {"prompt_id": job.prompt_id, "timestamp": t}))
    else:
        node = job.nodes[STAGE_ROLE.get(job.info.error_stage, "sampler")]
        base = {"prompt_id": job.prompt_id, "node_id": node, "node_type": _node_type(job, node, names),
                "executed": [], "timestamp": t}
        if job.state == "cancelled":
            out.append(("execution_interrupted", base))
        else:
            out.append(("execution_error", {**base, "exception_message": job.info.error or "the job failed",
                                            "exception_type": f"anima.{job.info.error_stage or 'orchestrator'}",
                                            "traceback": [], "current_inputs": {}, "current_outputs": {}}))
    out.append(executing(job, None))
    return out


def queue_item(prompt: PromptView, names: ModelNames) -> list:
    """[number, prompt_id, prompt, extra_data, outputs_to_execute]: the graph as sent (kept with the first chain's
    job), every chain's output nodes."""
    job = prompt.first
    extra = {"client_id": job.client_id} if job.client_id else {}
    return [job.number, prompt.id, job.graph(names), extra, [n for p in prompt.parts for n in output_nodes(p.nodes)]]


def history_entry(prompt: PromptView, names: ModelNames) -> dict:
    """One finished prompt: the queue item, its outputs by node id (each output node of a chain that ended done:
    its job's images, as ComfyUI keeps what executed before an error), its status and messages, meta."""
    saves = [(save, p) for p in prompt.parts if p.state == "done" for save in output_nodes(p.nodes)]
    ended = next((p for p in prompt.parts if p.state != "done"), prompt.parts[-1])
    kind = {"done": "execution_success", "cancelled": "execution_interrupted"}.get(ended.state, "execution_error")
    messages = [["execution_start", {"prompt_id": prompt.id, "timestamp": ts(prompt.first.info.created)}],
                [kind, {"prompt_id": prompt.id, "timestamp": ts(ended.info.updated)}]]
    if kind == "execution_error":
        messages[-1][1].update(exception_message=ended.info.error, exception_type=f"anima.{ended.info.error_stage}")
    done = prompt.state == "done"
    return {"prompt": queue_item(prompt, names),
            "outputs": {save: {"images": images(p, save)} for save, p in saves},
            "status": {"status_str": "success" if done else "error", "completed": done, "messages": messages},
            "meta": {save: {"node_id": save, "display_node": save, "parent_node": None, "real_node_id": save}
                     for save, _ in saves}}
