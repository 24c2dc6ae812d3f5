"""The durable job queue: state machine, write-then-rename, restart survival, limits, resume."""
import json
import os
import stat
import time

import pytest

from orchestrator.engine.jobs import JobError, JobStore, QueueFull

SPEC = {"prompt": "a girl", "seed": 7, "steps": 4}


def test_flow_and_persistence(tmp_path):
    store = JobStore(tmp_path)
    job = store.submit(SPEC)
    assert job.state == "queued" and job.spec == SPEC
    assert stat.S_IMODE(store.job_dir(job.id).stat().st_mode) == 0o700
    for state in ("encoding", "denoising", "decoding"):
        store.transition(job.id, state)
    done = store.transition(job.id, "done", image="/x.png", report="/r.json")
    assert done.state == "done" and done.image == "/x.png"
    assert [h[0] for h in done.history] == ["queued", "encoding", "denoising", "decoding", "done"]
    assert done.attempts == {"encoding": 1, "denoising": 1, "decoding": 1}
    # a second store on the same folder (another process) reads the same record
    again = JobStore(tmp_path).get(job.id)
    assert again.to_dict() == done.to_dict()
    on_disk = json.loads((store.job_dir(job.id) / "job.json").read_text())
    assert on_disk["state"] == "done"
    assert not list(store.root.glob("*/*.tmp"))


def test_illegal_transitions_are_refused(tmp_path):
    store = JobStore(tmp_path)
    job = store.submit(SPEC)
    with pytest.raises(JobError, match="is queued; it cannot become done"):
        store.transition(job.id, "done")
    store.transition(job.id, "encoding")
    with pytest.raises(JobError, match="cannot become decoding"):
        store.transition(job.id, "decoding")
    with pytest.raises(JobError, match="cannot be set"):
        store.transition(job.id, "denoising", created=0.0)
    store.transition(job.id, "denoising")
    store.transition(job.id, "decoding")
    store.transition(job.id, "done")
    with pytest.raises(JobError, match="already done"):
        store.cancel(job.id)
    with pytest.raises(JobError, match="only failed or cancelled"):
        store.resume(job.id)


def test_bad_ids_never_touch_the_filesystem(tmp_path):
    store = JobStore(tmp_path)
    for bad in ("../../etc", "", "20260101-120000-zzzzzz", 5, "20260101-120000-a1b2c3/../x"):
        with pytest.raises(JobError, match="is not a job id"):
            store.get(bad)
    with pytest.raises(JobError, match="no job"):
        store.get("20260101-120000-a1b2c3")


def test_restart_resumes_the_running_job_first(tmp_path):
    store = JobStore(tmp_path)
    a = store.submit(SPEC)
    b = store.submit({**SPEC, "seed": 8})
    store.transition(b.id, "encoding")
    store.transition(b.id, "denoising")
    # the daemon dies here; a new one opens the folder
    fresh = JobStore(tmp_path)
    assert [j.id for j in fresh.recover()] == [b.id]
    nxt = fresh.next_job()
    assert nxt.id == b.id and nxt.state == "denoising"
    fresh.transition(b.id, "decoding")
    fresh.transition(b.id, "done")
    assert fresh.next_job().id == a.id


def test_recover_requeues_extra_running_jobs_and_cleans_temp_files(tmp_path):
    store = JobStore(tmp_path)
    a, b = store.submit(SPEC), store.submit(SPEC)
    for j in (a, b):
        store.transition(j.id, "encoding")
    store.transition(b.id, "denoising")
    (store.job_dir(a.id) / "job.json.tmp").write_text("{torn")
    running = JobStore(tmp_path).recover()
    assert len(running) == 1
    other = store.get(b.id if running[0].id == a.id else a.id)
    assert other.state == "queued" and other.start_at in ("encoding", "denoising")
    assert not (store.job_dir(a.id) / "job.json.tmp").exists()


def test_queue_limit(tmp_path):
    store = JobStore(tmp_path, max_queue=2)
    a = store.submit(SPEC)
    store.submit(SPEC)
    with pytest.raises(QueueFull, match="the limit is 2"):
        store.submit(SPEC)
    store.cancel(a.id)                 # a finished job frees its place
    store.submit(SPEC)
    assert len(store.pending()) == 2


