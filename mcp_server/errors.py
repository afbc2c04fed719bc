"""The tools' error channel: a :class:`tracer.errors.TracerError` (bad argument, unreadable DB, refused SQL) becomes
a ``ToolError``, an ``is_error`` result the model reads and corrects from; its text never names the server's
directories (issue 30; :func:`tracer.errors.redact`, which run_sql's query workers apply too). Anything else a
tool raises is a server bug.
"""

from __future__ import annotations

from collections.abc import Iterable

from mcp.server.mcpserver.exceptions import ToolError

from tracer.errors import TracerError, redact


def tool_error(e: TracerError, hidden: Iterable[str]) -> ToolError:
    """The ToolError for ``e``: its message and hint (the hint says how to fix the call), without the ``hidden``
    directories (:func:`tracer.errors.hidden_directories`)."""
    return ToolError(redact(f"{e.message}. {e.hint}".strip() if e.hint else e.message, hidden))
