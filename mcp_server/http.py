"""Transports: stdio, and streamable HTTP at ``/mcp`` in a FastAPI app (with ``/healthz``) served by uvicorn.

Loopback by default (``:8090`` = 127.0.0.1:8090) with the SDK's DNS-rebinding protection: only loopback Host and
Origin headers are accepted (a bad Host gets 421, a bad Origin 403). A non-loopback address needs a bearer token
(refused to start without one) and keeps Host/Origin validation on with an explicit allow-list: the SDK would switch
the protection off for a non-local host. The MCP app is mounted at ``/`` with its own path ``/mcp`` (a mount at
``/mcp`` would serve ``/mcp/mcp``), and its session manager runs in the host app's lifespan, since a mounted
sub-app's lifespan never runs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from starlette.routing import Mount

from mcp_server.auth import BearerTokenMiddleware, authorized
from mcp_server.server import Connect, build_server
from tracer.analysis.sqlpool import SqlPool
from tracer.errors import UsageError

LOOPBACK_HOSTS = ["127.0.0.1:*", "localhost:*", "[::1]:*"]


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


def build_app(
    db: str | Path,
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
    mcp_app = mcp.streamable_http_app(streamable_http_path="/mcp", host=host, transport_security=security)
    checks = TransportSecurityMiddleware(security)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if connect is None:
            pool.start(db)
        try:
            async with mcp.session_manager.run():
                yield
        finally:
            pool.close()

    app = FastAPI(title="cuda-host-tracer MCP", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, str]:
        body = {"status": "ok", "mcp": "/mcp"}
        trusted = await checks.validate_request(request) is None
        if trusted and (token is None or authorized(dict(request.scope.get("headers") or []), token)):
            body["db"] = Path(db).name
        return body

    app.router.routes.append(Mount("/", app=mcp_app))
    return BearerTokenMiddleware(app, token) if token else app


def serve_http(
    db: str | Path,
    host: str,
    port: int,
    *,
    token: str | None = None,
    allowed_hosts: list[str] | None = None,
    log: Any = None,
    freshen: Callable[[], None] | None = None,
) -> None:
    """Serve until Ctrl-C (uvicorn, one process). ``freshen``: see :func:`mcp_server.server.build_server`."""
    import uvicorn

    app = build_app(db, host, port, token=token, allowed_hosts=allowed_hosts, freshen=freshen)
    shown = f"[{host}]" if ":" in host else host
    if log is not None:
        log.print(
            f"MCP endpoint: http://{shown}:{port}/mcp  (health: /healthz)"
            + ("  bearer token required" if token else ""),
            highlight=False,
        )
    uvicorn.run(app, host=host, port=port, log_level="warning")


def serve_stdio(db: str | Path) -> None:
    """Serve over stdin/stdout; stdout is the wire, so nothing else may print to it (query workers have their
    own pipes)."""
    pool = SqlPool().start(db)
    try:
        build_server(db, sql_pool=pool).run()
    finally:
        pool.close()