def test_disk_space_guard(tmp_path):
    store = JobStore(tmp_path, min_free_mb=1e12)
    with pytest.raises(JobError, match="MB free"):
        store.submit(SPEC)
    assert not any(store.root.iterdir())


def test_cancel_queued_and_running(tmp_path):
    store = JobStore(tmp_path)
    q = store.submit(SPEC)
    assert store.cancel(q.id).state == "cancelled"
    r = store.submit(SPEC)
    store.transition(r.id, "encoding")
    flagged = store.cancel(r.id)
    assert flagged.state == "encoding" and flagged.cancel_requested   # the daemon stops it at its next check
    assert store.transition(r.id, "cancelled").failed_at == "encoding"


def test_resume_failed_keeps_folder_and_restarts_at_its_stage(tmp_path):
    store = JobStore(tmp_path)
    job = store.submit(SPEC)
    store.transition(job.id, "encoding")
    store.transition(job.id, "denoising")
    state_file = store.job_dir(job.id) / "step_0003.state"
    state_file.write_bytes(b"latent")
    failed = store.fail(job.id, "scheduler", "scheduler died 3 times: SIGKILL")
    assert failed.error == {"stage": "scheduler", "message": "scheduler died 3 times: SIGKILL"}
    assert failed.failed_at == "denoising"
    resumed = store.resume(job.id)
    assert resumed.state == "queued" and resumed.start_at == "denoising" and resumed.attempts == {}
    assert state_file.read_bytes() == b"latent"
    assert store.next_job().id == job.id
    assert store.transition(job.id, "denoising").attempts == {"denoising": 1}


def test_unreadable_record_is_skipped_not_fatal(tmp_path):
    store = JobStore(tmp_path)
    good = store.submit(SPEC)
    bad = store.submit(SPEC)
    (store.job_dir(bad.id) / "job.json").write_text("{not json")
    assert [j.id for j in store.list()] == [good.id]
    with pytest.raises(JobError, match="unreadable"):
        store.get(bad.id)
    os.chmod(store.job_dir(bad.id), 0o700)


def test_jobs_of_one_second_run_in_submit_order(tmp_path, monkeypatch):
    """Job ids carry the second only: two jobs of one second must still be queued first-in first-out (the random id
    tail once decided their order)."""
    import orchestrator.engine.jobs as jobs_mod
    store = JobStore(tmp_path)
    tails = iter(["ffffff", "000000", "888888"])
    clock = iter([1_800_000_000.1, 1_800_000_000.2, 1_800_000_000.3])
    monkeypatch.setattr(jobs_mod.secrets, "token_hex", lambda n: next(tails))
    monkeypatch.setattr(jobs_mod.time, "time", lambda: next(clock, 1_800_000_000.9))
    ids = [store.submit(SPEC).id for _ in range(3)]
    assert ids[0] > ids[1]                               # the ids alone sort the other way
    assert [j.id for j in store.pending()] == ids
    assert store.next_job().id == ids[0]


# ---------------------------------------------------------------- crash leftovers, the in-memory store, prune


def test_a_job_folder_appears_whole(tmp_path, monkeypatch):
    """A crash between a job folder's mkdir and its first job.json left a folder skipped forever: now the folder is
    made under a hidden name with its record and renamed, so a crash at any point leaves no job folder at all."""
    store = JobStore(tmp_path)
    import orchestrator.engine.jobs as jobs_mod

    def crash(*a, **kw):
        raise OSError("power cut")
    monkeypatch.setattr(jobs_mod.os, "rename", crash)
    with pytest.raises(OSError, match="power cut"):
        store.submit(SPEC)
    monkeypatch.undo()
    assert [p.name for p in store.root.iterdir()] == []          # nothing half-made is left behind either
    job = store.submit(SPEC)
    assert [p.name for p in store.root.iterdir()] == [job.id]
    assert sorted(p.name for p in store.job_dir(job.id).iterdir()) == ["job.json"]


