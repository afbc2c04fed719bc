"""Processes (or the threads of one process) side by side: one column each, one row per measure, so a reader sees
at a glance which rank is slower and where its time went ("How do these processes compare?", issue 23).

A process is shown by the thread that does its work: its driver thread (most launch + sync time), else a rank's
main thread (a rank training on the CPU: the thread the ranks' table follows), else (a process with no CUDA call)
its busiest thread. Every rank's column is a ``training`` thread: under a launcher each rank trains. Each column
has the thread's exact breakdown (the parts add up to its wall time), its steps (:mod:`tracer.analysis.steps`) and
who woke and held it most; each row has one value per column, null where a column has none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.breakdown.holders import holders_of, wakers_of
from tracer.analysis.breakdown.load import load_thread_times
from tracer.analysis.breakdown.thread_time import MS, ThreadTime, ThreadTimes
from tracer.analysis.recording import RecordingInfo, load_recording
from tracer.analysis.steps import StepSeries, series_of
from tracer.errors import UsageError
from tracer.vocabulary import PART_NAMES

MAX_COLUMNS = 8


class Column(Record):
    """One process (by its working thread) or one thread."""

    label: Annotated[str, Field(description="e.g. 'rank 2 pid 4012' or 'tid 4013 pt_gloo_runloop'")]
    pid: int
    tid: int
    comm: Annotated[str, Field(description="the thread's name")]
    process_comm: str
    role: Annotated[str, Field(description="its process's role: main | rank | launcher | dataloader_worker | child")]
    thread_role: Annotated[str, Field(description="training | driver | cuda | thread")]
    rank: int | None
    top_waker: Annotated[str, Field(description="who ended most of its blocked time, with the ms")]
    top_holder: Annotated[str, Field(description="who held the CPU most while it waited for one, with the ms")]
    steps: Annotated[str, Field(description="its step series' headline (get_step_series)")]


class Row(Record):
    """One measure across the columns."""

    measure: Annotated[str, Field(description="e.g. 'sync share', 'typical step'")]
    unit: Annotated[str, Field(description="ms | share (0..1) | count | per s")]
    values: Annotated[list[float | None], Field(description="one per column, in the columns' order")]


class SideBySide(Record):
    """Processes or threads side by side: columns are the entities, rows the measures."""

    by: Annotated[str, Field(description="process | thread")]
    columns: list[Column]
    rows: list[Row]
    more: Annotated[int, Field(description="entities left out (at most 8 columns)")]
    headline: Annotated[str, Field(description="one line: where the columns differ most")]


def compare_processes(
    conn: duckdb.DuckDBPyConnection, pids: list[int] | None = None, threads_of: int | None = None
) -> SideBySide:
    """Return ``pids`` side by side (default: every process that issues CUDA calls or is a rank), or the threads
    of process ``threads_of``, busiest first."""
    info = load_recording(conn)
    times = load_thread_times(conn, info)
    if threads_of is not None:
        picked = sorted(times.of_pid(threads_of), key=lambda t: (t.cuda_calls == 0, -_busy(t), t.tid))
        by = "thread"
    else:
        wanted = pids if pids else _default_pids(info, times)
        missing = [p for p in wanted if p not in info.procs]
        if missing:
            raise UsageError(
                f"pid {missing[0]} is not in this trace",
                "Pass pids from get_trace_stats, or none for every CUDA process.",
            )
        picked = [t for p in wanted if (t := _working_thread(times, p)) is not None]
        by = "process"
    shown, more = picked[:MAX_COLUMNS], max(len(picked) - MAX_COLUMNS, 0)
    cols, series = [], []
    for t in shown:
        s = series_of(conn, t)
        series.append(s)
        cols.append(_column(conn, info, t, by, times.role_of(t), s.headline))
    rows = _rows(shown, series)
    return SideBySide(by=by, columns=cols, rows=rows, more=more, headline=_headline(by, cols, rows))


def _default_pids(info: RecordingInfo, times: ThreadTimes) -> list[int]:
    pids = [d.pid for d in times.drivers]
    pids += [p for p in sorted(info.rank_pids) if p not in pids]
    return sorted(pids, key=lambda p: (info.rank_pids.get(p, 1 << 30), p))


def _working_thread(times: ThreadTimes, pid: int) -> ThreadTime | None:
    """The thread that does the process's work: its driver thread, else a rank's main thread, else its busiest."""
    d = next((x for x in times.drivers if x.pid == pid), None)
    if d is None and pid in times.rank_pids:
        d = times.rank_thread(pid)
    if d is not None:
        return d
    mine = times.of_pid(pid)
    return max(mine, key=lambda t: (_busy(t), -t.tid), default=None)


def _busy(t: ThreadTime) -> int:
    return t.wall - t.ns("blocked")


def _column(
    conn: duckdb.DuckDBPyConnection,
    info: RecordingInfo,
    t: ThreadTime,
    by: str,
    thread_role: str,
    steps: str,
) -> Column:
    wakers = wakers_of(conn, info, t, limit=1)
    holders, _ = holders_of(conn, info, t, limit=1)
    p = info.procs.get(t.pid)
    rank = p.rank if p is not None else None
    role = info.process_role(t.pid)
    label = (
        f"tid {t.tid} {t.comm}"
        if by == "thread"
        else (f"rank {rank} " if rank is not None else "") + f"pid {t.pid} {info.comm(t.pid)}"
    )
    return Column(
        label=label,
        pid=t.pid,
        tid=t.tid,
        comm=t.comm,
        process_comm=info.comm(t.pid),
        role=role,
        thread_role=thread_role,
        rank=rank,
        top_waker=f"{wakers[0].comm} ({wakers[0].holder}) {wakers[0].blocked_ms:,.1f} ms" if wakers else "",
        top_holder=f"{holders[0].comm} ({holders[0].holder}) {holders[0].runq_ms:,.1f} ms" if holders else "",
        steps=steps,
    )


def _rows(threads: list[ThreadTime], series: list[StepSeries]) -> list[Row]:
    def row(measure: str, unit: str, values: list[float | None]) -> Row:
        return Row(measure=measure, unit=unit, values=[None if v is None else round(v, 4) for v in values])

    out = [
        row("wall", "ms", [t.wall / MS for t in threads]),
        row("cuda calls", "count", [float(t.cuda_calls) for t in threads]),
    ]
    for part in PART_NAMES:
        vals = [t.share(t.ns(part)) for t in threads]
        if any(vals):
            out.append(row(f"{part} share", "share", vals))
    out.append(row("faults", "count", [float(t.ns("faults")) for t in threads]))

    def per_step(value: Callable[[StepSeries], float]) -> list[float | None]:
        return [float(value(s)) if s.basis == "steps" else None for s in series]

    if any(s.basis == "steps" for s in series):
        out.append(row("steps", "count", per_step(lambda s: s.steps)))
        out.append(row("steps per s", "per s", per_step(lambda s: s.steps_per_s)))
        out.append(row("typical step", "ms", per_step(lambda s: s.typical_ms)))
        out.append(row("slow steps", "count", per_step(lambda s: s.slow_steps)))
    return out


def _headline(by: str, cols: list[Column], rows: list[Row]) -> str:
    """Name the share that differs most between the columns, and who has the most of it."""
    if len(cols) < 2:
        return f"{len(cols)} column" + ("" if len(cols) == 1 else "s") + ": nothing to set side by side"
    best = None
    for r in rows:
        if r.unit != "share":
            continue
        vals = [v or 0.0 for v in r.values]
        gap = max(vals) - min(vals)
        if best is None or gap > best[0]:
            best = (gap, r, vals)
    if best is None:
        return ""
    gap, r, vals = best
    hi, lo = vals.index(max(vals)), vals.index(min(vals))
    return (
        f"{r.measure} differs most: {cols[hi].label} {vals[hi]:.0%} against {cols[lo].label} {vals[lo]:.0%} "
        f"({len(cols)} {'threads' if by == 'thread' else 'processes'} side by side)"
    )
