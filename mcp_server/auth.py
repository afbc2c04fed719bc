"""Bearer-token check for the HTTP transport: a static token from a file or TRACER_MCP_TOKEN.

A small ASGI middleware rather than the SDK's OAuth resource-server machinery: one host, one secret, no issuer.
Compared in constant time; the token never appears on the command line (it would show in ps) or in logs.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tracer.bearer import authorized  # the one check, shared with the metrics endpoint

Scope = MutableMapping[str, Any]
__all__ = ["BearerTokenMiddleware", "authorized"]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class BearerTokenMiddleware:
    """Refuse HTTP requests without ``Authorization: Bearer <token>`` (401), except on ``exempt`` paths."""

    def __init__(self, app: ASGIApp, token: str, exempt: tuple[str, ...] = ("/healthz",)) -> None:
        if not token:
            raise ValueError("empty token")
        self.app = app
        self._token = token
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        if authorized(dict(scope.get("headers") or []), self._token):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {
                "error": "unauthorized",
                "error_description": "send Authorization: Bearer <token> (the server's --token-file or "
                "TRACER_MCP_TOKEN)",
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b'Bearer realm="mcp"'),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