def test_recover_removes_what_a_crash_left(tmp_path):
    import psutil
    store = JobStore(tmp_path)
    job = store.submit(SPEC)
    store.transition(job.id, "encoding")
    d = store.job_dir(job.id)
    before_boot = psutil.boot_time() - 60
    # what a cut can leave: job-id folders without a job.json (empty, or holding nothing but temporaries) and the
    # hidden half-made (.new-*) and half-removed (.gone-*) folders
    (store.root / "20250101-000000-abcdef").mkdir()
    half = store.root / "20250101-000001-abcdef"
    half.mkdir()
    (half / ".job.json.x1y2z3.tmp").write_text("{")
    (store.root / ".new-q1w2e3").mkdir()
    (store.root / ".new-q1w2e3" / "job.json").write_text("{}")
    (store.root / ".gone-a1s2d3").mkdir()
    (store.root / ".gone-a1s2d3" / "20250101-000002-abcdef").mkdir()
    # temporaries in the job folder: the daemon's own always go, a stage's only when stale (before the boot)
    for name in (".job.json.a1b2c3.tmp", ".cond.npy.a1b2c3.tmp", "job.json.tmp", "cond.npy.tmp.npy"):
        (d / name).write_bytes(b"torn")
    stale = d / ".sampler_state.safetensors.k9k9k9.tmp"
    stale.write_bytes(b"torn")
    os.utime(stale, (before_boot, before_boot))
    legacy_stale = d / "sampler_state.safetensors.new"
    legacy_stale.write_bytes(b"torn")
    os.utime(legacy_stale, (before_boot, before_boot))
    fresh = d / ".image.png.f0f0f0.tmp"                  # a live VAE may be writing this one right now
    fresh.write_bytes(b"half")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (d / ".latent.npy.zzzzzz.tmp").symlink_to(victim)   # links are never removed through
    kept = d / "cond.npy"
    kept.write_bytes(b"real data")
    fresh_store = JobStore(tmp_path, cached=True)
    assert [j.id for j in fresh_store.recover()] == [job.id]
    assert sorted(p.name for p in store.root.iterdir()) == [job.id]
    assert sorted(p.name for p in d.iterdir()) == sorted(["job.json", "cond.npy", fresh.name,
                                                           ".latent.npy.zzzzzz.tmp"])
    assert victim.read_text() == "keep" and kept.read_bytes() == b"real data"


def test_a_folder_with_data_but_no_record_is_left_alone(tmp_path):
    store = JobStore(tmp_path)
    odd = store.root / "20250101-000000-abcdef"
    odd.mkdir()
    (odd / "cond.npy").write_bytes(b"data")
    assert JobStore(tmp_path).recover() == []
    assert (odd / "cond.npy").read_bytes() == b"data"


def test_cached_store_reads_once_and_writes_through(tmp_path, monkeypatch):
    """The daemon re-read every job.json every 2 s; the single writer now keeps the records in memory."""
    store = JobStore(tmp_path, cached=True)
    jobs = [store.submit(SPEC) for _ in range(5)]
    store.transition(jobs[0].id, "encoding")
    reads = []
    real = JobStore._read
    monkeypatch.setattr(JobStore, "_read", lambda self, i: reads.append(i) or real(self, i))
    for _ in range(20):
        assert store.next_job().id == jobs[0].id
        store.list()
        store.get(jobs[3].id)
    assert reads == []
    changed = store.get(jobs[1].id)
    changed.spec["prompt"] = "mutated copy"                # a caller's copy never changes the store
    assert store.get(jobs[1].id).spec == SPEC
    store.transition(jobs[0].id, "denoising")
    monkeypatch.undo()
    reader = JobStore(tmp_path)                            # another process reading the folder sees the truth
    assert reader.get(jobs[0].id).state == "denoising"
    assert [j.to_dict() for j in reader.list()] == [j.to_dict() for j in store.list()]


