"""``tracer breakdown``: where each CUDA thread's wall time went, training thread first (the parts, who held the
CPU, who woke it, page faults, per time bucket), every thread of its process in brief, and the tracer's cost.
Each thread is named by what it runs (:func:`thread_names`): its OS name, or where that is generic (python3,
its process's), the Python function it was sampled in most.

Check: the parts of every second add up to its ``wall_ns`` by construction; what is checked is that the seconds
cover the thread's span (``threads.end_ns - threads.first_ns``). ``check.gap_pct`` reports the difference.
"""

from __future__ import annotations

import re

import duckdb

from tracer.analysis.breakdown.holders import TOP_N, Holder, holders_of, in_call_runq_by_class, wakers_of
from tracer.analysis.breakdown.load import load_thread_times
from tracer.analysis.breakdown.records import (
    AddUp,
    Breakdown,
    CpuWait,
    ThreadBreakdown,
    ThreadSummary,
    TimeBucket,
    parts_of,
)
from tracer.analysis.breakdown.thread_time import MS, S, ThreadTime, add_row, zero_row
from tracer.analysis.breakdown.tracer_cost import tracer_cost
from tracer.analysis.recording import RecordingInfo, load_recording
from tracer.analysis.stack_time import StackTime, load_frames, thread_name
from tracer.analysis.taxonomy import CALL_PART_NAMES, PART_NAMES
from tracer.vocabulary import HOLDER_CLASSES

# auto bucket width: the smallest of these that gives at most MAX_BUCKETS buckets over the training thread
BUCKET_CHOICES = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600)
MAX_BUCKETS = 60


def summary_of(t: ThreadTime, name: str) -> ThreadSummary:
    return ThreadSummary(
        pid=t.pid,
        tid=t.tid,
        comm=t.comm,
        name=name,
        cuda_calls=t.cuda_calls,
        wall_ms=round(t.wall / MS, 3),
        cpu_ms=round(t.ns("cpu") / MS, 3),
        in_calls_ms=round(t.ns(*CALL_PART_NAMES) / MS, 3),
        runq_ms=round(t.runq_ns / MS, 3),
        blocked_ms=round(t.ns("blocked") / MS, 3),
        faults=t.ns("faults"),
        page_alloc_bytes=t.ns("page_alloc_bytes"),
        reclaim_ms=round(t.ns("reclaim") / MS, 3),
    )


