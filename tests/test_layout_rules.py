"""Rules about the repository's layout (docs/architecture.md, "The layers in two minutes").

1. The layers import only downward, models < protocol < stages < orchestrator, with bench/ and scripts/ on top, and
   no import cycle: every import counts, at module level or inside a function, and static `import_module` strings.
2. No tracked file points outside the repository: a user of the project has only the repository, so a fact the code
   relies on lives in docs/ with its public source (docs/model-facts.md, docs/board-figures.md), never in a file beside
   the checkout. The words are assembled here so that this file is checked by the same rule as every other."""
from __future__ import annotations

import ast
import os
import re
import subprocess

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# what must not appear in a tracked file: the folder beside the checkout and the names of the files it held
FORBIDDEN = tuple(w.encode() for w in (
    ".." + "/shared", "/work" + "/shared",
    "board" + "-facts", "anima" + "-facts",
    "DESIGN" + ".md", "STYLE" + ".md",
))

# Files allowed to still hold such references: none now that the board model cites docs/board-figures.md. A set, so
# a later exception is named here and the test below lets it only shrink.
KNOWN_REMAINING: frozenset = frozenset()


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def references(rel: str, root: Path = ROOT) -> list[str]:
    """The forbidden words a tracked file holds, as 'LINE: word' (bytes, so binary files are read too)."""
    path = root / rel
    if path.is_symlink():                           # git tracks a link as the path it points to
        text = os.fsencode(os.readlink(path))
    elif path.is_file():
        text = path.read_bytes()
    else:                                           # deleted in the work tree: nothing left to say
        return []
    found = []
    for n, line in enumerate(text.split(b"\n"), 1):
        found += [f"{n}: {w.decode()}" for w in FORBIDDEN if w in line]
    return found


# ---- the layers: every import in the code, from the source (module level, inside functions, import_module strings)
LAYERS = ("models", "protocol", "stages", "orchestrator")      # each may import only those before it
# a string naming a module of the layers, as models.base.lazy.import_target takes it: "models.vae.pack:load_vae_pack"
TARGET = re.compile(r"(?:models|protocol|stages|orchestrator)(?:\.[a-z_][a-z0-9_]*)+(?::[A-Za-z_]\w*)?")
TOP = ("bench", "scripts")                                      # may import anything; no layer imports them


def _modules() -> dict[str, Path]:
    """Every module of the layers and the top, by dotted name."""
    mods = {}
    for rel in tracked_files():
        if rel.endswith(".py") and rel.split("/")[0] in LAYERS + TOP:
            name = rel[:-3].replace("/", ".")
            mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = ROOT / rel
    return mods


def _logger_names(tree: ast.AST) -> set:
    """The string constants naming a logger (`logging.getLogger("orchestrator.flow")`): dotted like a module, but no
    import."""
    return {id(node.args[0]) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger"
            and node.args and isinstance(node.args[0], ast.Constant)}


def _imported(name: str, path: Path, known: set) -> set:
    """The project modules `name` imports, wherever the import statement sits; `import_module("x.y")` too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_bytes(), str(path))
    loggers = _logger_names(tree)
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and TARGET.fullmatch(node.value)
              and id(node) not in loggers):
            targets = [node.value.partition(":")[0]]          # a models.base.lazy.import_target string in a table
        for t in targets:
            while t and t not in known:             # `from a.b import c`: the module a.b.c, else a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set]:
    mods = _modules()
    return {name: _imported(name, path, set(mods)) for name, path in mods.items()}


def _rank(module: str) -> int:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else len(LAYERS)


def upward_imports(graph: dict) -> list[str]:
    return sorted(f"{a} imports {b}" for a, deps in graph.items() for b in deps if _rank(b) > _rank(a))


def import_cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):                                   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_layers_import_only_downward():
    graph = import_graph()
    assert {"models.base.schema", "stages.base", "orchestrator.engine.daemon", "bench.chaos"} <= set(graph)
    assert "models.board.policy" in graph["stages.settings"]            # an import inside a method counts
    upward = upward_imports(graph)
    assert not upward, "imports against models < protocol < stages < orchestrator (bench/, scripts/ on top): " + \
        "; ".join(upward)


def test_no_import_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_import_rules_find_what_they_look_for(tmp_path):
    """The checks have teeth: an upward import inside a function, a relative import, an import_module string and a
    cycle are all found."""
    src = tmp_path / "mod.py"
    src.write_text("import importlib\nfrom . import sibling\n\ndef f():\n    from stages.base import StageProc\n"
                   "    importlib.import_module('orchestrator.engine.daemon')\n"
                   "    logging.getLogger('orchestrator.flow')\n")
    known = {"models.x.mod", "models.x.sibling", "stages.base", "orchestrator.engine.daemon", "orchestrator.flow"}
    deps = _imported("models.x.mod", src, known)
    assert deps == {"models.x.sibling", "stages.base", "orchestrator.engine.daemon"}
    assert upward_imports({"models.x.mod": deps}) == ["models.x.mod imports orchestrator.engine.daemon",
                                                      "models.x.mod imports stages.base"]
    assert upward_imports({"bench.b": {"orchestrator.engine.daemon"}, "stages.s": {"models.m"}}) == []
    assert upward_imports({"orchestrator.o": {"bench.b"}}) == ["orchestrator.o imports bench.b"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


# ---- words: no tracked file points outside the repository
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
    (tmp_path / "link").symlink_to(".." + "/shared/x")
    assert references("link", tmp_path) == ["1: .." + "/shared"]


def test_strings_that_name_a_module_are_imports_and_resolve():
    """Every "module:attr" string in the layers (the backends, pack loaders, subcommands, bundle writers, models.vae's
    exports) counts in the import graph, names a module that exists, and goes through the one helper."""
    graph = import_graph()
    assert "models.runtime.backends.board_sim" in graph["models.runtime.backends"]     # BACKENDS' table
    assert "models.vae.pack" in graph["models.packs.kinds"]                            # PACK_LOADERS
    assert "models.commands.synth" in graph["models.commands.cli"]                              # COMMANDS
    mods = _modules()
    for name, path in mods.items():
        if name.split(".")[0] not in LAYERS:
            continue
        for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and TARGET.fullmatch(node.value):
                module = node.value.partition(":")[0]
                assert module in mods, f"{name}: {node.value!r} names no module of the project"
    users = [n for n, p in mods.items() if n.split(".")[0] in LAYERS and "import_module(" in p.read_text()]
    assert users == ["models.base.lazy"], f"import_module outside models.base.lazy: {users}"


def test_the_one_lazy_helper_imports_what_the_string_names():
    from models.base.lazy import import_target
    from models.packs.pack import load_pack
    assert import_target("models.packs.pack:load_pack") is load_pack
    assert import_target("models.packs.pack").load_pack is load_pack
    with pytest.raises(AttributeError):
        import_target("models.packs.pack:no_such_thing")
    with pytest.raises(ImportError):
        import_target("models.no_such_module")
