"""ComfyUI API graphs <-> Anima jobs: graph -> job (with ComfyUI's `node_errors`), job -> graph.

The nodes themselves (inputs, bounds, outputs, the job fields each carries) are the node table's
(orchestrator/http/comfy_nodes.py); this module walks a graph through it. Readers: the HTTP front (`POST /prompt`, the
graphs in `/history` and `/queue`) and the PNG's `prompt`/`workflow` chunks (the API graph of a job, and ComfyUI's UI
workflow built from the same table).

The standard Anima text-to-image graph (API format: {node id: {"class_type", "inputs", "_meta": {"title"}}}; an input
is a literal or a link [source node id, output slot]):

    UNETLoader ─MODEL─▶ [LoRA loaders, ModelSamplingAuraFlow] ─MODEL─▶ KSampler ◀─LATENT─ EmptyLatentImage |
                                                                                         EmptySD3LatentImage
    CLIPLoader ─CLIP─▶ [LoraLoader ...] ─CLIP─▶ CLIPTextEncode ×2 ─CONDITIONING─▶ KSampler (positive, negative)
    VAELoader ─VAE─▶ VAEDecode ◀─LATENT─ KSampler;  VAEDecode ─IMAGE─▶ SaveImage

LoRA loaders chain as in ComfyUI: LoraLoader (strength_model on its MODEL output, strength_clip on its CLIP output)
and LoraLoaderModelOnly, any number, in the model's chain and the CLIP's; the job's `loras` list them from the
loaders outward, each with the strengths of the chains it is in (0 where it is not).

Validation follows ComfyUI's (execution.validate_prompt): unknown node types, missing inputs, bad links, type
mismatches, values outside min/max or not in a list are reported per node as {"errors": [{type, message, details,
extra_info}], "dependent_outputs", "class_type"}; the body of the 400 is {"error": {...}, "node_errors": {...}}.
Then what this pipeline cannot do (a size without a model pack, another sampling shift, an image, batch or hires fix
shape prompt.json cannot say: docs/workflows.md) is reported the same way, on the node that asks for it.

A hires fix (KSampler -> LatentUpscale[By], or VAEDecode -> ImageScale[By] -> VAEEncode, -> KSampler) maps onto
prompt.json's `hires`, RepeatLatentBatch / LatentFromBatch before the sampler onto `batch`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from models.sampling import latent_ops as lo
from models.sampling.sampler import DEFAULT_SAMPLER, DEFAULT_SCHEDULER
from models.sampling.step_cache import NODE_NAMES as CACHE_NODES, CacheSettings
from protocol.prompt import HiresSettings, mixes
from orchestrator.http.comfy_nodes import (ANIMA_CLIP_TYPE, InputSpec, ModelNames, NodeSpec, carried, node_table,
                                      places_in_order)
from orchestrator.http.comfy_conditioning import (SIDES, conditioning_entries, entry_field_node,
                                             entry_nodes)
from orchestrator.engine.prompt_spec import MAX_BATCH, PromptError, prompt_record
from protocol.prompt import MAX_FROM_BATCH, PromptFile, fit_size

MAX_NODES = 64                  # a text-to-image graph has 9 or 10; anything far larger is not one
MAX_ID_CHARS = 64

# ---------------------------------------------------------------- graph -> job


class GraphError(ValueError):
    """A graph this server refuses; `body()` is ComfyUI's 400 answer."""

    def __init__(self, error: dict, node_errors: dict | None = None):
        super().__init__(error["message"] + (f": {error['details']}" if error.get("details") else ""))
        self.error, self.node_errors = error, node_errors or {}

    def body(self) -> dict:
        return {"error": self.error, "node_errors": self.node_errors}


@dataclass(frozen=True)
class GraphJob:
    """A graph mapped onto a job: `spec` is a prompt.json object; `nodes` maps roles to the graph's node ids."""

    spec: dict
    nodes: dict[str, str]       # unet, clip, vae, positive, negative, latent, sampler, decode, save [, shift]
    output: str                 # the SaveImage node id (history outputs are keyed by it)
    record: PromptFile | None = None    # `spec` checked as the prompt record (checked_job): what SUBMIT carries


def _err(kind: str, message: str, details: str = "", **extra) -> dict:
    return {"type": kind, "message": message, "details": details, "extra_info": extra}


LORA_FIELD = re.compile(r"^loras\[(\d+)\]")      # a LoRA's prompt.json field: loras[i], loras[i].name ...


class _Checker:
    """validate_prompt's walk: from the output node through its links, each node checked once."""

    def __init__(self, graph: dict, table: dict[str, NodeSpec]):
        self.graph, self.table = graph, table
        self.errors: dict[str, list] = {}
        self.values: dict[str, dict] = {}           # node id -> converted literal inputs
        self.links: dict[str, dict] = {}            # node id -> {input: source node id}
        self.done: set[str] = set()

    def add(self, node_id: str, error: dict) -> None:
        self.errors.setdefault(node_id, []).append(error)

    def fields(self, node_id: str) -> dict:
        """A checked node's values as the prompt.json fields it carries (the node table's `job`)."""
        return self.table[self.graph[node_id]["class_type"]].job_values(self.values[node_id])

    def node(self, root: str) -> None:
        """Check `root` and every node it links to, depth first, in ComfyUI's order: an explicit stack (a chain as
        long as the node limit allows needs no recursion), each node once (a loop ends the walk; `cycle` finds it)."""
        stack = [self._visit(root)] if root not in self.done else []
        while stack:
            src = next(stack[-1], None)
            if src is None:
                stack.pop()
            elif src not in self.done:
                stack.append(self._visit(src))

    def _visit(self, node_id: str):
        """Check one node's inputs; yields the id of each node it links to, to be checked before its next input."""
        self.done.add(node_id)
        spec = self.table[self.graph[node_id]["class_type"]]
        inputs = self.graph[node_id].get("inputs", {})
        self.values[node_id], self.links[node_id] = {}, {}
        for i in spec.inputs:
            if i.name not in inputs:
                if not i.optional:
                    self.add(node_id, _err("required_input_missing", "Required input is missing", i.name,
                                           input_name=i.name))
                continue
            val = inputs[i.name]
            if i.is_link:
                src = self._link(node_id, i, val)
                if src is not None:
                    yield src
            elif isinstance(val, list):
                self.add(node_id, _err("invalid_input_type", f"{i.name} takes a value, not a link", i.name,
                                       input_name=i.name, received_value=val))
            else:
                self._value(node_id, i, val)

    def _link(self, node_id: str, i: InputSpec, val) -> str | None:
        """Check a link input -> its source node's id (None when the link is refused)."""
        info = dict(input_name=i.name, received_value=val)
        if not (isinstance(val, list) and len(val) == 2 and isinstance(val[0], (str, int))
                and isinstance(val[1], int) and not isinstance(val[1], bool)):
            self.add(node_id, _err("bad_linked_input", "Bad linked input, must be a length-2 list of "
                                   "[node_id, slot_index]", i.name, **info))
            return
        src = str(val[0])
        if src not in self.graph:
            self.add(node_id, _err("bad_linked_input", f"Linked node {src!r} is not in the prompt", i.name, **info))
            return
        outs = self.table[self.graph[src]["class_type"]].outputs
        if not 0 <= val[1] < len(outs) or outs[val[1]] != i.type:
            got = outs[val[1]] if 0 <= val[1] < len(outs) else "no such output"
            self.add(node_id, _err("return_type_mismatch", "Return type mismatch between linked nodes",
                                   f"{i.name}, {got} != {i.type}", input_name=i.name, received_type=got,
                                   linked_node=val))
            return
        self.links[node_id][i.name] = src
        return src

    def cycle(self, root: str) -> list[tuple[str, str]] | None:
        """A loop among the links checked from `root`: [(node id, the input that links it to the next one)], the
        last one's input closing the loop onto the first; None when the links from `root` form no loop. Iterative,
        each node entered once: linear in the graph's size."""
        state: dict[str, int] = {}                  # 1: on the current path, 2: finished
        path: list[tuple[str, str]] = []            # (node, input being followed) from root to the current node
        stack = [(root, iter(self.links.get(root, {}).items()))]
        state[root] = 1
        while stack:
            node, edges = stack[-1]
            step = next(edges, None)
            if step is None:
                state[node] = 2
                stack.pop()
                if path:
                    path.pop()
                continue
            name, src = step
            if state.get(src) == 1:                 # back onto the path: the loop runs from src to here
                on = [n for n, _ in stack]
                loop = [(n, path[k][1]) for k, n in enumerate(on) if k < len(path)] + [(node, name)]
                return loop[on.index(src):]
            if src not in state:
                state[src] = 1
                path.append((node, name))
                stack.append((src, iter(self.links.get(src, {}).items())))
        return None

    def _value(self, node_id: str, i: InputSpec, val) -> None:
        info = dict(input_name=i.name, received_value=val if isinstance(val, (str, int, float, bool)) else str(val))
        try:
            if i.type == "BOOLEAN" and not isinstance(val, bool):
                raise ValueError(f"{type(val).__name__} is not a BOOLEAN")
            if isinstance(val, dict) or val is None or (isinstance(val, bool) and i.type != "BOOLEAN"):
                raise ValueError(f"{type(val).__name__} is not a {i.type}")
            if i.type == "INT":
                if isinstance(val, str) and len(val) > 40:
                    raise ValueError("too many digits")
                val = int(val)                       # ComfyUI converts with int(): "20" and 20.0 are 20
            elif i.type == "FLOAT":
                val = float(val)
                if not math.isfinite(val):
                    raise ValueError("not a finite number")
            elif i.type in ("STRING", "COMBO") and not isinstance(val, str):
                raise ValueError("not a string")
        except (TypeError, ValueError, OverflowError) as e:
            self.add(node_id, _err("invalid_input_type", f"Failed to convert an input value to a {i.type} value",
                                   f"{i.name}, {info['received_value']!r}, {e}", exception_message=str(e), **info))
            return
        lo, hi = i.options.get("min"), i.options.get("max")
        if lo is not None and val < lo:
            self.add(node_id, _err("value_smaller_than_min", f"Value {val} smaller than min of {lo}", i.name, **info))
        elif hi is not None and val > hi:
            self.add(node_id, _err("value_bigger_than_max", f"Value {val} bigger than max of {hi}", i.name, **info))
        elif i.type == "COMBO" and i.choices is not None and val not in i.choices:
            self.add(node_id, _err("value_not_in_list", "Value not in list", f"{i.name}: {val!r} not in "
                                   f"{list(i.choices)}", **info))
        else:
            self.values[node_id][i.name] = val


