"""rknn-toolkit2 build-log parsing (real captured logs), the 2.3.2/AdaLN refusal, and worker exit descriptions."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models.rknn.buildlog import parse_build_log, parse_layer_row
from models.rknn.client import describe_exit
from models.rknn.graph_checks import find_adaln, regression_for

DATA = Path(__file__).parent / "data" / "rknn"


def test_real_log_with_erf_on_cpu():
    # captured from rknn-toolkit2 2.5.0 compiling a tiny FFN branch whose GELU the compiler did not fuse
    log = parse_build_log((DATA / "tiny_ffn_erf_on_cpu.log").read_text())
    assert log.toolkit_version == "2.5.0"
    assert log.compiler_version.startswith("2.5.0 (")
    assert log.regtask_errors == 0
    assert [lay.op for lay in log.cpu_ops] == ["Erf"]
    assert log.cpu_op_names() == ["Erf:erf_5"]
    # the graph's input and output operators are reported as CPU by the table but are not placements
    assert {lay.op for lay in log.layers if lay.target == "CPU"} == {"InputOperator", "OutputOperator", "Erf"}
    assert sum(lay.target == "NPU" for lay in log.layers) == log.summary()["npu_layers"] > 5
    # rows of the Feature Tensor table (same prefix, other columns) are not layers
    assert {lay.target for lay in log.layers} == {"NPU", "CPU"}
    assert all(":" in lay.name for lay in log.layers)
    assert len({lay.id for lay in log.layers}) == len(log.layers)


def test_real_log_with_fused_gelu_is_all_npu():
    log = parse_build_log((DATA / "gelu_fused_npu_only.log").read_text())
    assert log.cpu_ops == []
    assert "ConvExGelu" in {lay.op for lay in log.layers}


def test_regtask_lines_are_counted():
    # the message text is the one the toolkit prints (the prefix format as in the captured logs)
    text = (DATA / "gelu_fused_npu_only.log").read_text()
    bad = "E RKNN: [10:01:02.345] REGTASK: The bit width of field value exceeds the limit, target: v2, " \
          "offset: 0x4038, shift = 0, limit: 0x1fff, value: 0x2a01\n"
    log = parse_build_log(text + bad * 3)
    assert log.regtask_errors == 3
    assert "exceeds the limit" in log.regtask_samples[0]
    assert log.summary()["regtask_errors"] == 3


def test_layer_row_parsing():
    row = parse_layer_row("5    Erf                FLOAT16  CPU    (1,256,1,64)        (1,256,1,64)    "
                          "0/0/0                    32           Erf:c")
    assert (row.id, row.op, row.target, row.name) == (5, "Erf", "CPU", "Erf:c")
    assert parse_layer_row("ID   OpType  DataType Target InputShape OutputShape Cycles RW FullName") is None
    assert parse_layer_row("-----------") is None


def _adaln_graph() -> onnx.ModelProto:
    """LayerNorm(x) * (1 + Linear(c)): the AdaLN modulation computed inside the graph."""
    D = 8
    w = numpy_helper.from_array(np.eye(D, dtype=np.float32), "w")
    one = numpy_helper.from_array(np.ones((1,), np.float32), "one")
    nodes = [helper.make_node("LayerNormalization", ["x"], ["ln"], name="ln", epsilon=1e-6),
             helper.make_node("MatMul", ["c", "w"], ["lin"], name="lin"),
             helper.make_node("Add", ["lin", "one"], ["scale1"], name="scale1"),
             helper.make_node("Mul", ["ln", "scale1"], ["y"], name="modulate")]
    g = helper.make_graph(nodes, "adaln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, D]),
                                           helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, D])], [w, one])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


def test_adaln_pattern_and_2_3_2_refusal(tiny_dit):
    m = _adaln_graph()
    assert find_adaln(m) == ["modulate"]
    msg = regression_for("2.3.2", m)
    assert msg and "2.3.2" in msg and "139" in msg and "modulate" in msg
    assert regression_for("2.5.0", m) is None and regression_for("2.3.0", m) is None
    # the pack's branch graphs keep the modulation on the host: no AdaLN pattern in them
    from models.packs.branch_graphs import build_branch
    from models.dit.checkpoint import DiTCheckpoint
    from models.dit.partition import Geometry
    ck = DiTCheckpoint.open(tiny_dit)
    for kind in ("self", "cross", "ffn"):
        g = build_branch(kind, ck.branch_weights(0, kind), ck.config, Geometry.from_resolution(64, 64), "fp16")
        assert find_adaln(g) == [] and regression_for("2.3.2", g) is None


def test_compile_refuses_2_3_2_on_adaln(tmp_path, monkeypatch):
    from models.rknn import compile as rc
    pack = tmp_path / "pack"
    (pack / "onnx").mkdir(parents=True)
    onnx.save(_adaln_graph(), str(pack / "onnx" / "b00_ffn.onnx"))
    (pack / "manifest.json").write_text('{"branches": [{"block": 0, "kind": "ffn", "onnx": "onnx/b00_ffn.onnx", '
                                        '"sha256": "x"}]}')
    monkeypatch.setattr(rc, "toolkit_version", lambda venv=None: "2.3.2")
    with pytest.raises(rc.CompileError, match=r"b00_ffn.onnx: refusing .*2\.3\.2.*exit 139"):
        rc.compile_pack(pack)
    with pytest.raises(rc.CompileError, match="target 'rk9999'"):
        rc.compile_pack(pack, target="rk9999")
    with pytest.raises(rc.CompileError, match="no such pack"):
        rc.compile_pack(tmp_path / "nope")


def test_missing_toolkit_venv_is_a_clear_error(tmp_path):
    from models.rknn.compile import CompileError, compile_pack
    pack = tmp_path / "pack"
    (pack / "onnx").mkdir(parents=True)
    onnx.save(_adaln_graph(), str(pack / "onnx" / "b00_ffn.onnx"))
    (pack / "manifest.json").write_text('{"branches": [{"block": 0, "kind": "ffn", "onnx": "onnx/b00_ffn.onnx", '
                                        '"sha256": "x"}]}')
    with pytest.raises(CompileError, match="make rknn-venv"):
        compile_pack(pack, venv=tmp_path / "no-venv")


def test_exit_descriptions():
    assert describe_exit(-11) == "killed by SIGSEGV (exit 139)"
    assert describe_exit(139) == "exit 139 (SIGSEGV)"
    assert describe_exit(1) == "exit 1"
