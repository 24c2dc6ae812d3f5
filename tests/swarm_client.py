"""A ComfyUI client that sends exactly what SwarmUI's ComfyUI backend sends (ComfyUIAPIAbstractBackend.cs in
mcmonkeyprojects/SwarmUI), and reads the answers as it reads them; and SwarmUI's multi-backend dispatch over
several such servers (jobs to whichever backend is free; a backend that fails mid-job is set aside and its job
given to another).

    c = SwarmComfy("http://127.0.0.1:8188")
    c.load_value_set()                      # GET object_info: the model lists and node types, as LoadValueSet
    images = c.generate(graph)              # AwaitJobLive: ws, feature_flags, POST /prompt, the message loop,
                                            # GET history/{id}, GET view per image, POST history {"delete"}
What it checks on the way (each a SwarmProtocolError): text frames open with `{"type":` (SwarmUI parses only those
as JSON), the loop ends on `executing` with node null, history's `execution_error` message is the job's error.
"""
from __future__ import annotations

import json
import queue
import threading
import uuid
from dataclasses import dataclass, field

import requests
import websocket

MODEL_LISTS = {"Stable-Diffusion": ("UNETLoader", "unet_name"), "LoRA": ("LoraLoader", "lora_name"),
               "VAE": ("VAELoader", "vae_name"), "CLIP": ("CLIPLoader", "clip_name")}


class SwarmProtocolError(AssertionError):
    """The server answered something SwarmUI's backend would not take."""


class ComfyExecutionError(RuntimeError):
    """History's execution_error: SwarmUI's "ComfyUI execution error: <exception_message>"."""


@dataclass
class SwarmComfy:
    url: str                                        # "http://127.0.0.1:PORT"
    timeout_s: float = 60.0
    models: dict = field(default_factory=dict)      # subtype -> names, from object_info
    node_types: set = field(default_factory=set)
    messages: list = field(default_factory=list)    # (type, data) of the last job, ours only
    previews: int = 0                               # binary frames received in the last job
    server_flags: dict | None = None                # the server's answer to our feature_flags
    _ws: websocket.WebSocket | None = None
    _id: str = ""

    def _http(self, method: str, path: str, **kw) -> requests.Response:
        return requests.request(method, f"{self.url.rstrip('/')}/{path}", timeout=self.timeout_s, **kw)

    def _post_text(self, path: str, obj: dict) -> requests.Response:
        """SwarmUI posts queue/interrupt/history edits as StringContent: text/plain; charset=utf-8."""
        return self._http("POST", path, data=json.dumps(obj).encode(),
                          headers={"Content-Type": "text/plain; charset=utf-8"})

    def load_value_set(self) -> dict:
        """LoadValueSet: GET object_info; "error" in it is a failure; each model list from its loader's first input
        choice list (`input.required.PARAM[0]`). Also the liveness check SwarmUI's idler repeats."""
        r = self._http("GET", "object_info")
        r.raise_for_status()
        info = r.json()
        if "error" in info:
            raise SwarmProtocolError(f"remote error: {info['error']}")
        self.node_types = set(info)
        self.models = {sub: list(info[node]["input"]["required"][param][0])
                       for sub, (node, param) in MODEL_LISTS.items() if node in info}
        return info

    def _socket(self) -> None:
        """A reusable socket: connected once with a fresh GUID client id, then `feature_flags` sent first."""
        if self._ws is not None and self._ws.connected:
            return
        self._id = str(uuid.uuid4())
        ws_url = self.url.replace("http://", "ws://").rstrip("/") + f"/ws?clientId={self._id}"
        self._ws = websocket.create_connection(ws_url, timeout=self.timeout_s)
        self._ws.send(json.dumps({"type": "feature_flags", "data": {"supports_preview_metadata": True}}))

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def upload(self, data: bytes, name: str) -> str:
        """SwarmUI's init image without its custom nodes: multipart `image` and `overwrite` "true"."""
        r = self._http("POST", "upload/image", files={"image": (name, data, "image/png")},
                       data={"overwrite": "true"})
        r.raise_for_status()
        return r.json()["name"]

    def submit(self, graph: dict) -> str:
        self._socket()
        body = f'{{"prompt": {json.dumps(graph)}, "client_id": "{self._id}"}}'
        r = self._http("POST", "prompt", data=body.encode(), headers={"Content-Type": "application/json"})
        result = r.json()
        if "error" in result:
            raise SwarmProtocolError(f"ComfyUI errored: {json.dumps(result)}")
        return str(result["prompt_id"])

    def follow(self, prompt_id: str, on_start=None) -> None:
        """The message loop: messages before our execution_start are not ours; `executing` with node null ends it.
        `on_start()` is called at our execution_start (a test's cancel)."""
        self.messages, self.previews, mine = [], 0, False
        while True:
            frame = self._ws.recv()
            if isinstance(frame, bytes):
                self.previews += 1
                continue
            if not frame.startswith('{"type":'):
                raise SwarmProtocolError(f"a text frame SwarmUI would not parse as JSON: {frame[:40]!r}")
            msg = json.loads(frame)
            kind, data = msg["type"], msg["data"]
            if kind == "feature_flags":
                self.server_flags = data
            if not mine:
                if kind != "execution_start" or str(data.get("prompt_id")) != prompt_id:
                    continue
                mine = True
                if on_start is not None:
                    on_start()
            self.messages.append((kind, data))
            if kind == "executing" and data["node"] is None:
                return
            if kind == "progress":
                assert int(data["max"]) > 0, data

    def images(self, prompt_id: str) -> list[bytes]:
        """GET history/{id}; its execution_error message raised; every output's images by GET view; then POST
        history {"delete"}."""
        hist = self._http("GET", f"history/{prompt_id}").json()
        out = []
        if hist:
            entry = hist[prompt_id]
            for kind, data in entry.get("status", {}).get("messages", []):
                if kind == "execution_error" and "exception_message" in data:
                    raise ComfyExecutionError(data["exception_message"])
            for node_out in entry["outputs"].values():
                for img in node_out.get("images", []):
                    q = {"filename": img["filename"], "type": "temp" if img.get("type") == "temp" else "output"}
                    if img.get("subfolder"):
                        q["subfolder"] = img["subfolder"]
                    data = self._http("GET", "view", params=q).content
                    if not data:
                        raise SwarmProtocolError(f"empty image data for {img}")
                    out.append(data)
        r = self._post_text("history", {"delete": [prompt_id]})
        if r.status_code != 200:
            raise SwarmProtocolError(f"POST history delete: {r.status_code} {r.text}")
        return out

    def generate(self, graph: dict) -> list[bytes]:
        prompt_id = self.submit(graph)
        self.follow(prompt_id)
        return self.images(prompt_id)

    def interrupt(self, prompt_id: str) -> None:
        """doInterruptNow: the queue item deleted, the prompt interrupted by id, its history deleted."""
        for path, body in (("queue", {"delete": [prompt_id]}), ("interrupt", {"prompt_id": prompt_id}),
                           ("history", {"delete": [prompt_id]})):
            r = self._post_text(path, body)
            if r.status_code != 200:
                raise SwarmProtocolError(f"POST {path}: {r.status_code} {r.text}")


