"""Reads rknn-toolkit2's verbose build log: compiler version, operator placement (NPU/CPU), REGTASK errors, the
memory the compiler planned (internal: feature tensors; weights)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# "I RKNN: librknnc version: 2.5.0 (74ea630ce@2026-09-29T14:54:20)"
_COMPILER_RE = re.compile(r"librknnc version:\s*(\S+(?:\s*\([^)]*\))?)")
# "I rknn-toolkit2 version: 2.5.0"
_TOOLKIT_RE = re.compile(r"rknn-toolkit2 version:\s*(\S+)")
# the prefix of every line the compiler library prints: "D RKNN: [08:00:26.171] "
_RKNN_PREFIX_RE = re.compile(r"^[DIWE] RKNN: \[[0-9:.]+\] ?")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
LAYER_TABLE_TITLE = "Network Layer Information Table"
IO_OPS = ("InputOperator", "OutputOperator")      # the graph's inputs/outputs: always "CPU", not a placement
REGTASK = "REGTASK"                                # "REGTASK: The bit width of field value exceeds the limit, ..."
# "Total Internal Memory Size: 1.06816e+06KB", "Total Weight Memory Size: 515.5KB": what the compiler planned for the
# model's feature tensors (activations) and its weights; printed in KB (1024 bytes), large ones in C's %g form
_MEMORY_RE = re.compile(r"Total (Internal|Weight) Memory Size:\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([KMG]?B)\b")
_UNIT = {"B": 1, "KB": 1024, "MB": 1024 ** 2, "GB": 1024 ** 3}


@dataclass
class Layer:
    """One row of the compiler's Network Layer Information Table."""
    id: int
    op: str                  # the NPU op type, e.g. Conv, ConvExGelu, Softmax, Erf
    dtype: str
    target: str              # NPU | CPU (| GPU)
    input_shape: str
    output_shape: str
    name: str                # FullName: "OpType:onnx_node_name"


@dataclass
class BuildLog:
    """What a build log says. `cpu_ops` excludes the graph's input/output operators."""
    toolkit_version: str = ""
    compiler_version: str = ""
    layers: list = field(default_factory=list)
    regtask_errors: int = 0
    regtask_samples: list = field(default_factory=list)
    errors: list = field(default_factory=list)        # "E ..." lines other than REGTASK
    internal_bytes: int = 0                           # the compiler's planned activation memory (0: not in the log)
    weight_bytes: int = 0                             # the compiler's planned weight memory

    @property
    def cpu_ops(self) -> list:
        return [lay for lay in self.layers if lay.target == "CPU" and lay.op not in IO_OPS]

    def cpu_op_names(self) -> list:
        """["Erf:gelu_12", ...] — every operator the compiler placed on the CPU."""
        return [lay.name for lay in self.cpu_ops]

    def summary(self) -> dict:
        return {"toolkit": self.toolkit_version, "compiler": self.compiler_version, "layers": len(self.layers),
                "npu_layers": sum(lay.target == "NPU" for lay in self.layers), "cpu_ops": self.cpu_op_names(),
                "regtask_errors": self.regtask_errors, "regtask_samples": self.regtask_samples,
                "errors": self.errors[:10], "internal_bytes": self.internal_bytes, "weight_bytes": self.weight_bytes}


def _strip(line: str) -> str:
    return _ANSI_RE.sub("", line.rstrip("\n"))


def parse_layer_row(body: str):
    """The text of one table row (prefix removed) -> Layer, or None for rules/headers/other text."""
    parts = body.split(None, 8)
    if len(parts) < 9 or not parts[0].isdigit():
        return None
    i, op, dt, target, ins, outs, _cycles, _rw, name = parts
    return Layer(int(i), op, dt, target, ins, outs, name.strip())


def parse_build_log(text: str, max_samples: int = 5) -> BuildLog:
    """Parse the whole verbose log of one build (what the worker captured from fds 1 and 2)."""
    out = BuildLog()
    in_table = False
    rules = 0
    for raw in text.splitlines():
        line = _strip(raw)
        if REGTASK in line:
            out.regtask_errors += 1
            if len(out.regtask_samples) < max_samples:
                out.regtask_samples.append(line.strip())
            continue
        if not out.compiler_version:
            m = _COMPILER_RE.search(line)
            if m:
                out.compiler_version = m.group(1).strip()
        if not out.toolkit_version:
            m = _TOOLKIT_RE.search(line)
            if m:
                out.toolkit_version = m.group(1)
        m = _MEMORY_RE.search(line)
        if m:
            n = round(float(m.group(2)) * _UNIT[m.group(3).upper()])
            setattr(out, "internal_bytes" if m.group(1) == "Internal" else "weight_bytes", n)
            continue
        if line.startswith("E ") and len(out.errors) < 50:
            out.errors.append(line)
        body = _RKNN_PREFIX_RE.sub("", line, count=1)
        if LAYER_TABLE_TITLE in body:
            in_table, rules = True, 0
            continue
        if in_table:
            if body.startswith("---"):
                rules += 1
                if rules >= 3:          # rule above header, below header, and the closing rule
                    in_table = False
                continue
            row = parse_layer_row(body)
            if row is not None:
                out.layers.append(row)
    return out
