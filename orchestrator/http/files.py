"""`/view`'s reads on the front: the rules of what may be served are the engine's (orchestrator.engine.served_files)."""
from __future__ import annotations

import asyncio
from pathlib import Path

from orchestrator.engine.served_files import ALLOWED, MAX_FILE_BYTES, BadName, read, resolve

__all__ = ["ALLOWED", "MAX_FILE_BYTES", "BadName", "read", "read_async", "resolve"]


async def read_async(path: Path) -> bytes:
    """`read` on a worker thread: a slow disk holds up this request, never the front's event loop."""
    return await asyncio.to_thread(read, path)