def _custom(node_id: str, name: str, details: str, value=None) -> tuple[str, dict]:
    return node_id, _err("custom_validation_failed", "Custom validation failed for node", f"{name} - {details}",
                         input_name=name, received_value=value)


def graph_to_job(graph: Any, *, names: ModelNames = ModelNames(), sizes=None) -> GraphJob:
    """Map an API-format graph of one chain onto a prompt.json object, or raise GraphError with ComfyUI's 400 body.
    `sizes`: the (width, height) pairs that have a model pack (None: not checked here). A graph of several
    independent chains is refused here: graph_to_jobs maps it."""
    jobs = graph_to_jobs(graph, names=names, sizes=sizes)
    if len(jobs) > 1:
        raise _failed(graph, [_custom(jobs[1].output, "images", "a second independent chain: this caller takes "
                                      "one job per graph")], jobs[1].output)
    return jobs[0]


def graph_to_jobs(graph: Any, *, names: ModelNames = ModelNames(), sizes=None) -> list[GraphJob]:
    """Map an API-format graph onto one job per independent chain (`chains`: output nodes that share no sampler),
    in the order of their first output node in the graph, each checked as the prompt record (`checked_job`); or
    raise GraphError with ComfyUI's 400 body, every chain's problems in one node_errors as ComfyUI validates every
    output. `sizes`: as graph_to_job's."""
    return [checked_job(graph, job, sizes) for job in mapped_jobs(graph, names=names, sizes=sizes)]


def mapped_jobs(graph: Any, *, names: ModelNames = ModelNames(), sizes=None) -> list[GraphJob]:
    """graph_to_jobs before the prompt record's check: for a caller that changes a job first (the front sizes a job
    to its uploaded image) and then checks it with `checked_job`."""
    # the sizes bound /object_info's widgets; a graph's size is checked against the packs' sizes themselves, so a
    # size without a pack is refused naming them, not as out of a widget's range
    table = node_table(replace(names, sizes=()))
    outputs = _outline(graph, table)
    # 3) ComfyUI's checks, from each output through its links
    c = _Checker(graph, table)
    problems = _checked(c, outputs)
    if problems:
        raise _failed(graph, problems, outputs[0])
    built = [_chain_job(graph, table, c, chain, sizes) for chain in chains(c, table, outputs)]
    problems = [p for _, more in built for p in more]
    if problems:                        # the first failing chain's job output is the one that depends on them
        raise _failed(graph, problems, next(job.output for job, more in built if more))
    return [job for job, _ in built]


def checked_job(graph: dict, job: GraphJob, sizes=None) -> GraphJob:
    """4) The job's spec checked as the prompt record, once (what prompt.json still refuses: lengths, NUL, an empty
    prompt, a size without a pack in `sizes`), the refusal on the node that carries the field; -> the job with its
    record."""
    try:
        record = prompt_record(job.spec)
        if sizes:
            fit_size(record, sizes)
    except PromptError as e:
        raise field_error(graph, job, e.field, e.detail) from None
    return replace(job, record=record)


def _outline(graph: Any, table: dict[str, NodeSpec]) -> list[str]:
    """The graph's outline checked: an object of nodes, each a known class with an inputs object -> its output
    nodes (SaveImage, PreviewImage), in the graph's order."""
    if not isinstance(graph, dict) or not graph:
        raise GraphError(_err("invalid_prompt", "Invalid prompt: the prompt must be a non-empty object of nodes"))
    if len(graph) > MAX_NODES:
        raise GraphError(_err("invalid_prompt", f"Invalid prompt: {len(graph)} nodes; at most {MAX_NODES}"))
    node_errors = {}
    for node_id, node in graph.items():
        if len(node_id) > MAX_ID_CHARS:
            raise GraphError(_err("invalid_prompt", f"Invalid prompt: node id longer than {MAX_ID_CHARS} characters"))
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
            raise GraphError(_err("invalid_prompt", "Cannot execute because a node is missing the class_type "
                                  "property.", f"Node ID '#{node_id}'"))
        if not isinstance(node.get("inputs", {}), dict):
            raise GraphError(_err("invalid_prompt", "Invalid prompt: a node's inputs must be an object",
                                  f"Node ID '#{node_id}'"))
        ct = node["class_type"]
        if ct not in table:
            title = (node.get("_meta") or {}).get("title", ct) if isinstance(node.get("_meta"), dict) else ct
            e = _err("missing_node_type", f"Node '{ct}' not found. This server runs Anima text-to-image graphs "
                     f"only ({', '.join(table)}).", f"Node ID '#{node_id}'", node_id=node_id, class_type=ct,
                     node_title=str(title))
            node_errors[node_id] = {"errors": [e], "dependent_outputs": [], "class_type": ct}
    if node_errors:
        first = next(iter(node_errors.values()))["errors"][0]
        raise GraphError(first, node_errors)
    # 2) the outputs: SaveImage and PreviewImage nodes
    outputs = [k for k, n in graph.items() if table[n["class_type"]].output_node]
    if not outputs:
        raise GraphError(_err("prompt_no_outputs", "Prompt has no outputs", "this server needs a SaveImage node"))
    return outputs


def chains(c: _Checker, table: dict[str, NodeSpec], outputs: list[str]) -> list[list[str]]:
    """The outputs grouped into independent chains: two outputs are one chain when the nodes they are made from
    share a sampler (a KSampler's latent decoded twice, a hires fix's first pass saved too); sharing only nodes
    before the samplers (loaders, prompts, an empty or encoded latent) leaves them apart, each chain computing
    those for itself as ComfyUI's cache would give them. Chains in the order of their first output."""
    samplers = {}
    for out in outputs:
        samplers[out] = {n for n in upstream(c, out) if table[c.graph[n]["class_type"]].role == "sampler"}
    groups: list[tuple[set, list[str]]] = []
    for out in outputs:
        # an output of no sampler's image (an upload shown as it is) goes with the first: refused there
        joined = [g for g in groups if g[0] & samplers[out]] or ([] if samplers[out] or not groups else groups[:1])
        merged = (set(samplers[out]).union(*(g[0] for g in joined)),
                  [o for g in joined for o in g[1]] + [out])
        groups = [g for g in groups if g not in joined] + [merged]
    groups.sort(key=lambda g: outputs.index(min(g[1], key=outputs.index)))
    return [sorted(g[1], key=outputs.index) for g in groups]


def _chain_job(graph, table, c: _Checker, outputs: list[str], sizes) -> tuple[GraphJob, list]:
    """One chain's job (the output saving its final image the job's, the others its saves or, with a hires fix,
    its first pass's) and its problems."""
    role_of = {k: table[graph[k]["class_type"]].role for k in c.done}
    out = _final_output(c, role_of, outputs)
    roles, spec, problems = _roles(graph, table, c, out, sizes)
    if not problems:
        saves, problems = _saves(c, role_of, roles, outputs)
        roles.update(saves)
        if "base_save" in roles:
            spec["hires"]["keep_base"] = True
    return GraphJob(spec=spec, nodes=roles, output=out), problems


def _checked(c: _Checker, outputs: list[str]) -> list[tuple[str, dict]]:
    """ComfyUI's checks of every output's inputs and links, then a loop among them (ComfyUI's "Dependency cycle
    detected", before anything walks the chains) -> problems."""
    for out in outputs:
        c.node(out)
    problems = [(k, e) for k, es in c.errors.items() for e in es]
    for out in outputs:
        loop = c.cycle(out)
        if loop is not None:
            shown = " -> ".join(f"{n}.{name}" for n, name in loop) + f" -> {loop[0][0]}"
            return problems + [(n, _err("dependency_cycle", "Dependency cycle detected", f"{name} - the graph loops: "
                                        f"{shown}", input_name=name, cycle=[k for k, _ in loop])) for n, name in loop]
    return problems


def _final_output(c: _Checker, role_of: dict, outputs: list[str]) -> str:
    """The output node that saves the job's final image: the first one on a VAEDecode of a KSampler that samples
    another KSampler's result (a hires fix through an upscale or the pixel path, a chained split sampling; others may
    save its first pass's image), else the first output. Found from the graph, not the outputs' order."""
    for k in outputs:
        decode = c.links[k]["images"]
        sampler = c.links[decode].get("samples") if role_of[decode] == "decode" else None
        if sampler is not None and role_of[sampler] == "sampler" and _samples_a_sampler(c, role_of, sampler):
            return k
    return outputs[0]


def _samples_a_sampler(c: _Checker, role_of: dict, sampler: str) -> bool:
    """Whether a KSampler's latent comes, through any latent or image nodes, from another KSampler."""
    start = c.links[sampler]["latent_image"]
    return any(role_of.get(n) == "sampler" for n in upstream(c, start, skip=("vae", "mask")))


def upstream(c: _Checker, node: str, skip: tuple[str, ...] = ()) -> set[str]:
    """`node` and every node it is made from along the checked links (inputs named in `skip` not followed), each
    node once."""
    seen, todo = {node}, [node]
    while todo:
        for name, src in c.links.get(todo.pop(), {}).items():
            if name not in skip and src not in seen:
                seen.add(src)
                todo.append(src)
    return seen


