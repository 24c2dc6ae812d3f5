"""ComfyUI's PNG chunks: `prompt`, the job as ComfyUI's API graph, and `workflow`, the same graph as ComfyUI's editor
saves it (dropped on ComfyUI, the PNG loads this job); one of the PNG formats the ways in hand the engine
(orchestrator.http.png_formats). A job's LoRAs are its graph's loader nodes."""
from __future__ import annotations

import json
import logging

from orchestrator.http.comfy_graph import ModelNames, job_to_graph
from orchestrator.http.comfy_workflow import api_to_workflow
from protocol.messages import MAX_PNG_TEXT_CHARS

log = logging.getLogger(__name__)


def graph_chunks(image) -> dict[str, str]:
    """The `prompt` and `workflow` chunks of one image (orchestrator.engine.png_text.ImageText): the API graph a ComfyUI
    client sent for the job (kept as sent, as ComfyUI keeps it), else the job's own graph, its loaders naming
    `image.files` (unknown ones stay empty); a sent graph too large for a DECODE text value, or one that cannot be
    drawn as a workflow, is replaced by the job's own."""
    spec, pack, f = image.spec, image.pack, image.files
    names = ModelNames(unet=f.unet, clip=f.clip, vae=f.vae) if f is not None else \
        ModelNames(unet=(pack.source_name,) if pack.source_name else ())
    chunks = None
    if image.graph is not None:
        try:
            chunks = (json.dumps(image.graph), json.dumps(api_to_workflow(image.graph)))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:     # never fail a decode on it
            log.warning("job %s: the client's graph cannot be drawn as a workflow (%s); the job's own is used",
                        image.job, e)
        if chunks and max(map(len, chunks)) > MAX_PNG_TEXT_CHARS:
            chunks = None
    if chunks is None:
        graph = job_to_graph({**spec.to_dict(), "width": image.width, "height": image.height}, names=names)
        chunks = (json.dumps(graph), json.dumps(api_to_workflow(graph)))
    return {"prompt": chunks[0], "workflow": chunks[1]}
