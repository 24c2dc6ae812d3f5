"""The sha256 memo of models/records/manifest.py: a file checked against its manifest is not read again while its size,
mtime and inode stay the same; a changed one (same size, new mtime), or one too fresh to trust its mtime, is."""
from __future__ import annotations

import os
import time

import pytest

import models.records.manifest as manifest
from models.records.manifest import check_files, data_sha256


class Boom(Exception):
    pass


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """file_sha256 counted per file; the memo in tmp_path."""
    monkeypatch.setenv(manifest.MEMO_ENV, str(tmp_path / "memo.json"))
    reads = []
    real = manifest.file_sha256
    monkeypatch.setattr(manifest, "file_sha256", lambda p: reads.append(os.path.basename(p)) or real(p))
    return reads


def _settled(path, age_s: float = 10.0) -> None:
    t = time.time_ns() - int(age_s * 1e9)
    os.utime(path, ns=(t, t))


def test_a_checked_file_is_not_read_again_until_it_changes(tmp_path, counted):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    _settled(f)
    listed = [("w.bin", data_sha256(b"a" * 1000), 1000)]
    check_files(tmp_path, listed, Boom)
    check_files(tmp_path, listed, Boom)
    assert counted == ["w.bin"]                                 # the second check read nothing
    f.write_bytes(b"b" * 1000)                                  # same size, same inode, a new mtime
    _settled(f, 5.0)
    with pytest.raises(Boom, match="w.bin .sha256 differs"):
        check_files(tmp_path, listed, Boom)
    assert counted == ["w.bin", "w.bin"]


def test_a_fresh_file_is_not_remembered(tmp_path, counted):
    """Its mtime may not move when it is rewritten within the same clock tick: it is hashed at every check."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 10)
    listed = [("w.bin", data_sha256(b"a" * 10), 10)]
    check_files(tmp_path, listed, Boom)
    check_files(tmp_path, listed, Boom)
    assert counted == ["w.bin", "w.bin"]


def test_no_memo_when_turned_off_and_a_torn_memo_is_ignored(tmp_path, counted, monkeypatch):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 10)
    _settled(f)
    listed = [("w.bin", data_sha256(b"a" * 10), 10)]
    (tmp_path / "memo.json").write_text('{"x": [1, 2')               # torn
    check_files(tmp_path, listed, Boom)
    check_files(tmp_path, listed, Boom)
    assert counted == ["w.bin"]
    monkeypatch.setenv(manifest.MEMO_ENV, "")
    check_files(tmp_path, listed, Boom)
    assert counted == ["w.bin", "w.bin"]


def test_a_pack_loaded_twice_is_hashed_once(pipeline_assets, counted, tmp_path):
    """load_pack(check=True), as a stage start does it, on the session's tiny pack (copied: its files settled)."""
    import shutil

    from models.packs.pack import load_pack
    _, pack = pipeline_assets
    mine = tmp_path / "pack"
    shutil.copytree(pack, mine)
    for f in mine.rglob("*"):
        _settled(f)
    load_pack(mine)
    first = len(counted)
    assert first > 0
    load_pack(mine)
    assert len(counted) == first
