"""ComfyUI's conditioning nodes between CLIPTextEncode and a KSampler: their node table entries, graph -> job
(prompt.json's `positive` / `negative` entries) and job -> graph.

ComfyUI's semantics (nodes.py, node_helpers.conditioning_set_values): a CONDITIONING is a list of entries;
ConditioningCombine concatenates two lists (conditioning_1's entries first); ConditioningSetTimestepRange sets
start_percent / end_percent and ConditioningSetAreaStrength sets strength on every entry of its input, overwriting
what an earlier node set (so the node nearest the sampler wins); a ConditioningZeroOut / ConditioningAverage chain
under them is its entry's `zero_out` / `average` (comfy_graph._conditioning reads it). ConditioningConcat joins two contexts along the
token axis, which the model packs (built for 512 text rows) cannot take: refused on its node.
"""
from __future__ import annotations

import re

from orchestrator.http.comfy_nodes import CONCAT_REFUSAL

SIDES = ("positive", "negative")
# the node roles whose conditionings each take a model pass (ConditioningCombine / SetTimestepRange / SetAreaStrength)
MIXING_ROLES = ("combine", "cond_range", "cond_strength")
LEAF_ROLES = ("text", "zero_out", "average")      # an entry: a CLIPTextEncode, maybe through ZeroOut / Average
MAX_VISITS = 256                # nodes walked per side: more entries than prompt.json takes, far fewer than 2^depth


class _Walk:
    """One side's tree from the sampler's input down to its CLIPTextEncode leaves."""

    def __init__(self, c, role_of: dict, side: str, custom, chain):
        self.c, self.role_of, self.side, self.custom, self.chain = c, role_of, side, custom, chain
        self.entries: list[dict] = []
        self.roles: dict[str, str] = {}
        self.problems: list = []

    def run(self, root: str) -> None:
        # (node, window node, strength node) from the sampler down; the nearest-to-sampler setter wins
        stack, combines, visits = [(root, None, None)], 0, 0
        while stack and visits < MAX_VISITS:             # a shared node is walked once per path (ComfyUI's lists)
            visits += 1
            node, window, strength = stack.pop()
            role = self.role_of[node]
            if role in LEAF_ROLES:
                self._leaf(node, window, strength)
            elif role == "combine":
                self.roles[f"{self.side}_combine{combines}"] = node
                combines += 1
                links = self.c.links[node]       # conditioning_1 popped first: its entries come first
                stack += [(links["conditioning_2"], window, strength), (links["conditioning_1"], window, strength)]
            elif role == "cond_range":
                stack.append((self.c.links[node]["conditioning"], window or node, strength))
            elif role == "cond_strength":
                stack.append((self.c.links[node]["conditioning"], window, strength or node))
            else:
                self._refuse(node, role)

    def _leaf(self, node: str, window: str | None, strength: str | None) -> None:
        i = len(self.entries)
        roles, op = self.chain(node, self.side, self.problems)        # the text, through ZeroOut / Average
        self.roles.update({f"{self.side}_text{i}" if r == self.side else f"{r}{i}": n for r, n in roles.items()})
        entry = {"text": self.c.fields(roles[self.side])["prompt"]}
        if op is not None:
            entry.update({k: v for k, v in op.items() if k != "text"})
        if window is not None:
            self.roles[f"{self.side}_window{i}"] = window
            entry.update(self.c.fields(window))
        if strength is not None:
            self.roles[f"{self.side}_strength{i}"] = strength
            entry.update(self.c.fields(strength))
        self.entries.append(entry)

    def _refuse(self, node: str, role: str) -> None:
        name = next(iter(self.c.links[node]), "conditioning")
        if role == "concat":
            self.problems.append(self.custom(node, "conditioning_from", CONCAT_REFUSAL))
        else:
            self.problems.append(self.custom(node, name, f"a KSampler's {self.side} must come from CLIPTextEncode, "
                                         "through ConditioningZeroOut, ConditioningAverage, ConditioningCombine, "
                                         "ConditioningSetTimestepRange and ConditioningSetAreaStrength only"))


def conditioning_entries(c, role_of: dict, roles: dict, custom, chain) -> tuple[dict, list]:
    """A graph's KSampler conditionings -> (prompt.json's `positive`/`negative` for a side that is more than one
    plain CLIPTextEncode, problems); roles["positive"/"negative"] become each side's first CLIPTextEncode (its text
    is `prompt` / `negative_prompt`) and every node of a tree gets a role of its own (positive_text1 ...).
    `custom(node, input, details)`: a problem in ComfyUI's node_errors shape (comfy_graph's); `chain(node, side,
    problems)`: a leaf's ZeroOut / Average chain -> (roles `side`, `side`_zero ..., its entry or None)."""
    fields, problems = {}, []
    if "hires_sampler" in roles:             # a second KSampler: the first's combined conditioning, or plain prompts
        hires, first = c.links[roles["hires_sampler"]], c.links[roles["sampler"]]
        problems += [custom(roles["hires_sampler"], side, "a second KSampler's ConditioningCombine / "
                            "SetTimestepRange / SetAreaStrength must be the first KSampler's (the same node: one set "
                            "of conditionings per job, prompt.json's positive / negative)")
                     for side in SIDES if role_of[hires[side]] in MIXING_ROLES and hires[side] != first[side]]
    for side in SIDES:
        root = roles[side]
        if role_of[root] == "text":
            continue
        walk = _Walk(c, role_of, side, custom, chain)
        walk.run(root)
        problems += walk.problems
        if walk.problems or not walk.entries:
            continue
        roles.update(walk.roles)
        roles[side] = walk.roles[f"{side}_text0"]
        fields[side] = walk.entries
        clip = c.links[roles[side]]["clip"]
        problems += [custom(n, "clip", "every CLIPTextEncode of a KSampler must take the same CLIP (one text "
                                        "encoder, with the same LoRAs)")
                     for r, n in walk.roles.items() if "_text" in r and c.links[n]["clip"] != clip]
    return fields, problems


