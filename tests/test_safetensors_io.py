"""safetensors_io: our reader against the `safetensors` library, bf16 rounding, and malformed files."""
import json
import struct

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as st_save_numpy
from safetensors.torch import load_file as st_load_torch
from safetensors.torch import save_file as st_save_torch

from models.base.safetensors_io import (SafeTensorsError, SafeTensorsFile, TensorEntry, bf16_to_f32, f32_to_bf16,
                                   write_safetensors)


def test_reads_what_the_library_writes(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal((7,)).astype(np.float16)
    c = torch.randn(4, 6, dtype=torch.float32).to(torch.bfloat16)
    path = tmp_path / "lib.safetensors"
    st_save_torch({"a": torch.from_numpy(a), "b": torch.from_numpy(b), "c": c}, str(path), metadata={"k": "v"})
    f = SafeTensorsFile(path)
    assert sorted(f.keys()) == ["a", "b", "c"]
    assert f.metadata == {"k": "v"}
    assert f.dtype("c") == "BF16" and f.shape("c") == (4, 6)
    np.testing.assert_array_equal(f.get("a"), a)
    np.testing.assert_array_equal(f.get("b"), b.astype(np.float32))
    np.testing.assert_array_equal(f.get("c"), c.to(torch.float32).numpy())


def test_library_reads_what_we_write(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 3)).astype(np.float32)
    path = tmp_path / "ours.safetensors"
    calls = []

    def lazy():
        calls.append(1)
        return x

    write_safetensors(path, [TensorEntry("x_bf16", "BF16", (8, 3), lazy), TensorEntry("x_f16", "F16", (8, 3), x),
                             TensorEntry("empty", "F32", (0, 4), np.zeros((0, 4), np.float32))], {"m": 1})
    assert calls == [1]
    got = st_load_torch(str(path))
    np.testing.assert_array_equal(got["x_bf16"].float().numpy(), torch.from_numpy(x).bfloat16().float().numpy())
    np.testing.assert_array_equal(got["x_f16"].numpy(), x.astype(np.float16))
    assert tuple(got["empty"].shape) == (0, 4)
    assert not (tmp_path / "ours.safetensors.tmp").exists()


def test_bf16_rounding_matches_torch():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 1e3,
                        np.array([0.0, -0.0, np.inf, -np.inf, 1.00390625, 1.01171875], np.float32)])
    ours = bf16_to_f32(f32_to_bf16(x))
    ref = torch.from_numpy(x).bfloat16().float().numpy()
    np.testing.assert_array_equal(ours, ref)
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]


def test_memory_mapped_raw_is_a_view(tmp_path):
    """raw() is a view of the file's pages, not a copy: bytes written to the file afterwards show through it (a full
    read, which also has a `base`, keeps the old values)."""
    path = tmp_path / "v.safetensors"
    st_save_numpy({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(path))
    f = SafeTensorsFile(path)
    raw = f.raw("w")
    assert isinstance(raw.base, np.ndarray) or raw.base is not None
    assert not raw.flags.writeable
    np.testing.assert_array_equal(raw.view(np.float32), np.arange(12, dtype=np.float32).reshape(3, 4))
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    start = 8 + header_len + json.loads(path.read_bytes()[8:8 + header_len])["w"]["data_offsets"][0]
    with open(path, "r+b") as out:                          # the same pages, changed behind the reader's back
        out.seek(start)
        out.write(np.full(12, 7.5, np.float32).tobytes())
    np.testing.assert_array_equal(raw.view(np.float32), np.full((3, 4), 7.5, np.float32))


@pytest.mark.parametrize("case", ["empty", "short", "huge_header", "not_json", "truncated", "bad_size", "fp8"])
def test_malformed_files_get_clear_errors(tmp_path, case):
    path = tmp_path / f"{case}.safetensors"
    good = tmp_path / "good.safetensors"
    st_save_numpy({"w": np.ones((4, 4), np.float32)}, str(good))
    blob = good.read_bytes()
    if case == "empty":
        path.write_bytes(b"")
    elif case == "short":
        path.write_bytes(b"\x01\x02")
    elif case == "huge_header":
        path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    elif case == "not_json":
        path.write_bytes(struct.pack("<Q", 4) + b"GGUF" + b"\0" * 32)
    elif case == "truncated":
        path.write_bytes(blob[:-10])
    elif case == "bad_size":
        hdr = json.dumps({"w": {"dtype": "F32", "shape": [4, 5], "data_offsets": [0, 64]}}).encode()
        path.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 64)
    elif case == "fp8":
        hdr = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}).encode()
        path.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 4)
        f = SafeTensorsFile(path)  # the header is fine; reading the tensor is what fails
        with pytest.raises(SafeTensorsError, match="quantized/unsupported dtype F8_E4M3"):
            f.get("w")
        return
    with pytest.raises(SafeTensorsError) as e:
        SafeTensorsFile(path)
    assert str(path) in str(e.value)
    if case in ("truncated",):
        assert "truncated" in str(e.value)
    if case == "bad_size":
        assert "'w'" in str(e.value)


DEEP = "[" * 100_000 + "]" * 100_000
HUGE = "9" * 5000                                      # past Python's 4300-digit int-from-string limit


@pytest.mark.parametrize("header", [
    '{"w": {"dtype": "F32", "shape": [' + HUGE + '], "data_offsets": [0, 4]}}',
    '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + HUGE + ']}}',
    '{"w": ' + DEEP + '}',
    '{"__metadata__": {"k": ' + DEEP + '}}',
    '{"__metadata__": {"k": 1}}',
    '{"w": {"dtype": [], "shape": [1], "data_offsets": [0, 4]}}',
    '{"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}',
    '{"w": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}',
    '{"w": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}',
    '{"w": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}',
    '{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}',
    '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}',
    '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}',
    '{"w": {"dtype": "F8_E5M2", "shape": [1], "data_offsets": [8, 4]}}',
    '{"w": {"dtype": "F32", "shape": [0, 4611686018427387904, 4611686018427387904], "data_offsets": [0, 0]}}',
    '{"w": {"dtype": "F32", "shape": [' + ",".join(["1"] * 40) + '], "data_offsets": [0, 4]}}',
    '{"w": 5}',
    '{"w": {"dtype": "F32", "shape": [1]}}',
])
def test_hostile_headers_raise_the_loaders_own_error(tmp_path, header):
    """Huge integers, deep nesting, wrong types: SafeTensorsError naming the file, never ValueError/TypeError/
    RecursionError from deeper down (Python's own for a 5000-digit int and for deep nesting)."""
    path = tmp_path / "hostile.safetensors"
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
    with pytest.raises(SafeTensorsError) as e:
        f = SafeTensorsFile(path)
        for k in f.keys():          # a header that passes must still give readable tensors
            f.get(k)
    assert type(e.value) is SafeTensorsError and str(path) in str(e.value)
