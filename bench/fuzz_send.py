"""bench/fuzz_http.py's client: several requests in flight over keep-alive connections (one requests.Session per
worker thread), each answer judged in the worker (`judge`), and the jobs the accepted requests queued removed in
bulk (ComfyUI's `POST /queue {"delete": [...]}`, which cancels waiting jobs; a job already running fails at the
harness's missing encoder by design).

    sender = Sender(url, timeout_s=60, workers=4, secrets=(...))
    fut = sender.send(kind, index, method, path, text)   # -> Answer when done
    sender.cancel_queued()                               # the accepted jobs so far, one request
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

FUZZ_ENCODER = "/nonexistent/fuzz/"        # bench.fuzz_live.FUZZ_TOML's text encoder: every job fails there
CANCEL_BATCH = 32                           # accepted jobs removed per POST /queue
BUSY_TRIES = 30                             # a 503 with Retry-After (the front shedding load) is sent again this often


@dataclass
class Answer:
    kind: str
    index: int
    outcome: str                            # the status code, "ran" (an A1111 job that failed at the encoder), ...
    busy_s: float                           # the request's own time, answer to answer
    failures: list = field(default_factory=list)     # [(what, detail)]: 5xx, hangs, down, tracebacks, leaks
    job: str | None = None                  # the job an accepted request queued
    busy: int = 0                           # 503s with Retry-After before this answer (sent again after the wait)


def judge(kind: str, index: int, r: requests.Response, busy_s: float, secrets: tuple) -> Answer:
    """One answer's outcome and failures: a 5xx (other than an A1111 call's own job failing at the harness's
    missing encoder), a traceback in the body, a path of `secrets` shown."""
    text = r.text
    a = Answer(kind, index, str(r.status_code), busy_s)
    if r.status_code == 500 and FUZZ_ENCODER in text and '"JobFailed"' in text:
        a.outcome = "ran"
    elif r.status_code >= 500:
        a.failures.append(("5xx", f"{r.status_code} {text[:400]}"))
    if "Traceback (most recent call last)" in text:
        a.failures.append(("tracebacks", text[:400]))
    if any(x in text for x in secrets):
        a.failures.append(("leaks", text[:400]))
    if r.status_code == 200 and r.headers.get("Content-Type", "").startswith("application/json"):
        body = r.json()
        a.job = body.get("prompt_id") or body.get("job") if isinstance(body, dict) else None
    return a


class Sender:
    def __init__(self, url: str, timeout_s: float, workers: int, secrets: tuple = ()):
        self.url, self.timeout_s, self.secrets = url, timeout_s, secrets
        self.pool = ThreadPoolExecutor(max_workers=workers + 1, thread_name_prefix="fuzz")  # +1: the bulk cancel
        self.local = threading.local()
        self.queued: list[str] = []
        self.cancel_failures: list[str] = []

    def _session(self) -> requests.Session:
        s = getattr(self.local, "session", None)
        if s is None:
            s = self.local.session = requests.Session()
        return s

    def _one(self, kind: str, index: int, method: str, path: str, text: str) -> Answer:
        """The case's answer; a 503 that says Retry-After (img2img's bound on requests preparing images at once) is
        what a client waits out: sent again after it, up to BUSY_TRIES times, and counted apart."""
        data, busy = text.encode("utf-8", "surrogatepass"), 0
        while True:
            t0 = time.monotonic()
            try:
                r = self._session().request(method, self.url + path, data=data, timeout=self.timeout_s,
                                            headers={"Content-Type": "application/json"})
            except requests.Timeout:
                return Answer(kind, index, "hang", time.monotonic() - t0, [("hangs", text[:200])], busy=busy)
            except requests.ConnectionError as e:
                return Answer(kind, index, "down", time.monotonic() - t0, [("down", str(e)[:400])], busy=busy)
            wait_s = r.headers.get("Retry-After", "")
            if r.status_code != 503 or not wait_s.isdigit() or busy >= BUSY_TRIES:
                a = judge(kind, index, r, time.monotonic() - t0, self.secrets)
                a.busy = busy
                return a
            busy += 1
            time.sleep(min(int(wait_s), 5))

    def send(self, kind: str, index: int, method: str, path: str, text: str) -> Future:
        return self.pool.submit(self._one, kind, index, method, path, text)

    def queue(self, job: str) -> None:
        self.queued.append(job)
        if len(self.queued) >= CANCEL_BATCH:
            self.cancel_queued()

    def cancel_queued(self) -> Future | None:
        """Remove the accepted jobs that still wait, one request for all (in the pool, not in the caller's way)."""
        ids, self.queued = self.queued, []
        return self.pool.submit(self._cancel, ids) if ids else None

    def _cancel(self, ids: list) -> None:
        try:
            r = self._session().post(self.url + "queue", json={"delete": ids}, timeout=self.timeout_s)
            if r.status_code != 200:
                self.cancel_failures.append(f"POST /queue delete {len(ids)}: {r.status_code} {r.text[:300]}")
        except requests.RequestException as e:
            self.cancel_failures.append(f"POST /queue delete {len(ids)}: {e}")

    def close(self) -> None:
        self.pool.shutdown(wait=True)
