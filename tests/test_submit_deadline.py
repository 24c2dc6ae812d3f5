"""A SUBMIT whose answer comes after its client stopped waiting (the front's request_timeout_s: 503) is never queued:
a retrying client would otherwise get two jobs for one request (issue 45 item 4)."""
import asyncio
import json
import time
from collections import OrderedDict
from types import SimpleNamespace

from orchestrator.engine.jobs import JobStore
from protocol import messages as m
from protocol.prompt import PromptFile

PROMPT = {"prompt": "a girl", "seed": 7, "steps": 4, "width": 64, "height": 64}


def _daemon(tmp_path):
    """The SUBMIT handler over a job store in tmp_path, no sockets (as tests/test_jobs.py builds it)."""
    from orchestrator.engine.daemon import Daemon
    from orchestrator.engine.runfolder import RunFolder
    from stages.config import parse_config
    d = Daemon.__new__(Daemon)
    d.store, d.packs, d._submits, d._wake = JobStore(tmp_path, cached=True), \
        {(64, 64): SimpleNamespace(sampling=None)}, OrderedDict(), False
    d.vae_sizes, d._pending, d.rf = None, {}, RunFolder(tmp_path)
    d.cfg = parse_config({"run_dir": str(tmp_path)}, tmp_path / "pipeline.toml")
    return d


def test_a_submit_decided_after_its_client_gave_up_is_not_queued(tmp_path, monkeypatch):
    """The image work (reading and fitting the init image) outlasts the client's wait: the answer is busy/retry and
    no job is queued; the same work within the wait queues the job; a SUBMIT past its wait on arrival is refused
    before any work."""
    import orchestrator.engine.job_inputs as ji
    d = _daemon(tmp_path)
    calls = []

    def slow_inputs(root, spec):
        calls.append(spec)
        time.sleep(0.3)
        return {}
    monkeypatch.setattr(ji, "job_inputs", slow_inputs)
    prompt = PromptFile.from_data(PROMPT)
    late = d.handle(m.Submit(id=1, prompt=prompt, base_dir=str(tmp_path), answer_by=time.time() + 0.1))
    assert isinstance(late, m.Error) and late.code == "busy" and late.retry and "answer_by" in late.message, late
    assert d.store.entries()[0] == [] and len(calls) == 1 and 1 not in d._submits
    gone = d.handle(m.Submit(id=2, prompt=prompt, base_dir=str(tmp_path), answer_by=time.time() - 1))
    assert isinstance(gone, m.Error) and gone.code == "busy" and len(calls) == 1      # refused before the work
    ok = d.handle(m.Submit(id=3, prompt=prompt, base_dir=str(tmp_path), answer_by=time.time() + 30))
    assert isinstance(ok, m.Submitted) and [j.id for j in d.store.pending()] == [ok.job]
    waits = d.handle(m.Submit(id=4, prompt=prompt, base_dir=str(tmp_path)))          # 0: the client waits
    assert isinstance(waits, m.Submitted) and len(d.store.pending()) == 2


def test_the_front_sends_its_wait_and_listens_past_it(tmp_path):
    """The front's SUBMIT carries answer_by = now + request_timeout_s and its answer is awaited a grace longer, so
    a job the daemon queued (decided before answer_by) is never reported to the client as a 503."""
    from orchestrator.http.common import SUBMIT_GRACE_S, submit_job
    sent = []

    class Link:
        timeout_s = 5.0

        async def call(self, msg, expect, timeout_s=None):
            sent.append((msg, timeout_s, time.time()))
            return m.Submitted(id=msg.id, job="j1", seed=7)

    async def refresh():
        pass
    front = SimpleNamespace(link=Link(), rf=SimpleNamespace(root=tmp_path),
                            tracker=SimpleNamespace(follow=lambda job: None, refresh=refresh))
    sub = asyncio.run(submit_job(front, dict(PROMPT), {"api": "a1111"}))
    assert sub.job == "j1"
    (msg, timeout_s, at), = sent
    assert isinstance(msg, m.Submit) and abs(msg.answer_by - (at + 5.0)) < 1.0, msg.answer_by
    assert timeout_s == 5.0 + SUBMIT_GRACE_S and SUBMIT_GRACE_S >= 1.0
    assert json.loads(msg.origin) == {"api": "a1111"}
