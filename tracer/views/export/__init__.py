"""Exports of a trace DB to timeline viewers: a view over the DB, like the analyses, written to a file.

Contract: each format is one module with ``write(conn, out, selection) -> dict[str, int]`` that streams the
events of :mod:`tracer.views.export.rows` to a text stream and returns how many it wrote per kind.
:func:`export_trace` chooses the rows (window, budget), opens the output (``.gz`` compresses; ``-`` is stdout)
and writes it through a temporary file renamed at the end, so a failed export never leaves half a file.

Formats: ``chrome``, the trace-event JSON the PyTorch profiler (Kineto) writes, for ui.perfetto.dev,
chrome://tracing and Holistic Trace Analysis. :func:`export_ranks` writes it one file per rank of a distributed job,
``DIR/rank<R>.json``, the directory Holistic Trace Analysis loads as a job (``TraceAnalysis(trace_dir=DIR)``).
"""

from __future__ import annotations

import gzip
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TextIO

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.views.export import rows
from tracer.views.output import refuse_existing

if TYPE_CHECKING:
    from tracer.analysis.recording import RecordingInfo

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


class RankExportSummary(Record):
    """What a per-rank export wrote: one file per rank, and the processes in none of them."""

    directory: Annotated[str, Field(description="directory written into")]
    world_size: Annotated[int, Field(description="the job's ranks (WORLD_SIZE), as written in distributedInfo")]
    files: Annotated[list[ExportSummary], Field(description="one per rank of this recording, in rank order")]
    ranks: Annotated[list[int], Field(description="the rank of each file")]
    left_out: Annotated[
        list[str], Field(description="processes of no rank (a launcher such as torchrun's agent): 'comm (pid)'")
    ] = []


def rank_file(directory: Path, rank: int) -> Path:
    """Return the file of ``rank`` in a per-rank export: ``rank<R>.json`` (HTA reads every .json or .gz file of
    the directory, hta/common/trace_file.py create_rank_to_trace_dict_from_dir)."""
    return directory / f"rank{rank}.json"


def rank_groups(info: RecordingInfo) -> tuple[dict[int, tuple[int, ...]], list[tuple[int, str]]]:
    """Return ({rank: the pids of its file}, [(pid, comm) of the processes of no rank]) of the recording.

    A rank's processes are those whose ``processes.rank`` is R: its own and the DataLoader workers that inherit
    its environment (the Parquet dataset's rank partitions are cut the same way). The tracer is in none."""
    groups: dict[int, list[int]] = {}
    others = []
    for pid in info.target_pids():
        p = info.procs.get(pid)
        if p is not None and p.rank is not None:
            groups.setdefault(int(p.rank), []).append(pid)
        else:
            others.append((pid, info.comm(pid)))
    return {r: tuple(groups[r]) for r in sorted(groups)}, others


def export_ranks(
    conn: duckdb.DuckDBPyConnection,
    directory: Path,
    *,
    start_s: float | None = None,
    end_s: float | None = None,
    max_events: int | None = DEFAULT_MAX_EVENTS,
    force: bool = False,
) -> RankExportSummary:
    """Write each rank of the recording's distributed job to ``directory/rank<R>.json`` (Chrome format), each
    file led by its ``distributedInfo`` (rank, world_size, local_rank, host, job_id); return what was written.

    Several hosts' recordings of one job may export into one directory: each writes its own ranks' files.
    ``max_events`` bounds each file. Processes of no rank (a launcher) go to no file: HTA takes every .json or .gz
    file of the directory for a rank and one without ``distributedInfo.rank`` for rank 0 (trace_file.py
    create_rank_to_trace_dict), so a launcher's file would stand in for rank 0; the whole export has them.

    Raises:
        UsageError: the recording has no ranks, or a rank's file exists and ``force`` is not set.
    """
    from tracer.analysis.chains import compute_chains
    from tracer.analysis.recording import load_recording
    from tracer.errors import UsageError
    from tracer.views.export import chrome

    info = load_recording(conn)
    groups, others = rank_groups(info)
    if not groups:
        raise UsageError(
            "the recording has no ranks: no traced process had RANK (torchrun, DeepSpeed, Accelerate), "
            "OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID in its environment",
            "Export it as one file, without --per-rank.",
        )
    paths = {r: rank_file(directory, r) for r in groups}
    refuse_existing(list(paths.values()), force)
    host = rows.session_info(conn).get("host")
    sizes = [info.procs[p].world_size for pids in groups.values() for p in pids if info.procs[p].world_size]
    world_size = max([*sizes, max(groups) + 1])
    chains = compute_chains(conn, limit=1_000_000).chains
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for rank, pids in groups.items():
        own = next((info.procs[p] for p in pids if info.rank_pids.get(p) == rank), info.procs[pids[0]])
        distributed = {
            "rank": rank,
            "world_size": world_size,
            "local_rank": own.local_rank,
            "host": host,
            "job_id": own.job_id,
            "pid": own.pid,
        }
        files.append(
            _export(
                conn,
                paths[rank],
                fmt="chrome",
                start_s=start_s,
                end_s=end_s,
                max_events=max_events,
                pids=pids,
                write=lambda c, fh, sel, d=distributed: chrome.write(c, fh, sel, distributed=d, chains=chains),
            )
        )
    return RankExportSummary(
        directory=str(directory),
        world_size=world_size,
        files=files,
        ranks=list(groups),
        left_out=[f"{comm} ({pid})" for pid, comm in others],
    )


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

    return _export(
        conn, out, fmt=fmt, start_s=start_s, end_s=end_s, max_events=max_events, write={"chrome": chrome.write}[fmt]
    )


def _export(
    conn: duckdb.DuckDBPyConnection,
    out: Path | None,
    *,
    fmt: str,
    start_s: float | None,
    end_s: float | None,
    max_events: int | None,
    write: Callable[[duckdb.DuckDBPyConnection, TextIO, rows.Selection], dict[str, int]],
    pids: tuple[int, ...] | None = None,
) -> ExportSummary:
    """Write the window of ``pids``' rows (None: every process) to ``out`` through ``write``."""
    duration_ns, _ = rows.session_span(conn)
    start_ns = int((start_s or 0.0) * 1e9)
    # rows may end after duration_s (the final flush): an open end takes everything
    end_ns = int(end_s * 1e9) if end_s is not None else 2**62
    sel = rows.select(conn, start_ns, end_ns, max_events, pids)
    if out is None:
        counts = write(conn, sys.stdout, sel)
        sys.stdout.flush()
    else:
        counts = _write_file(out, lambda fh: write(conn, fh, sel))
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
