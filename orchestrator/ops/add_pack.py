"""`orchestrator init --add-pack PACK`: one more model pack in a run folder's pipeline.toml, written as an edit of the
file's text (one entry added to `packs`), so that every other line, comment and hand-edited key stays as it was."""
from __future__ import annotations

import re
from pathlib import Path

from models.base.durable import atomic_write
from orchestrator.engine.runfolder import RunFolder, toml_str, check_init_inputs
from stages.config import load_config

# the top-level keys as init writes them, each on one line (a `packs` array spread over lines is refused, not guessed)
_PACKS = re.compile(r'^packs[ \t]*=[ \t]*\[(?P<items>[^\]\n]*)\](?P<tail>[ \t]*(#[^\n]*)?)$', re.M)
_PACK_DIR = re.compile(r'^#?[ \t]*pack_dir[ \t]*=[^\n]*$', re.M)
_FIRST_TABLE = re.compile(r'^[ \t]*\[', re.M)


class AddPackError(ValueError):
    pass


def _edited(text: str, entry: str, has_default: bool) -> str:
    """The text with `entry` (a TOML string) added: appended to a one-line `packs = [...]`, or a `packs` line put
    after `pack_dir`; or, with no pack yet, `pack_dir = entry` in place of init's commented `# pack_dir = "…"`."""
    top = text[:m.start()] if (m := _FIRST_TABLE.search(text)) else text      # only top-level keys are edited
    packs = list(_PACKS.finditer(top))
    found = list(_PACK_DIR.finditer(top))
    dirs = [d for d in found if not d.group().startswith("#")] or found[:1]     # a commented-out one: init's
    if len(packs) > 1 or len(dirs) > 1:
        raise AddPackError("pipeline.toml sets `packs` or `pack_dir` more than once at its top")
    if packs:
        p = packs[0]
        items = p.group("items").rstrip()
        items = items[:-1] if items.endswith(",") else items            # ["a", ] -> ["a", "b"]
        joined = f"{items}, {entry}" if items.strip() else entry
        return text[:p.start("items")] + joined + text[p.end("items"):]
    if re.search(r'^packs[ \t]*=', top, re.M):
        raise AddPackError("pipeline.toml's `packs` is not a one-line list [\"…\", …]; add the pack to it by hand")
    if not dirs:
        raise AddPackError("pipeline.toml has no `pack_dir` line at its top to add the pack after; add it by hand "
                           "(packs = [\"…\"])")
    d = dirs[0]
    if not has_default or d.group().startswith("#"):
        return text[:d.start()] + f"pack_dir = {entry}" + text[d.end():]
    return text[:d.end()] + f"\npacks = [{entry}]" + text[d.end():]


def add_packs(rf: RunFolder, new_packs, said: list) -> None:
    """Add each of `new_packs` to RUN/pipeline.toml (one pack per image size: a second pack of a size already there
    is refused before anything is written); a pack already named is said and left alone."""
    toml = rf.pipeline_toml
    if not toml.is_file():
        raise AddPackError(f"--add-pack: {toml} does not exist; make the run folder first (orchestrator init --pack)")
    text = toml.read_text()
    have, added = list(load_config(toml).packs), []
    for pack in new_packs:
        path = Path(pack).expanduser().resolve()
        if path in have:
            said.append(f"kept {toml}: it already names {path}")
            continue
        check_init_inputs(have + [path], None)
        text = _edited(text, toml_str(path), bool(have))
        have.append(path)
        added.append(str(path))
    if text == toml.read_text():
        return
    checked = toml.with_name(toml.name + ".add-pack")
    atomic_write(checked, text)
    try:
        if list(load_config(checked).packs) != have:       # the edit must say what it was meant to, else nothing
            raise AddPackError(f"--add-pack: {toml} could not be edited safely; add the packs by hand")
    finally:
        checked.unlink(missing_ok=True)
    atomic_write(toml, text)
    said.append(f"added {', '.join(added)} to {toml} (every other "
                f"line kept; a running pipeline takes it after `orchestrator reload`)")
