"""Session limits for streamable HTTP: one client flooding ``initialize`` must not lock the others out.

The SDK keeps every session until it is deleted or idle for 30 minutes, up to 10,000, and then answers every new
client 503 (issue 17: 9,993 initialize POSTs in 28 s did that, for half an hour, and grew the server by 380 MB).
This ASGI middleware, in front of the SDK's app, keeps its own table of the sessions it has seen opened and:

- caps the sessions of one client (its remote address: a token is one shared secret, so it names no client) at
  ``per_client``, and all sessions at ``total``. Past a cap it does not refuse the new session: it ends an older
  one, so a new client always gets in. The one ended is the least valuable: a session never used after its
  ``initialize`` (what a flood opens) before one that was, one without a request in flight before one with (an
  open event stream, a tool call), the least recently used first; past ``total``, from the client holding most.
  A session is ended the way a client ends it, by a DELETE through the SDK, so no SDK internals are touched.
- serves at most ``in_flight`` requests of one session at once; up to ``queued`` more wait for a turn with
  their bodies unread (uvicorn stops reading a socket at 64 KiB), and any beyond get 429. With the SDK's body cap
  (4 MiB) and no event store (nothing is kept for replay), that bounds what one session can make the server hold:
  about 8 × 4 MiB + 64 × 64 KiB. What the SDK keeps per session of what its client declares is capped too: an
  ``initialize`` whose ``clientInfo`` or ``capabilities`` is over :data:`MAX_CLIENT_DECLARED` is refused (400).
- forgets sessions the SDK has ended: deleted by their client, answered 404 (gone), or idle past ``idle_s``,
  the idle timeout the SDK is given too (:func:`mcp_server.http.build_app`).

Clients behind one address (every local client on a loopback server, or everyone behind a proxy) share one
``per_client`` budget: a flood of sessions used like a real client's cannot be told apart from one.

Issue 30: who a request is, for run_sql's fair queue, is what the client cannot choose. The middleware writes it
into the request's scope as :data:`CLIENT_KEY`: ``session:<id>`` for a session this server issued and still
holds, else ``peer:<address>``. A forged ``mcp-session-id`` or a new ``clientInfo`` name per call buys no new
share. Requests without a known session (the 2026 protocol's sessionless calls) are capped per address like a
session's: ``in_flight + queued`` at once, beyond that 429.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import anyio

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PER_CLIENT = 16  # sessions one address may hold: a few assistants on one machine, each with a session or two
TOTAL = 128  # sessions in all (~40 KB each when idle)
IN_FLIGHT = 8  # requests of one session served at once (an event stream and parallel tool calls)
QUEUED = 64  # more of them waiting for a turn, before 429
IDLE_S = 300.0  # a session with no request for this long is ended (the SDK's default is 30 minutes)
SESSION_HEADER = b"mcp-session-id"
# what a session may make the server keep of what its client declares (clientInfo, capabilities, each, as JSON):
# a real client's are a few hundred bytes; the SDK keeps both for the session's life
MAX_CLIENT_DECLARED = 16 << 10
MAX_OPEN_BODY = 4 << 20  # a request without a session is read whole to check the above: at most this much
CLIENT_KEY = "tracer.client"  # the scope key naming who sent the request (see the module's docstring)


@dataclass
class _Session:
    sid: str
    client: str
    last: float  # monotonic time of its last request's start or end
    used: bool = False  # has had a request after the one that opened it
    in_flight: int = 0  # requests admitted or waiting
    turns: anyio.Semaphore | None = None  # made on the first request (it needs the event loop)

    def worth(self) -> tuple[bool, bool, float]:
        """Sort key: the smallest is ended first."""
        return (self.in_flight > 0, self.used, self.last)


class SessionLimits:
    """ASGI middleware over the SDK's streamable HTTP app (served at ``path``) enforcing the limits above."""

    def __init__(
        self,
        app: ASGIApp,
        path: str = "/mcp",
        *,
        per_client: int = PER_CLIENT,
        total: int = TOTAL,
        in_flight: int = IN_FLIGHT,
        queued: int = QUEUED,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(per_client, total, in_flight) < 1 or queued < 0 or idle_s <= 0:
            raise ValueError("session limits must be positive")
        self.app = app
        self.path = path
        self.per_client = per_client
        self.total = total
        self.in_flight = in_flight
        self.queued = queued
        self.idle_s = idle_s
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        self._sessionless: dict[str, int] = {}  # address -> its requests in progress without a known session

    def open_sessions(self, client: str | None = None) -> int:
        """Sessions open (as far as this middleware knows), of ``client`` or of all."""
        return sum(1 for s in self._sessions.values() if client is None or s.client == client)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != self.path:
            await self.app(scope, receive, send)
            return
        sid = _header(scope, SESSION_HEADER)
        session = self._sessions.get(sid) if sid is not None else None
        if session is None:
            await self._without_session(scope, receive, send, sid)
            return
        scope[CLIENT_KEY] = f"session:{sid}"
        if session.in_flight >= self.in_flight + self.queued:
            await _refuse(send, 429, f"too many requests at once in this session (at most {self.in_flight} served)")
            return
        if session.turns is None:
            session.turns = anyio.Semaphore(self.in_flight)
        turns = session.turns
        session.in_flight += 1
        session.used = True
        session.last = self._clock()
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            async with turns:
                await self.app(scope, receive, watch)
        finally:
            session.in_flight -= 1
            session.last = self._clock()
            # 404: the SDK no longer has it (ended, or idle past its timeout); a DELETE that succeeded ended it
            if status == 404 or (scope.get("method") == "DELETE" and 200 <= status < 300):
                self._sessions.pop(sid, None)

    async def _without_session(self, scope: Scope, receive: Receive, send: Send, sid: str | None) -> None:
        """A request with no session this server holds: counted against its address's cap."""
        peer = _peer(scope)
        scope[CLIENT_KEY] = f"peer:{peer}"
        if self._sessionless.get(peer, 0) >= self.in_flight + self.queued:
            await _refuse(send, 429, f"too many requests at once without a session from this address ({peer})")
            return
        self._sessionless[peer] = self._sessionless.get(peer, 0) + 1
        try:
            if sid is None and scope.get("method") == "POST":
                await self._open(scope, receive, send)
            else:  # unknown to us: the SDK answers (404 for an unknown or expired id, or a GET without one)
                await self.app(scope, receive, send)
        finally:
            n = self._sessionless.pop(peer, 1) - 1
            if n > 0:
                self._sessionless[peer] = n

    async def _open(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve a request that may open a session; once it has, end older ones past the caps."""
        client = _peer(scope)
        opened: str | None = None
        body = await _read_body(receive, MAX_OPEN_BODY)
        if body is None:
            await _refuse(send, 413, f"request body over {MAX_OPEN_BODY >> 20} MiB")
            return
        too_big = _oversized_initialize(body)
        if too_big is not None:
            await _refuse(send, 400, too_big, code=-32602)
            return
        receive = _replay(body, receive)

        async def watch(message: Message) -> None:
            nonlocal opened
            if message["type"] == "http.response.start" and int(message["status"]) < 400:
                sid = _header(message, SESSION_HEADER)
                if sid is not None:
                    # registered before the client can know the id, so its next request is counted
                    self._sessions[sid] = _Session(sid, client, self._clock())
                    opened = sid
            await send(message)

        await self.app(scope, receive, watch)
        if opened is not None:
            # shielded: the flood's own request being cancelled must not leave the table over its caps
            with anyio.CancelScope(shield=True):
                await self._enforce(scope, client, opened)

    async def _enforce(self, scope: Scope, client: str, new: str) -> None:
        self._forget_idle()
        while True:
            mine = [s for s in self._sessions.values() if s.client == client and s.sid != new]
            if len(mine) >= self.per_client:
                victims = mine
            elif len(self._sessions) > self.total:
                by_client: dict[str, list[_Session]] = {}
                for s in self._sessions.values():
                    if s.sid != new:
                        by_client.setdefault(s.client, []).append(s)
                if not by_client:
                    return
                victims = max(by_client.values(), key=len)
            else:
                return
            victim = min(victims, key=_Session.worth)
            self._sessions.pop(victim.sid, None)  # before the await: a concurrent opening must not pick it too
            log.info("ending MCP session %s of %s: over the session limits", victim.sid[:8], victim.client)
            await self._delete(scope, victim.sid)

    def _forget_idle(self) -> None:
        """Drop sessions idle past ``idle_s``: the SDK, given the same timeout, has ended them (its clock starts
        when a request ends, as ours does, and ours is read after its)."""
        cutoff = self._clock() - self.idle_s
        for s in [s for s in self._sessions.values() if s.in_flight == 0 and s.last < cutoff]:
            del self._sessions[s.sid]

    async def _delete(self, like: Scope, sid: str) -> None:
        """End session ``sid`` in the SDK with a DELETE, carrying the Host of ``like`` (a request the Host
        check let through) so the SDK's own Host check accepts it."""
        host = _header(like, b"host") or "127.0.0.1:80"
        scope = {
            **like,
            "method": "DELETE",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": b"",
            "headers": [(b"host", host.encode("latin-1")), (SESSION_HEADER, sid.encode())],
        }
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await anyio.sleep_forever()  # the SDK does not wait for a disconnect on DELETE
            raise AssertionError("unreachable")

        async def discard(_: Message) -> None:
            return None

        try:
            with anyio.fail_after(5):
                await self.app(scope, receive, discard)
        except Exception:  # the session stays until the SDK's idle timeout ends it
            log.warning("could not end MCP session %s", sid[:8], exc_info=True)


def _peer(scope: Scope) -> str:
    """The address of the connection's peer (not its port: a client picks a new one per connection)."""
    return str((scope.get("client") or ("?", 0))[0])


def _header(scope_or_message: MutableMapping[str, Any], name: bytes) -> str | None:
    for k, v in scope_or_message.get("headers") or []:
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return None


async def _read_body(receive: Receive, cap: int) -> bytes | None:
    """The whole request body, or None once it passes ``cap`` bytes (the rest is left unread)."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: what came is what there is
            break
        chunk = bytes(message.get("body") or b"")
        size += len(chunk)
        if size > cap:
            return None
        parts.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app ``body`` (already read) in one message, then waits on the client's."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _oversized_initialize(body: bytes) -> str | None:
    """Why ``body`` is refused, if it is an ``initialize`` whose ``clientInfo`` or ``capabilities`` is over
    :data:`MAX_CLIENT_DECLARED` bytes: the SDK keeps both for the session's life (a 4 MB clientInfo cost 3.6 MB
    per session, issue 30), and a real client's are a few hundred bytes. Anything else goes to the SDK as sent."""
    try:
        parsed = json.loads(body)
    except ValueError:  # the SDK answers it
        return None
    for m in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(m, dict) or m.get("method") != "initialize" or not isinstance(m.get("params"), dict):
            continue
        for key in ("clientInfo", "capabilities"):
            size = len(json.dumps(m["params"].get(key)).encode())
            if size > MAX_CLIENT_DECLARED:
                return (
                    f"initialize's params.{key} is {size:,} bytes: at most {MAX_CLIENT_DECLARED:,} are accepted "
                    "(the server keeps it for the session's life): send only the client's name, version, capabilities"
                )
    return None


async def _refuse(send: Send, status: int, message: str, *, code: int = -32600) -> None:
    """A JSON-RPC error (no id), as the SDK answers its own refusals, with Retry-After."""
    body = json.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
