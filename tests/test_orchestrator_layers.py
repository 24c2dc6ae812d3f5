"""The orchestrator's inner layers (docs/architecture.md, "The orchestrator's layers"): four packages, each
importing only those before it: the engine (the daemon, the plan and its runner, stage control, the job store and its
records, reports), the machine operations, the HTTP front with the vocabularies only it speaks (ComfyUI's node table
and graphs, A1111's names), the terminal's ways in (the CLI, the demo). No module stands loose at the top; the engine
is handed what a front knows (the PNG formats)."""
from __future__ import annotations

from tests.test_layout_rules import import_graph

PACKAGES = ("orchestrator.engine", "orchestrator.ops", "orchestrator.http", "orchestrator.terminal")


def package_of(module: str) -> int | None:
    """The module's place in PACKAGES (None: the top package itself, or outside orchestrator)."""
    return next((i for i, p in enumerate(PACKAGES) if module == p or module.startswith(p + ".")), None)


def upward_links(graph: dict) -> set[str]:
    """Imports from an orchestrator package to one after it in PACKAGES."""
    return {f"{a} imports {b}" for a, deps in graph.items() if package_of(a) is not None
            for b in deps if package_of(b) is not None and package_of(b) > package_of(a)}


def loose_modules(graph: dict) -> set[str]:
    return {m for m in graph if m.startswith("orchestrator.") and package_of(m) is None}


def test_each_package_imports_only_those_below_it():
    upward = sorted(upward_links(import_graph()))
    assert not upward, f"orchestrator packages import upward (engine < ops < http < terminal): {upward}"


def test_no_module_stands_loose_at_the_top():
    graph = import_graph()
    assert not loose_modules(graph), f"modules outside {PACKAGES}: {sorted(loose_modules(graph))}"
    assert {"orchestrator.engine.daemon", "orchestrator.http.comfy_graph", "orchestrator.terminal.cli"} <= set(graph)


def test_the_rule_finds_an_engine_module_importing_a_front():
    graph = {"orchestrator.engine.jobs": {"orchestrator.http.page", "orchestrator.engine.job_files"},
             "orchestrator.http.page": {"orchestrator.engine.jobs"},
             "orchestrator.terminal.cli": {"orchestrator.engine.daemon", "orchestrator.ops.doctor"},
             "orchestrator.ops.doctor": {"orchestrator.terminal.cli"},
             "orchestrator.engine.daemon": {"orchestrator.http.comfy_new"}, "orchestrator.loose": set()}
    assert upward_links(graph) == {"orchestrator.engine.jobs imports orchestrator.http.page",
                                   "orchestrator.ops.doctor imports orchestrator.terminal.cli",
                                   "orchestrator.engine.daemon imports orchestrator.http.comfy_new"}
    assert loose_modules(graph) == {"orchestrator.loose"}
