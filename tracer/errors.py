"""Errors that reach the user: a message, a hint saying how to fix it, and an exit code.

Lower layers raise these with the reason; only the CLI entry point catches them and prints ``error: ...`` and the
hint to stderr, with no traceback unless ``-v``. Exit codes: 2 usage, 3 environment, 4 target or library,
5 store.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

ECHO_CHARS = 80  # an argument quoted back in an error is cut to this (a 1 MB op name is not sent back)


class TracerError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(TracerError):
    exit_code = 2


class EnvironmentProblem(TracerError):
    """The machine cannot trace: not root, no bcc, no kernel headers, no BPF."""

    exit_code = 3


class TargetError(TracerError):
    """The target process or a library is missing."""

    exit_code = 4


class StoreError(TracerError):
    """The DB is missing, not ours, from a newer schema, locked, or unwritable."""

    exit_code = 5


def echo(value: str) -> str:
    """``value`` quoted for an error message, cut to :data:`ECHO_CHARS` characters: what a user or a model
    passed, shown back without sending back a megabyte of it."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}… ({len(value):,} characters)"


def hidden_directories(dirs: Iterable[str | Path]) -> tuple[str, ...]:
    """The directories a remote reader's error may not name (issue 30: the MCP server's): each of ``dirs`` as
    given and resolved (the root excepted), deepest first, so ``/srv/a`` is taken out before ``/srv``."""
    found = {v.rstrip(os.sep) for d in dirs for v in (os.path.abspath(d), os.path.realpath(d)) if len(v) > 1}
    return tuple(sorted(found, key=len, reverse=True))


def redact(text: str, hidden: Iterable[str]) -> str:
    """``text`` with the ``hidden`` directories (:func:`hidden_directories`) and the home directory taken out of
    every path it holds: a file there is named relative to it ("locked.duckdb is being written"), the directory
    itself "the served directory", the home directory ``~``."""
    for d in hidden:
        text = text.replace(d + os.sep, "")
        text = re.sub(re.escape(d) + r"(?![\w.-])", "the served directory", text)
    home = os.path.expanduser("~")
    return text.replace(home + os.sep, "~" + os.sep) if len(home) > 1 else text
