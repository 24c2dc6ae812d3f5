"""WebSocket clients of `/ws?clientId=`: ComfyUI's messages {"type", "data"} to one client or to all, and the one
message a client may send, ComfyUI's `feature_flags` (its first message: the client's flags kept, the server's
answered)."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid

from aiohttp import WSMsgType, web

log = logging.getLogger(__name__)

MAX_CLIENTS = 64                # a phone and a few scripts; more is a leak or an attack
MAX_CLIENT_ID_CHARS = 128
SEND_TIMEOUT_S = 5.0            # a client that does not read is dropped rather than holding the others up


class Hub:
    def __init__(self, server_flags: dict | None = None):
        self.sockets: dict[str, web.WebSocketResponse] = {}
        self.on_connect = None           # async callable(sid) -> list of (type, data) to greet a client with
        self.server_flags = server_flags or {}      # answered to a client's feature_flags
        self.client_flags: dict[str, dict] = {}     # what each client said it supports

    def __len__(self) -> int:
        return len(self.sockets)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """ComfyUI's /ws: a client id from the query (a new one when absent); a reconnect with the same id replaces
        the old socket; the first message is `status` with the queue."""
        sid = request.query.get("clientId", "")
        if len(sid) > MAX_CLIENT_ID_CHARS or not sid.isprintable():
            raise web.HTTPBadRequest(text=f"clientId: at most {MAX_CLIENT_ID_CHARS} printable characters")
        if len(self.sockets) >= MAX_CLIENTS and sid not in self.sockets:
            raise web.HTTPServiceUnavailable(text=f"too many WebSocket clients ({MAX_CLIENTS})")
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=64 * 1024)
        await ws.prepare(request)
        sid = sid or uuid.uuid4().hex
        old = self.sockets.pop(sid, None)
        if old is not None:
            await old.close()
        self.sockets[sid] = ws
        try:
            if self.on_connect is not None:
                for kind, data in await self.on_connect(sid):
                    await self._send(sid, ws, kind, data)
            first = True
            async for msg in ws:                 # read to notice the close, and a first feature_flags
                if msg.type == WSMsgType.ERROR:
                    log.warning("ws %s closed with %s", sid, ws.exception())
                elif msg.type == WSMsgType.TEXT and first:
                    first = not await self._first_message(sid, ws, msg.data)
        finally:
            if self.sockets.get(sid) is ws:
                del self.sockets[sid]
                self.client_flags.pop(sid, None)
        return ws

    async def _first_message(self, sid: str, ws: web.WebSocketResponse, text: str) -> bool:
        """ComfyUI's negotiation (server.py): a first JSON message {"type": "feature_flags", "data": {...}} is kept
        as the client's flags and answered with the server's; -> whether it was the first JSON message (text that
        is not JSON is ignored and does not count, as there)."""
        try:
            msg = json.loads(text)
        except ValueError:
            log.info("ws %s: a message that is not JSON; ignored", sid)
            return False
        if isinstance(msg, dict) and msg.get("type") == "feature_flags":
            flags = msg.get("data")
            self.client_flags[sid] = flags if isinstance(flags, dict) else {}
            await self._send(sid, ws, "feature_flags", self.server_flags)
        return True

    async def send(self, kind: str, data: dict, sid: str | None = None) -> None:
        """To client `sid`, or to every client when None (an unknown sid is dropped, as ComfyUI does)."""
        targets = list(self.sockets.items()) if sid is None else (
            [(sid, self.sockets[sid])] if sid in self.sockets else [])
        await asyncio.gather(*(self._send(s, ws, kind, data) for s, ws in targets))

    async def _send(self, sid: str, ws: web.WebSocketResponse, kind: str, data: dict) -> None:
        try:
            await asyncio.wait_for(ws.send_json({"type": kind, "data": data}), SEND_TIMEOUT_S)
        except (ConnectionError, RuntimeError, asyncio.TimeoutError) as e:
            log.info("ws %s: send failed (%s); dropping it", sid, e)
            if self.sockets.get(sid) is ws:
                del self.sockets[sid]
            await ws.close()

    async def close(self) -> None:
        for ws in list(self.sockets.values()):
            await ws.close()
        self.sockets.clear()
