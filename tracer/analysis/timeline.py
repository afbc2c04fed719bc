"""When things happened: fixed time buckets over the whole trace, and every event around one instant.

``buckets`` answers "when do the stalls happen" (per bucket: stored calls per op part from the probe catalog, so
synchronous copies count as syncs; sync p99 and max, off-CPU, preemptions, page allocation). ``around``
reconstructs the microsecond timeline around a stall: CUDA calls, off-CPU intervals and process events of the
traced tree within ±window, time-ordered, with offsets from the instant.

The sync p99 is the one percentile not taken from the exact in-kernel histogram: ``op_stats.hist`` is per process
and op over the whole recording, and nothing finer is recorded (``thread_breakdown`` has a second's sync *time*,
not its calls' latencies). So it is computed over the stored ``cuda_calls`` rows; once the recorder's row budget
binds they are a sample that keeps every slow call and only 1 in N of the fast ones, and the p99 leans high. Its
name says so (``sync_p99_us_sampled``); the exact per-op percentiles are in ``tracer stats``.
"""

from __future__ import annotations

from typing import Annotated

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.taxonomy import part_case_sql

S = 1_000_000_000


class Bucket(Record):
    """One time bucket."""

    start_s: Annotated[float, Field(description="bucket start, seconds since session start")]
    calls: Annotated[
        dict[str, int],
        Field(description="stored CUDA calls per part (launch/sync/alloc/free/copy/other; sync copies are sync)"),
    ]
    alloc_bytes: Annotated[int, Field(description="bytes requested by alloc calls")]
    sync_p99_us_sampled: Annotated[
        float | None,
        Field(
            description="p99 of the stored calls that waited for the GPU, µs. Once its row budget binds, cuda_calls "
            "keeps every slow call but only a sample of the fast ones, so this can lean high (no per-bucket "
            "histogram is recorded; exact per-op percentiles over the whole recording: trace_stats)"
        ),
    ]
    sync_max_us: Annotated[float | None, Field(description="slowest sync in the bucket, µs")]
    off_cpu_ms: Annotated[float, Field(description="off-CPU time of traced threads (sched_stats, exact), ms")]
    context_switches: int
    preemptions: int
    worst_stall_ms: Annotated[float, Field(description="longest single off-CPU interval, ms")]
    page_alloc_bytes: Annotated[int, Field(description="host-wide page allocation in the bucket")]
    max_load1: float | None


class Timeline(Record):
    bucket_s: int
    pid: int | None
    buckets: list[Bucket]


class TimelineEvent(Record):
    """One event near the instant."""

    ts_ns: int
    offset_us: Annotated[float, Field(description="ts - the instant, µs (negative = before)")]
    source: Annotated[str, Field(description="cuda | sched | process")]
    pid: int
    tid: int | None
    comm: str
    what: Annotated[str, Field(description="op, off-CPU reason, or process event kind")]
    dur_us: Annotated[float | None, Field(description="duration, µs (calls and off-CPU intervals)")]
    detail: Annotated[str, Field(description="off-CPU / runq inside a call, the preemptor, the child pid")]


class Around(Record):
    ts_ns: int
    window_ms: float
    pid: int | None
    events: list[TimelineEvent]


