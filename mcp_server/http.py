"""Transports: stdio, and streamable HTTP at ``/mcp`` in a FastAPI app (with ``/healthz``) served by uvicorn.

Loopback by default (``:8090`` = 127.0.0.1:8090) with the SDK's DNS-rebinding protection: only loopback Host and
Origin headers are accepted (a bad Host gets 421, a bad Origin 403). A non-loopback address needs a bearer token
(refused to start without one) and keeps Host/Origin validation on with an explicit allow-list: the SDK would switch
the protection off for a non-local host. The MCP app is mounted at ``/`` with its own path ``/mcp`` (a mount at
``/mcp`` would serve ``/mcp/mcp``), and its session manager runs in the host app's lifespan, since a mounted
sub-app's lifespan never runs.

Host/Origin are checked first, before any routing (:class:`HostCheck`): the SDK checks them only once a request
reaches its endpoint, and Starlette's slash redirect (``/mcp/`` → ``/mcp``) answered a forged Host before that
(issue 17). Sessions are capped per client and in all, end when idle for a few minutes, and hold a bounded number
of requests (:mod:`mcp_server.sessions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import os
import re
import resource
import socket
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import h11
import uvicorn
from fastapi import FastAPI, Request
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from starlette.responses import PlainTextResponse
from starlette.routing import Mount
from uvicorn.protocols.http.h11_impl import H11Protocol

from mcp_server import sessions
from mcp_server.auth import BearerTokenMiddleware, authorized
from mcp_server.server import build_server
from mcp_server.state import Connect
from tracer.analysis.db import recordings
from tracer.analysis.sql.pool import SqlPool
from tracer.errors import StoreError, UsageError

LOOPBACK_HOSTS = ["127.0.0.1:*", "localhost:*", "[::1]:*"]
# The SDK's own session cap, a backstop behind mcp_server.sessions' (which ends sessions after they open, so the
# SDK briefly holds the openings in flight on top of its TOTAL).
SDK_MAX_SESSIONS = 4 * sessions.TOTAL
STOP_GRACE_S = 0.5  # on SIGTERM/Ctrl-C, uvicorn waits this long for the requests in flight, then cancels them
STOP_S = 0.6  # and this long after the signal the workers are killed and the process ends (_DeadlineServer): with
# the kill and reap of four query workers after it, gone in about 0.7 s quiet, and up to 1.06 s seen under two loads
# on a 2-core machine
# Issue 30: 1,100 half-open connections made a server under `ulimit -n 1024` unreachable (uvicorn has no timeout
# for a request's head or body). A request's head and body must arrive within REQUEST_READ_S of its first byte
# (or of the connection); an idle keep-alive connection closes after KEEP_ALIVE_S; past MAX_CONNECTIONS open
# connections a new one is closed at once, and the process raises its own file limit to the hard limit.
REQUEST_READ_S = 15.0
KEEP_ALIVE_S = 5
MAX_CONNECTIONS = 1000
FD_RESERVE = 200  # descriptors kept for the DB files, query worker pipes and logs beyond the connections


def parse_listen(spec: str) -> tuple[str, int]:
    """Parse ``[HOST]:PORT`` ('':8090', '0.0.0.0:8090', '[::1]:8090'); an empty host means 127.0.0.1."""
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"bad --http address {spec!r}", "Use [HOST]:PORT, e.g. --http :8090 or --http 0.0.0.0:8090.")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(token_file: Path | None, env_value: str | None) -> str | None:
    """Return the bearer token from ``token_file`` (first line) or the environment value; None if neither."""
    if token_file is not None:
        try:
            token = token_file.read_text().strip().splitlines()[0].strip() if token_file.read_text().strip() else ""
        except OSError as e:
            raise UsageError(f"cannot read --token-file {token_file}: {e.strerror}", "Pass a readable file.") from None
        if not token:
            raise UsageError(
                f"--token-file {token_file} is empty",
                "Write a long random token into it, e.g. "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))' > token.txt",
            )
        return token
    return env_value.strip() if env_value and env_value.strip() else None


def security_for(host: str, port: int, extra_hosts: list[str]) -> TransportSecuritySettings:
    """Return the Host/Origin allow-list: loopback names, plus (non-loopback) this host's names and ``extra_hosts``."""
    hosts = list(LOOPBACK_HOSTS)
    if not is_loopback(host):
        names = {host, socket.gethostname(), socket.getfqdn()} - {"0.0.0.0", "::", ""}
        hosts += [f"{n}:{port}" for n in sorted(names)]
    hosts += [h if ":" in h else f"{h}:{port}" for h in extra_hosts]
    origins = [f"http://{h}" for h in hosts] + [
        f"https://{h}" for h in hosts if not h.startswith(("127.", "local", "[::1]"))
    ]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins)