def test_prune_keeps_running_and_queued_jobs(tmp_path):
    from orchestrator.engine.jobs import parse_age
    store = JobStore(tmp_path, cached=True)
    done = []
    for i in range(4):
        j = store.submit(SPEC)
        for s in ("encoding", "denoising", "decoding", "done"):
            store.transition(j.id, s)
        done.append(j)
    failed = store.submit(SPEC)
    store.fail(failed.id, "scheduler", "x")
    cancelled = store.submit(SPEC)
    store.cancel(cancelled.id)
    running = store.submit(SPEC)
    store.transition(running.id, "encoding")
    queued = store.submit(SPEC)
    removed = store.prune(keep=2)
    assert [j.id for j in removed] == [d.id for d in done]            # the 2 newest finished ones stay
    left = {j.id for j in store.list()}
    assert left == {failed.id, cancelled.id, running.id, queued.id}
    assert {p.name for p in store.root.iterdir()} == left
    assert store.prune(older_than_s=3600) == []
    later = time.time() + 7200
    assert {j.id for j in store.prune(older_than_s=3600, now=later)} == {failed.id, cancelled.id}
    assert {j.id for j in store.prune(keep=0)} == set()
    assert {j.id for j in JobStore(tmp_path).list()} == {running.id, queued.id}
    with pytest.raises(JobError, match="only finished jobs"):
        store.remove(running.id)
    assert (parse_age("7d"), parse_age("12h"), parse_age("30m"), parse_age("45s"), parse_age("90")) == \
        (7 * 86400, 12 * 3600, 1800, 45, 90)
    for bad in ("7 days", "-1d", "d", "1w", ""):
        with pytest.raises(ValueError, match="not an age"):
            parse_age(bad)


def _finished_records(store, n: int, t0: float = 1_700_000_000.0) -> list[str]:
    """`n` done jobs written as the daemon leaves them (one second apart), straight to disk."""
    ids = []
    for i in range(n):
        job_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(t0 + i)) + f"-{i:06x}"
        store.job_dir(job_id).mkdir()
        rec = {"id": job_id, "state": "done", "spec": {**SPEC, "prompt": "x" * 1000}, "created": t0 + i,
               "updated": t0 + i + 0.5, "origin": {"api": "comfyui", "graph": {"3": {"inputs": {}}}},
               "history": [["queued", t0 + i, "submitted"], ["done", t0 + i + 0.5, ""]], "image": f"/i/{i}.png"}
        (store.job_dir(job_id) / "job.json").write_text(json.dumps(rec))
        ids.append(job_id)
    return ids


def test_status_reads_and_copies_no_more_for_many_finished_jobs(tmp_path, monkeypatch):
    """STATUS deep-copied every record (3,000 finished jobs: 1.1 s per STATUS, /history?max_items=1024 57 s, +76 MB in
    the daemon). The daemon's store keeps an index entry per job and whole records only for the unfinished ones: a
    STATUS reads the records it details, no more, and copies none."""
    import orchestrator.engine.jobs as jobs_mod
    from orchestrator.engine.daemon import Daemon
    from protocol import messages as m
    done = _finished_records(JobStore(tmp_path), 300)
    store = JobStore(tmp_path, cached=True)
    queued = [store.submit(SPEC).id for _ in range(2)]
    store.transition(queued[0], "encoding")
    store.recover()
    daemon = Daemon.__new__(Daemon)                     # the STATUS handler over this store, no sockets
    daemon.store, daemon.progress, daemon.denoise_pass = store, {}, {}
    reads, copies = [], []
    real_read, real_copy = JobStore._read, jobs_mod.copy.deepcopy
    monkeypatch.setattr(JobStore, "_read", lambda self, i: reads.append(i) or real_read(self, i))
    monkeypatch.setattr(jobs_mod.copy, "deepcopy", lambda o, *a: copies.append(o) or real_copy(o, *a))
    page = daemon._status(m.Status(detail=True, limit=32))
    assert [j.job for j in page.jobs] == done[-30:] + queued and page.more
    assert json.loads(page.jobs[0].spec_json)["prompt"] == "x" * 1000 and page.jobs[0].image == "/i/270.png"
    assert sorted(reads) == done[-30:] and copies == []          # the detailed finished ones, read once each
    reads.clear()
    older = daemon._status(m.Status(limit=5, before=done[-30]))
    assert [j.job for j in older.jobs] == done[-35:-30] and older.more and reads == []
    active = daemon._status(m.Status(active=True, detail=True))
    assert [j.job for j in active.jobs] == queued and not active.more
    assert json.loads(active.jobs[1].spec_json) == SPEC and active.jobs[1].position == 1
    assert reads == [] and copies == []
    assert set(store._live) == set(queued)                       # whole records in memory: the unfinished only
    assert store.next_job().id == queued[0] and reads == [] and copies == []


