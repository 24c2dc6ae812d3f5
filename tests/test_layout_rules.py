"""Rules about the repository's own words: no tracked file points outside the repository.

A user of the project has only the repository, so a fact the code relies on lives in docs/ with its public source
(docs/model-facts.md, docs/board-figures.md), never in a file beside the checkout. The words are assembled here so
that this file is checked by the same rule as every other."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# what must not appear in a tracked file: the folder beside the checkout and the names of the files it held
FORBIDDEN = tuple(w.encode() for w in (
    ".." + "/shared", "/work" + "/shared",
    "board" + "-facts", "anima" + "-facts",
    "DESIGN" + ".md", "STYLE" + ".md",
))

# Files that still hold such references on main, and only these: the board model's, which its own branch rewrites to
# cite docs/board-figures.md. Empty this set when that lands; the test below lets it only shrink.
KNOWN_REMAINING = frozenset({
    "docs/board.md",
    "models/board/account.py",
    "models/board/auto.py",
    "models/board/cost.toml",
    "models/board/pace.py",
    "tests/test_board_model.py",
    "tests/test_board_sim.py",
})


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def references(rel: str, root: Path = ROOT) -> list[str]:
    """The forbidden words a tracked file holds, as 'LINE: word' (bytes, so binary files are read too)."""
    path = root / rel
    if path.is_symlink() or not path.is_file():     # a link is checked by its target's own entry; a deleted file
        return []                                   # staged for removal has no words
    found = []
    for n, line in enumerate(path.read_bytes().split(b"\n"), 1):
        found += [f"{n}: {w.decode()}" for w in FORBIDDEN if w in line]
    return found


def test_no_tracked_file_points_outside_the_repository():
    files = tracked_files()
    assert "tests/test_layout_rules.py" in files and len(files) > 100       # the whole tree, this file included
    offenders = {f: refs for f in files if f not in KNOWN_REMAINING and (refs := references(f))}
    assert not offenders, ("files pointing outside the repository (cite docs/ or a public source instead): "
                           + "; ".join(f"{f} line {', line '.join(r)}" for f, r in sorted(offenders.items())))


def test_known_remaining_references_can_only_shrink():
    """Every file of KNOWN_REMAINING is tracked and still has a reference: one that lost them leaves the set."""
    files = set(tracked_files())
    not_tracked = sorted(KNOWN_REMAINING - files)
    assert not not_tracked, f"KNOWN_REMAINING names files that are not tracked: {not_tracked}"
    clean = sorted(f for f in KNOWN_REMAINING if not references(f))
    assert not clean, f"these files no longer point outside the repository: remove them from KNOWN_REMAINING: {clean}"


def test_the_rule_finds_what_it_looks_for(tmp_path):
    """The check has teeth: a file holding each forbidden word is reported with the line."""
    for i, w in enumerate(FORBIDDEN):
        (tmp_path / f"f{i}.md").write_bytes(b"fine\nsee " + w + b" for more\n")
        assert references(f"f{i}.md", tmp_path) == [f"2: {w.decode()}"]
    (tmp_path / "clean.md").write_text("docs/model-facts.md and docs/board-figures.md\n")
    assert references("clean.md", tmp_path) == []
