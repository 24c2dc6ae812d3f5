"""models.base.durable.atomic_write: exclusive temporaries, no link followed, keep-existing, fsync, stale cleanup."""
import os
import time

import numpy as np
import pytest

from models.base import durable
from models.base.durable import atomic_write, is_temporary, remove_stale_temporaries


def test_writes_bytes_text_and_writer(tmp_path):
    atomic_write(tmp_path / "a.bin", b"\x00\x01")
    atomic_write(tmp_path / "b.txt", "héllo\n")
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    atomic_write(tmp_path / "c.npy", lambda f: np.save(f, arr))
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_text("utf-8") == "héllo\n"
    assert np.array_equal(np.load(tmp_path / "c.npy"), arr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.txt", "c.npy"]   # no temporaries left


def test_planted_links_are_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    dest = tmp_path / "y.png"
    for name in ("y.png.tmp", ".y.png.tmp", "y.png.new"):     # every name an attacker could guess
        (tmp_path / name).symlink_to(victim)
    atomic_write(dest, b"new")
    assert victim.read_text() == "keep"
    assert dest.read_bytes() == b"new" and not dest.is_symlink()


def test_a_link_at_the_destination_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    dest = tmp_path / "out.png"
    dest.symlink_to(victim)
    atomic_write(dest, b"new")
    assert victim.read_text() == "keep" and dest.read_bytes() == b"new" and not dest.is_symlink()


def test_overwrite_false_keeps_an_existing_file(tmp_path):
    dest = tmp_path / "out.png"
    dest.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        atomic_write(dest, b"new", overwrite=False)
    assert dest.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.png"]
    atomic_write(tmp_path / "fresh.png", b"new", overwrite=False)
    assert (tmp_path / "fresh.png").read_bytes() == b"new"


def test_overwrite_false_refuses_a_dangling_link(tmp_path):
    dest = tmp_path / "out.png"
    dest.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        atomic_write(dest, b"new", overwrite=False)
    assert not (tmp_path / "nowhere").exists()


def test_failing_writer_leaves_old_file_and_no_temporary(tmp_path):
    dest = tmp_path / "state.bin"
    dest.write_bytes(b"old")

    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk on fire")
    with pytest.raises(RuntimeError):
        atomic_write(dest, boom)
    assert dest.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_file_and_folder_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(durable.os, "fsync", spy)
    atomic_write(tmp_path / "x", b"1")
    assert str(tmp_path.resolve()) in synced                    # the folder, after the rename
    assert any(is_temporary(os.path.basename(p)) for p in synced)   # the file, before it


def test_mode_and_umask(tmp_path):
    atomic_write(tmp_path / "secret", b"k", mode=0o600)
    assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "plain", b"k")
    finally:
        os.umask(old)
    assert (tmp_path / "plain").stat().st_mode & 0o777 == 0o640


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    (tmp_path / ".job.json.abc123.tmp").write_text("torn")
    (tmp_path / "job.json").write_text("{}")
    (tmp_path / "notes.tmp").write_text("user file")             # not our pattern
    os.mkdir(tmp_path / ".dir.x1.tmp")                           # a folder: left alone
    (tmp_path / ".link.x2.tmp").symlink_to(tmp_path / "job.json")   # a link: left alone
    removed = remove_stale_temporaries(tmp_path)
    assert [p.name for p in removed] == [".job.json.abc123.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dir.x1.tmp", ".link.x2.tmp", "job.json", "notes.tmp"]
    assert (tmp_path / "job.json").read_text() == "{}"


def test_stale_temporaries_by_age_and_destination(tmp_path):
    from models.base.durable import temporary_target
    assert temporary_target(".y.png.k3_j2x.tmp") == "y.png" and temporary_target("y.png.tmp") is None
    for name in (".cond.npy.a1.tmp", ".image.png.b2.tmp"):
        (tmp_path / name).write_bytes(b"torn")
    assert remove_stale_temporaries(tmp_path, older_than_s=3600) == []          # fresh: maybe still being written
    assert [p.name for p in remove_stale_temporaries(tmp_path, targets=lambda t: t == "cond.npy")] == \
        [".cond.npy.a1.tmp"]
    old = time.time() - 7200
    os.utime(tmp_path / ".image.png.b2.tmp", (old, old))
    assert [p.name for p in remove_stale_temporaries(tmp_path, older_than_s=3600)] == [".image.png.b2.tmp"]
