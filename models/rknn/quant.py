"""The quantization part of a toolkit request for a W8A8 pack's branch: its quantizer dataset written out as the .npy
files rknn-toolkit2 reads (one line of paths per sample, in graph input order) and the INT8 MatMuls to keep."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from models.records.manifest import branch_int8, quant_info

NP = {"f16": np.float16, "f32": np.float32}
INT8_INPUTS = ("xn",)              # the graph input the INT8 projections read (the host's modulated activation)


def quant_fingerprint(manifest: dict, branch: dict, part: dict = None) -> str:
    """What a quantized build depends on besides its ONNX: the dataset and the INT8 tensor names (of `part`, a shard
    of `branch`, when given)."""
    q = quant_info(manifest)
    key = [q["dataset"]["sha256"], branch_int8(part if part is not None else branch), q.get("smooth"), q["int8"]]
    if part is not None:                               # the same dataset, cut to the shard's inputs
        key.append([part.get("cut"), part.get("range")])
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def stem_of(branch: dict) -> str:
    return f"b{int(branch['block']):02d}_{branch['kind']}"


def _shard_cutter(branch: dict, part: dict):
    """feed -> the shard's part of it (models.dit.shards.shard_feed), or the identity for a whole branch."""
    if part is None:
        return lambda feed: feed
    from models.dit.shards import shard_feed
    from models.packs.sharded import part_specs
    spec = part_specs(branch)[int(part["index"])]
    return lambda feed: shard_feed(spec, feed)


def quant_request(pack: Path, manifest: dict, branch: dict, work: Path, dataset=None, part: dict = None) -> dict:
    """{dataset, int8, int8_inputs} for a worker request, the .npy files written under `work`; None for a branch of
    a float pack (or a float branch). `part`: a shard of `branch` (its manifest entry): its INT8 MatMuls, and the
    branch's quantizer inputs cut as the executor cuts a pass for that shard (shard_feed: a rows shard's rows of
    xn), so the pack stores one dataset whatever its shards."""
    q = quant_info(manifest)
    entry = part if part is not None else branch
    names = branch_int8(entry)
    if q is None or not names:
        return None
    from models.base.safetensors_io import SafeTensorsFile
    st = dataset or SafeTensorsFile(Path(pack) / q["dataset"]["file"])
    have = set(st.keys())
    stem, rows, cut = stem_of(branch), [], _shard_cutter(branch, part)
    work.mkdir(parents=True, exist_ok=True)
    for k in range(int(q["dataset"]["samples"])):
        if f"{stem}.{k}.xn" not in have:
            break
        feed = cut({i["name"]: st.get(f"{stem}.{k}.{i['name']}" if f"{stem}.{k}.{i['name']}" in have
                                      else f"shared.{i['name']}") for i in entry["inputs"]})
        paths = []
        for inp in entry["inputs"]:
            p = work / f"{stem}.{k}.{inp['name']}.npy"
            np.save(p, feed[inp["name"]].astype(NP[inp["dtype"]]).reshape(inp["shape"]))
            paths.append(str(p))
        rows.append(paths)
    if not rows:
        raise ValueError(f"{pack}: the quantizer dataset has no samples for {stem}")
    import onnx
    g = onnx.load(str(Path(pack) / entry["onnx"]), load_external_data=False).graph
    # graph inputs and constants appear in the toolkit's tensor table but are not layers it lets one set to float16
    fixed = [i["name"] for i in entry["inputs"]] + [i.name for i in g.initializer]
    return {"dataset": rows, "int8": names, "int8_inputs": list(INT8_INPUTS), "graph_inputs": fixed}