def buckets_of(t: ThreadTime, bucket_s: int) -> list[TimeBucket]:
    """Return the thread's per-second rows summed into ``bucket_s``-wide buckets."""
    acc: dict[int, dict[str, int]] = {}
    for sec, row in t.by_sec.items():
        add_row(acc.setdefault(sec // bucket_s, zero_row()), row)
    out = []
    for b, row in sorted(acc.items()):
        wall = row["wall"]
        nz = [p for p in PART_NAMES if row[p]]
        out.append(
            TimeBucket(
                start_s=float(b * bucket_s),
                wall_ms=round(wall / MS, 3),
                ms={p: round(row[p] / MS, 3) for p in nz},
                share={p: round(row[p] / wall, 4) if wall else 0.0 for p in nz},
                faults=row["faults"],
                page_alloc_bytes=row["page_alloc_bytes"],
            )
        )
    return out


def check_of(t: ThreadTime) -> AddUp:
    """Return the coverage check of an exact thread: its seconds' wall_ns against its span."""
    span = t.span_ns
    parts = sum(t.total.get(p, 0) for p in PART_NAMES)
    gap = span - t.wall
    return AddUp(
        span_ms=round(span / MS, 3),
        accounted_ms=round(t.wall / MS, 3),
        gap_ms=round(gap / MS, 3),
        gap_pct=round(100 * gap / span, 3) if span else 0.0,
        parts_mismatch_ms=round((parts - t.wall) / MS, 3),
    )


def cpu_wait_of(t: ThreadTime, holders: list[Holder]) -> CpuWait:
    """The thread's whole wait for a CPU: its runq parts and its in-call run queue, split by holder class from
    ``holders`` (all of them; :func:`in_call_runq_by_class`). A sync's wakeup that waited for the CPU is time in
    "sync", and was the wait hidden there (issue 28: 0.3% shown waiting for a CPU, 94% of the sync time)."""
    inside = in_call_runq_by_class(t, holders)
    by = {c: t.ns(f"runq_{c}") + inside[c] for c in HOLDER_CLASSES}
    total = t.runq_ns + t.ns("call_runq")
    return CpuWait(
        ms=round(total / MS, 3),
        share=round(t.share(total), 4),
        in_calls_ms=round(t.ns("call_runq") / MS, 3),
        by_holder_ms={c: round(v / MS, 3) for c, v in by.items()},
    )


def auto_bucket(span_ns: int) -> int:
    """Return the smallest of BUCKET_CHOICES that splits ``span_ns`` into at most MAX_BUCKETS buckets."""
    for b in BUCKET_CHOICES:
        if span_ns <= b * S * MAX_BUCKETS:
            return b
    return BUCKET_CHOICES[-1]


def time_breakdown(
    conn: duckdb.DuckDBPyConnection, pid: int | None = None, tid: int | None = None, bucket_s: int = 0
) -> Breakdown:
    """Return where the CUDA threads' time went (of ``pid``, or only thread ``tid``), training thread first.

    Args:
        bucket_s: bucket width in seconds for the per-bucket rows; 0 picks one that gives at most MAX_BUCKETS.
    """
    info = load_recording(conn)
    if tid is not None and pid is None:
        pid = _pid_of_tid(conn, info, tid)
    times = load_thread_times(conn, info, pid)
    training = times.training
    drivers = {t.tid for t in times.drivers}
    # every CUDA thread; with tid, that thread even if it made no CUDA call (a thread faulting in memory)
    shown = list(times.cuda_threads) if tid is None else [t for t in (times.by_tid(tid),) if t is not None]
    shown.sort(key=lambda t: (t is not training, t.tid not in drivers, [-x for x in t.gpu_work_key]))
    focus = shown[0] if shown else None
    bucket = bucket_s if bucket_s > 0 else auto_bucket(focus.span_ns if focus else 0)
    scope = pid if pid is not None else (training.pid if training else None)
    in_scope = times.of_pid(scope)
    names = thread_names(conn, info, shown + in_scope)
    out = []
    for t in shown:
        every, hnote = holders_of(conn, info, t, limit=None)  # all of them: the in-call wait's split needs them
        out.append(
            ThreadBreakdown(
                pid=t.pid,
                tid=t.tid,
                comm=t.comm,
                name=names[(t.pid, t.tid)],
                process_comm=info.comm(t.pid),
                role=times.role_of(t),
                cuda_calls=t.cuda_calls,
                first_s=round(t.first_ns / S, 3),
                end_s=round(t.end_ns / S, 3),
                exited=t.exited,
                wall_ms=round(t.wall / MS, 3),
                parts=parts_of(t),
                in_call_off_cpu_ms=round(t.ns("call_off_cpu") / MS, 3),
                in_call_runq_ms=round(t.ns("call_runq") / MS, 3),
                cpu_wait=cpu_wait_of(t, every),
                io_ms=round(t.ns("io") / MS, 3),
                faults=t.ns("faults"),
                page_alloc_bytes=t.ns("page_alloc_bytes"),
                reclaim_ms=round(t.ns("reclaim") / MS, 3),
                holders=every[:TOP_N],
                holders_note=hnote,
                wakers=wakers_of(conn, info, t),
                check=check_of(t) if times.basis == "exact" else None,
                buckets=buckets_of(t, bucket) if t is focus else [],
            )
        )
    siblings = [summary_of(t, names[(t.pid, t.tid)]) for t in in_scope]
    siblings.sort(key=lambda s: (-s.page_alloc_bytes, -s.faults, s.tid))
    return Breakdown(
        basis=times.basis,
        note=times.note,
        pid=pid,
        tid=tid,
        bucket_s=bucket,
        training_tid=training.tid if training else None,
        threads=out,
        process_threads=siblings,
        tracer=tracer_cost(conn, info, times),
    )


# OS thread names that say nothing of what a thread runs: the interpreter's (python, python3, python3.12: a thread
# inherits its creator's name) and the one PyTorch gives its main thread
GENERIC_COMM = re.compile(r"python[0-9.]*|pt_main_thread")


def informative(comm: str, process_comm: str) -> bool:
    """True when a thread's OS name says what it runs: set, not its process's, not a generic one."""
    return bool(comm) and comm != process_comm and not GENERIC_COMM.fullmatch(comm)


def thread_names(
    conn: duckdb.DuckDBPyConnection, info: RecordingInfo, threads: list[ThreadTime]
) -> dict[tuple[int, int], str]:
    """(pid, tid) -> the thread's name (:func:`~tracer.analysis.stack_time.thread_name`): its OS name where that is
    :func:`informative`, else its tid and the Python function of its hottest sampled stack with Python frames."""
    plain = {(t.pid, t.tid) for t in threads if not informative(t.comm, info.comm(t.pid))}
    # a thread blocked longer than it ran is named by where it waits, not by its CPU function (issue 28)
    waiting = {(t.pid, t.tid) for t in threads if (t.pid, t.tid) in plain and t.ns("blocked") > t.ns("cpu")}
    hottest = _hottest_python_stacks(conn, info, plain)  # also a waiting thread's, if it has no blocked stack
    where = _hottest_blocked_stacks(conn, info, waiting)
    frames = load_frames(conn, [*hottest.values(), *where.values()])
    out = {}
    for t in threads:
        key = (t.pid, t.tid)
        blocked = key in where
        sid = where.get(key) if blocked else hottest.get(key)
        st = [StackTime(sid, frames=frames.get(sid, []))] if sid is not None else []
        # a generic OS name is passed as none: thread_name then names the thread by its hottest function
        out[key] = thread_name("" if key in plain else t.comm, info.comm(t.pid), t.tid, st, blocked=blocked)
    return out


def _hottest_blocked_stacks(
    conn: duckdb.DuckDBPyConnection, info: RecordingInfo, threads: set[tuple[int, int]]
) -> dict[tuple[int, int], int]:
    """(pid, tid) -> the stack with Python frames each thread was blocked in longest (ties: the lowest stack_id);
    none for a recording without ``offcpu_stacks``."""
    if not threads or not info.has("offcpu_stacks"):
        return {}
    pids, tids = zip(*sorted(threads), strict=True)
    rows = conn.execute(
        """SELECT pid, tid, stack_id FROM (
             SELECT pid, tid, stack_id,
                    row_number() OVER (PARTITION BY pid, tid ORDER BY sum(blocked_ns) DESC, stack_id) AS r
             FROM offcpu_stacks
             SEMI JOIN (SELECT unnest($pids) AS p, unnest($tids) AS t) ON pid = p AND tid = t
             WHERE stack_id IN (SELECT stack_id FROM stacks WHERE kind = 'python')
             GROUP BY pid, tid, stack_id)
           WHERE r = 1""",
        {"pids": list(pids), "tids": list(tids)},
    ).fetchall()
    return {(int(p), int(t)): int(sid) for p, t, sid in rows}


def _hottest_python_stacks(
    conn: duckdb.DuckDBPyConnection, info: RecordingInfo, threads: set[tuple[int, int]]
) -> dict[tuple[int, int], int]:
    """(pid, tid) -> the stack with Python frames each thread was sampled in most (ties: the lowest stack_id);
    none for a recording without ``cpu_samples``."""
    if not threads or not info.has("cpu_samples"):
        return {}
    pids, tids = zip(*sorted(threads), strict=True)
    rows = conn.execute(
        """SELECT pid, tid, stack_id FROM (
             SELECT pid, tid, stack_id,
                    row_number() OVER (PARTITION BY pid, tid ORDER BY sum(samples) DESC, stack_id) AS r
             FROM cpu_samples
             SEMI JOIN (SELECT unnest($pids) AS p, unnest($tids) AS t) ON pid = p AND tid = t
             WHERE stack_id IN (SELECT stack_id FROM stacks WHERE kind = 'python')
             GROUP BY pid, tid, stack_id)
           WHERE r = 1""",
        {"pids": list(pids), "tids": list(tids)},
    ).fetchall()
    return {(int(p), int(t)): int(sid) for p, t, sid in rows}


def _pid_of_tid(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, tid: int) -> int | None:
    for table in ("threads", "thread_breakdown", "cuda_calls"):
        if info.has(table):
            r = conn.execute(f"SELECT any_value(pid) FROM {table} WHERE tid = ?", [tid]).fetchone()
            if r and r[0] is not None:
                return int(r[0])
    return None
