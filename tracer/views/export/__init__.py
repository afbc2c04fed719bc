"""Exports of a trace DB to timeline viewers: a view over the DB, like the analyses, written to a file.

Contract: each format is one module with ``write(conn, out, selection) -> dict[str, int]`` that streams the
events of :mod:`tracer.views.export.rows` to a text stream and returns how many it wrote per kind.
:func:`export_trace` chooses the rows (window, budget), opens the output (``.gz`` compresses; ``-`` is stdout)
and writes it through a temporary file renamed at the end, so a failed export never leaves half a file.

Formats: ``chrome``, the trace-event JSON the PyTorch profiler (Kineto) writes, for ui.perfetto.dev,
chrome://tracing and Holistic Trace Analysis.
"""

from __future__ import annotations

import gzip
import os
import sys
from pathlib import Path
from typing import Annotated, TextIO

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.views.export import rows

FORMATS = ("chrome",)
DEFAULT_MAX_EVENTS = 1_000_000  # ~250 MB of JSON: what ui.perfetto.dev opens comfortably in a browser tab


class ExportSummary(Record):
    """What an export wrote, and what it left out."""

    format: Annotated[str, Field(description="chrome")]
    path: Annotated[str, Field(description="file written, '-' for stdout")]
    window_start_s: Annotated[float, Field(description="start of the exported window, s since session start")]
    window_end_s: Annotated[float, Field(description="end of the exported window, s since session start")]
    events: Annotated[dict[str, int], Field(description="trace events written, by kind")]
    calls_in_window: Annotated[int, Field(description="stored CUDA call rows in the window")]
    calls_written: Annotated[int, Field(description="of those, written (the budget keeps the longest)")]
    off_cpu_in_window: Annotated[int, Field(description="off-CPU intervals in the window")]
    off_cpu_written: Annotated[int, Field(description="of those, written")]
    min_kept_dur_us: Annotated[
        float | None, Field(description="when --max-events bound: the shortest call or interval kept, µs")
    ] = None
    notes: Annotated[list[str], Field(description="what the file does not hold, and why")] = []


def export_trace(
    conn: duckdb.DuckDBPyConnection,
    out: Path | None,
    *,
    fmt: str = "chrome",
    start_s: float | None = None,
    end_s: float | None = None,
    max_events: int | None = DEFAULT_MAX_EVENTS,
) -> ExportSummary:
    """Write the trace (or the window [start_s, end_s)) to ``out`` in ``fmt``; return what was written.

    Args:
        out: the file to write (``.gz`` is gzip-compressed); None writes to stdout.
        max_events: most CUDA calls and off-CPU intervals together, longest kept first; None or 0: all.
    """
    from tracer.views.export import chrome

    writer = {"chrome": chrome.write}[fmt]
    duration_ns, _ = rows.session_span(conn)
    start_ns = int((start_s or 0.0) * 1e9)
    # rows may end after duration_s (the final flush): an open end takes everything
    end_ns = int(end_s * 1e9) if end_s is not None else 2**62
    sel = rows.select(conn, start_ns, end_ns, max_events)
    if out is None:
        counts = writer(conn, sys.stdout, sel)
        sys.stdout.flush()
    else:
        counts = _write_file(out, lambda fh: writer(conn, fh, sel))
    return ExportSummary(
        format=fmt,
        path=str(out) if out is not None else "-",
        window_start_s=start_ns / 1e9,
        window_end_s=(end_ns if end_s is not None else duration_ns) / 1e9,
        events=counts,
        calls_in_window=sel.calls_in_window,
        calls_written=sel.calls_kept,
        off_cpu_in_window=sel.off_cpu_in_window,
        off_cpu_written=sel.off_cpu_kept,
        min_kept_dur_us=sel.keep_from[0] / 1e3 if sel.keep_from else None,
        notes=sel.notes,
    )


def _write_file(path: Path, body) -> dict[str, int]:  # body: a callable taking the text stream
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fh: TextIO
        if path.suffix == ".gz":
            fh = gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6)
        else:
            fh = open(tmp, "w", encoding="utf-8", buffering=1 << 20)  # closed below
        with fh:
            counts = body(fh)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return counts
