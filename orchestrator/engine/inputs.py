"""The run folder's upload folders (RUN/input, RUN/temp, RUN/output: ComfyUI's `type` input | temp | output) and the
job inputs kept in a job folder.

A name never leaves its folder: a file name is one plain name (no "/", "\\", NUL or control character, not "." or
"..", not hidden, at most MAX_NAME_BYTES of UTF-8); a subfolder is such names joined by "/" (at most MAX_DEPTH; "" and
"." parts dropped as os.path.normpath drops them, ".." and absolute paths refused). Every folder on the way is looked
at without following links (a link planted in an upload folder is refused, never followed), and a file is written
through models.base.durable.atomic_write, which replaces a link at the destination instead of writing through it.

ComfyUI's rules for an upload (server.py, `image_upload`): without `overwrite` "true" or "1", a name taken by another
file becomes "NAME (1).EXT", "NAME (2).EXT" ... and a name holding the same bytes is answered as it is, without
writing again; the answer is {"name", "subfolder", "type"}. `LoadImage` lists the input folder's image files (the
top level, sorted, as ComfyUI's INPUT_TYPES does). Whether a name is taken by the same bytes is known from each file's
digest, remembered per file (its inode, size and times), so an upload under a much-used name reads no earlier file.

One meaning per name, as ComfyUI's: "<job id>/image.png [output]" (type output, a job id subfolder) is that job's
own image, the one /view serves; uploads never write under a job id. RUN/temp/a1111/ (PRIVATE) holds the A1111
img2img requests' own images, each named by its bytes (keep_private): uploads never write there and a reader checks
the bytes against the name, so a job reads what its request sent.
"""
from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections import OrderedDict
from pathlib import Path

from models.base.durable import atomic_write, is_temporary
from orchestrator.engine import served_files
from orchestrator.engine.upload_space import KINDS, check_room
from orchestrator.engine.job_record import JOB_ID_RE

MAX_NAME_BYTES = 255
MAX_DEPTH = 8
MAX_RENAMES = 10_000
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
               ".bmp": "image/bmp", ".gif": "image/gif"}
JOB_INPUTS = ("init_image", "mask", "mix_image")   # kept in a job folder as NAME.png (mix_image: init_mix.image)
PRIVATE = ("temp", "a1111")                      # RUN/temp/a1111: img2img requests' own images, named by their bytes
# the folders the front and the CLI upload into (the page: static/app.js UPLOAD_FOLDER, the CLI: cli.CLI_UPLOADS,
# img2img: PRIVATE): no upload may put a file in their place
OWN_FOLDERS = {("input", "page"), ("input", "cli"), PRIVATE}
PRIVATE_NAME_HEX = 32                            # hex digits of the sha256 in a private image's name
DIGESTS_KEPT = 4096                              # files whose digest is remembered (least recently used dropped)


