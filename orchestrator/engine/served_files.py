"""What `/view` may serve: a job's own files in the run's jobs folder, nothing else (the HTTP front serves them,
orchestrator.http.files; a job's init image named as "<job id>/NAME [output]" is found by the same rules,
orchestrator.engine.inputs).

A request names `filename`, `subfolder` and `type` (ComfyUI's /view). Only type "output", a subfolder that is a job
id, and a file name from ALLOWED pass; the path must be the plain file itself (no link anywhere on the way: the real
path equals the path asked for) and is opened with O_NOFOLLOW | O_NONBLOCK (the front reads it off its event loop) and must be a regular
file. Anything else is a 400 (a malformed name) or a 404.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from orchestrator.engine.job_files import BASE_IMAGE_FILE, IMAGE_FILE, JOB_FILES, names
from orchestrator.engine.job_record import JOB_ID_RE

# the job's images (a batch's other ones, a hires fix's first pass images: base.png ...), its report and plot
ALLOWED = {"timing.png": "image/png", "report.json": "application/json",
           **{n: "image/png" for f in JOB_FILES if f.name in (IMAGE_FILE, BASE_IMAGE_FILE) for n in names(f)}}
MAX_FILE_BYTES = 64 * 2**20


class BadName(ValueError):
    """A name that could never be served (400)."""


def resolve(jobs_dir: Path, filename: str, subfolder: str = "", kind: str = "output") -> tuple[Path, str]:
    """(path, content type) of an allowed file; BadName for a malformed request, FileNotFoundError when absent."""
    if kind != "output":
        raise BadName(f"type {kind!r}: only 'output' is served")
    if not filename or "/" in filename or "\\" in filename or "\x00" in filename or filename.startswith("."):
        raise BadName("filename must be a plain file name")
    if not subfolder or not JOB_ID_RE.match(subfolder):
        raise BadName("subfolder must be a job id (like 20260101-120000-a1b2c3)")
    if filename not in ALLOWED:
        raise FileNotFoundError(filename)
    root = Path(os.path.realpath(jobs_dir))
    path = root / subfolder / filename
    if os.path.realpath(path) != str(path):          # a link on the way (job folder or file): never followed
        raise FileNotFoundError(str(path))
    return path, ALLOWED[filename]


def read(path: Path) -> bytes:
    """The file's bytes: opened without following a link, a regular file, at most MAX_FILE_BYTES. O_NONBLOCK: a FIFO
    (or a device) planted under an allowed name is refused at once, where a plain open would wait for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
            raise FileNotFoundError(str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_FILE_BYTES)
    finally:
        os.close(fd)
