"""The trace overview: environment, event accounting, per-op latency, per-process scheduling, host peaks,
the training thread's time breakdown, the tracer's own cost, and chain counts.

Latency percentiles come from ``op_stats.hist``, the exact in-kernel histogram over every call (not only the
stored rows), through :func:`tracer.hist.quantile`: buckets are log-linear (16 per power of two), a percentile is
interpolated linearly inside its bucket and clamped to the op's min/max, so the error is at most half a bucket
width (<= 3.1 %).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Annotated, NamedTuple

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.breakdown.load import load_thread_times
from tracer.analysis.breakdown.records import PartTime, parts_of
from tracer.analysis.breakdown.thread_time import ThreadTimes
from tracer.analysis.breakdown.tracer_cost import TracerCost, tracer_cost
from tracer.analysis.chains import ChainContext, compute_chains
from tracer.analysis.db import RecordingState, recording_state, session_row, thinned_note
from tracer.analysis.job import job_alignment
from tracer.analysis.processes import (
    TOP_BUSY_THREADS,
    BusyThread,
    ProcessGroup,
    busy_threads,
    group_processes,
    grouped_processes,
    process_figures_sql,
    top_busy_threads,
)
from tracer.analysis.recording import DATALOADER_COMM, RecordingInfo, load_recording, main_pid
from tracer.analysis.taxonomy import part_name
from tracer.hist import OpHistogram
from tracer.vocabulary import TRACER_ROLE

TOP_PROCESS_GROUPS = 6  # process groups in the overview unless detail
MIN_PART_SHARE = 0.001  # the training thread's parts in the overview: 0.1% of its wall time or more
TARGET_CHARS = 120  # the launched command in the overview, cut (a long command line with paths is most of 4 KB)
# the session's notes in the overview, cut: a duty-cycled recording's note with a checkout's long path in the
# command took a 4 KB answer to 4.2 KB (CI, issue 23's bound); detail has them whole
NOTES_CHARS = 100
# the worst chain's summary in the overview, cut to this many characters: a pointer to get_causal_chains, which
# has it whole (a straggler's summary alone was 466 bytes of a 4 KB answer)
TOP_CHAIN_CHARS = 160

__all__ = ["DATALOADER_COMM", "main_pid", "op_stats", "trace_stats"]


class Environment(Record):
    """Where and when the trace was recorded."""

    started_at: Annotated[str, Field(description="wall-clock start, ISO 8601 UTC")]
    duration_s: Annotated[float, Field(description="recording length in seconds")]
    status: Annotated[str, Field(description="complete | interrupted | target_exited | failed | recording")]
    host: str
    kernel: str
    cpu_model: str
    cpu_cores: int
    mem_bytes: int
    gpus: Annotated[str, Field(description="GPU names, empty if none")]
    driver: str
    python_version: str
    tracer_version: str
    target: Annotated[
        str,
        Field(
            description=f"pid N or the launched command (get_trace_stats: cut to {TARGET_CHARS} characters unless "
            "detail)"
        ),
    ]
    overhead_pct: Annotated[float | None, Field(description="estimated tracing overhead, % of the target's CPU")]
    notes: Annotated[
        str,
        Field(description=f"the recording's caveats (get_trace_stats: cut to {NOTES_CHARS} characters unless detail)"),
    ]


class OpStat(Record):
    """Latency of one CUDA API function over every call (exact counts from the in-kernel histogram)."""

    op: Annotated[str, Field(description="API function, e.g. cudaStreamSynchronize")]
    layer: Annotated[str, Field(description="runtime (libcudart) | driver (libcuda); kept apart, never summed")]
    part: Annotated[
        str,
        Field(
            description="where its time goes in the breakdown (probe catalog): launch | sync | alloc | free | copy | "
            "other; sync includes synchronous copies (cudaMemcpy, cuMemcpyDtoH), which wait for the GPU"
        ),
    ]
    calls: Annotated[int, Field(description="number of calls (scaled from a sample when sampled_fraction < 1)")]
    total_ms: Annotated[float, Field(description="sum of latencies in ms")]
    p50_us: Annotated[float, Field(description="median latency, µs")]
    p95_us: Annotated[float, Field(description="95th percentile, µs")]
    p99_us: Annotated[float, Field(description="99th percentile, µs")]
    max_us: Annotated[float, Field(description="slowest call, µs")]
    tail_ratio: Annotated[float, Field(description="p99 / p50: how much worse the tail is than the typical call")]
    bytes: Annotated[int, Field(description="total bytes allocated / copied / set")]
    sampled_fraction: Annotated[float, Field(description="1.0 = every call counted; < 1 = scaled from a sample")]


class ProcessStat(Record):
    """One process of the traced tree: CUDA activity and how much it was kept off the CPU."""

    pid: int
    ppid: int | None
    comm: Annotated[str, Field(description="process name (DataLoader workers: pt_data_worker)")]
    role: Annotated[
        str,
        Field(
            description="main (the traced target) | rank (a rank's own process in a distributed job) | launcher "
            "(started the ranks: torchrun's agent) | dataloader_worker | child | tracer"
        ),
    ]
    rank: Annotated[
        int | None, Field(description="its rank in a distributed job (a worker: its rank's), else null")
    ] = None
    cuda_calls: Annotated[int, Field(description="CUDA calls (exact, from op_stats)")]
    context_switches: Annotated[int, Field(description="times its threads were switched out")]
    preemptions: Annotated[int, Field(description="of those, while still runnable (CPU taken away)")]
    off_cpu_s: Annotated[float, Field(description="total off-CPU time of its threads, seconds")]
    runq_s: Annotated[float, Field(description="of that, time runnable but waiting for a CPU, seconds")]
    worst_stall_ms: Annotated[float, Field(description="longest single off-CPU interval, ms")]
    first_s: Annotated[float, Field(description="first seen, seconds since session start")]
    exit_s: Annotated[float | None, Field(description="exit time, seconds since start; null if alive at the end")]
    exit_code: Annotated[int | None, Field(description="wait(2) status: code << 8 | signal")]


class HostPeaks(Record):
    """Worst host conditions seen in the ~1 Hz samples."""

    samples: int
    max_load1: float | None
    max_cpu_busy_pct: float | None
    min_mem_available_bytes: int | None
    max_page_alloc_bytes_per_s: Annotated[float | None, Field(description="peak host-wide page allocation rate")]
    max_swap_used_bytes: int | None


class TrainingTime(Record):
    """The training thread (most launch + sync time) and where its wall time went."""

    pid: int
    tid: int
    comm: str
    basis: Annotated[str, Field(description="exact (thread_breakdown) | estimated (older recording)")]
    wall_ms: float
    parts: Annotated[
        list[PartTime],
        Field(description="parts of at least 0.1% of its wall time, largest first (get_time_breakdown: every part)"),
    ]
    cpu_wait_share: Annotated[
        float,
        Field(
            description="its whole wait for a CPU, 0..1 of its wall time: the runq parts plus the wait inside CUDA "
            "calls, which the parts count in the call's part (a sync's wakeup behind the CPU's holder)"
        ),
    ] = 0.0


class TraceStats(Record):
    """Overview of one trace: start every investigation here."""

    environment: Environment
    pid: Annotated[int | None, Field(description="the pid filter applied, null for the whole tree")]
    events_traced: Annotated[int, Field(description="CUDA calls counted in kernel (every call)")]
    events_stored: Annotated[int, Field(description="individual call rows kept in cuda_calls")]
    events_lost: Annotated[int, Field(description="events dropped because a ring buffer was full")]
    ops: Annotated[list[OpStat], Field(description="per op, worst tail ratio first")]
    process_groups: Annotated[
        list[ProcessGroup],
        Field(
            description="the traced processes grouped by (comm, parent, role, rank), main first; the top "
            f"{TOP_PROCESS_GROUPS} unless detail (more_processes says what is left out), and the tracer's own only "
            "with detail (its cost is in tracer)"
        ),
    ]
    more_processes: Annotated[
        str | None, Field(description="the groups left out, e.g. '12 more groups, 3,410 processes'; null if none")
    ] = None
    busy_threads: Annotated[
        list[BusyThread],
        Field(
            description="threads on CPU for >= 5% of the recording (of one core), CUDA or not, busiest first: every "
            f"rank's main thread and the {TOP_BUSY_THREADS} busiest in all unless detail (more_busy_threads: the rest)"
        ),
    ]
    more_busy_threads: Annotated[
        int, Field(description="busy threads left out of busy_threads (detail=True lists them all); 0 if none")
    ] = 0
    processes: Annotated[
        list[ProcessStat], Field(description="one row per process: only with detail=True or a pid filter")
    ]
    host: HostPeaks
    chains_by_severity: Annotated[dict[str, int], Field(description="causal chains found, by severity")]
    top_chain: Annotated[
        str | None,
        Field(
            description=f"the worst chain's summary, cut to {TOP_CHAIN_CHARS} characters (get_causal_chains has it "
            "whole); null if none"
        ),
    ]
    training_thread: Annotated[
        TrainingTime | None, Field(description="where the training thread's time went (get_time_breakdown: more)")
    ]
    tracer: Annotated[TracerCost, Field(description="the tracer's own cost on this host (never a culprit)")]
    recording: Annotated[
        RecordingState,
        Field(
            description="whether the recording finished, is still being written (live: the numbers cover what was "
            "flushed so far) or was cut off (exact aggregates may be missing)"
        ),
    ]
    job: Annotated[
        str | None,
        Field(description="several recordings analysed as one job: how many, and how well their clocks line up"),
    ] = None
    thinned: Annotated[
        str | None,
        Field(
            description="when tracer record --max-db-size thinned the oldest detail rows: before when, and how many "
            "(the aggregates stay exact); null if nothing was thinned"
        ),
    ] = None


def op_stats(conn: duckdb.DuckDBPyConnection, *, pid: int | None = None) -> list[OpStat]:
    """Return per-(op, layer) latency over every call, summed over pids unless ``pid`` is given; worst tail first."""
    rows = conn.execute(
        "SELECT op, layer, calls, total_ns, min_ns, max_ns, bytes, sampled_fraction, hist FROM op_stats "
        "WHERE ($pid IS NULL OR pid = $pid)",
        {"pid": pid},
    ).fetchall()
    groups: dict[tuple[str, str], list[tuple]] = defaultdict(list)
    for r in rows:
        groups[(r[0], r[1])].append(r)
    out = []
    for (op, layer), rs in groups.items():
        calls = sum(r[2] or 0 for r in rs)
        hist = OpHistogram.of((r[8], r[4], r[5]) for r in rs)
        p50, p95, p99 = (hist.quantile(q) for q in (0.5, 0.95, 0.99))
        frac = min((r[7] if r[7] is not None else 1.0) for r in rs)
        out.append(
            OpStat(
                op=op,
                layer=layer or "",
                part=part_name(op),
                calls=int(calls),
                total_ms=round(sum(r[3] or 0 for r in rs) / 1e6, 3),
                p50_us=round(p50 / 1e3, 1),
                p95_us=round(p95 / 1e3, 1),
                p99_us=round(p99 / 1e3, 1),
                max_us=round(hist.max_ns / 1e3, 1),
                tail_ratio=round(p99 / p50, 1) if p50 > 0 else 0.0,
                bytes=int(sum(r[6] or 0 for r in rs)),
                sampled_fraction=float(frac),
            )
        )
    out.sort(key=lambda o: (-o.tail_ratio, -o.calls, o.op))
    return out


# the session's columns of Environment's names: a NULL (or a column an older recording lacks) reads "" or 0
_ENVIRONMENT_TEXT = tuple("status host kernel cpu_model gpus driver python_version tracer_version target notes".split())
_ENVIRONMENT_NUMBERS = ("duration_s", "cpu_cores", "mem_bytes")
# DuckDB formats the start: a TIMESTAMPTZ reaching Python would need pytz
_STARTED_AT = {"started_at": "strftime(started_at AT TIME ZONE 'UTC', '%Y-%m-%dT%H:%M:%SZ')"}


def environment(conn: duckdb.DuckDBPyConnection) -> Environment:
    s = session_row(conn, (*_ENVIRONMENT_TEXT, *_ENVIRONMENT_NUMBERS, "overhead_pct"), _STARTED_AT)
    if s is None:
        raise LookupError("session table is empty")
    return Environment(
        **{k: s[k] or "" for k in (*_ENVIRONMENT_TEXT, "started_at")},
        **{k: s[k] or 0 for k in _ENVIRONMENT_NUMBERS},
        overhead_pct=s["overhead_pct"],
    )


class ProcessRow(NamedTuple):
    """A process's figures as :class:`ProcessStat` has them, unrounded and unvalidated: what grouping reads. A
    fork-heavy recording has 200 K processes, and validating a model each cost a second of `get_trace_stats`
    that lists only their groups (issue 21)."""

    pid: int
    ppid: int | None
    comm: str
    role: str
    rank: int | None
    cuda_calls: int
    context_switches: int
    preemptions: int
    off_cpu_s: float
    runq_s: float
    worst_stall_ms: float
    first_s: float
    exit_s: float | None
    exit_code: int | None

    def stat(self) -> ProcessStat:
        return ProcessStat(
            **self._replace(
                off_cpu_s=round(self.off_cpu_s, 3),
                runq_s=round(self.runq_s, 3),
                worst_stall_ms=round(self.worst_stall_ms, 2),
                first_s=round(self.first_s, 3),
                exit_s=None if self.exit_s is None else round(self.exit_s, 3),
            )._asdict()
        )


def process_rows(
    conn: duckdb.DuckDBPyConnection, *, pid: int | None = None, info: RecordingInfo | None = None
) -> list[ProcessRow]:
    """Return every traced process (or just ``pid``) as a :class:`ProcessRow`, in the analysis' ranking: the
    main process first, then by CUDA calls and off-CPU time (``info``: the recording, when the caller has loaded
    it)."""
    info = info or load_recording(conn)
    got = conn.execute(
        f"SELECT pid, ppid, comm, first_ns / 1e9, exit_ns / 1e9, exit_code, calls, sw, pre, off / 1e9, rq / 1e9, "
        f"worst / 1e6 FROM ({process_figures_sql(info, 'NULL')}) ORDER BY rn",
        {"pid": pid, "main": info.main_pid},
    ).fetchall()
    role, procs = info.process_role, info.procs
    return [
        ProcessRow(
            p,
            pp,
            comm or "",
            role(p),
            procs[p].rank if p in procs else None,
            calls,
            sw,
            pre,
            off,
            rq,
            worst,
            first or 0.0,
            ex,
            code,
        )  # fmt: skip
        for p, pp, comm, first, ex, code, calls, sw, pre, off, rq, worst in got
    ]


def _processes(conn: duckdb.DuckDBPyConnection, pid: int | None, info: RecordingInfo, detail: bool) -> dict:
    """The processes part of the overview: groups (the top ones unless ``detail``), busy threads, and one row
    per process with ``detail`` or a ``pid``."""
    # every process's row only when they are listed; else their groups, summed in DuckDB
    rows = process_rows(conn, pid=pid, info=info) if detail or pid is not None else []
    groups = group_processes(rows) if rows else grouped_processes(conn, info)
    if not detail:
        # the recorder's own processes have their section (tracer): listing them here too cost a tenth of the
        # 4 KB an assistant's first answer is allowed (issue 23)
        groups = [g for g in groups if g.role != TRACER_ROLE]
    shown = groups if detail else groups[:TOP_PROCESS_GROUPS]
    rest = groups[len(shown) :]
    more = f"{len(rest):,} more groups, {sum(g.processes for g in rest):,} processes (detail=True)" if rest else None
    busy = busy_threads(conn, info, pid)
    busy, more_busy = (busy, 0) if detail else top_busy_threads(busy)
    return {
        "process_groups": shown,
        "more_processes": more,
        "busy_threads": busy,
        "more_busy_threads": more_busy,
        "processes": [r.stat() for r in rows] if detail or pid is not None else [],
    }


def host_peaks(conn: duckdb.DuckDBPyConnection) -> HostPeaks:
    """Return the worst host sample values; page allocation is normalised to bytes per second."""
    r = conn.execute("""
        WITH h AS (SELECT *, ts_ns - lag(ts_ns) OVER (ORDER BY ts_ns) AS dt FROM host_samples)
        SELECT count(*), max(load1), max(cpu_busy_pct), min(mem_available_bytes),
               max(page_alloc_bytes * 1e9 / CASE WHEN dt IS NULL OR dt <= 0 THEN 1e9 ELSE dt END),
               max(swap_used_bytes)
        FROM h""").fetchone()
    assert r is not None
    return HostPeaks(
        samples=int(r[0]),
        max_load1=r[1],
        max_cpu_busy_pct=r[2],
        min_mem_available_bytes=r[3],
        max_page_alloc_bytes_per_s=r[4],
        max_swap_used_bytes=r[5],
    )


def training_time(
    conn: duckdb.DuckDBPyConnection,
    pid: int | None = None,
    info: RecordingInfo | None = None,
    times: ThreadTimes | None = None,
) -> tuple[TrainingTime | None, TracerCost]:
    """Return the training thread's breakdown in brief (of ``pid`` when given) and the tracer's own cost
    (``info``/``times``: the recording and its thread times when the caller has loaded them)."""
    info = info or load_recording(conn)
    times = times or load_thread_times(conn, info, pid)
    t = times.training
    cost = tracer_cost(conn, info, times)
    if t is None:
        return None, cost
    # the parts under 0.1% (a malloc at start-up, the tracer's 1 ms) are get_time_breakdown's: here each took 40
    # of the 4 KB an overview may have
    parts = sorted((p for p in parts_of(t) if p.ms > 0 and p.share >= MIN_PART_SHARE), key=lambda p: -p.ms)
    return (
        TrainingTime(
            pid=t.pid,
            tid=t.tid,
            comm=t.comm,
            basis=times.basis,
            wall_ms=round(t.wall / 1e6, 3),
            parts=parts,
            cpu_wait_share=round(t.share(t.runq_ns + t.ns("call_runq")), 4),
        ),
        cost,
    )


def trace_stats(conn: duckdb.DuckDBPyConnection, pid: int | None = None, detail: bool = False) -> TraceStats:
    """Return the overview of the trace (or of one process with ``pid``), including chain counts by severity;
    processes grouped (the top groups), with every process and group when ``detail``."""
    ev = session_row(conn, ("events_traced", "events_stored", "events_lost")) or {}
    ctx = ChainContext.load(conn, pid)  # one load of every thread's time, for the chains and the breakdown
    chains = compute_chains(conn, pid=pid, limit=1, ctx=ctx)
    training, cost = training_time(conn, pid, ctx.info, ctx.times)
    env = environment(conn)
    if not detail:
        env = env.model_copy(update={"target": _cut(env.target, TARGET_CHARS), "notes": _cut(env.notes, NOTES_CHARS)})
    return TraceStats(
        environment=env,
        pid=pid,
        events_traced=int(ev.get("events_traced") or 0),
        events_stored=int(ev.get("events_stored") or 0),
        events_lost=int(ev.get("events_lost") or 0),
        ops=op_stats(conn, pid=pid),
        **_processes(conn, pid, ctx.info, detail),
        host=host_peaks(conn),
        chains_by_severity=chains.by_severity,
        top_chain=_cut(chains.chains[0].summary, TOP_CHAIN_CHARS) if chains.chains else None,
        training_thread=training,
        tracer=cost,
        recording=recording_state(conn),
        job=job.note if (job := job_alignment(conn)) is not None else None,
        thinned=thinned_note(conn),
    )


def _cut(text: str, chars: int) -> str:
    """Return ``text`` cut at a word boundary to at most ``chars`` characters, marked with an ellipsis."""
    if len(text) <= chars:
        return text
    head = text[: chars - 1]
    head = head[: head.rfind(" ")] if " " in head else head
    return head.rstrip(" ,;:") + "…"
