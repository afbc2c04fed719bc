"""The tools' error channel: a :class:`tracer.errors.TracerError` (bad argument, unreadable DB, refused SQL) becomes
a ``ToolError``, an ``is_error`` result the model reads and corrects from; its text never names the server's
directories (issue 30). Anything else a tool raises is a server bug.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from mcp.server.mcpserver.exceptions import ToolError

from tracer.errors import TracerError


def hidden_directories(dirs: Iterable[Path]) -> tuple[str, ...]:
    """The directories no error may name: each of ``dirs`` as given and resolved (the root excepted), deepest
    first, so ``/srv/a`` is taken out before ``/srv``."""
    found = {v.rstrip(os.sep) for d in dirs for v in (os.path.abspath(d), os.path.realpath(d)) if len(v) > 1}
    return tuple(sorted(found, key=len, reverse=True))


def redact(text: str, hidden: Iterable[str]) -> str:
    """``text`` with the ``hidden`` directories (:func:`hidden_directories`) and the home directory taken out of
    every path it holds: a file there is named relative to it ("locked.duckdb is being written"), the directory
    itself "the served directory"."""
    for d in hidden:
        text = text.replace(d + os.sep, "")
        text = re.sub(re.escape(d) + r"(?![\w.-])", "the served directory", text)
    home = os.path.expanduser("~")
    return text.replace(home + os.sep, "~" + os.sep) if len(home) > 1 else text


def tool_error(e: TracerError, hidden: Iterable[str]) -> ToolError:
    """The ToolError for ``e``: its message and hint (the hint says how to fix the call), redacted."""
    return ToolError(redact(f"{e.message}. {e.hint}".strip() if e.hint else e.message, hidden))