class InputNameError(ValueError):
    """A name or subfolder that could never be in an upload folder (HTTP `status`, 400 by default: 403 for a folder
    uploads may not write, 409 for a name a folder holds); `field` names the form field."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status


def check_name(name, field: str = "filename") -> str:
    """One plain file name, or InputNameError saying why not."""
    if not isinstance(name, str) or not name:
        raise InputNameError(field, "a file name is required")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise InputNameError(field, f"longer than {MAX_NAME_BYTES} bytes")
    if any(c in name for c in "/\\") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InputNameError(field, f"{name[:80]!r} is not a plain file name (no '/', '\\', NUL or control "
                                    "characters)")
    if name in (".", "..") or name.startswith("."):
        raise InputNameError(field, f"{name[:80]!r}: names starting with '.' are not taken")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InputNameError(field, "not text (a lone surrogate)") from None
    return name


def check_subfolder(sub, field: str = "subfolder") -> tuple[str, ...]:
    """The parts of a relative subfolder ("" is the folder itself), or InputNameError."""
    if sub is None or sub == "":
        return ()
    if not isinstance(sub, str):
        raise InputNameError(field, "must be a string")
    if sub.startswith("/") or "\\" in sub or (len(sub) > 1 and sub[1] == ":"):
        raise InputNameError(field, f"{sub[:80]!r}: must be a relative path inside the folder")
    parts = tuple(p for p in sub.split("/") if p not in ("", "."))
    if ".." in parts:
        raise InputNameError(field, f"{sub[:80]!r}: '..' would leave the folder")
    if len(parts) > MAX_DEPTH:
        raise InputNameError(field, f"deeper than {MAX_DEPTH} folders")
    for p in parts:
        check_name(p, field)
    return parts


def check_kind(kind, field: str = "type") -> str:
    kind = "input" if kind in (None, "") else kind
    if kind not in KINDS:
        raise InputNameError(field, f"{str(kind)[:40]!r}: must be one of {', '.join(KINDS)}")
    return kind


def job_of(kind: str, parts: tuple[str, ...]) -> str | None:
    """The job id when (kind, subfolder parts) name a job's own files (type output, a job id first), else None."""
    return parts[0] if kind == "output" and parts and JOB_ID_RE.match(parts[0]) else None


def check_writable(kind: str, parts: tuple[str, ...], name: str) -> None:
    """InputNameError (403) for a folder an upload may not write (a job's, or the img2img requests' own), or for a
    file that would take the place of one of OWN_FOLDERS."""
    if not parts and (kind, name) in OWN_FOLDERS:
        raise InputNameError("image", f"{name!r} in {kind}/ is the folder of the page's, the CLI's or img2img's "
                                      "uploads; upload under another name", status=403)
    if job_of(kind, parts):
        raise InputNameError("subfolder", f"{parts[0]!r} is a job id: \"{parts[0]}/NAME [output]\" names that job's "
                                          "own files, which uploads do not write", status=403)
    if (kind,) + parts[:1] == PRIVATE:
        raise InputNameError("subfolder", f"{'/'.join(PRIVATE)} holds the A1111 img2img requests' own images, which "
                                          "uploads do not write", status=403)


def _plain_dir(path: Path, create: bool) -> None:
    """`path` is a real folder (not a link), created 0700 when missing and `create`; else FileNotFoundError."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise InputNameError("subfolder", f"{path.name!r} is not a folder (a link or a file)")


def folder(run_root: Path, kind: str, parts: tuple[str, ...] = (), *, create: bool = False) -> Path:
    """RUN/<kind>/<parts...>, every folder on the way checked to be a real folder (created when `create`)."""
    base = Path(os.path.realpath(run_root))
    path = base / kind
    _plain_dir(path, create)
    for p in parts:
        path = path / p
        _plain_dir(path, create)
    if os.path.realpath(path) != str(path):                    # a link swapped in meanwhile: never followed
        raise InputNameError("subfolder", "leads out of the upload folder")
    return path


def _job_file(run_root: Path, parts: tuple[str, ...], name: str) -> Path:
    """A job's own file as /view serves it (orchestrator.engine.served_files: its allowed names, no link on the way)."""
    from stages.config import JOBS_DIR
    if len(parts) > 1:
        raise FileNotFoundError("/".join(parts))
    try:
        return served_files.resolve(Path(run_root) / JOBS_DIR, name, parts[0], "output")[0]
    except served_files.BadName as e:
        raise InputNameError("filename", str(e)) from None


def find(run_root: Path, kind: str, subfolder: str, name: str) -> Path:
    """An existing regular file in an upload folder, or a job's own file for "<job id>/NAME [output]" (not a link);
    FileNotFoundError, or InputNameError for names."""
    kind, parts = check_kind(kind), check_subfolder(subfolder)
    check_name(name)
    path = _job_file(run_root, parts, name) if job_of(kind, parts) else folder(run_root, kind, parts) / name
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(str(path))
    return path