def test_a_wrong_typed_record_is_set_aside_not_fatal(tmp_path):
    """Valid JSON with `"created": "yesterday"` stopped the daemon's recover (TypeError sorting the jobs): it is set
    aside, listed as unreadable with why, left on disk; the other jobs list and run."""
    from orchestrator.engine.job_record import UNREADABLE
    store = JobStore(tmp_path)
    good = store.submit(SPEC)
    bad = store.submit(SPEC)
    path = store.job_dir(bad.id) / "job.json"
    rec = json.loads(path.read_text())
    for field, value in (("created", "yesterday"), ("updated", None), ("error", "oops"), ("image", 5)):
        path.write_text(json.dumps({**rec, field: value}))
        daemon_store = JobStore(tmp_path, cached=True)
        assert [j.id for j in daemon_store.recover()] == []
        entries, _ = daemon_store.entries()
        assert [(e.id, e.state) for e in entries if e.state == UNREADABLE] == [(bad.id, UNREADABLE)], field
        aside = next(e for e in entries if e.id == bad.id)
        assert str(path) in aside.error and field in aside.error
        assert [j.id for j in daemon_store.pending()] == [good.id] and daemon_store.next_job().id == good.id
        with pytest.raises(JobError, match="unreadable"):
            daemon_store.get(bad.id)
        with pytest.raises(JobError, match="unreadable"):
            daemon_store.remove(bad.id)
        assert [e.id for e in daemon_store.prunable(keep=0)] == []
        assert path.exists()


# (field, a value of the wrong type or out of range, what the reason names): each read in a record otherwise whole
BAD_FIELDS = [
    ("state", "bogus", "state: 'bogus' is not one of queued"),
    ("created", -1.0, "created: -1.0 is out of range"),
    ("updated", 1e300, "updated: 1e+300 is out of range"),
    ("spec", "a girl", "spec: expected dict, got str"),
    ("spec", {**SPEC, "steps": 0}, "spec.steps: must be in 1..200, got 0"),
    ("spec", {**SPEC, "cfg": "high"}, "spec.cfg"),
    ("start_at", "done", "start_at: 'done' is not one of encoding, denoising, decoding"),
    ("failed_at", 3, "failed_at"),
    ("error", {"stage": "vae", "message": 5}, "error.message: expected string, got int"),
    ("attempts", {"encoding": "twice"}, "attempts.encoding: expected integer"),
    ("attempts", {"sleeping": 1}, "attempts"),
    ("cancel_requested", "no", "cancel_requested: expected boolean"),
    ("report", "", "report"),
    ("history", [["queued", "noon", ""]], "history[0][1]: expected float"),
    ("history", [["queued", 1.0]], "history[0]"),
    ("origin", ["comfyui"], "origin: expected dict, got list"),
]


@pytest.mark.parametrize("field,value,says", BAD_FIELDS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD_FIELDS)])
def test_every_field_of_a_record_is_type_checked_on_read(tmp_path, field, value, says):
    """job.json is a typed record: a queued job whose record holds a wrong-typed or out-of-range field (a spec its
    flow would refuse, attempts that are not counts, history entries that are not [state, time, note]) was taken as
    the next job and failed the daemon when it ran or changed it. It is set aside when read, naming the file and the
    field, and the daemon's queue goes on with the next job."""
    from orchestrator.engine.job_record import UNREADABLE
    store = JobStore(tmp_path)
    bad, good = store.submit(SPEC), store.submit(SPEC)
    path = store.job_dir(bad.id) / "job.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    daemon_store = JobStore(tmp_path, cached=True)
    assert daemon_store.recover() == []
    aside = {e.id: e for e in daemon_store.entries()[0]}[bad.id]
    assert aside.state == UNREADABLE and str(path) in aside.error and says in aside.error, aside.error
    assert [j.id for j in daemon_store.pending()] == [good.id] and daemon_store.next_job().id == good.id
    with pytest.raises(JobError, match="unreadable"):
        JobStore(tmp_path).get(bad.id)
    assert path.exists()