def _paths(db: str | Path | Sequence[str | Path]) -> list[Path]:
    """The recordings ``db`` names (several: a job); as given when they cannot be listed (opening says why)."""
    try:
        return recordings(db)
    except StoreError:
        return [Path(str(db))]


def sql_file(db: str | Path | Sequence[str | Path]) -> Path | None:
    """The one file run_sql's query workers open as they start; None for a job (run_sql refuses it)."""
    paths = _paths(db)
    return paths[0] if len(paths) == 1 else None


def build_app(
    db: str | Path | Sequence[str | Path],
    host: str = "127.0.0.1",
    port: int = 8090,
    *,
    token: str | None = None,
    allowed_hosts: list[str] | None = None,
    connect: Connect | None = None,
    sql_pool: SqlPool | None = None,
    freshen: Callable[[], None] | None = None,
) -> Any:
    """Return the ASGI app: FastAPI with ``/healthz`` and MCP streamable HTTP at ``/mcp``.

    run_sql's query workers (``sql_pool``, default a new :class:`SqlPool`) start with the app and are killed
    when it stops. ``/healthz`` always says ok, and names the DB only to a request the MCP endpoint would accept
    (allowed Host and Origin, and the token when one is set).

    Raises:
        UsageError: non-loopback ``host`` without a token.
    """
    if not is_loopback(host) and not token:
        raise UsageError(
            f"refusing to serve MCP on non-loopback address {host} without a bearer token",
            "Set TRACER_MCP_TOKEN or pass --token-file FILE (clients then send Authorization: Bearer "
            "<token>), or bind to loopback with --http :PORT.",
        )
    pool = sql_pool or SqlPool()
    mcp = build_server(db, connect=connect, sql_pool=pool, freshen=freshen)
    security = security_for(host, port, allowed_hosts or [])
    mcp_app = mcp.streamable_http_app(
        streamable_http_path="/mcp",
        host=host,
        transport_security=security,
        session_idle_timeout=sessions.IDLE_S,
        max_sessions=SDK_MAX_SESSIONS,
    )
    checks = TransportSecurityMiddleware(security)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if connect is None:
            pool.start(sql_file(db))
        try:
            async with mcp.session_manager.run():
                try:
                    yield
                finally:
                    # before the sessions end: a tool call's thread waiting on a query worker returns at once,
                    # where ending the sessions first would wait for it (a run_sql for up to its timeout)
                    pool.close()
        finally:
            pool.close()

    app = FastAPI(title="cuda-host-tracer MCP", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, str]:
        body = {"status": "ok", "mcp": "/mcp"}
        trusted = strict_refusal(request.scope, security) is None and await checks.validate_request(request) is None
        if trusted and (token is None or authorized(dict(request.scope.get("headers") or []), token)):
            body["db"] = "+".join(p.name for p in _paths(db))
        return body

    app.router.routes.append(Mount("/", app=sessions.SessionLimits(mcp_app, "/mcp")))
    return HostCheck(BearerTokenMiddleware(app, token) if token else app, checks)


# host[:port] as a Host header or an Origin's authority carries it: a name or IPv4 address, or [IPv6]
_AUTHORITY = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::([0-9]{1,5}))?")


def _authority(text: str) -> tuple[str, str | None] | None:
    m = _AUTHORITY.fullmatch(text)
    return (m.group(1).lower(), m.group(2)) if m else None


def _matches(auth: tuple[str, str | None] | None, patterns: list[str]) -> bool:
    """True when the parsed host[:port] ``auth`` is one of ``patterns`` (``host:port`` or ``host:*``): the whole
    host and the whole port compared, never a prefix (``127.0.0.1:evil.com`` is no host of ours)."""
    if auth is None:
        return False
    host, port = auth
    for pat in patterns:
        want_host, _, want_port = pat.rpartition(":")
        if host == want_host.lower() and (want_port == "*" or port == want_port):
            return True
    return False


