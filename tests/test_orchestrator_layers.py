"""The orchestrator's inner layers (docs/architecture.md, "The orchestrator's layers"): the engine (daemon, plan and
its runner, stage control, the job store and its records) sits below the ways in (the CLI and the demo, the HTTP
front with its ComfyUI, A1111 and page parts, and the vocabularies only a front speaks: ComfyUI's node table and
graphs, A1111's names). No engine module imports a front: the engine is handed what a front knows (the PNG formats)."""
from __future__ import annotations

from tests.test_layout_rules import import_graph

FRONTS = ("orchestrator.cli", "orchestrator.demo", "orchestrator.http", "orchestrator.a1111_names",
          "orchestrator.a1111_infotext", "orchestrator.png_formats")
COMFY = "orchestrator.comfy_"           # comfy_nodes, comfy_graph, comfy_workflow ...: ComfyUI's vocabulary


def is_front(module: str) -> bool:
    return module.startswith(COMFY) or any(module == f or module.startswith(f + ".") for f in FRONTS)


def engine_imports_of_fronts(graph: dict) -> set[str]:
    return {f"{a} imports {b}" for a, deps in graph.items() if a.startswith("orchestrator") and not is_front(a)
            for b in deps if is_front(b)}


def test_the_engine_imports_no_front():
    upward = sorted(engine_imports_of_fronts(import_graph()))
    assert not upward, f"engine modules import a front (ways in sit above the engine): {upward}"


def test_the_rule_finds_an_engine_module_importing_a_front():
    graph = {"orchestrator.jobs": {"orchestrator.http.page", "orchestrator.job_files"},
             "orchestrator.http.page": {"orchestrator.jobs"}, "orchestrator.cli": {"orchestrator.daemon"},
             "orchestrator.comfy_new": {"orchestrator.comfy_nodes"}, "orchestrator.daemon": {"orchestrator.comfy_new"}}
    assert engine_imports_of_fronts(graph) == {"orchestrator.jobs imports orchestrator.http.page",
                                               "orchestrator.daemon imports orchestrator.comfy_new"}