def test_a_resume_its_flow_would_refuse_is_refused_and_nothing_written(tmp_path):
    """A finished job's spec is listed, not parsed; resuming one whose spec its flow would refuse is a JobError
    naming the field, the record on disk unchanged (it would have become the daemon's next job)."""
    store = JobStore(tmp_path, cached=True)
    job = store.submit(SPEC)
    store.transition(job.id, "cancelled")
    path = store.job_dir(job.id) / "job.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "spec": {**SPEC, "steps": 0}}))
    store = JobStore(tmp_path, cached=True)
    assert store.get(job.id).state == "cancelled"                 # listed and shown as it is
    before = path.read_text()
    with pytest.raises(JobError, match=r"not saved: spec.steps: must be in 1..200, got 0"):
        store.resume(job.id)
    assert path.read_text() == before and store.pending() == []


def test_what_a_record_keeps_of_free_text_is_a_record(tmp_path):
    """A failure's message is free text from a stage (it may echo the request): NULs and any length were written
    into a record that could then not be read back."""
    store = JobStore(tmp_path, cached=True)
    job = store.submit(SPEC)
    store.transition(job.id, "encoding")
    store.fail(job.id, "encoder", "bad\x00byte " + "x" * 70_000)
    again = JobStore(tmp_path).get(job.id)
    assert again.state == "failed" and again.error["message"].startswith("bad\\x00byte x")
    assert len(again.error["message"]) == 65_536 and again.history[-1][2] == again.error["message"]


def test_a_submit_whose_origin_the_record_cannot_keep_is_a_field_error(tmp_path):
    """SUBMIT's origin is kept in the job's record: one it cannot keep (a list, 65 keys, a key of 129 characters)
    is the client's bad_request naming the field, not a failure of the daemon's store (its traceback in the log)."""
    from collections import OrderedDict
    from orchestrator.engine.daemon import Daemon
    from protocol import messages as m
    daemon = Daemon.__new__(Daemon)                     # the SUBMIT handler over this store, no sockets
    from types import SimpleNamespace
    daemon.store, daemon.packs, daemon._submits, daemon._wake = JobStore(tmp_path, cached=True), \
        {(64, 64): SimpleNamespace(sampling=None)}, OrderedDict(), False
    daemon.vae_sizes = None                             # a VAE that decodes any size (no VAE pack configured)
    daemon._pending = {}                                # no SUBMIT's LoRAs under check
    from orchestrator.engine.runfolder import RunFolder
    daemon.rf = RunFolder(tmp_path)                     # uploads (none here) are read from its input/
    from stages.config import parse_config
    daemon.cfg = parse_config({"run_dir": str(tmp_path)}, tmp_path / "pipeline.toml")   # no stage records: none stale
    from protocol.prompt import PromptFile
    prompt = PromptFile.from_data({"prompt": "a girl", "seed": 7, "steps": 4, "width": 64, "height": 64})
    for origin, field in (([1], "origin"), ({f"k{i}": 1 for i in range(65)}, "origin"),
                          ({"k" * 129: 1}, "origin.<key>")):
        reply = daemon._submit(m.Submit(id=1, prompt=prompt, base_dir=str(tmp_path), origin=json.dumps(origin)))
        assert isinstance(reply, m.Error) and reply.code == "bad_request" and reply.field == field, reply
    assert daemon.store.entries()[0] == []
    reply = daemon._submit(m.Submit(id=2, prompt=prompt, base_dir=str(tmp_path), origin='{"api": "cli"}'))
    assert isinstance(reply, m.Submitted) and daemon.store.get(reply.job).origin == {"api": "cli"}


