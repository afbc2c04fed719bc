"""The consoles the CLI prints on: stdout for results, stderr for everything else, with one width rule.

On a terminal rich uses the terminal's width, and ``COLUMNS`` when set (also when piped, so
``COLUMNS=120 tracer demo | less`` lays out for 120 columns). Piped without ``COLUMNS``, rich would assume 80
columns and squeeze the tables, cutting numbers to ``1,2…``; we lay out for :data:`PIPED_WIDTH` instead, wide
enough for every table at its natural width. stderr messages are soft-wrapped: rich never breaks them, so a
status line or a path is never split mid-word at column 80 when stderr is a log file.

This module imports only rich, so every command can build its consoles at import time without paying for the
analyses.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

PIPED_WIDTH = 160  # the widest table (stats' per-op table with long op names) at its natural width


def make_console(*, stderr: bool = False) -> Console:
    """Return a Console on stdout (results) or stderr (messages) that lays out for the width described above."""
    stream = sys.stderr if stderr else sys.stdout
    sized = stream.isatty() or os.environ.get("COLUMNS", "").isdigit()
    return Console(stderr=stderr, width=None if sized else PIPED_WIDTH, soft_wrap=stderr)
