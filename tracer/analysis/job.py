"""A job: several recordings analysed as one (each host records its own ranks with `tracer record`).

:func:`open_job` returns an in-memory DuckDB that ATTACHes every recording READ_ONLY and defines one view per
schema table, the UNION ALL BY NAME of the recordings' tables, so every analysis runs on the job unchanged. Two
things differ between recordings and are made one here:

- **Keys.** Pids and tids are per host (per boot, per PID namespace): two hosts' ranks may both be pid 12345.
  Every pid- or tid-valued column (:data:`PID_COLUMNS`) of recording ``i`` reads ``i * PID_STRIDE + pid``; recording
  0 keeps its pids. PID_STRIDE = 10**7 is above Linux's largest pid (PID_MAX_LIMIT = 2**22), so the decimal digits
  stay readable: 10012345 is recording 1's pid 12345. Pid 0 (an interrupt, the idle task) and
  NULL stay as they are. Stack ids are numbered per recording too and are moved apart by :data:`STACK_STRIDE`.
  ``processes`` gains ``recording`` and ``host``, ``session`` gains ``recording``.
- **Clocks.** ``ts_ns`` counts from each recording's own start. Recordings are lined up by their wall-clock start
  (``session.realtime_at_start_ns``, read back to back with the monotonic start; an older recording's
  ``started_at``, microseconds): recording ``i`` is shifted by ``k_i`` whole seconds, ``k_i = round(offset_i / 1 s)``
  where ``offset_i`` is its start after the earliest one's. Whole seconds, because the per-second tables (``sec``)
  and ``ts_ns`` of one recording must stay consistent with each other (the analyses relate them): a shift by a
  fraction of a second would move events across ``sec`` boundaries. The cost is a residual misalignment of up to
  0.5 s between two recordings, reported with the clocks' read bounds as the job's alignment bound
  (:func:`job_alignment`). The hosts' own clock synchronisation (NTP, PTP) is outside that bound.

The ``session`` view has one row per recording. :func:`tracer.analysis.db.session_row`, which every reader of the
session uses, reads the ``job_session`` view instead: one row that combines them per column (:data:`SESSION_RULES`:
the earliest start, the span of the job, summed counts and costs, the worst status, the distinct hosts).

``run_sql`` (untrusted SQL, run in a query worker on one file) is not offered on a job: the worker reads a single
.duckdb file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.errors import StoreError
from tracer.schema import CHAINS_RESULT, TABLES
from tracer.sqltext import ident, literal, union_view

S = 1_000_000_000
PID_STRIDE = 10_000_000  # > PID_MAX_LIMIT (2**22): recording i's pid p reads i * PID_STRIDE + p
STACK_STRIDE = 10**12  # recording i's stack_id s reads i * STACK_STRIDE + s (a recording has far fewer stacks)
# an older recording has only started_at (microseconds, read by a separate call after the monotonic start): the
# bound given to its read, generous for two consecutive Python calls
STARTED_AT_READ_NS = 1_000_000
JOB_SESSION = "job_session"  # the job's one session row (session_row reads it)
RECORDINGS_TABLE = "job_recordings"  # one row per recording: its file, host and clock alignment
GLOB_CHARS = "*?["

# Every pid- or tid-valued column, by table (tests/test_job.py fails on a pid-like column missing here).
PID_COLUMNS: dict[str, tuple[str, ...]] = {
    "session": ("recorder_pid",),
    "processes": ("pid", "ppid"),
    "threads": ("pid", "tid"),
    "thread_breakdown": ("pid", "tid"),
    "thread_wakers": ("pid", "tid", "waker_pid", "waker_tid"),
    "cuda_calls": ("pid", "tid"),
    "op_stats": ("pid",),
    "sched": ("pid", "tid", "preempted_by_pid", "waker_pid", "waker_tid"),
    "sched_stats": ("pid", "tid"),
    "preemptors": ("tid", "pid"),
    "process_events": ("pid", "ppid", "child"),
    "offcpu_stacks": ("pid", "tid", "waker_pid", "waker_tid"),
    "cpu_samples": ("pid", "tid"),
    "kernel_names": ("pid",),
    "nccl_comms": ("pid", "tid"),
    "nccl_progress": ("pid",),
    "process_placement": ("pid",),
    "thread_snapshots": ("pid", "tid"),
    "gc_collections": ("pid", "tid"),
}
PID_LIST_COLUMNS: dict[str, tuple[str, ...]] = {"causal_chains": ("pids",)}
STACK_COLUMNS: dict[str, tuple[str, ...]] = {
    t: ("stack_id",) for t in ("stacks", "cuda_calls", "offcpu_stacks", "cpu_samples", "gc_collections")
}
# instants in ns since the session start (shifted by whole seconds); every other *_ns column is an amount of time
TIME_NS_COLUMNS: dict[str, tuple[str, ...]] = {
    "session": ("flushed_ns", "summaries_flushed_ns"),
    "processes": ("first_ns", "exit_ns"),
    "threads": ("first_ns", "end_ns"),
    "cuda_calls": ("ts_ns",),
    "sched": ("ts_ns",),
    "process_events": ("ts_ns",),
    "host_samples": ("ts_ns",),
    "causal_chains": ("start_ns", "end_ns"),
    "nccl_comms": ("ts_ns",),
    "nccl_progress": ("first_ns", "last_ns"),
    "dropped_rows": ("from_ns", "to_ns"),
    "process_placement": ("ts_ns",),
    "cgroup_cpu": ("ts_ns",),
    "cpu_idle": ("ts_ns",),
    "thread_snapshots": ("ts_ns", "blocked_since_ns"),
    "gc_collections": ("ts_ns",),
}
SEC_COLUMNS: dict[str, tuple[str, ...]] = {t.name: ("sec",) for t in TABLES if "sec" in t.column_names}

# How job_session combines the recordings' session rows, per column ({c}: the column; status_key orders the
# recordings worst status first). Every session column has a rule (a test holds it).
_STATUS_KEY = (
    "(CASE status WHEN 'recording' THEN 7 WHEN 'failed' THEN 6 WHEN 'disk_full' THEN 5 WHEN 'snapshot' THEN 4 "
    "WHEN 'interrupted' THEN 3 WHEN 'target_exited' THEN 2 WHEN 'complete' THEN 1 ELSE 0 END) * 100000 - recording"
)
_WORST = f"arg_max({{c}}, {_STATUS_KEY})"  # of the recording whose status is the job's: recording_state reads it
_DISTINCT = "coalesce(string_agg(DISTINCT nullif({c}, ''), ', ' ORDER BY nullif({c}, '')), '')"
_SUM, _MAX = "sum({c})", "max({c})"
_PER_HOST = "(SELECT sum(m) FROM (SELECT max({c}) AS m FROM session GROUP BY {host_key}))"  # a host counted once
SESSION_RULES: dict[str, str] = {
    "session_id": "min({c})",
    "started_at": "min({c})",  # the job starts with its earliest recording: ts_ns 0
    "start_mono_ns": "arg_min({c}, recording_offset_ns)",  # that recording's
    "realtime_at_start_ns": "min({c})",
    "clock_read_ns": _MAX,
    "duration_s": "max({c} + shift_s)",  # the job's span on the aligned clock
    "status": _WORST,  # unfinished if one recording is
    "host": _DISTINCT,
    "kernel": _DISTINCT,
    "cpu_model": _DISTINCT,
    "cpu_cores": _PER_HOST,  # the job's CPUs: each host (boot) once, however many recordings it made
    "mem_bytes": _PER_HOST,
    "gpus": _DISTINCT,
    "driver": _DISTINCT,
    "python_version": _DISTINCT,
    "tracer_version": _DISTINCT,
    "target": _DISTINCT,
    "libraries": _DISTINCT,
    "events_traced": _SUM,
    "events_stored": _SUM,
    "events_lost": _SUM,
    "overhead_pct": _MAX,  # the most any recording cost its target
    "notes": "coalesce(string_agg(nullif({c}, ''), chr(10) ORDER BY recording), '')",
    "recorder_pid": _WORST,
    "recorder_start_ticks": _WORST,
    "boot_id": _WORST,
    "recorder_cpu_s": _SUM,  # all recorders' CPU
    "recorder_peak_rss_bytes": _MAX,  # per host: the largest recorder
    "startup_s": _MAX,
    "compile_s": _MAX,
    "attach_s": _MAX,
    "startup_cpu_s": _MAX,
    "first_event_s": _MAX,
    "flush_s": _MAX,
    "recording_cpu_pct": _MAX,
    "recording_s": _MAX,  # the longest recording's
    "holds": _SUM,
    "held_ms": _SUM,
    "command_fate": _DISTINCT,
    "flushed_ns": "min({c})",  # every recording's rows are written up to here (shifted)
    "summaries_flushed_ns": "min({c})",
    "sample_hz": _MAX,
    "offcpu_stacks": "bool_or({c})",
    "max_db_bytes": _MAX,
}


# --- alignment ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clock:
    """One recording's wall-clock start and how it is shifted onto the job's clock."""

    start_unix_ns: int  # its wall-clock start
    read_ns: int  # bound of that read (session.clock_read_ns; STARTED_AT_READ_NS for started_at)
    precise: bool  # from realtime_at_start_ns (else started_at)
    offset_ns: int = 0  # start after the job's earliest recording
    shift_s: int = 0  # whole seconds added to its times
    residual_ns: int = 0  # offset_ns - shift_s: how far its shifted times are off (|.| <= 0.5 s)


def align(clocks: Sequence[Clock]) -> list[Clock]:
    """Return ``clocks`` with their offset from the earliest start, whole-second shift and residual."""
    first = min(c.start_unix_ns for c in clocks)
    out = []
    for c in clocks:
        off = c.start_unix_ns - first
        k = math.floor(off / S + 0.5)
        out.append(Clock(c.start_unix_ns, c.read_ns, c.precise, off, k, off - k * S))
    return out


def alignment_bound_ns(clocks: Sequence[Clock]) -> int:
    """Return the most two recordings' aligned times can be apart: their residuals' difference plus both reads'
    bounds, over every pair (a job's recordings are >= 2)."""
    pairs = ((a, b) for i, a in enumerate(clocks) for b in clocks[i + 1 :])
    return max((abs(a.residual_ns - b.residual_ns) + a.read_ns + b.read_ns for a, b in pairs), default=0)


class JobRecording(Record):
    """One recording of a job and how its clock was lined up."""

    recording: Annotated[int, Field(description="its index: its pids read recording * 10,000,000 + pid")]
    file: str
    host: str
    shift_s: Annotated[int, Field(description="whole seconds added to its times (its start after the earliest)")]
    offset_ms: Annotated[float, Field(description="its wall-clock start after the earliest recording's, ms")]
    residual_ms: Annotated[float, Field(description="offset left after the whole-second shift, ms")]
    clock: Annotated[str, Field(description="realtime (read at its start) | started_at (older recording, us)")]


class JobAlignment(Record):
    """The recordings analysed as one job, and how well their clocks line up."""

    recordings: list[JobRecording]
    bound_ms: Annotated[
        float, Field(description="most two recordings' aligned times can be apart (hosts' clock sync not included)")
    ]
    note: Annotated[str, Field(description="the alignment in one line")]


def is_job(conn: duckdb.DuckDBPyConnection) -> bool:
    """True when ``conn`` is a job of several recordings (:func:`tracer.analysis.db.open_job`)."""
    row = conn.execute(
        "SELECT count(*) FROM duckdb_views() WHERE view_name = ? AND database_name = current_database()", [JOB_SESSION]
    ).fetchone()
    return bool(row and row[0])


def job_alignment(conn: duckdb.DuckDBPyConnection) -> JobAlignment | None:
    """Return the alignment of the job behind ``conn``; None for a single recording."""
    if not is_job(conn):
        return None
    rows = conn.execute(
        f"SELECT recording, file, host, shift_s, offset_ns, residual_ns, clock, bound_ns FROM {RECORDINGS_TABLE} "
        "ORDER BY recording"
    ).fetchall()
    recs = [
        JobRecording(
            recording=r,
            file=f,
            host=h or "",
            shift_s=k,
            offset_ms=round(off / 1e6, 3),
            residual_ms=round(res / 1e6, 3),
            clock=clk,
        )
        for r, f, h, k, off, res, clk, _ in rows
    ]
    bound = rows[0][7] / 1e6 if rows else 0.0
    shown = f"{bound:.0f}" if bound >= 1 else f"{bound:.3f}"
    hosts = sorted({r.host for r in recs if r.host})
    note = (
        f"{len(recs)} recordings ({len(hosts)} host{'s' if len(hosts) != 1 else ''}) as one job, aligned by wall "
        f"clock to ±{shown} ms; pid {PID_STRIDE + 12345} = recording 1's pid 12345"
    )
    return JobAlignment(recordings=recs, bound_ms=round(bound, 3), note=note)


# --- the job's connection -------------------------------------------------------------------------------------


def _columns(conn: duckdb.DuckDBPyConnection, alias: str) -> dict[str, list[str]]:
    """Return {table: its columns in order} of attached recording ``alias``."""
    out: dict[str, list[str]] = {}
    for t, c in conn.execute(
        "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = ? AND schema_name = 'main' "
        "ORDER BY table_name, column_index",
        [alias],
    ).fetchall():
        out.setdefault(t, []).append(c)
    return out


def _clock(conn: duckdb.DuckDBPyConnection, alias: str, cols: list[str]) -> tuple[Clock, str, str | None]:
    """Return the recording's start on the wall clock, its host and its boot id, from its (last) session row."""
    have = set(cols)
    precise = "realtime_at_start_ns" in have
    sel = ", ".join(
        [
            "epoch_ns(started_at)",
            "realtime_at_start_ns" if precise else "NULL",
            "clock_read_ns" if "clock_read_ns" in have else "NULL",
            "host" if "host" in have else "NULL",
            "boot_id" if "boot_id" in have else "NULL",
        ]
    )
    row = conn.execute(f"SELECT {sel} FROM {alias}.main.session ORDER BY session_id DESC LIMIT 1").fetchone()
    assert row is not None  # validate() refused a recording without a session row
    started, real, read, host, boot = row
    if real is not None:
        return Clock(int(real), int(read) if read is not None else STARTED_AT_READ_NS, True), host or "", boot
    if started is None:
        raise StoreError(f"{alias}: its session row has no start time", "A job's recordings need their start.")
    return Clock(int(started), STARTED_AT_READ_NS, False), host or "", boot


def _expr(table: str, col: str, i: int, clock: Clock) -> str:
    """Return the SQL reading ``col`` of recording ``i``'s ``table`` as the job sees it."""
    q = ident(col)
    if i and col in PID_COLUMNS.get(table, ()):
        return f"CASE WHEN {q} > 0 THEN {q} + {i * PID_STRIDE} ELSE {q} END"
    if i and col in PID_LIST_COLUMNS.get(table, ()):
        return f"list_transform({q}, lambda p: CASE WHEN p > 0 THEN p + {i * PID_STRIDE} ELSE p END)"
    if i and col in STACK_COLUMNS.get(table, ()):
        return f"{q} + {i * STACK_STRIDE}"
    if clock.shift_s and col in TIME_NS_COLUMNS.get(table, ()):
        return f"{q} + {clock.shift_s * S}"
    if clock.shift_s and col in SEC_COLUMNS.get(table, ()):
        return f"{q} + {clock.shift_s}"
    if i and table == "session" and col == "target":  # "pid N" names the target by its pid
        n = "TRY_CAST(substr(target, 5) AS BIGINT)"
        return f"CASE WHEN target LIKE 'pid %' AND {n} > 0 THEN 'pid ' || ({n} + {i * PID_STRIDE}) ELSE target END"
    return q


def define_views(conn: duckdb.DuckDBPyConnection, files: list[Path]) -> None:
    """Create the job's recordings table and its views over the attached recordings rec0..recN."""
    cols = [_columns(conn, f"rec{i}") for i in range(len(files))]
    found = [_clock(conn, f"rec{i}", cols[i].get("session", [])) for i in range(len(files))]
    clocks = align([c for c, _, _ in found])
    bound = alignment_bound_ns(clocks)
    conn.execute(
        f"CREATE TABLE {RECORDINGS_TABLE} (recording INTEGER, file VARCHAR, path VARCHAR, host VARCHAR, "
        "boot_id VARCHAR, start_unix_ns BIGINT, offset_ns BIGINT, shift_s BIGINT, residual_ns BIGINT, "
        "clock_read_ns BIGINT, clock VARCHAR, bound_ns BIGINT)"
    )
    for i, (f, c, (_, host, boot)) in enumerate(zip(files, clocks, found, strict=True)):
        conn.execute(
            f"INSERT INTO {RECORDINGS_TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                i,
                f.name,
                str(f),
                host,
                boot,
                c.start_unix_ns,
                c.offset_ns,
                c.shift_s,
                c.residual_ns,
                c.read_ns,
                "realtime" if c.precise else "started_at",
                bound,
            ],
        )
    for t in TABLES:
        if t.name == CHAINS_RESULT:  # each recording's own answer: the job's is computed over all of them
            continue
        parts = []
        for i, clock in enumerate(clocks):
            have = cols[i].get(t.name)
            if have is None:  # an older recording without this table
                continue
            exprs = [f"{_expr(t.name, c, i, clock)} AS {ident(c)}" for c in have]
            if t.name in ("session", "processes"):
                exprs.append(f"{i} AS recording")
            if t.name == "processes":
                exprs.append(f"{literal(found[i][1])} AS host")
            parts.append((f"SELECT {', '.join(exprs)} FROM rec{i}.main.{t.name}", [*have, *_extra(t.name)]))
        if not parts:
            continue
        if t.name == "meta":  # one row per key: the app, and the oldest schema among the recordings
            union = " UNION ALL ".join(sql for sql, _ in parts)
            conn.execute(
                "CREATE VIEW meta AS SELECT key, CASE WHEN key = 'schema_version' THEN "
                f"CAST(min(TRY_CAST(value AS INTEGER)) AS VARCHAR) ELSE min(value) END AS value FROM ({union}) "
                "GROUP BY key"
            )
            continue
        conn.execute(f"CREATE VIEW {t.name} AS {union_view(t.name, parts)}")
    _define_job_session(conn)


def _extra(table: str) -> list[str]:
    return {"session": ["recording"], "processes": ["recording", "host"]}.get(table, [])


def _define_job_session(conn: duckdb.DuckDBPyConnection) -> None:
    """Create the one-row view of the job's session (:data:`SESSION_RULES`)."""
    have = [r[0] for r in conn.execute("DESCRIBE session").fetchall()]
    host_key = "coalesce(" + ", ".join([c for c in ("boot_id", "host") if c in have] + ["CAST(recording AS VARCHAR)"])
    host_key += ")"
    aggs = []
    for c in have:
        if c == "recording":
            continue
        rule = SESSION_RULES.get(c, "arg_min({c}, recording)")  # a column with no rule: the first recording's
        aggs.append(f"{rule.format(c=ident(c), host_key=host_key)} AS {ident(c)}")
    conn.execute(
        f"CREATE VIEW {JOB_SESSION} AS SELECT {', '.join(aggs)} FROM session "
        f"JOIN (SELECT recording, shift_s, offset_ns AS recording_offset_ns FROM {RECORDINGS_TABLE}) USING (recording)"
    )