def _saves(c: _Checker, role_of: dict, roles: dict, outputs: list[str]) -> tuple[dict, list]:
    """The other output nodes' roles -> ({role: node}, problems): on the job's image (its VAEDecode, or another of
    the same latent and VAE: the same pixels) save1, save2 ...; with a hires fix, on its first pass's image (the
    pixel path's VAEDecode, or a VAEDecode of the first KSampler's latent) base_save, base_save1 ... (the job keeps
    that image: hires.keep_base)."""
    def decodes(node: str, sampler: str) -> bool:
        links = c.links[node]
        return role_of[node] == "decode" and links["samples"] == sampler and links["vae"] == roles["vae"]
    final, out, problems, count = roles["decode"], {}, [], {"save": 1, "base_save": 0}
    for k in outputs:
        if k == roles["save"]:
            continue
        image = c.links[k]["images"]
        if image == final or decodes(image, c.links[final]["samples"]):
            role = "save"
        elif "hires_sampler" in roles and (image == roles.get("hires_decode") or decodes(image, roles["sampler"])):
            role = "base_save"
            if image != roles.get("hires_decode"):
                out.setdefault("base_decode", image)
        else:
            problems.append(_custom(k, "images", f"every SaveImage and PreviewImage must save the job's image (a "
                                    f"VAEDecode of the latent node '{c.links[final]['samples']}' with its VAE) or, "
                                    f"with a hires fix, its first pass's (a VAEDecode of the first KSampler's "
                                    f"latent); node '{image}' is neither"))
            continue
        out[f"{role}{count[role] or ''}"] = k
        count[role] += 1
    return out, problems


def output_nodes(nodes: dict[str, str]) -> list[str]:
    """A job's output node ids: those on its final image (roles save, save1 ...), then those on a hires fix's first
    pass image (base_save, base_save1 ...)."""
    final = [nodes["save"]] + [nodes[f"save{k}"] for k in range(1, len(nodes)) if f"save{k}" in nodes]
    return final + base_outputs(nodes)


def base_outputs(nodes: dict[str, str]) -> list[str]:
    """The output node ids that save a hires fix's first pass image (hires.keep_base)."""
    return [nodes[r] for r in ["base_save"] + [f"base_save{k}" for k in range(1, len(nodes))] if r in nodes]


def sized_to_image(graph: dict, job: GraphJob, size: tuple[int, int], sizes=None) -> GraphJob:
    """A job from an encoded image at the image's size (ComfyUI's VAEEncode encodes the image as it is): the upload's
    (width, height), or GraphError on its LoadImage naming the sizes with a model pack (`sizes`; None: not checked)."""
    w, h = size
    if sizes is not None and (w, h) not in set(sizes):
        have = ", ".join(f"{a}x{b}" for a, b in sizes)
        raise _failed(graph, [_custom(job.nodes["image"], "image", f"the image is {w}x{h}, a size without a model "
                                      f"pack; the sizes with one: {have}", job.spec["init_image"])], job.output)
    problems = _hires_size_problems(graph, job, w, h)
    if problems:
        raise _failed(graph, problems, job.output)
    return replace(job, spec={**job.spec, "width": w, "height": h})


