"""bench/fuzz_cases.py and bench/fuzz_send.judge: the HTTP fuzz's cases are distinct and a resumed run continues the
same sequence; answers are judged as the fuzz counts them. In process, no pipeline."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from bench.fuzz_cases import Cases, FuzzState
from bench.fuzz_inputs import InputRequests, denoise_of, steps_of
from bench.fuzz_send import Sender, judge


def _sampling(rng):
    body = {"steps": steps_of(rng), "denoise": denoise_of(rng)}
    return "POST", "anima/jobs", json.dumps(body)


def _take(cases: Cases, kind: str, n: int) -> list:
    return [cases.next_case(kind) for _ in range(n)]


def test_a_resumed_state_continues_the_same_distinct_sequence(tmp_path):
    makers = {"sampling": _sampling}
    whole = _take(Cases(makers, FuzzState(7)), "sampling", 300)
    first_state = FuzzState(7)
    first = _take(Cases(makers, first_state), "sampling", 120)
    first_state.save(tmp_path / "state.json")
    later = FuzzState.load(tmp_path / "state.json", seed=7)
    assert later.kinds["sampling"]["next"] == first_state.kinds["sampling"]["next"]
    rest = _take(Cases(makers, later), "sampling", 180)
    assert first + rest == whole
    texts = [case[2] for _, case in whole]
    assert len(set(texts)) == len(texts)
    other = _take(Cases(makers, FuzzState(8)), "sampling", 20)
    assert [c for _, c in other] != [c for _, c in whole[:20]]


def test_duplicates_are_skipped_and_a_small_space_is_exhausted():
    state = FuzzState(0)
    cases = Cases({"tiny": lambda rng: ("POST", "x", rng.choice("abc"))}, state)
    got = []
    while (nxt := cases.next_case("tiny")) is not None:
        got.append(nxt[1][2])
    assert sorted(got) == ["a", "b", "c"]
    k = state.kinds["tiny"]
    assert k["exhausted"] and k["duplicates"] >= 2000 and not cases.open("tiny")


def test_the_state_refuses_another_seed_and_keeps_failures(tmp_path):
    state = FuzzState(3, target=50)
    state.kind("image_page")
    state.add("image_page", 0, "400", 0.01)
    state.fail("image_page", "5xx", 17, "500 boom")
    state.peaks({"http": 300})
    state.save(tmp_path / "s.json")
    with pytest.raises(ValueError, match="--seed 3"):
        FuzzState.load(tmp_path / "s.json", seed=4)
    back = FuzzState.load(tmp_path / "s.json", seed=3, target=50)
    assert back.failures == [{"kind": "image_page", "what": "5xx", "index": 17, "detail": "500 boom", "run": 0}]
    assert not back.ok() and back.peaks({"http": 200}) == [] and back.peak_rss_mb == {"http": 300}
    assert back.summary() == ["image_page cases=1/50 duplicates_skipped=0 5xx=1 tracebacks=0 hangs=0 over_memory=0"]


def _two_runs(tmp_path):
    """A state as bench/fuzz_state.json's: run 1 without per-kind counts, over_memory in run 2 for two kinds."""
    state = FuzzState(0, target=50)
    state.runs.append({"cases": 3})
    for i in range(3):
        state.add("image_page", i, "200", 0.1)
    state.runs[-1].pop("kind_cases")                     # the first runs of the real state did not record them
    state.runs.append({"cases": 2})
    state.add("image_page", 3, "400", 0.1)
    state.add("sampling_page", 0, "400", 0.1)
    for kind in ("image_page", "sampling_page"):
        state.fail(kind, "over_memory", None, "http peak 1008 MB > 1000 MB")
    return state