def test_a_resent_prune_gets_the_first_ones_answer(tmp_path):
    """A PRUNE whose reply the client did not wait for (the daemon busy reading 3,000 records) was resent and
    removed the next batch: the first batch's jobs were removed but never listed or counted. A resend (same request
    id) gets the first answer; a new request goes on."""
    from collections import OrderedDict
    from orchestrator.engine.daemon import Daemon
    from protocol import messages as m
    ids = _finished_records(JobStore(tmp_path), 300)
    daemon = Daemon.__new__(Daemon)                     # the PRUNE handler over this store, no sockets
    daemon.store, daemon.progress, daemon._prunes = JobStore(tmp_path, cached=True), {}, OrderedDict()
    daemon.denoise_pass = {}
    first = m.Prune(keep=0)
    reply = daemon._prune(first)                        # a batch: up to 256 jobs or PRUNE_BATCH_S
    n = len(reply.jobs)
    assert 1 <= n <= m.MAX_JOBS_LISTED and [j.job for j in reply.jobs] == ids[:n] and reply.more
    again = daemon._prune(m.Prune(id=first.id, keep=0))             # the resend
    assert again == reply and len(daemon.store.entries()[0]) == 300 - n
    listed = [j.job for j in reply.jobs]
    while True:
        rest = daemon._prune(m.Prune(keep=0))
        listed += [j.job for j in rest.jobs]
        if not rest.more:
            break
    assert listed == ids and daemon.store.entries()[0] == []


def test_a_job_id_with_a_trailing_newline_is_not_a_job_id(tmp_path):
    """JOB_ID_RE ended in `$`, which also matches before a final newline: "JOB\\n" passed as an id (into a path, a
    /view subfolder, a STATUS)."""
    from orchestrator.http import files
    from orchestrator.engine.job_record import JOB_ID_RE
    store = JobStore(tmp_path)
    job = store.submit(SPEC).id
    for bad in (job + "\n", "\n" + job, job + "\r\n"):
        assert JOB_ID_RE.match(bad) is None
        with pytest.raises(JobError, match="is not a job id"):
            store.get(bad)
        with pytest.raises(files.BadName):
            files.resolve(store.root, "image.png", bad)
    assert JOB_ID_RE.match(job) and store.get(job).id == job


def test_other_names_that_reach_files_refuse_a_trailing_newline(tmp_path):
    """The same `$` let "anima\\n" through as a unit name and "job\\n" into a shared-memory segment name."""
    from orchestrator.ops import service
    from protocol.arena import ArenaError, segment_name
    with pytest.raises(service.ServiceError, match="--name"):
        service.target("anima\n", user_unit=True, root=str(tmp_path))
    assert service.target("anima", user_unit=True, root=str(tmp_path)).name == "anima"
    with pytest.raises(ArenaError, match="not usable in a segment name"):
        segment_name(tmp_path, "job\n")
    assert segment_name(tmp_path, "job")


def test_daemon_restart_clears_every_job_folder_temporary(tmp_path):
    """Every file of the job-folder table leaves a torn temporary: a daemon start removes all of the daemon's own
    (init_latent.npy's among them: it was missing from the list), a stage's only when stale."""
    import psutil
    from models.base.durable import atomic_write
    from orchestrator.engine.job_files import DAEMON, JOB_FILES, names
    store = JobStore(tmp_path)
    job = store.submit(SPEC)
    store.transition(job.id, "encoding")
    d = store.job_dir(job.id)
    atomic_write(d / "init_latent.npy", b"whole")              # the file itself stays; only its torn copies go
    before_boot = psutil.boot_time() - 60
    daemon_temps, stale_stage, fresh_stage = [], [], []
    for f in JOB_FILES:
        for i, name in enumerate(names(f)):
            temp = d / f".{name}.t{i:05d}.tmp"                 # the name atomic_write gives its temporary
            temp.write_bytes(b"torn")
            if f.writer == DAEMON:
                daemon_temps.append(temp.name)
            else:
                old = d / f".{name}.s{i:05d}.tmp"
                old.write_bytes(b"torn")
                os.utime(old, (before_boot, before_boot))
                stale_stage.append(old.name)
                fresh_stage.append(temp.name)
    assert ".init_latent.npy.t00000.tmp" in daemon_temps and ".job.json.t00000.tmp" in daemon_temps
    assert ".hires_init_3.npy.t00003.tmp" in daemon_temps and ".first_1.png.t00001.tmp" in daemon_temps
    JobStore(tmp_path, cached=True).recover()
    left = sorted(p.name for p in d.iterdir())
    assert left == sorted(["job.json", "init_latent.npy", *fresh_stage])      # a live stage may be writing those
    assert (d / "init_latent.npy").read_bytes() == b"whole"
