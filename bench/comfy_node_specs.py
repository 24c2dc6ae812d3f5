"""The node table (orchestrator/http/comfy_nodes.py) against a ComfyUI checkout's own input declarations.

    .venv/bin/python bench/comfy_node_specs.py --comfyui-src COMFYUI_CHECKOUT [--out bench/out/comfy_node_specs.json]

Reads ComfyUI's source without importing it (no torch needed): each node class's INPUT_TYPES dict in nodes.py and
comfy_extras/*.py, and the io.Schema inputs (io.Int.Input("width", default=..., min=...)) of the newer nodes. For every
node class of the table it prints each input whose type, default, min, max, step or choices differ from ComfyUI's
(a COMBO whose choices ComfyUI computes at run time, e.g. the model folders', is not compared), and the inputs one
side has and the other lacks. The last line is `comfy_node_specs nodes=N inputs=M differ=K missing=J`. Where this
pipeline supports less than ComfyUI (steps, cfg, the shift, the sizes with a pack) the differences are expected:
the module docstring of orchestrator/http/comfy_nodes.py lists them.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.http.comfy_nodes import node_table  # noqa: E402

NAMES = {"MAX_RESOLUTION": 16384, "True": True, "False": False, "None": None}
UNKNOWN = "<run time>"          # a value ComfyUI computes when it runs (a folder listing, a sampler list)
PARTIAL = "**"                  # a declaration that unpacks another's (LoadImageMask's **LoadImage's): not all here
IO_TYPES = {"Int": "INT", "Float": "FLOAT", "String": "STRING", "Boolean": "BOOLEAN", "Combo": "COMBO"}


def value(node: ast.AST):
    """A literal of ComfyUI's source; UNKNOWN for what only running it gives."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return [value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if k is None:                                   # {**types["required"], ...}: not followed here
                out[PARTIAL] = True
                continue
            out[value(k)] = value(v)
        return out
    if isinstance(node, ast.Name):
        return NAMES.get(node.id, UNKNOWN)
    if isinstance(node, ast.Attribute):                     # IO.STRING (a type), nodes.MAX_RESOLUTION
        if isinstance(node.value, ast.Name) and node.value.id == "IO":
            return node.attr
        return NAMES.get(node.attr, UNKNOWN)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = value(node.operand)
        return -v if isinstance(v, (int, float)) else UNKNOWN
    return UNKNOWN


def classic_inputs(cls: ast.ClassDef) -> dict | None:
    """{input: (type, options)} from an INPUT_TYPES method's returned dict (required and optional)."""
    fn = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "INPUT_TYPES"), None)
    ret = fn and next((n for n in ast.walk(fn) if isinstance(n, ast.Return)), None)
    if ret is None:
        return None
    out = {}
    groups = value(ret.value)
    groups = groups if isinstance(groups, dict) else {}
    for group in ("required", "optional"):
        decls = groups.get(group)
        for name, decl in decls.items() if isinstance(decls, dict) else ():
            decl = decl if isinstance(decl, list) else [decl]
            kind, opts = decl[0], (decl[1] if len(decl) > 1 and isinstance(decl[1], dict) else {})
            out[name] = ("COMBO", {**opts, "choices": kind}) if isinstance(kind, list) or kind == UNKNOWN \
                else (kind, opts)
    return out


def schema_inputs(cls: ast.ClassDef) -> tuple[str, dict] | None:
    """(node_id, {input: (type, options)}) from a define_schema's io.Schema(...) call."""
    for call in (n for n in ast.walk(cls) if isinstance(n, ast.Call)):
        kw = {k.arg: k.value for k in call.keywords}
        if "node_id" not in kw or "inputs" not in kw or not isinstance(kw["inputs"], ast.List):
            continue
        out = {}
        for inp in kw["inputs"].elts:
            f = inp.func if isinstance(inp, ast.Call) else None
            kind = f.value.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) else None
            if not kind or not inp.args:
                continue
            opts = {k.arg: value(k.value) for k in inp.keywords}
            if kind == "Combo" and "options" in opts:
                opts["choices"] = opts.pop("options")
            out[value(inp.args[0])] = (IO_TYPES.get(kind, kind.upper()), opts)
        return value(kw["node_id"]), out
    return None


def comfy_nodes(src: Path) -> dict[str, dict]:
    """Every node class's inputs in a ComfyUI checkout, by class name (classic) or node_id (io.Schema)."""
    out: dict[str, dict] = {}
    for path in [src / "nodes.py", *sorted((src / "comfy_extras").glob("*.py"))]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            schema = schema_inputs(cls)
            if schema is not None:
                out.setdefault(schema[0], schema[1])
            inputs = classic_inputs(cls)
            if inputs:
                out.setdefault(cls.name, inputs)
    return out


def differences(ours, theirs: dict) -> list[dict]:
    """One row per input of node spec `ours` that differs from ComfyUI's declaration `theirs`."""
    rows = []
    for i in ours.inputs:
        if i.name not in theirs:
            if PARTIAL not in theirs:
                    rows.append({"input": i.name, "what": "not in ComfyUI"})
            continue
        kind, opts = theirs[i.name]
        mine = {"type": i.type, "default": i.default, **{k: i.options.get(k) for k in ("min", "max", "step")}}
        comfy = {"type": kind, "default": opts.get("default"), **{k: opts.get(k) for k in ("min", "max", "step")}}
        if i.type == "COMBO" and opts.get("choices") not in (UNKNOWN, None) and i.choices is not None:
            mine["choices"], comfy["choices"] = list(i.choices), opts["choices"]
            comfy["default"] = opts.get("default", opts["choices"][0] if opts["choices"] else None)
        elif i.type == "COMBO":
            mine["default"] = comfy["default"] = None                   # run-time lists: no default to compare
        for key in mine:
            if mine[key] != comfy[key] and not (i.is_link and key != "type"):
                rows.append({"input": i.name, "what": key, "ours": mine[key], "comfyui": comfy[key]})
    rows += [{"input": name, "what": "not in the table"} for name in theirs
             if name != PARTIAL and ours.input(name) is None]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfyui-src", type=Path, required=True, help="a ComfyUI checkout (nodes.py, comfy_extras/)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON")
    args = ap.parse_args(argv)
    theirs = comfy_nodes(args.comfyui_src)
    report, inputs = {}, 0
    for name, spec in node_table().items():
        if name not in theirs:
            report[name] = [{"what": "not a ComfyUI node (this project's)"}]
            continue
        inputs += len(spec.inputs)
        rows = differences(spec, theirs[name])
        if rows:
            report[name] = rows
        for r in rows:
            both = f" ours={r['ours']!r} comfyui={r['comfyui']!r}" if "ours" in r else ""
            print(f"{name:22} {r.get('input', ''):26} {r['what']}{both}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    differ = sum(1 for rows in report.values() for r in rows if "ours" in r)
    missing = sum(1 for rows in report.values() for r in rows if "ours" not in r)
    print(f"comfy_node_specs nodes={len(node_table())} inputs={inputs} differ={differ} missing={missing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