# a refused entry field -> (the role of its node in the entry, the input carrying it)
ENTRY_PLACES = {"text": ("text", "text"), "start": ("window", "start"), "end": ("window", "end"),
                "strength": ("strength", "strength"), "zero_out": ("zero", "conditioning"),
                "average": ("average", "conditioning_to"), "average.weight": ("average", "conditioning_to_strength"),
                "average.text": ("from", "text")}


def entry_field_node(job_nodes: dict, field: str) -> tuple[str, str] | None:
    """The (node, input) carrying `positive[i].text|start|end|strength|zero_out|average...`, or None."""
    m = re.match(r"^(positive|negative)\[(\d+)\](?:\.([\w.]+))?$", field or "")
    if m is None:
        return None
    side, i, name = m.group(1), m.group(2), m.group(3) or "text"
    role, name = ENTRY_PLACES.get(name, ("text", "text"))
    node = job_nodes.get(f"{side}_{role}{i}")
    return None if node is None else (node, name)


# ---------------------------------------------------------------- job -> graph

COND_IDS = 60                   # the conditioning nodes of a job's entries: "60", "61" ...


def _operation_nodes(node, new, out: list, e: dict, role: str, head: list, clip: list) -> list:
    """An entry's ConditioningZeroOut and ConditioningAverage (a CLIPTextEncode of its own as conditioning_from) after
    its CLIPTextEncode `head`, in the order the encoder applies them; `role` has {} for the node's kind. -> the last
    node's output."""
    if e.get("zero_out"):
        zero = new(role.format("zero"))
        out.append(node(role.format("zero"), "ConditioningZeroOut", conditioning=head))
        head = [zero, 0]
    if e.get("average"):
        src, avg = new(role.format("from")), new(role.format("average"))
        out.append(node(role.format("from"), "CLIPTextEncode", {"prompt": e["average"]["text"]}, clip=clip))
        out.append(node(role.format("average"), "ConditioningAverage", e["average"], conditioning_to=head,
                        conditioning_from=[src, 0]))
        head = [avg, 0]
    return head


def entry_nodes(node, spec: dict, ids: dict, clip: list) -> list[tuple[str, dict]]:
    """A job's `positive` / `negative` entries as ComfyUI nodes: a CLIPTextEncode per entry (the first at the side's
    own id), its ConditioningZeroOut / ConditioningAverage, its ConditioningSetTimestepRange and ConditioningSetAreaStrength when not the defaults, chained by
    ConditioningCombine; ids["positive"/"negative"] end at each side's last node."""
    out, n, used = [], [COND_IDS], set()

    def new(role: str) -> str:
        """The role's id: its graph's (ids from a graph's roles), unless a node of this build already took it (one
        window node over several entries in the graph is one node per entry here)."""
        if role not in ids or ids[role] in used:
            while str(n[0]) in ids.values():
                n[0] += 1
            ids[role] = str(n[0])
        used.add(ids[role])
        return ids[role]

    for side in SIDES:
        entries = spec.get(side)
        if not entries:
            continue
        last = None
        for i, e in enumerate(entries):
            role = side if i == 0 else f"{side}_text{i}"
            new(role)
            out.append(node(role, "CLIPTextEncode", {"prompt": e["text"]}, clip=clip))
            head = _operation_nodes(node, new, out, e, f"{side}_{{}}{i}", [ids[role], 0], clip)
            if e.get("start", 0.0) != 0.0 or e.get("end", 1.0) != 1.0:
                new(f"{side}_window{i}")
                out.append(node(f"{side}_window{i}", "ConditioningSetTimestepRange",
                                {"start": e.get("start", 0.0), "end": e.get("end", 1.0)}, conditioning=head))
                head = [ids[f"{side}_window{i}"], 0]
            if e.get("strength", 1.0) != 1.0:
                new(f"{side}_strength{i}")
                out.append(node(f"{side}_strength{i}", "ConditioningSetAreaStrength", {"strength": e["strength"]},
                                conditioning=head))
                head = [ids[f"{side}_strength{i}"], 0]
            if last is not None:
                new(f"{side}_combine{i - 1}")
                out.append(node(f"{side}_combine{i - 1}", "ConditioningCombine", conditioning_1=last,
                                conditioning_2=head))
                head = [ids[f"{side}_combine{i - 1}"], 0]
            last = head
        ids[f"{side}_out"] = last[0]
    return out