class Dispatcher:
    """SwarmUI's multi-backend as far as jobs go: `usages` workers per backend (its MaxUsages, 1 + OverQueue: a
    job queued behind the running one, each on a socket of its own) take the next job when one of them is free;
    a backend that fails (connection refused or dropped mid-job) is set aside and its job goes back to the
    queue for another; each job's images are kept by its key, with the backend that made them."""

    def __init__(self, urls: list[str], timeout_s: float = 60.0, usages: int = 2):
        self.urls, self.timeout_s, self.usages = urls, timeout_s, usages
        self.jobs: queue.Queue = queue.Queue()
        self.results: dict = {}
        self.total = 0
        self.failed: dict[str, str] = {}          # backend url -> why it was set aside
        self.retried: list = []                   # keys of jobs given to another backend
        self._lock = threading.Lock()

    def run(self, jobs: dict) -> dict:
        """{key: graph} -> {key: (url, images)}; every job done, or an AssertionError when no backend is left."""
        self.total = len(jobs)
        for key, graph in jobs.items():
            self.jobs.put((key, graph))
        workers = [threading.Thread(target=self._work, args=(u,), daemon=True)
                   for u in self.urls for _ in range(self.usages)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(self.timeout_s * len(jobs))
        missing = set(jobs) - set(self.results)
        assert not missing, f"jobs never done: {sorted(missing)}; backends set aside: {self.failed}"
        return self.results

    def _work(self, url: str) -> None:
        client = SwarmComfy(url, self.timeout_s)
        try:
            client.load_value_set()
        except (requests.RequestException, SwarmProtocolError) as e:
            self.failed[url] = f"init: {e}"
            return
        while len(self.results) < self.total:
            try:
                key, graph = self.jobs.get(timeout=0.2)
            except queue.Empty:
                continue                              # a job may come back from a backend that fails
            try:
                images = client.generate(graph)
            except (requests.RequestException, websocket.WebSocketException, OSError) as e:
                self.retried.append(key)
                self.jobs.put((key, graph))           # the backend went away: the job to another one
                self.failed[url] = f"{type(e).__name__}: {e}"
                client.close()
                return
            with self._lock:
                self.results[key] = (url, images)
        client.close()