def buckets(conn: duckdb.DuckDBPyConnection, seconds: int = 10, pid: int | None = None) -> Timeline:
    """Return per-bucket activity over the whole session, ``seconds`` wide."""
    w = max(int(seconds), 1) * S
    p = {"w": w, "pid": pid}
    out: dict[int, dict] = {}

    def slot(b: int) -> dict:
        return out.setdefault(
            b,
            dict(
                calls={},
                alloc_bytes=0,
                sync_p99_us_sampled=None,
                sync_max_us=None,
                off_cpu_ms=0.0,
                context_switches=0,
                preemptions=0,
                worst_stall_ms=0.0,
                page_alloc_bytes=0,
                max_load1=None,
            ),
        )

    for b, cls, n, by, p99, mx in conn.execute(
        f"""
            SELECT ts_ns // $w, {part_case_sql("op")} AS cls, count(*), coalesce(sum(bytes), 0),
                   quantile_cont(dur_ns, 0.99), max(dur_ns)
            FROM cuda_calls WHERE ($pid IS NULL OR pid = $pid) GROUP BY ALL""",
        p,
    ).fetchall():
        s = slot(b)
        s["calls"][cls] = int(n)
        if cls == "alloc":
            s["alloc_bytes"] = int(by)
        if cls == "sync":
            s["sync_p99_us_sampled"], s["sync_max_us"] = round(p99 / 1e3, 1), round(mx / 1e3, 1)
    for b, off, sw, pre, worst in conn.execute(
        """
            SELECT sec * 1000000000 // $w, sum(off_cpu_ns), sum(switches), sum(preemptions),
            max(max_off_cpu_ns)
            FROM sched_stats WHERE ($pid IS NULL OR pid = $pid) GROUP BY 1""",
        p,
    ).fetchall():
        s = slot(b)
        s.update(
            off_cpu_ms=round(off / 1e6, 1),
            context_switches=int(sw),
            preemptions=int(pre),
            worst_stall_ms=round(worst / 1e6, 1),
        )
    for b, pa, load in conn.execute(
        "SELECT ts_ns // $w, sum(page_alloc_bytes), max(load1) FROM host_samples GROUP BY 1", {"w": w}
    ).fetchall():
        slot(b).update(page_alloc_bytes=int(pa or 0), max_load1=load)
    return Timeline(bucket_s=w // S, pid=pid, buckets=[Bucket(start_s=b * w / S, **v) for b, v in sorted(out.items())])


def around(
    conn: duckdb.DuckDBPyConnection,
    ts_ns: int,
    window_ms: float = 5,
    pid: int | None = None,
    limit: int = 500,
) -> Around:
    """Return every CUDA call, off-CPU interval and process event overlapping ts ± window, in time order."""
    half = int(window_ms * 1e6)
    p = {"lo": ts_ns - half, "hi": ts_ns + half, "pid": pid, "limit": limit}
    # events at the same instant in a fixed order (pid, tid, what): two runs, the CLI's and an MCP tool's, agree
    rows = conn.execute(
        """
        SELECT * FROM (
          SELECT c.ts_ns, 'cuda' AS source, c.pid, c.tid, coalesce(pr.comm, '') AS comm, c.op AS what,
                 c.dur_ns, printf('off_cpu=%.1fus runq=%.1fus%s', c.off_cpu_ns / 1e3, c.runq_ns / 1e3,
                   CASE WHEN c.bytes IS NOT NULL THEN printf(' bytes=%d', c.bytes) ELSE '' END) AS detail
          FROM cuda_calls c LEFT JOIN processes pr USING (pid)
          WHERE c.ts_ns <= $hi AND c.ts_ns + c.dur_ns >= $lo AND ($pid IS NULL OR c.pid = $pid)
          UNION ALL
          SELECT ts_ns, 'sched', pid, tid, coalesce(comm, ''), 'off_cpu:' || reason, dur_ns,
                 printf('runq=%.1fus', runq_ns / 1e3) || CASE WHEN preempted_by_pid IS NOT NULL
                   THEN printf(' by %s(%d)', coalesce(preempted_by_comm, '?'), preempted_by_pid) ELSE '' END
          FROM sched WHERE ts_ns <= $hi AND ts_ns + dur_ns >= $lo AND ($pid IS NULL OR pid = $pid)
          UNION ALL
          SELECT ts_ns, 'process', pid, NULL, coalesce(comm, ''), kind, NULL,
                 concat_ws(' ', CASE WHEN child IS NOT NULL THEN 'child=' || child END,
                           CASE WHEN exit_code IS NOT NULL THEN 'exit_code=' || exit_code END,
                           CASE WHEN filename IS NOT NULL THEN 'file=' || filename END)
          FROM process_events WHERE ts_ns BETWEEN $lo AND $hi AND ($pid IS NULL OR pid = $pid OR child = $pid)
        ) ORDER BY ts_ns, source, pid, tid, what LIMIT $limit""",
        p,
    ).fetchall()
    return Around(
        ts_ns=ts_ns,
        window_ms=window_ms,
        pid=pid,
        events=[
            TimelineEvent(
                ts_ns=r[0],
                offset_us=round((r[0] - ts_ns) / 1e3, 1),
                source=r[1],
                pid=r[2],
                tid=r[3],
                comm=r[4],
                what=r[5],
                dur_us=None if r[6] is None else round(r[6] / 1e3, 1),
                detail=r[7] or "",
            )
            for r in rows
        ],
    )