def strict_refusal(scope: dict[str, Any], security: TransportSecuritySettings) -> tuple[int, str] | None:
    """(status, reason) when the request's Host or Origin is not exactly an allowed one (issue 30: the SDK's
    ``127.0.0.1:*`` matches by prefix, so ``Host: 127.0.0.1:evil.com`` and ``Origin:
    http://localhost:8090.evil.com`` passed); None when both are."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
    host = headers.get("host")
    if host is not None and not _matches(_authority(host.strip()), list(security.allowed_hosts)):
        return 421, "Invalid Host header"
    origin = headers.get("origin")
    if origin:  # absent or empty: a same-origin request, as the SDK reads it
        u = urlsplit(origin.strip())
        ok = u.scheme in ("http", "https") and not (u.path or u.query or u.fragment or u.username)
        patterns = [o.split("://", 1)[1] for o in security.allowed_origins if o.startswith(f"{u.scheme}://")]
        if not (ok and _matches(_authority(u.netloc), patterns)):
            return 403, "Invalid Origin header"
    return None


class HostCheck:
    """Refuse a request whose Host (421) or Origin (403) the MCP endpoint would refuse, before any routing or
    redirect, so nothing this server sends is built from a forged Host. ``/healthz`` is exempt: it answers
    everyone, and names the DB only to requests that pass these same checks. Host and Origin are parsed and
    compared whole (:func:`strict_refusal`) before the SDK's own check."""

    def __init__(self, app: Any, checks: TransportSecurityMiddleware, exempt: tuple[str, ...] = ("/healthz",)) -> None:
        self.app = app
        self.checks = checks
        self.exempt = exempt

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") not in self.exempt:
            strict = strict_refusal(scope, self.checks.settings)
            if strict is not None:
                await PlainTextResponse(strict[1], status_code=strict[0])(scope, receive, send)
                return
            refused = await self.checks.validate_request(Request(scope))  # Content-Type stays the SDK's check
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def serve_http(
    db: str | Path | Sequence[str | Path],
    host: str,
    port: int,
    *,
    token: str | None = None,
    allowed_hosts: list[str] | None = None,
    log: Any = None,
    freshen: Callable[[], None] | None = None,
) -> None:
    """Serve until Ctrl-C or SIGTERM (uvicorn, one process), and be gone within STOP_S of either.
    ``freshen``: see :func:`mcp_server.server.build_server`."""
    pool = SqlPool()
    app = build_app(db, host, port, token=token, allowed_hosts=allowed_hosts, freshen=freshen, sql_pool=pool)
    shown = f"[{host}]" if ":" in host else host
    if log is not None:
        log.print(
            f"MCP endpoint: http://{shown}:{port}/mcp  (health: /healthz)"
            + ("  bearer token required" if token else ""),
            highlight=False,
        )
    _DeadlineServer(http_config(app, host, port), pool).run()


def raise_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # some kernels cap it below an infinite hard limit (fs.nr_open)
            pass
    return soft


def http_config(app: Any, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings for the MCP endpoint: the bounded protocol, keep-alive and connection caps."""
    files = raise_file_limit()
    cap = max(16, min(MAX_CONNECTIONS, (files if files != resource.RLIM_INFINITY else 1 << 20) - FD_RESERVE))
    BoundedH11Protocol.max_connections = cap
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=STOP_GRACE_S,
        http=BoundedH11Protocol,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading each request (head and body) and a cap on connections.

    The deadline starts with the connection and again with the first byte of each later request, and ends when
    the request has arrived whole; while the response streams (an SSE stream) no deadline runs. A connection
    past :attr:`max_connections` is closed before it is read: fewer file descriptors than the process may hold
    stay open, so accept() keeps working for the next client once the slow ones are cut.
    """

    max_connections = MAX_CONNECTIONS
    read_s = REQUEST_READ_S

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._read_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self._arm()
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):  # the request arrived whole
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.read_s, self._too_slow)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _too_slow(self) -> None:
        self._read_deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()  # the app sees a disconnect if it was reading the body


class _DeadlineServer(uvicorn.Server):
    """uvicorn's server with a deadline on stopping. uvicorn waits for the requests in flight, and a tool call runs
    in a thread that cancellation cannot stop (a live server's wait for a snapshot, a query's wait on its worker):
    a live server took over 2 s to stop, one with a run_sql in flight 7 s (issue 17). STOP_S after the signal,
    whatever is still running, the query workers are killed and the process ends by that signal, as uvicorn itself
    ends after a graceful stop."""

    def __init__(self, config: uvicorn.Config, pool: SqlPool) -> None:
        super().__init__(config)
        self._pool = pool
        self._deadline: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._deadline is None:
            self._deadline = threading.Timer(STOP_S, self._stop_now, args=(sig,))
            self._deadline.daemon = True
            self._deadline.start()

    def _stop_now(self, sig: int) -> None:
        self._pool.close()
        # Die by the signal, as uvicorn does: its handler is reset at the C level, as Python lets only the main
        # thread call signal.signal (and the main thread may be the one stuck).
        libc = ctypes.CDLL(None)
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(sig, None)  # SIG_DFL
        os.kill(os.getpid(), sig)


def serve_stdio(db: str | Path | Sequence[str | Path]) -> None:
    """Serve over stdin/stdout; stdout is the wire, so nothing else may print to it (query workers have their
    own pipes)."""
    pool = SqlPool().start(sql_file(db))
    try:
        build_server(db, sql_pool=pool).run()
    finally:
        pool.close()
