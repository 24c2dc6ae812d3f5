"""The front's client of the orchestrator daemon: one DEALER socket, many requests in flight, each matched to its
reply by id and read as every daemon client reads one (orchestrator.engine.daemon_client.read_reply). A daemon that is
down (no connection: ZMQ_IMMEDIATE refuses the send) or silent (no reply within the timeout) is `DaemonDown` -> 503,
never a hang."""
from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from orchestrator.engine.daemon_client import DaemonDown, DaemonRefused, read_reply  # noqa: F401 - theirs to catch
from protocol import codec
from protocol import messages as m
from protocol.fields import ProtocolError
from protocol.sockets import configure

log = logging.getLogger(__name__)


class DaemonLink:
    def __init__(self, endpoint: str, timeout_s: float = 5.0):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        sock = configure(self.ctx.socket(zmq.DEALER))
        sock.setsockopt(zmq.IMMEDIATE, 1)          # queue only to a connected daemon: a dead one fails the send
        sock.connect(self.endpoint)
        self.sock = sock
        self._reader = asyncio.create_task(self._read(), name="daemon-link")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        if self.sock is not None:
            self.sock.close(0)
        for fut in self.pending.values():
            fut.cancel()
        self.ctx.term()

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            if len(frames) < 2 or frames[0].bytes != b"":
                log.warning("dropped a daemon reply without the delimiter frame")
                continue
            try:
                reply = codec.decode(frames[1:])
            except ProtocolError as e:
                log.warning("undecodable daemon reply dropped: %s", e)
                continue
            fut = self.pending.pop(reply.id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def call(self, msg: m.Message, expect: type[m.Message], timeout_s: float | None = None) -> m.Message:
        """Send `msg`, return the reply of kind `expect`; DaemonRefused for an ERROR, DaemonDown for no answer."""
        fut = asyncio.get_running_loop().create_future()
        self.pending[msg.id] = fut
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            try:
                await self.sock.send_multipart([b"", *codec.encode(msg)], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise DaemonDown(f"the orchestrator daemon is not running (no connection to {self.endpoint}); is "
                                 f"supervisord up?") from None
            try:
                reply = await asyncio.wait_for(fut, timeout_s)
            except asyncio.TimeoutError:
                raise DaemonDown(f"the orchestrator daemon did not answer {msg.KIND} within {timeout_s:.0f} s") from None
        finally:
            self.pending.pop(msg.id, None)
        return read_reply(reply, expect, msg.KIND)

    async def status_pages(self, **status):
        """The jobs of a STATUS listing page by page, the newest page first (each oldest first): a reply stops at
        its size budget or `limit` and says `more`, so the next page asks for the jobs `before` its oldest one."""
        before = status.pop("before", None)
        while True:
            reply = await self.call(m.Status(before=before, **status), m.Jobs)
            yield reply.jobs
            if not reply.more or not reply.jobs:
                return
            before = reply.jobs[0].job