def test_a_failure_marked_fixed_stays_in_the_history_and_no_longer_fails_the_state(tmp_path):
    state = _two_runs(tmp_path)
    assert not state.ok()
    with pytest.raises(ValueError, match="no unmarked 'over_memory' failure in run 1"):
        state.mark_fixed(1, "over_memory", "b867376", "tests/test_image_budget.py")
    assert state.mark_fixed(2, "over_memory", "b867376", "tests/test_image_budget.py") == 2
    state.save(tmp_path / "s.json")
    back = FuzzState.load(tmp_path / "s.json", seed=0, target=50)
    assert back.ok() and len(back.failures) == 2
    assert back.failures[0]["fixed"] == {"commit": "b867376", "test": "tests/test_image_budget.py"}
    assert back.kinds["image_page"]["over_memory"] == 1  # the history's counter kept
    # a run after the fix: its cases are the ones whose memory was checked with the fix in
    back.runs.append({"cases": 1})
    back.add("image_page", 4, "200", 0.1)
    assert back.memory_checked("image_page") == 1 and back.memory_checked("sampling_page") == 0
    lines = back.summary()
    assert lines[0] == ("image_page cases=5/50 duplicates_skipped=0 5xx=0 tracebacks=0 hangs=0 over_memory=0 "
                        "fixed=1 memory_checked=1")
    assert lines[2] == ("fixed: image_page over_memory (run 2: http peak 1008 MB > 1000 MB) by b867376, "
                        "regression test tests/test_image_budget.py")
    # the same failure again, after the fix, fails the state
    back.fail("image_page", "over_memory", None, "http peak 1200 MB > 1000 MB")
    assert not back.ok() and "over_memory=1 fixed=1" in back.summary()[0]


def test_mark_fixed_from_the_command_line(tmp_path, capsys):
    from bench.fuzz_http import main
    _two_runs(tmp_path).save(tmp_path / "s.json")
    assert main(["--resume", str(tmp_path / "s.json"), "--mark-fixed", "2", "hangs", "abc", "t.py"]) == 2
    assert main(["--resume", str(tmp_path / "s.json"), "--mark-fixed", "2", "over_memory", "b867376",
                 "tests/test_image_budget.py"]) == 0
    out = capsys.readouterr().out
    assert "2 over_memory failure(s) of run 2 marked fixed by b867376" in out and out.rstrip().endswith("ok")
    assert FuzzState.load(tmp_path / "s.json", seed=0).ok()


def _response(status: int, body: dict) -> requests.Response:
    r = requests.Response()
    r.status_code, r._content = status, json.dumps(body).encode()
    r.headers["Content-Type"] = "application/json"
    return r


def test_judge_counts_what_the_fuzz_fails_on():
    ok = judge("k", 1, _response(200, {"prompt_id": "j1"}), 0.1, ())
    assert (ok.outcome, ok.failures, ok.job) == ("200", [], "j1")
    ran = judge("k", 2, _response(500, {"error": "JobFailed: /nonexistent/fuzz/x", "type": "JobFailed"}), 0.1, ())
    assert (ran.outcome, ran.failures) == ("ran", [])
    bad = judge("k", 3, _response(502, {"error": "Traceback (most recent call last): /srv/loras/x"}), 0.1, ("/srv/loras",))
    assert [w for w, _ in bad.failures] == ["5xx", "tracebacks", "leaks"]


def test_the_input_kinds_have_room_for_the_target():
    """Each input kind's space holds far more than a few hundred cases: 400 draws give nearly 400 distinct texts."""
    gen = InputRequests(lambda: {"3": {"inputs": {}}}, {"a.png": b"x", "b.png": b"y"}, {"a.png": "a.png"})
    for kind in InputRequests.KINDS:
        state = FuzzState(0)
        cases = Cases({kind: getattr(gen, kind)}, state)
        _take(cases, kind, 400)
        assert state.kinds[kind]["duplicates"] < 40, kind


class _Front(BaseHTTPRequestHandler):
    """A front that sheds the first POST with 503 Retry-After, accepts the next (a job) and counts cancels."""
    seen: list = []

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Front.seen.append(self.path)
        if self.path.endswith("/cancel"):
            status, body, extra = 200, {"note": "cancelled"}, {}
        elif _Front.seen.count(self.path) == 1:
            status, body, extra = 503, {"error": "busy"}, {"Retry-After": "0"}
        else:
            status, body, extra = 200, {"job": "j7"}, {}
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **extra}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_sender_waits_out_retry_after_and_cancels_what_it_queued():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Front)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sender = Sender(f"http://127.0.0.1:{server.server_port}/", timeout_s=10, workers=2)
        a = sender.send("image_a1111", 5, "POST", "sdapi/v1/img2img", "{}").result(timeout=30)
        sender.close()
    finally:
        server.shutdown()
    assert (a.outcome, a.busy, a.job, a.failures) == ("200", 1, "j7", [])
    assert _Front.seen == ["/sdapi/v1/img2img", "/sdapi/v1/img2img", "/anima/jobs/j7/cancel"]


