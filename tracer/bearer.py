"""The one bearer-token check of the servers a recording runs: the MCP server's HTTP transport
(mcp_server/auth.py) and the Prometheus endpoint (tracer/recorder/metrics.py). A static token from a file or
TRACER_MCP_TOKEN, compared in constant time; it never appears on the command line or in logs.
"""

from __future__ import annotations

import hmac
from collections.abc import MutableMapping


def authorized(headers: MutableMapping[bytes, bytes] | dict[bytes, bytes], token: str) -> bool:
    """True when the raw ``headers`` (lower-case names, as ASGI gives them) carry ``Authorization: Bearer <token>``
    (compared in constant time)."""
    return hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {token}".encode())
