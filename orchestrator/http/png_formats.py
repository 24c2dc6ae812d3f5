"""The PNG formats the ways in hand the engine (orchestrator.engine.png_text): A1111's infotext, then ComfyUI's graphs. The
CLI's `serve` starts the daemon with them; `png_metadata` writes one image's chunks as the daemon does."""
from __future__ import annotations

from orchestrator.http.a1111_infotext import parameters_chunk
from orchestrator.http.comfy_png import graph_chunks
from orchestrator.engine.png_text import ImageText, LoaderFiles, png_text

PNG_FORMATS = (parameters_chunk, graph_chunks)


def png_metadata(spec, pack, job: str, names=None, graph: dict | None = None, lora_hashes: dict | None = None,
                 batch_pos: int = 0) -> dict[str, str]:
    """One image's text chunks (`parameters`, `prompt`, `workflow`, `anima`); `names`: the loaders' file names
    (comfy_nodes.ModelNames or LoaderFiles; None: only the pack's checkpoint is known)."""
    files = None if names is None else LoaderFiles(unet=names.unet, clip=names.clip, vae=names.vae)
    return png_text(PNG_FORMATS, ImageText(spec, pack, job, files, graph, lora_hashes or {}, batch_pos))