class _Lanes(BaseHTTPRequestHandler):
    """POST /slow answers after 0.5 s, POST /fast at once (400), GET /system_stats 200."""

    def _answer(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/slow":
            time.sleep(0.5)
        self._answer(400)

    def do_GET(self):
        self._answer(200)

    def log_message(self, *args):
        pass


def test_a_slow_kind_does_not_hold_back_the_fast_ones():
    """Each kind has its own lanes: in 3 s a kind answering in 0.5 s gets ~6 cases, one answering at once many
    more (taking the kinds in turn, both got the slow one's count)."""
    import subprocess
    import sys
    from types import SimpleNamespace
    from bench.fuzz_run import fuzz
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Lanes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # the watched "program": a small process of its own (this test worker's RSS, with the suite's models loaded
    # beside it, may pass the harness's memory bound and fail the run for a reason not the test's)
    small = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    info = SimpleNamespace(state="RUNNING", pid=small.pid)
    pipe = SimpleNamespace(sup=SimpleNamespace(info=lambda name: info))
    state = FuzzState(0)
    makers = {"slow": lambda rng: ("POST", "slow", str(rng.random())),
              "fast": lambda rng: ("POST", "fast", str(rng.random()))}
    try:
        run = fuzz(pipe, f"http://127.0.0.1:{server.server_port}/", state, makers, 10_000, 10.0, (), workers=2,
                   max_s=3.0)
    finally:
        server.shutdown()
        small.kill()
        small.wait()
    slow, fast = state.kinds["slow"]["cases"], state.kinds["fast"]["cases"]
    assert 3 <= slow <= 8 and fast > 5 * slow, (slow, fast)
    assert run["cases"] == slow + fast and state.ok()


def test_every_accepted_job_is_seen_to_end_cleanly(tmp_path):
    """check_ends reads each queued job's record once the queue settled: failed at the fuzz's missing encoder, failed
    naming a field or cancelled is clean; a job the daemon failed itself (its own exception) or a record gone is the
    case's bad_ends failure."""
    from bench.fuzz_run import check_ends
    from bench.fuzz_send import FUZZ_ENCODER

    def job(name: str, state: str, stage: str | None = None, message: str = "") -> str:
        (tmp_path / name).mkdir()
        err = {"stage": stage, "message": message} if stage else None
        (tmp_path / name / "job.json").write_text(json.dumps({"state": state, "error": err}))
        return name
    jobs = {job("a", "failed", "encoder", f"cannot start: --text-encoder {FUZZ_ENCODER}te.safetensors: no such file"):
            ("image_page", 1),
            job("b", "cancelled"): ("image_page", 2),
            job("c", "failed", "orchestrator", "prompt.json field 'loras[0]': bad file"): ("page_lora", 3),
            job("d", "failed", "orchestrator", "TypeError: 'NoneType' object is not subscriptable"): ("image_page", 4),
            job("e", "failed", "encoder", "encoder died"): ("sampling_comfy", 5),
            "gone": ("sampling_page", 6)}
    state = FuzzState(0)
    for kind, _ in jobs.values():
        state.kind(kind)
    ends = check_ends(tmp_path, jobs, state)
    assert ends == {"failed at the encoder": 1, "cancelled": 1, "failed naming a field": 1, "other": 3}
    bad = [(f["kind"], f["index"], f["what"]) for f in state.failures]
    assert bad == [("image_page", 4, "bad_ends"), ("sampling_comfy", 5, "bad_ends"), ("sampling_page", 6, "bad_ends")]
    assert "TypeError" in state.failures[0]["detail"] and "no readable job.json" in state.failures[2]["detail"]
    assert not state.ok() and state.kinds["image_page"]["bad_ends"] == 1
