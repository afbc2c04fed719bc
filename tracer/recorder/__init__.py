"""The write half: everything that makes a recording (probes loaded, rings drained, rows stored).

It imports only the shared contract at ``tracer``'s top (schema, hist, procfs, errors) and ``probes``: never a
reader (``tracer.analysis``), a view or the MCP server. The commands use the names below and nothing deeper.

The names load lazily: ``tracer record`` starts compiling the BPF program (:func:`prewarm`) before the rest of
the recorder (numpy, pyarrow, duckdb) is imported, so the compile overlaps those imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "Recorder": "session",
    "RecordOptions": "session",
    "RecordSummary": "finalize",
    "Check": "preflight",
    "checks": "preflight",
    "check_environment": "preflight",
    "verify_program": "preflight",
    "cuda_libraries": "preflight",
    "ProgramOptions": "program",
    "prewarm": "program",
    "start_cwd": "program",
    "parse_size": "sizecap",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'tracer.recorder' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tracer.recorder.{_PUBLIC[name]}"), name)
