"""Reading a PNG the way ComfyUI's web front end does, written here from its documented behaviour, independently of
the code that writes the chunks (orchestrator.engine.report / comfy_workflow):

- chunks: after the 8-byte signature, each chunk is length (4, big-endian), type (4), data, CRC-32 (4); the front
  end (src/scripts/metadata/png.ts) takes `tEXt` (keyword NUL text) and `iTXt` (keyword NUL, compression flag and
  method, language NUL, translated keyword NUL, text) chunks into {keyword: text};
- a dropped PNG (ComfyApp.handleFile): `workflow` if present -> loadGraphData(JSON.parse(workflow)); else `prompt` ->
  loadApiJson(JSON.parse(prompt)); else `parameters` -> importA1111;
- API graph (`prompt`, zComfyApiWorkflow): {node id: {"inputs": {name: value or [node id, output index]},
  "class_type": str, "_meta": {"title": str}}};
- UI workflow (`workflow`, zComfyWorkflow, schema 0.4): last_node_id, last_link_id, nodes [{id, type, pos [x, y],
  size [w, h], flags, order, mode, inputs [{name, type, link}], outputs [{name, type, links, slot_index}],
  properties, widgets_values}], links [[id, origin id, origin slot, target id, target slot, type]], version.

The widget order of each node class below is ComfyUI's INPUT_TYPES order (nodes.py / comfy_extras), with the seed's
"control after generate" value saved right after the seed.
"""
from __future__ import annotations

import json
import struct
import zlib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SEED_CONTROL = ("fixed", "increment", "decrement", "randomize")

# class_type -> its widget inputs in ComfyUI's order ("*control*" marks the seed's extra widget value)
WIDGETS = {
    "UNETLoader": ("unet_name", "weight_dtype"),
    "CLIPLoader": ("clip_name", "type", "device"),
    "VAELoader": ("vae_name",),
    "CLIPTextEncode": ("text",),
    "EmptyLatentImage": ("width", "height", "batch_size"),
    "EmptySD3LatentImage": ("width", "height", "batch_size"),
    "ModelSamplingAuraFlow": ("shift",),
    "KSampler": ("seed", "*control*", "steps", "cfg", "sampler_name", "scheduler", "denoise"),
    "KSamplerAdvanced": ("add_noise", "noise_seed", "*control*", "steps", "cfg", "sampler_name", "scheduler",
                         "start_at_step", "end_at_step", "return_with_leftover_noise"),
    "VAEDecode": (),
    "SaveImage": ("filename_prefix",),
    "AnimaSpectrum": ("w", "m", "lam", "window", "flex", "warmup", "stop"),     # this server's own node
    "EasyCache": ("reuse_threshold", "start_percent", "end_percent", "verbose"),
    "LazyCache": ("reuse_threshold", "start_percent", "end_percent", "verbose"),
}
OPTIONAL_DEFAULTS = {("CLIPLoader", "device"): "default"}


def text_chunks(data: bytes) -> tuple[dict[str, str], dict[str, str]]:
    """({keyword: text}, {keyword: chunk type}) of a PNG's tEXt/iTXt chunks; CRCs checked."""
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    texts, kinds, pos = {}, {}, 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        crc, = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in a {kind!r} chunk"
        if kind == b"tEXt":
            key, _, text = body.partition(b"\0")
            texts[key.decode("latin-1")] = text.decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _lang, _, rest = rest.partition(b"\0")
            _translated, _, text = rest.partition(b"\0")
            texts[key.decode("latin-1")] = (zlib.decompress(text) if compressed else text).decode("utf-8")
        else:
            pos += 12 + length
            continue
        kinds[key.decode("latin-1")] = kind.decode()
        pos += 12 + length
    return texts, kinds


def dropped(texts: dict[str, str]) -> str:
    """Which chunk ComfyUI's front end loads from a dropped PNG."""
    for key in ("workflow", "prompt", "parameters"):
        if texts.get(key):
            return key
    return "none"


