"""Every accounted thread's time: the recorder's exact accounting (``thread_breakdown``, counted in kernel per
(thread, second) with parts that add up to ``wall_ns``) as stored, or for a recording without it the estimate
of :mod:`tracer.analysis.breakdown.estimate`."""

from __future__ import annotations

import duckdb

from tracer.analysis.breakdown.estimate import estimate_thread_times
from tracer.analysis.breakdown.thread_time import FIELDS, S, ThreadTime, ThreadTimes, add_row, column_of, zero_row
from tracer.analysis.recording import RecordingInfo, load_recording
from tracer.analysis.taxonomy import CALL_PART_NAMES

NO_BREAKDOWN = "no breakdown in this recording"


def load_thread_times(
    conn: duckdb.DuckDBPyConnection, info: RecordingInfo | None = None, pid: int | None = None
) -> ThreadTimes:
    """Return every accounted thread's time (of ``pid`` only when given): exact when the recording has
    ``thread_breakdown`` rows, else estimated from op_stats, sched_stats and the stored calls."""
    info = info or load_recording(conn)
    if info.has_breakdown:
        return ThreadTimes("exact", "", _exact(conn, info, pid))
    threads = estimate_thread_times(conn, info, pid)
    if not threads:
        return ThreadTimes("none", f"{NO_BREAKDOWN}, and no CUDA calls to estimate one from", [])
    return ThreadTimes(
        "estimated",
        f"{NO_BREAKDOWN} (recorded without per-thread time accounting): estimated from op_stats (exact call time "
        "per process), sched_stats (exact off-CPU and run-queue time per thread) and the stored calls; no page "
        "faults, no wakers",
        threads,
    )


def _exact(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, pid: int | None) -> list[ThreadTime]:
    # The rows as stored, the few (tid, sec) repeats summed below: DuckDB's GROUP BY of 20-odd sums costs ~10 ms
    # however few the rows, most of trace_stats' budget.
    cols = ", ".join(f"coalesce({column_of(f)}, 0)" for f in FIELDS)
    rows = conn.execute(
        f"SELECT pid, tid, sec, {cols} FROM thread_breakdown WHERE ($pid IS NULL OR pid = $pid) ORDER BY tid, sec",
        {"pid": pid},
    ).fetchall()
    meta: dict[int, tuple] = {}
    if info.has("threads"):
        for r in conn.execute(
            "SELECT tid, pid, comm, first_ns, end_ns, exited, cuda_calls FROM threads "
            "WHERE ($pid IS NULL OR pid = $pid)",
            {"pid": pid},
        ).fetchall():
            meta[r[0]] = r
    out: dict[int, ThreadTime] = {}
    for r in rows:
        p, tid, sec = r[0], r[1], int(r[2])
        t = out.get(tid)
        if t is None:
            m = meta.get(tid)
            t = out[tid] = ThreadTime(
                pid=p,
                tid=tid,
                comm=(m[2] if m else None) or info.comm(p),
                first_ns=int(m[3]) if m and m[3] is not None else sec * S,
                end_ns=int(m[4]) if m and m[4] is not None else (sec + 1) * S,
                exited=bool(m[5]) if m else False,
                cuda_calls=int(m[6] or 0) if m else 0,
                total=zero_row(),
            )
        row = dict(zip(FIELDS, (int(v) for v in r[3:]), strict=True))
        if sec in t.by_sec:  # a long interval closed late: a second row for the same second
            add_row(t.by_sec[sec], row)
        else:
            t.by_sec[sec] = row
        add_row(t.total, row)
    if not meta:  # no threads rows: a thread issued CUDA calls when it spent time in them
        for t in out.values():
            t.cuda_calls = 1 if t.ns(*CALL_PART_NAMES) > 0 else 0
            t.end_ns = max(t.end_ns, max(t.by_sec, default=0) * S + S)
    return sorted(out.values(), key=lambda t: (t.pid, t.tid))
