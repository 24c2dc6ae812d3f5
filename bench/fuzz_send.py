"""bench/fuzz_http.py's client: several requests in flight over keep-alive connections (one requests.Session per
worker thread), each answer judged in the worker (`judge`), and the job an accepted request queued cancelled at once
by the same worker (`POST /anima/jobs/{job}/cancel`: queued or already running, it would only start the harness's
missing encoder). Removing them in bulk instead (`POST /queue {"delete": [...]}` every 32) was measured slower:
the waiting jobs ran meanwhile, each starting the encoder, and an A1111 call queued behind them outwaited --timeout.

    sender = Sender(url, timeout_s=60, workers=4, secrets=(...))
    fut = sender.send(kind, index, method, path, text)   # -> Answer when done
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

FUZZ_ENCODER = "/nonexistent/fuzz/"        # bench.fuzz_live.FUZZ_TOML's text encoder: every job fails there
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
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fuzz")
        self.local = threading.local()

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
                if a.job:
                    self._cancel(a)
                return a
            busy += 1
            time.sleep(min(int(wait_s), 5))

    def send(self, kind: str, index: int, method: str, path: str, text: str) -> Future:
        return self.pool.submit(self._one, kind, index, method, path, text)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _cancel(self, a: Answer) -> None:
        """The accepted job cancelled; a 5xx or no answer is the case's failure (a 409, it ended already, is not)."""
        try:
            r = self._session().post(self.url + f"anima/jobs/{a.job}/cancel", timeout=self.timeout_s)
        except requests.RequestException as e:
            a.failures.append(("down", f"cancel {a.job}: {e}"[:400]))
            return
        if r.status_code >= 500:
            a.failures.append(("5xx", f"cancel {a.job}: {r.status_code} {r.text[:300]}"))