_digests: OrderedDict[tuple, str] = OrderedDict()       # (dev, inode, size, mtime, ctime) -> sha256 hex
_digests_lock = threading.Lock()


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _remember(st: os.stat_result, digest: str) -> None:
    with _digests_lock:
        _digests[_identity(st)] = digest
        _digests.move_to_end(_identity(st))
        while len(_digests) > DIGESTS_KEPT:
            _digests.popitem(last=False)


def _digest_of(path: Path) -> str | None:
    """The sha256 of a regular file (not a link), remembered by its identity: hashed once, not at every look."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        with _digests_lock:
            known = _digests.get(_identity(st))
        if known is None:
            known = hashlib.sha256(f.read()).hexdigest()
            _remember(st, known)
        return known


def _same_bytes(path: Path, size: int, digest: str) -> bool:
    """Does `path` hold the bytes of that size and digest? A file of another size is not read."""
    try:
        st = os.lstat(path)
        return stat.S_ISREG(st.st_mode) and st.st_size == size and _digest_of(path) == digest
    except OSError:
        return False


def _written(path: Path, data: bytes, digest: str, *, overwrite: bool) -> None:
    atomic_write(path, data, mode=0o600, overwrite=overwrite)
    try:
        _remember(os.lstat(path), digest)
    except OSError:
        pass


def _check_not_folder(path: Path, field: str = "image") -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        raise InputNameError(field, f"{path.name[:80]!r} is a folder here; upload under another name", status=409)


def save_upload(run_root: Path, kind: str, subfolder: str, name: str, data: bytes, *, overwrite: bool,
                quota_bytes: int | None = None) -> str:
    """Write an upload by ComfyUI's rules; -> the name it has (renamed "NAME (i).EXT" when taken, unless
    `overwrite`; an existing file with the same bytes keeps its name and is not written again). UploadsFull when
    writing it would pass `quota_bytes`."""
    kind, parts = check_kind(kind), check_subfolder(subfolder)
    check_name(name)
    check_writable(kind, parts, name)
    where = folder(run_root, kind, parts, create=True)
    digest = hashlib.sha256(data).hexdigest()
    if overwrite:
        _check_not_folder(where / name)
        check_room(run_root, len(data), quota_bytes)
        _written(where / name, data, digest, overwrite=True)
        return name
    stem, ext = os.path.splitext(name)
    candidate = name
    for i in range(1, MAX_RENAMES + 1):
        if len(candidate.encode("utf-8")) > MAX_NAME_BYTES:
            raise InputNameError("image", f"no free name for {name[:80]!r} within {MAX_NAME_BYTES} bytes")
        path = where / candidate
        if _same_bytes(path, len(data), digest):
            return candidate
        if not os.path.lexists(path):            # a taken name is not written at all (each write is an fsync)
            check_room(run_root, len(data), quota_bytes)
            try:
                _written(path, data, digest, overwrite=False)
                return candidate
            except FileExistsError:              # a concurrent upload took it meanwhile: maybe with these bytes
                if _same_bytes(path, len(data), digest):
                    return candidate
        candidate = f"{stem} ({i}){ext}"
    raise InputNameError("image", f"{MAX_RENAMES} files already take the name {name[:80]!r}")


def private_name(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:PRIVATE_NAME_HEX] + ".png"


def keep_private(run_root: Path, data: bytes, quota_bytes: int | None = None) -> str:
    """An img2img request's PNG in RUN/temp/a1111/ under the name its bytes give -> the name as a prompt's init_image
    or mask takes it ("a1111/<sha256>.png [temp]"). Written unless the file there holds these bytes (then only
    touched, so pruning by age spares it); a file that does not (changed behind the front's back) is replaced.
    UploadsFull when writing it would pass `quota_bytes`."""
    where = folder(run_root, PRIVATE[0], PRIVATE[1:], create=True)
    name = private_name(data)
    digest = hashlib.sha256(data).hexdigest()
    ref = f"{PRIVATE[1]}/{name} [{PRIVATE[0]}]"
    if _same_bytes(where / name, len(data), digest):
        try:
            os.utime(where / name, follow_symlinks=False)
            return ref
        except FileNotFoundError:                # pruned meanwhile: written again
            pass
    check_room(run_root, len(data), quota_bytes)
    _written(where / name, data, digest, overwrite=True)
    return ref


def drop_private(run_root: Path, data: bytes) -> None:
    """Remove the RUN/temp/a1111/ file keep_private wrote for `data` (its request was refused: no job reads it)."""
    try:
        where = folder(run_root, PRIVATE[0], PRIVATE[1:])
        os.unlink(where / private_name(data))
    except (OSError, InputNameError):          # gone already, or the folder is not ours to clean
        pass


def _check_private(kind: str, parts: tuple[str, ...], name: str, data: bytes, field: str) -> None:
    if (kind,) + parts[:1] == PRIVATE and private_name(data) != name:
        raise InputNameError(field, f"{name[:80]!r} does not hold the image its name says (changed after it was "
                                    "kept); send the request again")


def list_images(run_root: Path) -> list[str]:
    """LoadImage's choices: the image files at the top of RUN/input (regular files, no links), sorted."""
    try:
        base = folder(run_root, "input")
        entries = list(os.scandir(base))
    except (FileNotFoundError, InputNameError):
        return []
    return sorted(e.name for e in entries
                  if e.is_file(follow_symlinks=False) and not e.name.startswith(".") and not is_temporary(e.name)
                  and os.path.splitext(e.name)[1].lower() in IMAGE_TYPES)


def annotated(name: str, default_kind: str) -> tuple[str, str, str]:
    """ComfyUI's annotated name "sub/NAME.png [input]" -> (subfolder, name, kind)."""
    kind = default_kind
    for k in KINDS:
        if name.endswith(f" [{k}]"):
            name, kind = name[:-len(k) - 3], k
            break
    sub, _, base = name.rpartition("/")
    return sub, base, kind


def read_upload(run_root: Path, ref: str, field: str = "image") -> bytes:
    """The bytes of an uploaded image as a graph or prompt names it (LoadImage's "sub/NAME.png [input]"), read
    without following a link and checked to decode (models.images' bounds); InputNameError for a name that could
    not be there, FileNotFoundError, or models.images.ImageInputError."""
    from models.images import open_bounded
    from models.images.decode import MAX_INPUT_BYTES
    if not isinstance(ref, str):
        raise InputNameError(field, "must be a file name")
    sub, name, kind = annotated(ref, "input")
    try:
        path = find(run_root, kind, sub, name)
    except InputNameError as e:
        raise InputNameError(field, str(e)) from None
    parts = check_subfolder(sub)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise FileNotFoundError(str(path))
        data = f.read(MAX_INPUT_BYTES + 1)
    _check_private(kind, parts, name, data, field)
    open_bounded(data).close()
    return data


def upload_size(run_root: Path, ref: str) -> tuple[int, int] | None:
    """An upload's (width, height) as read_upload finds it; None when it cannot be read (the daemon's check at submit
    names the field then)."""
    from models.images import ImageInputError, open_bounded
    try:
        with open_bounded(read_upload(run_root, ref)) as im:
            return im.size
    except (InputNameError, OSError, ImageInputError):
        return None


def keep_in_job(job_dir: Path, inputs: dict[str, bytes]) -> dict[str, Path]:
    """The job's input images (JOB_INPUTS -> PNG bytes) written durably into its folder before the job is
    acknowledged, so a job resumed after a crash reads the same bytes; -> the paths written."""
    out = {}
    for key, data in inputs.items():
        if key not in JOB_INPUTS:
            raise ValueError(f"{key!r} is not a job input ({', '.join(JOB_INPUTS)})")
        out[key] = atomic_write(Path(job_dir) / f"{key}.png", data, mode=0o600)
    return out