def _hires_size_problems(graph: dict, job: GraphJob, width: int, height: int) -> list:
    """A hires fix's checks that need the first pass's size (width x height pixels): crop "center" must cut
    nothing (prompt.json's hires does not crop), and a pixel ImageScaleBy must give the job's second size in whole
    latent cells (ComfyUI scales to round(side * scale_by) pixels; VAEEncode crops that to a multiple of 8)."""
    h, node = job.spec.get("hires"), job.nodes.get("upscale")
    if h is None or node is None:
        return []
    up, pixel, problems = graph[node]["inputs"], h.get("space") == "pixel", []
    if up.get("crop") == "center":
        if pixel:
            old, new = (height, width), (h["width"], h["height"])
        else:
            old = (height // lo.LATENT_SCALE, width // lo.LATENT_SCALE)
            try:
                new = lo.upscale_size(old, h["width"], h["height"])[::-1]
            except lo.LatentOpError as e:               # a side past what any latent may be
                return [_custom(node, "width", str(e), h["width"])]
        if lo.center_crop_margins(*old, *new) != (0, 0):
            problems.append(_custom(node, "crop", f"center would crop the {width}x{height} first pass to the aspect "
                                    f"of {h['width']}x{h['height']}; a job's hires pass does not crop: set disabled, "
                                    "or keep the aspect", "center"))
    if pixel and "scale" in h:
        comfy = (round(width * h["scale"]), round(height * h["scale"]))
        ours = HiresSettings(scale=h["scale"], space="pixel").size(width, height)
        if comfy != ours:
            problems.append(_custom(node, "scale_by", f"scales the {width}x{height} image to {comfy[0]}x{comfy[1]}, "
                                    f"which is not the {ours[0]}x{ours[1]} (whole latent cells) a job's pixel pass "
                                    "scales to: pick a scale_by whose sizes are multiples of 8", h["scale"]))
    return problems


def prompt_detail(message: str, field: str = "") -> str:
    """A prompt.json refusal's text without its "prompt.json: field 'F': " lead (the daemon's words are prompt.json's;
    a graph or an HTTP request named no such file)."""
    for lead in (f"prompt.json: field '{field}': ", "prompt.json: "):
        if message.startswith(lead):
            return message[len(lead):]
    return message


def field_nodes(graph: dict, job: GraphJob, field: str) -> list[tuple[str, str]] | None:
    """The (node id, input name) pairs of a job's graph that carry a prompt.json field (the node table's `job` and
    `refusals` at each node's place): `loras` (the stack as a whole: its count, its rank) every loader; None for a
    field no node carries."""
    field = field or ""
    entry = entry_field_node(job.nodes, field)
    if entry is not None:
        return [entry]
    table = node_table()
    for place, node in places_in_order(job.nodes):
        name = carried(place, table[graph[node]["class_type"]]).get(field)
        if name is not None:
            return [(node, name)]
    lora = LORA_FIELD.match(field)
    if lora and f"lora{lora.group(1)}" in job.nodes:            # loras[i] as a whole: its loader's lora_name
        return [(job.nodes[f"lora{lora.group(1)}"], "lora_name")]
    if field == "loras" or lora:
        loaders = [n for r, n in job.nodes.items() if r.startswith("lora")]
        if loaders:
            return [(n, "lora_name") for n in loaders]
    if field in ("init_mix", "latent_mix") and field in job.nodes:     # a mix as a whole: its node's first input
        node = job.nodes[field]
        return [(node, MIX_INPUTS[graph[node]["class_type"]][0])]
    if field == "hires" and "upscale" in job.nodes:             # the second size as a whole: where it is asked
        return [(job.nodes["upscale"], "scale_by" if "scale" in job.spec.get("hires", {}) else "width")]
    root = re.split(r"[.\[]", field, maxsplit=1)[0]
    if root in job.spec:                                          # another field of the job: the sampler's
        return [(job.nodes["sampler"], field)]
    return None


def field_error(graph: dict, job: GraphJob, field: str, detail: str) -> GraphError:
    """A refusal of one of the job's prompt.json fields (graph_to_job's own check, or the daemon's at submit: a LoRA it
    cannot apply) as ComfyUI's 400: node_errors on the node(s) that carry the field."""
    where = field_nodes(graph, job, field) or [(job.nodes["sampler"], field or "prompt")]
    return _failed(graph, [_custom(node, name, prompt_detail(detail, field)) for node, name in where], job.output)


def _roles(graph, table, c: _Checker, out: str, sizes) -> tuple[dict, dict, list]:
    """The job from a graph whose links and values passed ComfyUI's checks -> (roles, prompt.json object, problems)."""
    problems = []
    role_of = {k: table[graph[k]["class_type"]].role for k in c.done}
    decode, crop = c.links[out]["images"], None
    if role_of[decode] == "crop":                                 # ImageCrop of the decoded image
        crop, decode = decode, c.links[decode]["image"]
    if role_of[decode] != "decode":                               # an IMAGE of LoadImage or ImageScale: no job
        where = (crop, "image") if crop else (out, "images")
        return {}, {}, [_custom(*where, "SaveImage must save VAEDecode's image (of the last KSampler), or one "
                                "ImageCrop of it")]
    mix, sampler, problems = _mix_inputs(c, role_of, c.links[decode]["samples"])
    if problems:                                                  # LatentComposite / LatentBlend before VAEDecode
        return {}, {}, problems
    if role_of[sampler] != "sampler":
        return {}, {}, [_custom(decode, "samples", "VAEDecode must decode the KSampler's output")]
    vae = c.links[decode]["vae"]
    second = _second_pass(c, role_of, sampler, vae)           # a hires fix: `sampler` is its second KSampler
    if second is not None:
        if second[2] or mix:
            return {}, {}, second[2] or [_custom(mix, MIX_INPUTS[graph[mix]["class_type"]][0], MIX_WHERE)]
        sampler, mix = second[1], second[0].get("latent_mix")
    latent, batch = _chain(graph, c, role_of, c.links[sampler]["latent_image"], "samples", ("batch",))
    start = None                                                  # LatentComposite / LatentBlend of two uploads
    if role_of[latent] == "latent_mix":
        start = _mix_start(c, role_of, vae, latent)
        if start[2]:
            return {}, {}, start[2]
        latent = start[3]
    image = _image_latent(c, role_of, vae, latent)                # None: not from an image
    if image is not None and image[2]:
        return {}, {}, image[2]
    if role_of[latent] != "latent" and image is None:
        where = (batch[-1], "samples") if batch else (sampler, "latent_image")
        return {}, {}, [_custom(*where, "a KSampler's latent must come from EmptyLatentImage, EmptySD3LatentImage, "
                                "VAEEncode[ForInpaint] or SetLatentNoiseMask (through RepeatLatentBatch / "
                                "LatentFromBatch), or for a second pass the first KSampler's LATENT, as it is or "
                                "through LatentUpscale[By] or ImageScale[By] + VAEEncode (two passes at most)")]
    roles = {"save": out, "decode": decode, "sampler": sampler, "latent": latent, "vae": vae,
             **{f"batch{i}": n for i, n in enumerate(batch)}, **(second[0] if second else {}),
             **({"crop": crop} if crop else {})}
    entries = _sampler_conditionings(graph, c, role_of, roles, problems)
    if problems:
        return roles, {}, problems
    loras = _loras(graph, c, role_of, roles, problems)
    roles.update(image[0] if image else {})
    spec = {**_job_fields(graph, c, roles, sizes, problems), **entries}
    if image is not None:                                         # ComfyUI's size: the image's (the job's: its pack's)
        spec = {**{k: x for k, x in spec.items() if k not in ("width", "height")}, **image[1]}
    if start is not None:                                         # a mix of two uploads (init_mix)
        roles, spec = {**roles, **start[0]}, {**spec, "init_mix": start[1]}
    _batch_fields(c, roles, batch, spec, problems)
    if second is not None:
        _second_pass_fields(graph, c, role_of, roles, spec, sizes, problems)
    if loras:
        spec["loras"] = loras
    if crop:
        spec["crop"] = c.fields(crop)
    _mix_fields(graph, c, roles, spec, mix, problems)
    return roles, spec, problems


MIX_INPUTS = {"LatentComposite": ("samples_to", "samples_from"), "LatentBlend": ("samples1", "samples2")}
MIX_WHERE = ("LatentComposite / LatentBlend run here before the first KSampler on two VAEEncodes of uploads, or after "
             "an img2img KSampler, before its VAEDecode or a second KSampler (directly or through LatentUpscale[By]), "
             "mixing the KSampler's LATENT with the VAEEncode it starts from (a mix after a second pass or on the "
             "pixel path is not supported yet)")


START_EMPTY = ("ComfyUI cannot combine an empty latent (EmptyLatentImage's [B, 4, h, w], EmptySD3LatentImage's [B, 16, "
               "h, w]) with Anima's encoded one [B, 16, 1, h, w]: its LatentComposite / LatentBlend fail at run time. "
               "Before the first KSampler they take two VAEEncodes of uploads (prompt.json's init_mix)")


def _mix_start(c: _Checker, role_of: dict, vae: str, mix: str) -> tuple[dict, dict, list, str]:
    """A LatentComposite / LatentBlend the first KSampler starts from, of two VAEEncodes of LoadImages (prompt.json's
    init_mix: samples_to's / samples1's upload is the init_image, the other's init_mix.image, `onto` "init_image")
    -> (roles, init_mix, problems, the samples_to / samples1 VAEEncode). An empty latent, a masked one (its noise
    mask would ride on samples_to's side only) or a batch between are refused on the mix's input."""
    class_type = c.graph[mix]["class_type"]
    ins = MIX_INPUTS[class_type]
    a, b = (c.links[mix][name] for name in ins)
    for node, name in ((a, ins[0]), (b, ins[1])):
        role = role_of[node]
        if role != "encode":
            why = (START_EMPTY if role == "latent" else
                   "a noise mask through LatentComposite / LatentBlend before the first KSampler is not supported "
                   "yet: mix two plain VAEEncodes" if role in ("noise_mask", "inpaint_encode") else
                   "before the first KSampler LatentComposite / LatentBlend take two VAEEncodes of uploads (a batch "
                   "after the mix, RepeatLatentBatch / LatentFromBatch, is fine)")
            return {}, {}, [_custom(mix, name, why)], a
    other = _image_latent(c, role_of, vae, b)
    if other[2]:
        return {}, {}, other[2], a
    kind = "composite" if class_type == "LatentComposite" else "blend"
    roles = {"init_mix": mix, "mix_encode": b, "mix_image": other[0]["image"]}
    return roles, {"image": other[1]["init_image"], "kind": kind, **c.fields(mix)}, [], a


def _mix_inputs(c: _Checker, role_of: dict, mix: str) -> tuple[str | None, str, list]:
    """A latent input's node `mix`, a LatentComposite / LatentBlend -> (it, the KSampler whose LATENT it takes,
    problems); another node -> (None, it, []). One input must be a KSampler's LATENT."""
    if role_of[mix] != "latent_mix":
        return None, mix, []
    first, second = MIX_INPUTS[c.graph[mix]["class_type"]]
    a, b = c.links[mix][first], c.links[mix][second]
    if (role_of[a] == "sampler") == (role_of[b] == "sampler"):
        return mix, a, [_custom(mix, first, f"one of {first} / {second} must be the KSampler's LATENT and the other "
                                            f"the VAEEncode it starts from; {MIX_WHERE}")]
    return mix, a if role_of[a] == "sampler" else b, []


def _mix_fields(graph, c: _Checker, roles: dict, spec: dict, node: str | None, problems: list) -> None:
    """prompt.json's `latent_mix` from the node, its other latent checked: the VAEEncode (or the masked or batched
    latent) the first KSampler starts from; of one image with a batch, only pasted onto the batch (ComfyUI's
    LatentBlend and a paste of a batch into one image fail on differing batches)."""
    if node is None:
        return
    ins = MIX_INPUTS[graph[node]["class_type"]]
    onto = "result" if c.links[node][ins[0]] == roles["sampler"] else "image"
    other, name = c.links[node][ins[onto == "result"]], ins[onto == "result"]
    kind = "composite" if graph[node]["class_type"] == "LatentComposite" else "blend"
    head = c.links[roles["sampler"]]["latent_image"]
    if "encode" not in roles or other not in (head, roles["encode"], roles.get("noise_mask")):
        problems.append(_custom(node, name, f"must be the VAEEncode the KSampler starts from (node "
                                f"'{roles.get('encode', head)}'): {MIX_WHERE}"))
        return
    if other != head and spec.get("batch", 1) > 1 and (kind, onto) != ("composite", "result"):
        problems.append(_custom(node, name, f"one image's latent with the KSampler's batch of {spec['batch']}: "
                                "ComfyUI cannot combine them; take the latent the KSampler takes (after "
                                "RepeatLatentBatch)"))
        return
    roles["latent_mix"] = node
    spec["latent_mix"] = {"kind": kind, "onto": onto, **c.fields(node)}


def _second_pass_fields(graph, c: _Checker, role_of: dict, roles: dict, spec: dict, sizes, problems: list) -> None:
    """A hires fix's `hires` into `spec`, and what refuses it: a masked first latent on the latent path, a second
    size without a model pack."""
    spec["hires"] = _hires(graph, c, role_of, roles, spec, problems)
    if "mask" in spec and "hires_encode" not in roles:
        # ComfyUI's LATENT keeps its noise_mask through KSampler and LatentUpscale: its second pass is masked
        where = (roles["upscale"], "samples") if "upscale" in roles else (roles["hires_sampler"], "latent_image")
        problems.append(_custom(*where, "the first pass's latent carries its noise mask "
                                "into ComfyUI's second KSampler, which a job's second pass does not: inpaint "
                                "with the pixel path (VAEDecode -> ImageScale[By] -> VAEEncode) or without a "
                                "hires fix"))
    if not problems and (spec.get("width") or sizes):    # an image's job: at the pack's size here
        problems += _hires_size_problems(graph, GraphJob(spec, roles, roles["save"]), *(
            (spec["width"], spec["height"]) if spec.get("width") else sizes[0]))


def _sampler_conditionings(graph, c: _Checker, role_of: dict, roles: dict, problems: list) -> dict:
    """The first KSampler's positive and negative -> prompt.json's `positive` / `negative` entries for the sides that
    are more than one plain CLIPTextEncode; their nodes' roles into `roles`. A ZeroOut / Average chain is one entry
    (_conditioning); Combine and windows are several, each a model pass (comfy_conditioning)."""
    entries = {}
    for side in ("positive", "negative"):
        root = c.links[roles["sampler"]][side]
        if role_of[root] not in ("text", "zero_out", "average"):     # Combine, windows, Concat (refused there)
            roles[side] = root
            continue
        more, entry = _conditioning(graph, c, role_of, root, side, problems)
        roles.update(more)
        if entry is not None:
            entries[side] = [entry]
    mixed, more = conditioning_entries(c, role_of, roles, _custom,    # roles positive/negative: first text
                                       lambda node, side, found: _conditioning(graph, c, role_of, node, side, found))
    problems += more
    return {**entries, **mixed}


def _conditioning(graph, c: _Checker, role_of: dict, node: str, side: str, problems: list) -> tuple[dict, dict | None]:
    """A sampler input back to its CLIPTextEncode through ConditioningZeroOut / ConditioningAverage (conditioning_to)
    -> (roles: `side`, `side`_zero, `side`_average, `side`_from; prompt.json's entry, None when plain). Applied from
    the text out as ComfyUI runs them: a zero-out zeroes the Qwen3 states, an average blends them with a plain
    CLIPTextEncode's (conditioning_from), a zero-out after an average zeroes the blend too."""
    ops = []
    for _ in range(len(graph)):
        if role_of[node] not in ("zero_out", "average"):
            break
        ops.append(node)
        node = c.links[node]["conditioning" if role_of[node] == "zero_out" else "conditioning_to"]
    if role_of[node] != "text":
        problems.append(_custom(ops[-1], "conditioning" if role_of[ops[-1]] == "zero_out" else "conditioning_to",
                                "a ConditioningZeroOut / ConditioningAverage takes a CLIPTextEncode (or another of "
                                "them) here"))
        return {side: node}, None
    roles, entry = {side: node}, {"text": c.fields(node)["prompt"], "zero_out": False}
    for op in reversed(ops):                                      # from the text out
        if role_of[op] == "zero_out":
            roles.setdefault(f"{side}_zero", op)
            entry = {"text": entry["text"], "zero_out": True}       # an earlier average's blend is zeroed too
            continue
        src = c.links[op]["conditioning_from"]
        if "average" in entry:
            problems.append(_custom(op, "conditioning_to", "one ConditioningAverage per sampler input here (an "
                                    "average of an average is not a prompt.json entry)"))
        elif role_of[src] != "text":
            problems.append(_custom(op, "conditioning_from", "conditioning_from must be a CLIPTextEncode here (its "
                                    "text's Qwen3 states are what is averaged in)"))
        else:
            roles.update({f"{side}_average": op, f"{side}_from": src})
            entry["average"] = {"text": c.fields(src)["prompt"], "weight": c.fields(op)["weight"]}
    return roles, (entry if len(entry) > 2 or entry["zero_out"] else None)


def _loras(graph, c: _Checker, role_of: dict, roles: dict, problems: list) -> list:
    """The job's LoRAs from the sampler's model chain and the prompts' CLIP chain (both prompts' the same one); the
    model chain's other nodes and the CLIP loader into `roles`."""
    model_loras = _model_chain(graph, c, role_of, roles, problems)
    texts = [r for r in ("positive", "negative", "positive_from", "negative_from") if r in roles]
    clips = {side: _chain(graph, c, role_of, c.links[roles[side]]["clip"], "clip") for side in texts}
    for side in texts[1:]:
        if clips[side] != clips["positive"]:
            problems.append(_custom(roles[side], "clip", "every CLIPTextEncode must take the same CLIP (one text "
                                                         "encoder, with the same LoRAs, encodes the prompts)"))
    roles["clip"], clip_loras = clips["positive"]
    clip_type = c.values[roles["clip"]].get("type", ANIMA_CLIP_TYPE)
    if clip_type != ANIMA_CLIP_TYPE:
        problems.append(_custom(roles["clip"], "type", f"{clip_type!r} is not Anima's text encoder type: "
                                f"{ANIMA_CLIP_TYPE!r} (ComfyUI's Anima template)", clip_type))
    loras = []                                                    # from the loaders outward: ComfyUI's patch order
    for node in list(reversed(model_loras)) + [n for n in reversed(clip_loras) if n not in model_loras]:
        val = c.fields(node)
        entry = {"name": val["name"], "strength": val["strength"] if node in model_loras else 0.0,
                 "clip_strength": val.get("clip_strength", 0.0) if node in clip_loras else 0.0}
        if entry["strength"] or entry["clip_strength"]:           # ComfyUI: both 0 leaves the models as they are
            roles[f"lora{len(loras)}"] = node
            loras.append(entry)
    return loras


def _job_fields(graph, c: _Checker, roles: dict, sizes, problems: list) -> dict:
    """prompt.json's fields from the first KSampler, its prompts, latent and model patches."""
    v = {r: c.fields(k) for r, k in roles.items()}
    w, h = v["latent"].get("width"), v["latent"].get("height")      # an encoded image: the pack's size
    if sizes is not None and w is not None and (w, h) not in set(sizes):
        have = ", ".join(f"{a}x{b}" for a, b in sizes)
        problems.append(_custom(roles["latent"], "width", f"{w}x{h} has no model pack; the sizes with one: {have}", w))
    ks = v["sampler"]
    spec = {"prompt": v["positive"]["prompt"], "negative_prompt": v["negative"]["prompt"],
            "seed": ks["seed"], "steps": ks["steps"], "cfg": ks["cfg"], "width": w, "height": h,
            "sampler": ks["sampler"], "scheduler": ks["scheduler"],
            # a ComfyUI graph means what it means in ComfyUI: every step computed, unless it patches Spectrum in
            "spectrum": {**v["spectrum"], "enabled": True} if "spectrum" in v else False}
    if "cache" in v:
        kind = next(k for k, name in CACHE_NODES.items() if graph[roles["cache"]]["class_type"] == name)
        spec["cache"] = {"kind": kind, **v["cache"]}
        if "spectrum" in v:
            problems.append(_custom(roles["cache"], "model", f"{CACHE_NODES[kind]} and AnimaSpectrum both decide "
                                    "which model calls to skip: use one of them"))
    spec.update(_latent_fields(ks))
    return spec


def _batch_fields(c: _Checker, roles: dict, batch: list, spec: dict, problems: list) -> None:
    """prompt.json's `batch` and `batch_index` into `spec` where not 1 and 0 (_batch_size)."""
    batch_size, first = _batch_size(c, roles, batch, problems)
    if batch_size > 1:                                            # its images run one after another, as in the batch
        spec["batch"] = batch_size
    if first:                                                     # past the batch's first image: its noise
        spec["batch_index"] = first


def _batch_size(c: _Checker, roles: dict, batch: list, problems: list) -> tuple[int, int]:
    """(images, the first one's place in the batch's noise) of the latent source's batch_size (1 for an encoded
    image) through RepeatLatentBatch / LatentFromBatch (`batch`, nearest the sampler first), as nodes.py's own ops
    count and clamp them on a stand-in latent: prompt.json's `batch` B and `batch_index` I are ComfyUI's batch
    images I..I+B-1, each its own place in the batch's noise."""
    x, idx = np.zeros((c.fields(roles["latent"]).get("batch", 1), 1, 1, 1), np.float32), None
    for node in reversed(batch):
        v = c.values[node]
        if "amount" in v:
            x, _, idx = lo.repeat_batch(x, v["amount"], None, idx)
        else:
            x, _, idx = lo.from_batch(x, v["batch_index"], v["length"], None, idx)
    node, v = batch[0] if batch else roles["latent"], c.values[batch[0]] if batch else {}
    first = idx[0] if idx else 0
    if len(x) > MAX_BATCH:
        problems.append(_custom(node, "amount" if "amount" in v else "length", f"a batch of {len(x)} images; at "
                                f"most {MAX_BATCH} per job", len(x)))
    elif first + len(x) > MAX_FROM_BATCH:
        name = "amount" if "amount" in v else "batch_index"
        problems.append(_custom(node, name, f"picks images {first}..{first + len(x) - 1} of the batch; a job's "
                                f"come from its first {MAX_FROM_BATCH}", v.get(name)))
    return (1, 0) if problems else (len(x), first)


def _second_pass(c: _Checker, role_of: dict, sampler: str, vae: str) -> tuple[dict, str | None, list] | None:
    """A second pass ending at KSampler `sampler`: its latent the first KSampler's own, LatentUpscale[By] of it, or
    VAEEncode of ImageScale[By] of the first KSampler's VAEDecode (the pixel path) -> (the second pass's roles, the
    first KSampler, problems); None for a graph of one pass. Every VAE the same one (one VAE stage)."""
    latent = c.links[sampler]["latent_image"]
    roles = {"hires_sampler": sampler}
    if role_of[latent] == "latent_mix" and not {role_of[n] for n in c.links[latent].values()} & {"sampler", "upscale"}:
        return None                                     # a mix of uploads before the first KSampler (_mix_start)
    if role_of[latent] in ("sampler", "latent_mix"):  # chained on the first's LATENT as it is (split sampling), or mixed
        mix, first, problems = _mix_inputs(c, role_of, latent)
        return {**roles, **({"latent_mix": mix} if mix else {})}, first, problems
    if role_of[latent] == "upscale":
        roles["upscale"] = latent
        mix, first, problems = _mix_inputs(c, role_of, c.links[latent]["samples"])
        roles.update({"latent_mix": mix} if mix else {})
        if problems or role_of[first] != "sampler":
            return roles, None, problems or [_custom(latent, "samples", "a hires fix upscales the first KSampler's "
                                                                        "latent")]
        return roles, first, []
    if role_of[latent] != "encode" or role_of[c.links[latent]["pixels"]] != "upscale":
        return None
    roles.update(hires_encode=latent, upscale=c.links[latent]["pixels"])
    decode = roles["hires_decode"] = c.links[roles["upscale"]]["image"]
    if role_of[decode] != "decode" or role_of[c.links[decode]["samples"]] != "sampler":
        return roles, None, [_custom(roles["upscale"], "image", "ImageScale[By] before VAEEncode is a pixel hires "
                                     "fix here: it scales the first KSampler's VAEDecode (an upload is encoded at "
                                     "its own size)")]
    wrong = [n for n in (decode, latent) if c.links[n]["vae"] != vae]
    if wrong:
        return roles, None, [_custom(n, "vae", "every VAEDecode and VAEEncode must take the same VAE (one VAE "
                                     "stage)") for n in wrong]
    return roles, c.links[decode]["samples"], []


def _hires(graph, c: _Checker, role_of: dict, roles: dict, spec: dict, problems: list) -> dict:
    """prompt.json's `hires` from the upscale node and the second KSampler: its steps and denoise, and its seed,
    cfg, sampler, scheduler and prompts where they differ from the first's. Both passes take one model chain."""
    ks, h = c.fields(roles["hires_sampler"]), {}
    if "upscale" in roles:                              # else chained: the first latent as it is
        up = c.fields(roles["upscale"])
        h = {"method": up["method"], **({"space": "pixel"} if "hires_encode" in roles else {})}
        problems += _upscale_size(roles["upscale"], up, h, (spec["width"], spec["height"]) if spec.get("width")
                                  else None)
    problems += _second_sampler(graph, c, roles, ks, h)
    if c.links[roles["hires_sampler"]]["model"] != c.links[roles["sampler"]]["model"]:
        problems.append(_custom(roles["hires_sampler"], "model", "both KSamplers must take the same MODEL (one model "
                                "chain per job: its LoRAs, patches and shift are both passes')"))
    for key in ("seed", "cfg", "sampler", "scheduler"):
        if ks[key] != spec[key]:
            h[key] = ks[key]
    clip = _chain(graph, c, role_of, c.links[roles["positive"]]["clip"], "clip")
    for side, key in (("positive", "prompt"), ("negative", "negative_prompt")):
        node = c.links[roles["hires_sampler"]][side]
        if node == c.links[roles["sampler"]][side]:
            continue
        if role_of[node] != "text":
            problems.append(_custom(roles["hires_sampler"], side, "a second pass's own prompt is a plain "
                                    "CLIPTextEncode here (or the first pass's conditioning, the same node)"))
            continue
        roles[f"hires_{side}"] = node
        if _chain(graph, c, role_of, c.links[node]["clip"], "clip") != clip:
            problems.append(_custom(node, "clip", "the second pass's CLIPTextEncode must take the first's CLIP (one "
                                    "text encoder, with the same LoRAs)"))
        text = c.fields(node)["prompt"]
        if text != spec[key]:
            h[key] = text
    return h


def _upscale_size(node: str, up: dict, h: dict, first: tuple[int, int] | None) -> list:
    """The second size from the upscale node's fields (`up`): scale_by (prompt.json's hires.scale, 1..4), or width
    and height, a 0 side keeping the first pass's aspect as the node does (`first`: its (width, height), None when
    an init image sets it later)."""
    if "scale" in up:
        if not 1.0 <= up["scale"] <= 4.0:
            return [_custom(node, "scale_by", f"a hires fix upscales by 1..4 (prompt.json's hires.scale), got "
                            f"{up['scale']}", up["scale"])]
        h["scale"] = up["scale"]
        return []
    width, height = up["width"], up["height"]
    if not (width and height):
        if first is None:
            return [_custom(node, "width" if not width else "height", "0 (keep the aspect) needs the first pass's "
                            "size, which an init image's graph gets only at submit: give both width and height", 0)]
        try:
            width, height = _kept_aspect(width, height, *first, h.get("space") == "pixel")
        except lo.LatentOpError as e:                   # a side past what any latent may be
            return [_custom(node, "width" if width else "height", str(e), width or height)]
    if h.get("space") == "pixel" and (width % 8 or height % 8):
        return [_custom(node, "width" if width % 8 else "height", f"{width}x{height}: VAEEncode would crop the "
                        "scaled image to a multiple of 8 pixels: give a width and height that are multiples of 8")]
    h.update(width=width, height=height)                # crop: checked once the first size is known
    return []


def _kept_aspect(width: int, height: int, w0: int, h0: int, pixel: bool) -> tuple[int, int]:
    """An upscale node's size with a 0 side from a w0 x h0 first pass: ImageScale's rule on pixels (round, at least
    1), LatentUpscale's on latent cells (models/sampling/latent_ops.upscale_size), in pixels."""
    if not (width or height):
        return w0, h0                                   # both 0: the input as it is
    if pixel:
        if not width:
            return max(1, round(w0 * height / h0)), height
        return width, max(1, round(h0 * width / w0))
    cells = lo.upscale_size((h0 // lo.LATENT_SCALE, w0 // lo.LATENT_SCALE), width, height)
    return cells[1] * lo.LATENT_SCALE, cells[0] * lo.LATENT_SCALE


def _second_sampler(graph, c: _Checker, roles: dict, ks: dict, h: dict) -> list:
    """The second KSampler's steps and denoise from its fields (`ks`). KSamplerAdvanced adding its noise and
    sampling to the end: the denoise whose schedule it samples (steps - start_at_step of the full schedule of steps:
    ComfyUI's denoise (steps - s) / steps takes the schedule of int(steps' / d) = steps steps, its last steps' + 1,
    the same sigmas). Without its noise (a first pass's leftover noise to finish) or ending early: its window as it
    is (hires.start_step ... leftover_noise over denoise 1)."""
    node = roles["hires_sampler"]
    if "denoise" in ks:
        h.update(steps=ks["steps"], denoise=ks["denoise"])
        return []
    if ks["add_noise"] != "enable" or ks["end_step"] < ks["steps"]:
        h.update(steps=ks["steps"], denoise=1.0, **_latent_fields(ks))
        return []
    left = ks["steps"] - ks["start_step"]
    if left <= 0:
        return [_custom(node, "start_at_step", f"leaves no step of the {ks['steps']}-step schedule to sample",
                        ks["start_step"])]
    d = left / ks["steps"]
    if int(left / d) != ks["steps"]:            # float rounding: the denoise would take another schedule
        return [_custom(node, "start_at_step", f"{ks['start_step']} of {ks['steps']} steps has no denoise "
                        "that takes the same sigmas; use KSampler's denoise", ks["start_step"])]
    h.update(steps=left, denoise=d)
    return []


def _image_latent(c: _Checker, role_of: dict, vae: str, latent: str) -> tuple[dict, dict, list] | None:
    """The sampler's latent from an image: VAEEncode of LoadImage's IMAGE, optionally through SetLatentNoiseMask with
    LoadImage's MASK or a LoadImageMask, or VAEEncodeForInpaint with such a mask (`grow_mask_by`) -> (roles,
    prompt.json fields, problems); None for a latent of another kind.
    The mask keeps ComfyUI's rule (`mask_channel`: LoadImage's MASK is 1 - alpha), which the job reads, not A1111's."""
    if role_of[latent] not in ("encode", "noise_mask", "inpaint_encode"):
        return None
    roles, fields = {}, {}
    if role_of[latent] == "inpaint_encode":
        fields.update(c.fields(latent))                            # grow_mask_by
    if role_of[latent] == "noise_mask":
        roles["noise_mask"] = latent
    if role_of[latent] != "encode":                               # SetLatentNoiseMask's or VAEEncodeForInpaint's mask
        roles["mask"] = c.links[latent]["mask"]
        mask = c.fields(roles["mask"])                              # LoadImageMask's, or LoadImage's MASK:
        fields["mask"] = mask.get("mask", mask.get("init_image"))     # its upload's alpha (LoadImageMask's alpha)
        fields["mask_channel"] = mask.get("mask_channel", "alpha")
    if role_of[latent] == "noise_mask":
        latent = c.links[latent]["samples"]
        if role_of[latent] != "encode":
            return roles, fields, [_custom(roles["noise_mask"], "samples", "the masked latent must be VAEEncode's "
                                           "(RepeatLatentBatch / LatentFromBatch go after SetLatentNoiseMask)")]
    roles["encode"] = latent
    pixels = c.links[latent]["pixels"]
    if role_of[pixels] != "image":
        return roles, fields, [_custom(latent, "pixels", "the pixels must be a LoadImage's (an upload), or for a "
                                       "pixel hires fix ImageScale[By] of the first KSampler's VAEDecode")]
    roles["image"] = pixels
    fields["init_image"] = c.fields(pixels)["init_image"]
    if c.links[latent]["vae"] != vae:
        return roles, fields, [_custom(latent, "vae", "VAEEncode and VAEDecode must take the same VAE (one VAE stage)")]
    problems = [_custom(roles[role], "image", f"Invalid image file: {fields[key]}", fields[key])
                for role, key in (("image", "init_image"), ("mask", "mask")) if key in fields
                and not _upload_name(fields[key])]
    return roles, fields, problems


def _upload_name(ref: str) -> bool:
    """A name LoadImage could give ("sub/NAME.png [input]"): one that stays inside an upload folder."""
    from orchestrator.engine.inputs import InputNameError, annotated, check_name, check_subfolder
    sub, name, _ = annotated(ref, "input")
    try:
        check_name(name)
        check_subfolder(sub)
    except InputNameError:
        return False
    return True


def _latent_fields(ks: dict) -> dict:
    """prompt.json's fields for sampling from the latent (docs/latent-sampling.md), from a KSampler's fields, only
    those off their defaults: KSampler's denoise; KSamplerAdvanced's add_noise, start/end step and leftover noise
    as nodes.py maps them (an end past the steps is the end)."""
    out = {}
    if "denoise" in ks and ks["denoise"] != 1.0:
        out["denoise"] = ks["denoise"]
    if "add_noise" in ks:
        if ks["add_noise"] == "disable":
            out["add_noise"] = False
        if ks["start_step"]:
            out["start_step"] = ks["start_step"]
        if ks["end_step"] < ks["steps"]:
            out["end_step"] = ks["end_step"]
            out["leftover_noise"] = ks["leftover_noise"] == "enable"
    return out


def _chain(graph, c: _Checker, role_of: dict, node: str, link: str, through=("lora",)) -> tuple[str, list]:
    """Back from `node` along input `link` through nodes of the `through` roles -> (the node it starts at, the nodes
    passed, nearest first). No loops here (graph_to_job refused them); bounded all the same."""
    passed = []
    for _ in range(len(graph)):
        if role_of[node] not in through:
            break
        passed.append(node)
        node = c.links[node][link]
    return node, passed


def _model_chain(graph, c: _Checker, role_of: dict, roles: dict, problems: list) -> list:
    """The sampler's model back to UNETLoader: its shift and Spectrum nodes into `roles`, -> its LoRA loaders."""
    sampler = roles["sampler"]
    unet, passed = _chain(graph, c, role_of, c.links[sampler]["model"], "model",
                          ("shift", "lora", "spectrum", "cache"))
    for node in passed:
        if role_of[node] == "cache" and "cache" in roles:
            problems.append(_custom(node, "model", "one step cache per job (EasyCache or LazyCache)"))
        elif role_of[node] != "lora":
            roles[role_of[node]] = node
    if role_of[unet] != "unet":
        problems.append(_custom(roles.get("shift", sampler), "model", "the model must come from UNETLoader, through "
                                "LoRA loaders, ModelSamplingAuraFlow, AnimaSpectrum, EasyCache and LazyCache only"))
    roles["unet"] = unet
    return [n for n in passed if role_of[n] == "lora"]


def _failed(graph: dict, problems: list, out: str) -> GraphError:
    node_errors: dict = {}
    for node_id, e in problems:
        entry = node_errors.setdefault(node_id, {"errors": [], "dependent_outputs": [out],
                                                 "class_type": graph[node_id]["class_type"]})
        entry["errors"].append(e)
    details = "\n".join(f"{e['message']}: {e['details']}" for _, e in problems)
    return GraphError(_err("prompt_outputs_failed_validation", "Prompt outputs failed validation", details),
                      node_errors)


# ---------------------------------------------------------------- job -> graph

# The graph a job is shown as when it did not come from ComfyUI (node ids as in ComfyUI's default workflow style)
CANONICAL_IDS = {"unet": "1", "clip": "2", "vae": "3", "positive": "4", "negative": "5", "latent": "6",
                 "sampler": "7", "decode": "8", "save": "9", "spectrum": "30"}
LORA_IDS = 10                   # the job's i-th LoRA loader is node "10" + i
CACHE_ID = "31"                 # the job's EasyCache / LazyCache node
IMAGE_IDS = {"image": "40", "encode": "41", "mask": "42", "noise_mask": "43"}     # a job from an init image
BATCH_ID = "44"                 # a batch from an init image: RepeatLatentBatch after its latent
CROP_ID = "46"                  # ImageCrop of the decoded image
MIX_ID = "47"                   # latent_mix: LatentComposite / LatentBlend (before VAEDecode or the second pass)
START_IDS = {"init_mix": "47", "mix_image": "48", "mix_encode": "49"}    # init_mix: the mix the KSampler starts from
FROM_BATCH_ID = "45"            # a job past its batch's first image: LatentFromBatch after RepeatLatentBatch
HIRES_IDS = {"upscale": "50", "hires_sampler": "51", "hires_positive": "52", "hires_negative": "53",
             "hires_decode": "54", "hires_encode": "55"}                     # a hires fix's second pass
COND_IDS = {"positive_zero": "60", "positive_from": "61", "positive_average": "62", "negative_zero": "63",
            "negative_from": "64", "negative_average": "65"}           # a sampler input's conditioning operations
BASE_IDS = {"base_decode": "56", "base_save": "57"}     # hires.keep_base: the first pass's VAEDecode and SaveImage
ADVANCED_END = 10000            # KSamplerAdvanced's end_at_step for "to the end" (nodes.py's default)
TITLES = {"positive": "CLIP Text Encode (Positive Prompt)", "negative": "CLIP Text Encode (Negative Prompt)",
          "hires_positive": "CLIP Text Encode (Hires Positive Prompt)",
          "hires_negative": "CLIP Text Encode (Hires Negative Prompt)", "hires_sampler": "KSampler (Hires)",
          "positive_from": "CLIP Text Encode (Positive Average With)",
          "negative_from": "CLIP Text Encode (Negative Average With)"}


def job_to_graph(spec: dict, *, names: ModelNames = ModelNames(), ids: dict[str, str] | None = None) -> dict:
    """The API graph of a job (a resolved PromptSpec dict: width/height set): what a ComfyUI client would have sent
    for it. Loader file names are the first known ones ('' when unknown)."""
    ids = {**CANONICAL_IDS, "crop": CROP_ID, **(ids or {})}
    table = node_table(names)

    def node(role: str, class_type: str, fields: dict | None = None, **inputs) -> tuple[str, dict]:
        """Node `role` of `class_type`: the job's `fields` it carries (the node table's `job`) and its other
        `inputs` (links, values the job does not hold)."""
        spec = table[class_type]
        return ids[role], {"inputs": spec.graph_inputs(fields or {}, **inputs), "class_type": class_type,
                           "_meta": {"title": TITLES.get(role, spec.display_name)}}

    first = lambda xs: xs[0] if xs else ""  # noqa: E731
    # the job's LoRAs as loaders chained after UNETLoader and CLIPLoader (ModelOnly when the text encoder's is 0)
    model, clip, loaders = [ids["unet"], 0], [ids["clip"], 0], []
    for i, lora in enumerate(spec.get("loras") or ()):
        role = f"lora{i}"
        ids.setdefault(role, str(LORA_IDS + i))
        sc = lora.get("clip_strength")
        if sc is None:                                      # omitted or null: the model's strength (ComfyUI's)
            sc = lora.get("strength", 1.0)
        fields = {"name": lora["name"], "strength": lora.get("strength", 1.0), "clip_strength": sc}
        if sc:
            loaders.append(node(role, "LoraLoader", fields, model=model, clip=clip))
            model, clip = [ids[role], 0], [ids[role], 1]
        else:
            loaders.append(node(role, "LoraLoaderModelOnly", fields, model=model))
            model = [ids[role], 0]
    sp = spec.get("spectrum")
    if isinstance(sp, dict) and sp.get("enabled"):          # the job forecast steps: the graph says so by its node
        loaders.append(node("spectrum", "AnimaSpectrum", sp, model=model))
        model = [ids["spectrum"], 0]
    cache = spec.get("cache")
    if isinstance(cache, dict):                             # the job's step cache as ComfyUI's node
        d = CacheSettings(**cache)
        ids.setdefault("cache", CACHE_ID)
        loaders.append(node("cache", d.node, {f: getattr(d, f) for f in table[d.node].job}, model=model))
        model = [ids["cache"], 0]
    mixed = {side for side in SIDES if mixes(spec.get(side))}     # Combine / windows: entry_nodes, else below
    return dict((
        node("unet", "UNETLoader", unet_name=first(names.unet), weight_dtype="default"),
        node("clip", "CLIPLoader", clip_name=first(names.clip), type=ANIMA_CLIP_TYPE),
        node("vae", "VAELoader", vae_name=first(names.vae)),
        *loaders,
        *_conditioning_nodes(node, spec, ids, clip, skip=mixed),
        *entry_nodes(node, {side: spec[side] for side in mixed}, ids, clip),
        *_latent_nodes(node, spec, ids),
        _sampler_node(node, spec, {**ids, **{side: ids.get(f"{side}_out", ids[side]) for side in SIDES}}, model),
        *_mix_nodes(node, spec, ids),
        *_hires_nodes(node, spec, ids, model, clip),
        node("decode", "VAEDecode", samples=[ids["hires_sampler" if spec.get("hires") else "latent_mix"
                                                  if spec.get("latent_mix") else "sampler"], 0], vae=[ids["vae"], 0]),
        *([node("crop", "ImageCrop", spec["crop"], image=[ids["decode"], 0])] if spec.get("crop") else []),
        node("save", "SaveImage", images=[ids["crop" if spec.get("crop") else "decode"], 0], filename_prefix="anima"),
        *_base_nodes(node, spec, ids),
    ))


def _conditioning_nodes(node, spec: dict, ids: dict, clip: list, skip=()) -> list[tuple[str, dict]]:
    """Each sampler input: its CLIPTextEncode, then for a prompt.json entry ConditioningZeroOut (zero_out) and
    ConditioningAverage with a CLIPTextEncode of its own (average), in the order the encoder applies them; the
    sampler's links in ids["cond_positive"] / ids["cond_negative"]."""
    out = []
    for side, key in (("positive", "prompt"), ("negative", "negative_prompt")):
        if side in skip:
            continue
        e = (spec.get(side) or [{"text": spec.get(key, "")}])[0]
        out.append(node(side, "CLIPTextEncode", {"prompt": e["text"]}, clip=clip))
        head = [ids[side], 0]
        if e.get("zero_out"):
            ids.setdefault(f"{side}_zero", COND_IDS[f"{side}_zero"])
            out.append(node(f"{side}_zero", "ConditioningZeroOut", conditioning=head))
            head = [ids[f"{side}_zero"], 0]
        if e.get("average"):
            for role in (f"{side}_from", f"{side}_average"):
                ids.setdefault(role, COND_IDS[role])
            out.append(node(f"{side}_from", "CLIPTextEncode", {"prompt": e["average"]["text"]}, clip=clip))
            out.append(node(f"{side}_average", "ConditioningAverage", e["average"], conditioning_to=head,
                            conditioning_from=[ids[f"{side}_from"], 0]))
            head = [ids[f"{side}_average"], 0]
        ids[f"cond_{side}"] = head[0]
    return out


def _mix_nodes(node, spec: dict, ids: dict) -> list[tuple[str, dict]]:
    """latent_mix: LatentComposite / LatentBlend of the KSampler's LATENT and the latent it takes (`onto` first)."""
    m = spec.get("latent_mix")
    if not m:
        return []
    ids.setdefault("latent_mix", MIX_ID)
    class_type = "LatentComposite" if m["kind"] == "composite" else "LatentBlend"
    pair = [[ids["sampler"], 0], [ids["latent"], 0]]
    if m.get("onto") == "image":
        pair.reverse()
    return [node("latent_mix", class_type, m, **dict(zip(MIX_INPUTS[class_type], pair)))]


def _keeps_base(spec: dict) -> bool:
    h = spec.get("hires")
    return isinstance(h, dict) and bool(h.get("keep_base"))


def job_nodes(spec: dict) -> dict[str, str]:
    """The roles of the graph job_to_graph makes for a job (the canonical ids): its base image's SaveImage too when it
    keeps one."""
    return {**CANONICAL_IDS, **({"base_save": BASE_IDS["base_save"]} if _keeps_base(spec) else {})}


def _base_nodes(node, spec: dict, ids: dict) -> list[tuple[str, dict]]:
    """hires.keep_base: SaveImage of the first pass's image: the pixel path's VAEDecode, or a VAEDecode of the first
    KSampler's latent of its own."""
    if not _keeps_base(spec):
        return []
    for role, default in BASE_IDS.items():
        ids.setdefault(role, default)
    out, image = [], ids["hires_decode"]
    if spec["hires"].get("space") != "pixel":
        out.append(node("base_decode", "VAEDecode", samples=[ids["sampler"], 0], vae=[ids["vae"], 0]))
        image = ids["base_decode"]
    return out + [node("base_save", "SaveImage", images=[image, 0], filename_prefix="anima_base")]


def _latent_nodes(node, spec: dict, ids: dict) -> list[tuple[str, dict]]:
    """The sampler's latent: EmptyLatentImage, or for a job from an init image LoadImage -> VAEEncode [->
    SetLatentNoiseMask with LoadImage's MASK (mask_channel alpha, the same upload) or a LoadImageMask], or with
    grow_mask_by VAEEncodeForInpaint taking that mask. A mask of
    A1111's rule shows as LoadImageMask red: the same mask for a grey mask without alpha (docs/workflows.md)."""
    if not spec.get("init_image"):
        out = [node("latent", "EmptyLatentImage", {**spec, "batch": 1 if spec.get("batch_index") else
                                                     spec.get("batch", 1)})]
        return out + _from_batch_nodes(node, spec, ids, [ids["latent"], 0])
    for role, default in IMAGE_IDS.items():
        ids.setdefault(role, default)
    out = [node("image", "LoadImage", spec)]
    mask, channel = None, spec.get("mask_channel")
    if spec.get("mask"):
        if channel == "alpha" and spec["mask"] == spec["init_image"] and ids["mask"] in (IMAGE_IDS["mask"], ids["image"]):
            mask = [ids["image"], 1]
        else:
            out.append(node("mask", "LoadImageMask", {**spec, "mask_channel": channel or "red"}))
            mask = [ids["mask"], 0]
    pixels = dict(pixels=[ids["image"], 0], vae=[ids["vae"], 0])
    samples = [ids["encode"], 0]
    if spec.get("grow_mask_by") is not None:
        out.append(node("encode", "VAEEncodeForInpaint", spec, **pixels, mask=mask))
    else:
        out.append(node("encode", "VAEEncode", **pixels))
    if mask is not None and spec.get("grow_mask_by") is None:
        out.append(node("noise_mask", "SetLatentNoiseMask", samples=samples, mask=mask))
        samples = [ids["noise_mask"], 0]
    if spec.get("init_mix"):
        out += _start_mix_nodes(node, spec["init_mix"], ids, samples)
        samples = [ids["init_mix"], 0]
    if spec.get("batch", 1) > 1 and not spec.get("batch_index"):   # the encoded image repeated: its batch
        ids.setdefault("batch0", BATCH_ID)
        out.append(node("batch0", "RepeatLatentBatch", spec, samples=samples))
        samples = [ids["batch0"], 0]
    ids["latent"] = samples[0]
    return out + _from_batch_nodes(node, spec, ids, samples)


def _start_mix_nodes(node, m: dict, ids: dict, init: list) -> list[tuple[str, dict]]:
    """init_mix: LoadImage -> VAEEncode of its other upload, and the LatentComposite / LatentBlend of the init image's
    latent (`init`) and that one (`onto` first) the KSampler starts from."""
    for role, default in START_IDS.items():
        ids.setdefault(role, default)
    class_type = "LatentComposite" if m["kind"] == "composite" else "LatentBlend"
    pair = [init, [ids["mix_encode"], 0]]
    if m.get("onto") == "image":
        pair.reverse()
    return [node("mix_image", "LoadImage", {"init_image": m["image"]}),
            node("mix_encode", "VAEEncode", pixels=[ids["mix_image"], 0], vae=[ids["vae"], 0]),
            node("init_mix", class_type, m, **dict(zip(MIX_INPUTS[class_type], pair)))]


def _from_batch_nodes(node, spec: dict, ids: dict, samples: list) -> list[tuple[str, dict]]:
    """A job past its batch's first image (batch_index I, batch B): its one latent repeated to I + B images by
    RepeatLatentBatch, then LatentFromBatch's images I..I+B-1 (their noise the batch's); none for I = 0."""
    first = spec.get("batch_index") or 0
    if not first:
        return []
    ids.setdefault("batch1", BATCH_ID)              # the roles as graph_to_job names them: nearest the sampler first
    ids.setdefault("batch0", FROM_BATCH_ID)
    batch = spec.get("batch", 1)
    out = [node("batch1", "RepeatLatentBatch", {"batch": first + batch}, samples=samples),
           node("batch0", "LatentFromBatch", {"batch": batch, "batch_index": first}, samples=[ids["batch1"], 0])]
    ids["latent"] = ids["batch0"]
    return out


def _hires_nodes(node, spec: dict, ids: dict, model: list, clip: list) -> list[tuple[str, dict]]:
    """A second pass after the first KSampler: on its latent as it is (hires without a size), LatentUpscaleBy /
    LatentUpscale of it, or (space pixel) VAEDecode -> ImageScaleBy / ImageScale -> VAEEncode; then KSampler (Hires)
    with the hires settings (the job's where they are not set; KSamplerAdvanced for a step window) and, for its own
    prompts, CLIPTextEncode nodes of its own."""
    h = spec.get("hires")
    if not h:
        return []
    for role, default in HIRES_IDS.items():
        ids.setdefault(role, default)
    by = h.get("scale") is not None
    size = {**h, "method": h.get("method") or "nearest-exact"}
    crop = {} if by else {"crop": "disabled"}
    first = ids["latent_mix" if spec.get("latent_mix") else "sampler"]   # the first latent, mixed with latent_mix
    if not by and h.get("width") is None:               # chained on the first KSampler's LATENT as it is
        out, latent = [], first
    elif h.get("space") == "pixel":
        out = [node("hires_decode", "VAEDecode", samples=[ids["sampler"], 0], vae=[ids["vae"], 0]),
               node("upscale", "ImageScaleBy" if by else "ImageScale", size, image=[ids["hires_decode"], 0], **crop),
               node("hires_encode", "VAEEncode", pixels=[ids["upscale"], 0], vae=[ids["vae"], 0])]
        latent = ids["hires_encode"]
    else:
        out = [node("upscale", "LatentUpscaleBy" if by else "LatentUpscale", size, samples=[first, 0], **crop)]
        latent = ids["upscale"]
    # a side of several conditionings: the first KSampler's last node of them (comfy_conditioning.entry_nodes)
    links = {**ids, **{side: ids[f"{side}_out"] for side in ("positive", "negative") if f"{side}_out" in ids},
             "latent": latent}
    for side, key in (("positive", "prompt"), ("negative", "negative_prompt")):
        if h.get(key) is not None:
            out.append(node(f"hires_{side}", "CLIPTextEncode", {"prompt": h[key]}, clip=clip))
            links[f"cond_{side}"] = ids[f"hires_{side}"]
    own = {k: h[k] for k in ("seed", "cfg", "sampler", "scheduler") if h.get(k) is not None}
    second = {**spec, **own, "steps": h.get("steps") or spec["steps"], "denoise": h.get("denoise", 0.5),
              "denoise_steps": "comfyui", "start_step": h.get("start_step"), "end_step": h.get("end_step"),
              "add_noise": h.get("add_noise", True), "leftover_noise": h.get("leftover_noise", False)}
    out.append(_sampler_node(node, second, links, model, role="hires_sampler"))
    return out


def _sampler_node(node, spec: dict, ids: dict, model: list, role: str = "sampler") -> tuple[str, dict]:
    """KSampler for a job run from its first step, KSamplerAdvanced for one with a step window or without noise, or
    counting its denoise as A1111's img2img (that window on the full schedule); node `role`, its links the `ids` of
    positive, negative and latent."""
    if spec.get("denoise_steps", "comfyui") == "a1111":
        from models.sampling.latent_ops import a1111_start_step
        off = a1111_start_step(spec["steps"], spec.get("denoise", 1.0))
        end = spec.get("end_step")
        spec = {**spec, "denoise": 1.0, "denoise_steps": "comfyui", "start_step": off + (spec.get("start_step") or 0),
                "end_step": None if end is None else off + end}
    end, toggle = spec.get("end_step"), lambda on: "enable" if on else "disable"   # noqa: E731
    fields = {**spec, "sampler": spec.get("sampler", DEFAULT_SAMPLER), "scheduler": spec.get("scheduler",
              DEFAULT_SCHEDULER), "denoise": spec.get("denoise", 1.0), "add_noise": toggle(spec.get("add_noise", True)),
              "start_step": spec.get("start_step") or 0, "end_step": ADVANCED_END if end is None else end,
              "leftover_noise": toggle(spec.get("leftover_noise"))}
    plain = spec.get("start_step") is None and end is None and spec.get("add_noise", True)
    return node(role, "KSampler" if plain else "KSamplerAdvanced", fields, model=model,
                positive=[ids.get("cond_positive", ids["positive"]), 0],
                negative=[ids.get("cond_negative", ids["negative"]), 0], latent_image=[ids["latent"], 0])


def graph_links(graph: dict, table: dict[str, NodeSpec] | None = None) -> list[tuple[str, int, str, str, str]]:
    """Every link of an API graph: (source id, source slot, target id, target input, type), in node then input
    order (what a UI workflow's `links` list needs)."""
    table = table or node_table()
    out = []
    for node_id, n in graph.items():
        spec = table.get(n.get("class_type"))
        for i in (spec.inputs if spec else ()):
            val = n.get("inputs", {}).get(i.name)
            if i.is_link and isinstance(val, list) and len(val) == 2:
                out.append((str(val[0]), int(val[1]), node_id, i.name, i.type))
    return out