def check_api_graph(graph) -> None:
    assert isinstance(graph, dict) and graph, "the API graph is an object of nodes"
    for node_id, node in graph.items():
        assert isinstance(node_id, str) and isinstance(node, dict)
        assert isinstance(node.get("class_type"), str), f"node {node_id} has no class_type"
        assert isinstance(node.get("inputs"), dict), f"node {node_id} has no inputs object"
        assert isinstance((node.get("_meta") or {}).get("title"), str), f"node {node_id} has no _meta.title"
        for name, value in node["inputs"].items():
            if isinstance(value, list):
                assert len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int), (node_id, name)
                assert value[0] in graph, f"node {node_id}.{name} links to a missing node {value[0]}"


def widget_values(node: dict) -> list:
    """An API node's widget values in the order its UI node saves them."""
    out = []
    for name in WIDGETS[node["class_type"]]:
        if name == "*control*":
            out.append("*control*")
        else:
            out.append(node["inputs"].get(name, OPTIONAL_DEFAULTS.get((node["class_type"], name))))
    return out


def check_workflow(wf, graph: dict) -> None:
    """The 0.4 schema, links consistent with the nodes' slots, and the same graph as `graph` (the API form)."""
    assert isinstance(wf, dict) and isinstance(wf.get("version"), (int, float))
    for key, kind in (("last_node_id", int), ("last_link_id", int), ("nodes", list), ("links", list)):
        assert isinstance(wf.get(key), kind), f"workflow.{key}"
    nodes = {}
    for n in wf["nodes"]:
        for key, kind in (("id", int), ("type", str), ("flags", dict), ("order", int), ("mode", int),
                          ("properties", dict), ("widgets_values", list), ("inputs", list), ("outputs", list)):
            assert isinstance(n.get(key), kind), f"node {n.get('id')}.{key}"
        for key in ("pos", "size"):
            assert len(n[key]) == 2 and all(isinstance(v, (int, float)) for v in n[key]), f"node {n['id']}.{key}"
        assert n["id"] not in nodes and n["id"] <= wf["last_node_id"]
        nodes[n["id"]] = n
    # every link sits in its two slots, with one type
    seen = set()
    for link in wf["links"]:
        assert len(link) == 6
        lid, src, src_slot, dst, dst_slot, kind = link
        assert lid not in seen and lid <= wf["last_link_id"]
        seen.add(lid)
        out, inp = nodes[src]["outputs"][src_slot], nodes[dst]["inputs"][dst_slot]
        assert lid in out["links"] and inp["link"] == lid, f"link {lid} not in its slots"
        assert out["type"] == inp["type"] == kind, f"link {lid}: {out['type']} -> {inp['type']} as {kind}"
    for n in nodes.values():
        for inp in n["inputs"]:
            assert inp["link"] is None or inp["link"] in seen
        for s, out in enumerate(n["outputs"]):
            assert out.get("slot_index", s) == s and all(lid in seen for lid in out["links"])
    # the same graph as the API form: nodes, types, widget values, every link
    assert sorted(nodes) == sorted(int(k) for k in graph), "workflow and prompt have other nodes"
    by_id = {(lk[3], nodes[lk[3]]["inputs"][lk[4]]["name"]): lk for lk in wf["links"]}
    api_links = 0
    for node_id, node in graph.items():
        n = nodes[int(node_id)]
        assert n["type"] == node["class_type"]
        want = widget_values(node)
        got = list(n["widgets_values"])
        assert len(got) == len(want), (node_id, got, want)
        for g, w in zip(got, want):
            assert g in SEED_CONTROL if w == "*control*" else g == w, (node_id, got, want)
        title = node["_meta"]["title"]
        assert n.get("title", title) == title
        for name, value in node["inputs"].items():
            if isinstance(value, list):
                api_links += 1
                lk = by_id.get((int(node_id), name))
                assert lk is not None, f"no workflow link into {node_id}.{name}"
                assert (lk[1], lk[2]) == (int(value[0]), value[1]), f"{node_id}.{name}: {lk} vs {value}"
    assert api_links == len(wf["links"])


def read_comfy_png(data: bytes) -> dict:
    """Everything ComfyUI takes from the PNG, checked: {texts, kinds, dropped, prompt, workflow}."""
    texts, kinds = text_chunks(data)
    prompt = json.loads(texts["prompt"])
    check_api_graph(prompt)
    workflow = json.loads(texts["workflow"])
    check_workflow(workflow, prompt)
    return {"texts": texts, "kinds": kinds, "dropped": dropped(texts), "prompt": prompt, "workflow": workflow}
