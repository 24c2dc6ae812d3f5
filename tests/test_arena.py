"""Shared-memory arena: owner creates/unlinks, stages attach from other processes, kills leak nothing, reap, free space."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from protocol.arena import (SHM_DIR, Arena, ArenaError, list_segments, reap, run_prefix, segment_name,
                            shm_free_bytes)

TIMEOUT_S = 30


@pytest.fixture
def run_dir(tmp_path):
    """A fresh run directory; any segment of its prefix left at the end fails the test (and is removed)."""
    yield tmp_path
    left = reap(run_prefix(tmp_path), keep=set())
    assert left == [], f"test leaked shm segments {left}"


def _child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


ATTACH_WRITE = """
    import sys
    import numpy as np
    from protocol.arena import Arena
    from protocol.tensors import TensorDesc
    a = Arena.attach(sys.argv[1])
    x = TensorDesc("f32", (4, 5), slot="x", offset=int(sys.argv[2]))
    y = TensorDesc("bf16", (3,), slot="y", offset=int(sys.argv[3]))
    a.write(y, (a.read(x)[:3, 0].view(np.uint32) >> 16).astype(np.uint16))
    a.view(x)[...] *= 2
    a.close()
    print("done", flush=True)
"""


def test_create_attach_in_subprocess_write_read_unlink(run_dir):
    name = segment_name(run_dir, "job-1")
    assert name.startswith(run_prefix(run_dir)) and len(run_prefix(run_dir)) == len("anima_12345678_")
    with Arena.create(name, 1 << 16) as arena:
        x = arena.alloc("x", "f32", (4, 5))
        y = arena.alloc("y", "bf16", (3,))
        assert x.offset % 64 == 0 and y.offset % 64 == 0 and y.offset >= x.offset + x.nbytes
        src = np.arange(20, dtype=np.float32).reshape(4, 5) + 0.5
        arena.write(x, src)
        p = _child(ATTACH_WRITE, name, str(x.offset), str(y.offset))
        out, err = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == 0 and out.strip() == "done", err
        assert "resource_tracker" not in err and "leaked" not in err
        np.testing.assert_array_equal(arena.read(x), src * 2)
        np.testing.assert_array_equal(arena.read(y), (src[:3, 0].view(np.uint32) >> 16).astype(np.uint16))
        assert list_segments(run_prefix(run_dir)) == [name]
        assert oct(os.stat(os.path.join(SHM_DIR, name)).st_mode & 0o777) == oct(0o600)
    assert list_segments(run_prefix(run_dir)) == []


def test_sigkill_of_an_attached_stage_leaks_nothing(run_dir):
    before = set(os.listdir(SHM_DIR))
    name = segment_name(run_dir, "job-2")
    arena = Arena.create(name, 1 << 20)
    d = arena.alloc("x", "u8", (1 << 20,))
    p = _child("""
        import sys, time
        from protocol.arena import Arena
        from protocol.tensors import TensorDesc
        a = Arena.attach(sys.argv[1])
        a.view(TensorDesc("u8", (1 << 20,), slot="x", offset=0))[:] = 7
        print("attached", flush=True)
        time.sleep(60)
    """, name)
    assert p.stdout.readline().strip() == "attached"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=TIMEOUT_S)
    assert np.all(arena.read(d) == 7)
    new = set(os.listdir(SHM_DIR)) - before  # other engineers' runs may add theirs: look at ours and Python's
    assert [n for n in new if n.startswith(("psm_", "wnsm_"))] == []  # the stage created no segment of its own
    assert list_segments(run_prefix(run_dir)) == [name]
    arena.close()
    assert list_segments(run_prefix(run_dir)) == []


def test_killed_owner_leaves_a_segment_that_reap_removes_but_live_ones_stay(run_dir):
    live = Arena.create(segment_name(run_dir, "live"), 4096)
    p = _child("""
        import sys, time
        from protocol.arena import Arena, segment_name
        Arena.create(segment_name(sys.argv[1], "crashed"), 4096)
        print("created", flush=True)
        time.sleep(60)
    """, str(run_dir))
    assert p.stdout.readline().strip() == "created"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=TIMEOUT_S)
    prefix = run_prefix(run_dir)
    assert list_segments(prefix) == sorted([prefix + "crashed", prefix + "live"])
    other = Arena.create(segment_name(str(run_dir) + "-other", "crashed"), 4096)  # another run's segment
    try:
        assert reap(prefix, keep={"live"}) == [prefix + "crashed"]
        assert list_segments(prefix) == [prefix + "live"]
        assert other.name in os.listdir(SHM_DIR)  # reap only touches its own run's prefix
    finally:
        other.close()
    live.close()


def test_free_space_check_names_the_arena_and_sizes(run_dir):
    free = shm_free_bytes()
    with pytest.raises(ArenaError, match=r"not enough shared memory for job arena anima_\w+_big: need .* MiB free"):
        Arena.create(segment_name(run_dir, "big"), free + 1)
    with pytest.raises(ArenaError, match="margin"):
        Arena.create(segment_name(run_dir, "big"), max(1, free - 1024), margin_bytes=4096)
    assert list_segments(run_prefix(run_dir)) == []


def test_clear_errors_for_misuse(run_dir):
    with pytest.raises(ArenaError, match="does not exist"):
        Arena.attach(segment_name(run_dir, "nothing"))
    with pytest.raises(ArenaError, match="job id"):
        segment_name(run_dir, "a/b")
    with pytest.raises(ArenaError, match="must start with"):
        Arena.create("psm_foreign", 4096)
    with Arena.create(segment_name(run_dir, "j"), 4096) as arena:
        with pytest.raises(ArenaError, match="already exists"):
            Arena.create(arena.name, 4096)
        x = arena.alloc("x", "f32", (8,))
        with pytest.raises(ArenaError, match="already allocated"):
            arena.alloc("x", "f32", (8,))
        with pytest.raises(ArenaError, match="does not fit"):
            arena.alloc("huge", "f32", (4096,))
        with pytest.raises(ArenaError, match="shape"):
            arena.write(x, np.zeros(7, np.float32))
        with pytest.raises(ArenaError, match="holds f32"):
            arena.write(x, np.zeros(8, np.float16))
        from protocol.tensors import TensorDesc
        with pytest.raises(ArenaError, match="outside arena"):
            arena.view(TensorDesc("f32", (8,), slot="x", offset=4090))
        with pytest.raises(ArenaError, match="inline frame"):
            arena.view(TensorDesc("f32", (8,), frame=1))
        with pytest.raises(ArenaError, match="outside arena"):
            arena.region(4000, 200)
        assert arena.slots.remaining() == (64, 4096 - 64)  # after x: [0, 32) and the failed allocations
        region = arena.region(1024, 1024)
        r = region.alloc("scratch", "f16", (100,))
        assert r.offset == 1024 and region.cursor == 1224
        with pytest.raises(ArenaError, match="does not fit"):
            region.alloc("more", "f16", (500,))
        stage = Arena.attach(arena.name)
        with pytest.raises(ArenaError, match="only the owner"):
            stage.unlink()
        stage.close()
        stage.close()  # twice is fine
        assert arena.name in os.listdir(SHM_DIR)


def test_close_with_live_views_still_unlinks(run_dir):
    arena = Arena.create(segment_name(run_dir, "views"), 4096)
    d = arena.alloc("x", "f32", (4,))
    v = arena.view(d)
    v[:] = 3.0
    arena.close()  # a view is still alive: unmapped later, unlinked now
    assert arena.name not in os.listdir(SHM_DIR)
    assert float(v.sum()) == 12.0
    with pytest.raises(ArenaError, match="closed"):
        arena.view(d)
    del v


def test_reap_touches_only_regular_files_of_its_user(run_dir, tmp_path, monkeypatch, caplog):
    """/dev/shm is world-writable: a folder, a link or another user's file named with the run's prefix is logged and
    left alone (unlinking a folder raises IsADirectoryError: the orchestrator would never get past its start)."""
    prefix = run_prefix(run_dir)
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    squat_dir, squat_link = prefix + "squat-dir", prefix + "squat-link"
    os.mkdir(os.path.join(SHM_DIR, squat_dir))
    os.symlink(target, os.path.join(SHM_DIR, squat_link))
    stale = Arena.create(segment_name(run_dir, "stale"), 4096)
    stale._mm.close()
    stale._mm = None                 # the owner is "dead": its segment stays behind
    try:
        with caplog.at_level("WARNING", logger="protocol.arena"):
            assert reap(prefix, keep=set()) == [stale.name]
        assert sorted(list_segments(prefix)) == sorted([squat_dir, squat_link])
        assert target.read_bytes() == b"keep me"
        assert "a directory" in caplog.text and "a symbolic link" in caplog.text
        # a file of another user (here: ours, seen through another euid) is left alone too
        other = Arena.create(segment_name(run_dir, "foreign"), 4096)
        monkeypatch.setattr(os, "geteuid", lambda: 4242)
        assert reap(prefix, keep=set()) == []
        assert other.name in list_segments(prefix) and "owned by uid" in caplog.text
        monkeypatch.undo()
        other.close()
        # stages never attach through a link or to a folder
        for name in (squat_link, squat_dir):
            with pytest.raises(ArenaError, match="cannot be opened"):
                Arena.attach(name)
    finally:
        os.rmdir(os.path.join(SHM_DIR, squat_dir))
        os.unlink(os.path.join(SHM_DIR, squat_link))
