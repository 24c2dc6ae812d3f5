"""An API graph (orchestrator.http.comfy_graph) as ComfyUI's UI workflow: the JSON its web page saves and loads.

ComfyUI stores two text chunks in a PNG: `prompt` (the API graph that ran) and `workflow` (the editor's graph). Its
front end, given a dropped PNG, loads `workflow` when there is one, else `prompt` (as an API graph), else A1111's
`parameters`. The workflow here follows the front end's schema version 0.4:

    {"last_node_id", "last_link_id", "nodes": [node], "links": [[id, origin_id, origin_slot, target_id, target_slot,
     type]], "groups": [], "config": {}, "extra": {}, "version": 0.4}
    node = {"id", "type", "pos": [x, y], "size": [w, h], "flags": {}, "order", "mode": 0,
            "inputs": [{"name", "type", "link"}], "outputs": [{"name", "type", "links": [ids], "slot_index"}],
            "properties": {"Node name for S&R": type}, "widgets_values": [...], "title"?}

`widgets_values` are a node's widget inputs in INPUT_TYPES order (the node table's order), with the extra
"control after generate" value right after a seed, as ComfyUI's editor saves it. The layout is one column per depth
of the graph, so it opens readable.
"""
from __future__ import annotations

from orchestrator.http.comfy_graph import graph_links
from orchestrator.http.comfy_nodes import NodeSpec, node_table

VERSION = 0.4
CONTROL_AFTER_GENERATE = "fixed"     # the seed is the job's; the editor should not change it on the next queue
COLUMN_W, ROW_H, MARGIN = 360, 40, 40


def _int_ids(graph: dict) -> dict[str, int]:
    """Workflow node ids are integers: numeric API ids are kept, others get fresh numbers after the largest."""
    ids = {k: int(k) for k in graph if k.isdigit() and str(int(k)) == k}
    nxt = max(ids.values(), default=0) + 1
    for k in graph:
        if k not in ids:
            ids[k], nxt = nxt, nxt + 1
    return ids


def _order(graph: dict, links: list) -> list[str]:
    """A topological order (sources first), ties in graph order: the order ComfyUI would execute."""
    deps = {k: set() for k in graph}
    for src, _, dst, _, _ in links:
        if src in deps and dst in deps:
            deps[dst].add(src)
    out, done = [], set()
    while len(out) < len(graph):
        ready = [k for k in graph if k not in done and deps[k] <= done]
        if not ready:                                   # a cycle: keep the rest in graph order
            ready = [k for k in graph if k not in done]
        for k in ready:
            out.append(k)
            done.add(k)
    return out


def _fits(graph: dict, table: dict, link) -> bool:
    """A link the editor can draw: its source is a node of the graph with that output slot, of the input's type (a
    client's graph may hold unchecked nodes that no output needs)."""
    src, slot, _, _, kind = link
    outs = table[graph[src]["class_type"]].outputs if src in graph else ()
    return 0 <= slot < len(outs) and outs[slot] == kind


def _widgets(spec: NodeSpec, inputs: dict) -> list:
    values = []
    for i in spec.inputs:
        if not i.is_widget:
            continue
        v = inputs.get(i.name, i.default)
        if isinstance(v, list):                        # a widget fed by a link: the editor keeps its default
            v = i.default
        values.append(v)
        if i.options.get("control_after_generate"):
            values.append(CONTROL_AFTER_GENERATE)
        elif i.options.get("image_upload"):            # the editor's upload button saves its value after the name
            values.append("image")
    return values


def _size(spec: NodeSpec, n_widgets: int) -> list[float]:
    slots = max(sum(1 for i in spec.inputs if i.is_link), len(spec.outputs))
    multiline = any(i.options.get("multiline") for i in spec.inputs)
    return [400.0 if multiline else 315.0, 30.0 + 22.0 * slots + (120.0 if multiline else 26.0 * n_widgets)]


def api_to_workflow(graph: dict, table: dict[str, NodeSpec] | None = None) -> dict:
    """ComfyUI's UI workflow (schema 0.4) of an API graph whose node classes are in `table`."""
    table = table or node_table()
    graph = {k: n for k, n in graph.items() if isinstance(n, dict) and n.get("class_type") in table}
    ids = _int_ids(graph)
    links = [lk for lk in graph_links(graph, table) if _fits(graph, table, lk)]
    order = _order(graph, links)
    # link ids in graph_links order; each input slot and output slot learns its links
    link_rows, into, out_of = [], {}, {}
    for n, (src, slot, dst, name, kind) in enumerate(links, start=1):
        dst_spec = table[graph[dst]["class_type"]]
        dst_slot = [i.name for i in dst_spec.inputs if i.is_link].index(name)
        link_rows.append([n, ids[src], slot, ids[dst], dst_slot, kind])
        into[(dst, name)] = n
        out_of.setdefault((src, slot), []).append(n)
    # depth (longest path from a source) -> column
    depth: dict[str, int] = {}
    for k in order:
        depth[k] = max((depth[s] + 1 for s, _, d, _, _ in links if d == k and s in depth), default=0)
    nodes, column_y = [], {}
    for position, k in enumerate(order):
        node = graph[k]
        spec = table[node["class_type"]]
        inputs = node.get("inputs") if isinstance(node.get("inputs"), dict) else {}
        widgets = _widgets(spec, inputs)
        size = _size(spec, len(widgets))
        x, y = MARGIN + depth[k] * COLUMN_W, column_y.get(depth[k], MARGIN)
        column_y[depth[k]] = y + size[1] + ROW_H
        entry = {
            "id": ids[k], "type": spec.class_type, "pos": [float(x), float(y)], "size": size, "flags": {},
            "order": position, "mode": 0,
            "inputs": [{"name": i.name, "type": i.type, "link": into.get((k, i.name))}
                       for i in spec.inputs if i.is_link],
            "outputs": [{"name": name, "type": kind, "links": out_of.get((k, s), []), "slot_index": s}
                        for s, (name, kind) in enumerate(zip(spec.output_names or spec.outputs, spec.outputs))],
            "properties": {"Node name for S&R": spec.class_type},
            "widgets_values": widgets,
        }
        title = (node.get("_meta") or {}).get("title")
        if title and title != spec.display_name:
            entry["title"] = title
        nodes.append(entry)
    nodes.sort(key=lambda e: e["id"])
    return {"last_node_id": max(ids.values(), default=0), "last_link_id": len(link_rows), "nodes": nodes,
            "links": link_rows, "groups": [], "config": {}, "extra": {"ds": {"scale": 1.0, "offset": [0.0, 0.0]}},
            "version": VERSION}
