"""Where each CUDA thread's wall time went: on CPU, inside CUDA calls by class, waiting for a CPU by holder,
blocked (with the waker), plus page faults, in total and per time bucket; and what the tracer itself cost.

Source: ``thread_breakdown``, counted in kernel per (thread, second) with parts that add up to ``wall_ns``
(:data:`tracer.analysis.taxonomy.PART_NAMES`); ``preemptors`` (by waiting thread) names who held the CPU,
``thread_wakers`` who ended each blocked interval. A recording without them (made before the time accounting
existed, or by a recorder that did not run it) gets an *estimate* (``basis = "estimated"``) from ``op_stats``
(exact per-process call time), ``sched_stats`` (exact per-thread off-CPU and run-queue time) and the stored
calls; it has no faults and no wakers, and says so in ``note``.

The training thread is the thread with the most time issuing and waiting for GPU work (launch + sync), ties
broken by CUDA calls then tid: it is the one whose time a job's step time is made of, and unlike a call count
it is not inflated by cheap calls nor deflated when launch probes are duty-cycled. Each process that issues CUDA
calls has such a *driver* thread; the training thread is the top one.

Check: the parts of every second add up to its ``wall_ns`` by construction; what is checked is that the seconds
cover the thread's span (``threads.end_ns - threads.first_ns``). ``check.gap_pct`` reports the difference.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Literal

import duckdb
from pydantic import Field

from probes.catalog import Layer, spec_of
from tracer.analysis import Record
from tracer.analysis.recording import RecordingInfo, load_recording
from tracer.analysis.taxonomy import CALL_PART_NAMES, PART_NAMES, RUNQ_PART_NAMES, part_name

S = 1_000_000_000
MS = 1_000_000
# every per-second quantity of thread_breakdown kept per thread: the parts (they sum to wall) and the extras
EXTRA_NS: tuple[str, ...] = ("io", "call_off_cpu", "call_runq", "reclaim")
COUNTS: tuple[str, ...] = ("faults", "page_alloc_bytes")
FIELDS: tuple[str, ...] = ("wall", *PART_NAMES, *EXTRA_NS, *COUNTS)
# auto bucket width: the smallest of these that gives at most MAX_BUCKETS buckets over the training thread
BUCKET_CHOICES = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600)
MAX_BUCKETS = 60
TOP_N = 5  # holders and wakers listed per thread
NO_BREAKDOWN = "no breakdown in this recording"

Basis = Literal["exact", "estimated", "none"]
HolderClass = Literal["self", "tree", "other", "tracer", "interrupt"]


def _col(name: str) -> str:
    return name if name in COUNTS else f"{name}_ns"


# ---------------------------------------------------------------------------------------------- in memory
@dataclass
class ThreadTime:
    """One thread's time: totals and per second, in ns (counts for faults/page_alloc_bytes), keyed by FIELDS."""

    pid: int
    tid: int
    comm: str
    first_ns: int
    end_ns: int
    exited: bool
    cuda_calls: int
    total: dict[str, int] = field(default_factory=dict)
    by_sec: dict[int, dict[str, int]] = field(default_factory=dict)

    @property
    def wall(self) -> int:
        return self.total.get("wall", 0)

    @property
    def span_ns(self) -> int:
        return max(self.end_ns - self.first_ns, 0)

    def ns(self, *names: str) -> int:
        """Return the sum of the named parts/extras in ns over the whole span."""
        return sum(self.total.get(n, 0) for n in names)

    def share(self, ns: float) -> float:
        """Return ``ns`` as a share of the thread's accounted wall time (0 when it has none)."""
        return ns / self.wall if self.wall > 0 else 0.0

    @property
    def host_ns(self) -> int:
        """Time the thread was doing its own work, on CPU or inside non-waiting calls (not sync, queue, blocked)."""
        return self.ns("cpu", *(p for p in CALL_PART_NAMES if p != "sync"))

    @property
    def runq_ns(self) -> int:
        return self.ns(*RUNQ_PART_NAMES)

    @property
    def gpu_work_key(self) -> tuple[int, int, int]:
        """Sort key of the training-thread rule: launch + sync time, then CUDA calls, then lowest tid."""
        return (self.ns("launch", "sync"), self.cuda_calls, -self.tid)


@dataclass
class ThreadTimes:
    """Every accounted thread of a recording (or of one pid), the driver threads and the basis."""

    basis: Basis
    note: str
    threads: list[ThreadTime]

    def by_tid(self, tid: int) -> ThreadTime | None:
        return next((t for t in self.threads if t.tid == tid), None)

    @property
    def cuda_threads(self) -> list[ThreadTime]:
        return [t for t in self.threads if t.cuda_calls > 0]

    @property
    def drivers(self) -> list[ThreadTime]:
        """Per process, its CUDA thread with the most launch + sync time; best first."""
        best: dict[int, ThreadTime] = {}
        for t in self.cuda_threads:
            if t.pid not in best or t.gpu_work_key > best[t.pid].gpu_work_key:
                best[t.pid] = t
        return sorted(best.values(), key=lambda t: t.gpu_work_key, reverse=True)

    @property
    def training(self) -> ThreadTime | None:
        d = self.drivers
        return d[0] if d else None


def _zero() -> dict[str, int]:
    return dict.fromkeys(FIELDS, 0)


def _add(into: dict[str, int], row: dict[str, int]) -> None:
    for k, v in row.items():
        into[k] = into.get(k, 0) + int(v or 0)


def load_thread_times(
    conn: duckdb.DuckDBPyConnection, info: RecordingInfo | None = None, pid: int | None = None
) -> ThreadTimes:
    """Return every accounted thread's time (of ``pid`` only when given): exact when the recording has
    ``thread_breakdown`` rows, else estimated from op_stats, sched_stats and the stored calls."""
    info = info or load_recording(conn)
    if info.has_breakdown:
        return ThreadTimes("exact", "", _exact(conn, info, pid))
    threads = _estimate(conn, info, pid)
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
    cols = ", ".join(f"coalesce({_col(f)}, 0)" for f in FIELDS)
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
                total=_zero(),
            )
        row = dict(zip(FIELDS, (int(v) for v in r[3:]), strict=True))
        if sec in t.by_sec:  # a long interval closed late: a second row for the same second
            _add(t.by_sec[sec], row)
        else:
            t.by_sec[sec] = row
        _add(t.total, row)
    if not meta:  # no threads rows: a thread issued CUDA calls when it spent time in them
        for t in out.values():
            t.cuda_calls = 1 if t.ns(*CALL_PART_NAMES) > 0 else 0
            t.end_ns = max(t.end_ns, max(t.by_sec, default=0) * S + S)
    return sorted(out.values(), key=lambda t: (t.pid, t.tid))


# ---------------------------------------------------------------------------------------------- estimate
def _estimate(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, pid: int | None) -> list[ThreadTime]:
    """Per-(thread, second) parts from what an older recording has (see the module docstring)."""
    p = {"pid": pid}
    spans = conn.execute(
        "SELECT pid, tid, min(ts_ns), max(ts_ns + dur_ns), count(*) FROM cuda_calls "
        "WHERE ($pid IS NULL OR pid = $pid) GROUP BY pid, tid",
        p,
    ).fetchall()
    if not spans:
        return []
    ops = conn.execute(
        "SELECT pid, op, layer, sum(calls), sum(total_ns) FROM op_stats WHERE ($pid IS NULL OR pid = $pid) "
        "GROUP BY ALL",
        p,
    ).fetchall()
    # A runtime call and the driver call it makes inside (cudaMalloc -> cuMemAlloc) are the same time: per
    # (pid, part) count the runtime layer when it has calls, else the driver layer.
    layers: dict[tuple[int, str], set[str]] = defaultdict(set)
    op_total: dict[tuple[int, str], int] = {}
    calls_by_pid: dict[int, int] = defaultdict(int)
    for pp, op, layer, calls, total in ops:
        layers[(pp, part_name(op))].add(layer or _layer_of(op))
        op_total[(pp, op)] = int(total or 0)
        calls_by_pid[pp] += int(calls or 0)

    def counted(pp: int, op: str, layer: str) -> bool:
        have = layers.get((pp, part_name(op)), set())
        return layer == "runtime" or "runtime" not in have

    stored = conn.execute(
        "SELECT pid, tid, ts_ns // 1000000000 AS sec, op, any_value(layer), sum(dur_ns), sum(off_cpu_ns), "
        "sum(runq_ns) FROM cuda_calls WHERE ($pid IS NULL OR pid = $pid) GROUP BY pid, tid, sec, op",
        p,
    ).fetchall()
    stored_op_sum: dict[tuple[int, str], int] = defaultdict(int)
    for pp, _, _, op, _, dur, _, _ in stored:
        stored_op_sum[(pp, op)] += int(dur or 0)
    calls_in: dict[int, dict[int, dict[str, int]]] = defaultdict(lambda: defaultdict(_zero))
    for pp, tid, sec, op, layer, dur, off, runq in stored:
        if not counted(pp, op, layer or _layer_of(op)):
            continue
        # scale the stored calls' time up to the exact op_stats total (launches are stored as a sample)
        base = stored_op_sum[(pp, op)]
        scale = op_total.get((pp, op), base) / base if base else 1.0
        row = calls_in[tid][int(sec)]
        row[part_name(op)] += int((dur or 0) * scale)
        # off-CPU inside calls is not scaled: the slow calls that hold it are always stored
        row["call_off_cpu"] += int(off or 0)
        row["call_runq"] += int(runq or 0)
    sched: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    for tid, sec, off, runq in conn.execute(
        "SELECT tid, sec, sum(off_cpu_ns), sum(runq_ns) FROM sched_stats WHERE ($pid IS NULL OR pid = $pid) "
        "GROUP BY tid, sec",
        p,
    ).fetchall():
        sched[tid][int(sec)] = (int(off or 0), int(runq or 0))
    holders = _holder_weights(conn, info)
    stored_by_pid: dict[int, int] = defaultdict(int)
    for pp, _, _, _, n in spans:
        stored_by_pid[pp] += int(n)
    out = []
    for pp, tid, t0, t1, n_stored in spans:
        # the thread is accounted until its process exits, or the recording ends
        exit_ns = info.procs[pp].exit_ns if pp in info.procs else None
        end = max(int(t1), exit_ns if exit_ns is not None else info.duration_ns)
        t = ThreadTime(
            pid=pp, tid=tid, comm=info.comm(pp), first_ns=int(t0), end_ns=end, exited=False, cuda_calls=0, total=_zero()
        )
        carry = (0, 0)
        for sec in range(int(t0) // S, (end - 1) // S + 1):
            wall = min(end, (sec + 1) * S) - max(int(t0), sec * S)
            if wall <= 0:
                continue
            row = _zero()
            _add(row, calls_in[tid].get(sec, {}))
            row["wall"] = wall
            in_calls = sum(row[c] for c in CALL_PART_NAMES)
            if in_calls > wall:  # the scaled call time cannot exceed the second: trim it proportionally
                for c in CALL_PART_NAMES:
                    row[c] = row[c] * wall // in_calls
                in_calls = sum(row[c] for c in CALL_PART_NAMES)
            off, runq = sched[tid].get(sec, (0, 0))
            out_runq = max(runq - row["call_runq"], 0) + carry[0]
            out_blocked = max(off - runq - max(row["call_off_cpu"] - row["call_runq"], 0), 0) + carry[1]
            room = wall - in_calls
            carry = (0, 0)
            if out_runq + out_blocked > room:
                # sched_stats books an off-CPU interval in the second it began: what does not fit in this
                # second ran over into the next ones
                k = room / (out_runq + out_blocked)
                fit_runq, fit_blocked = int(out_runq * k), int(out_blocked * k)
                carry = (out_runq - fit_runq, out_blocked - fit_blocked)
                out_runq, out_blocked = fit_runq, fit_blocked
            w = holders(pp, tid, sec)
            tot_w = sum(w.values())
            for cls, part in (("self", "runq_self"), ("tree", "runq_tree"), ("other", "runq_other")):
                row[part] = int(out_runq * w.get(cls, 0) / tot_w) if tot_w else 0
            row["runq_tracer"] = out_runq - row["runq_self"] - row["runq_tree"] - row["runq_other"]
            if not tot_w:  # nobody recorded as holding the CPU: leave it unattributed as "other"
                row["runq_other"], row["runq_tracer"] = row["runq_tracer"], 0
            row["blocked"] = out_blocked
            row["cpu"] = wall - in_calls - out_runq - out_blocked
            t.by_sec[sec] = row
            _add(t.total, row)
        # exact per process (op_stats); split between a process's CUDA threads by their stored calls
        t.cuda_calls = round(calls_by_pid.get(pp, 0) * n_stored / stored_by_pid[pp]) if stored_by_pid[pp] else 0
        out.append(t)
    return sorted(out, key=lambda t: (t.pid, t.tid))


def _layer_of(op: str) -> str:
    s = spec_of(op)
    return "driver" if s and s.layer == Layer.DRIVER else "runtime"


def _holder_weights(conn: duckdb.DuckDBPyConnection, info: RecordingInfo) -> Callable[[int, int, int], dict[str, int]]:
    """Return f(pid, tid, sec) -> {holder class: runq_ns}: who held the CPU in that second (per waiting thread
    when the recording says which thread waited)."""
    has_tid = info.has("preemptors", "tid")
    flag = "is_tracer" if info.has("preemptors", "is_tracer") else "NULL"
    rows = conn.execute(
        f"SELECT sec, {'tid' if has_tid else 'NULL'}, pid, comm, is_target, {flag}, sum(runq_ns) FROM preemptors "
        "GROUP BY ALL"
    ).fetchall()
    per: dict[tuple[int, int | None], list[tuple]] = defaultdict(list)
    for sec, tid, hp, comm, is_target, is_tracer, runq in rows:
        per[(int(sec), tid)].append((hp, comm, is_target, is_tracer, int(runq or 0)))

    def weights(pid: int, tid: int, sec: int) -> dict[str, int]:
        w: dict[str, int] = defaultdict(int)
        for hp, comm, is_target, is_tracer, runq in per.get((sec, tid if has_tid else None), []):
            w[holder_class(info, pid, hp, comm, is_target, is_tracer)] += runq
        return w

    return weights


def holder_class(
    info: RecordingInfo,
    pid: int,
    holder_pid: int | None,
    comm: str | None,
    is_target: bool | None,
    is_tracer: bool | None,
) -> HolderClass:
    """Return whose a task that held the CPU (or woke the thread) was, seen from a thread of ``pid``."""
    if info.is_tracer(holder_pid, comm, is_tracer):
        return "tracer"
    if not holder_pid:
        return "interrupt"
    if holder_pid == pid:
        return "self"
    if is_target or info.in_tree(holder_pid):
        return "tree"
    return "other"


# ---------------------------------------------------------------------------------------------- records
class PartTime(Record):
    """One part of a thread's wall time. Parts: cpu (on CPU outside CUDA calls), launch, sync (waiting for the
    GPU: synchronize and synchronous copies), alloc, free, copy (async copies), other (memset, stream waits),
    runq_self / runq_tree / runq_other / runq_tracer (runnable, waiting for a CPU held by its own process, its
    own workers, other processes, the tracer), blocked (sleep, futex such as the GIL or a queue, I/O)."""

    part: Annotated[str, Field(description=" | ".join(PART_NAMES))]
    ms: Annotated[float, Field(description="time in the part, ms")]
    share: Annotated[float, Field(description="of the thread's accounted wall time, 0..1")]


class Holder(Record):
    """A task that held the CPU while the thread waited for one (``preemptors``)."""

    pid: int
    comm: Annotated[str, Field(description="its name")]
    holder: Annotated[str, Field(description="self (own process) | tree (own workers) | other | tracer")]
    preemptions: Annotated[int, Field(description="times it took the CPU from the thread")]
    runq_ms: Annotated[float, Field(description="run-queue wait it caused the thread (inside calls too), ms")]


class Waker(Record):
    """A task that woke the thread from a blocked interval (``thread_wakers``): the GIL holder, a worker that
    delivered a batch, an interrupt (pid 0)."""

    pid: int
    tid: int
    comm: str
    holder: Annotated[str, Field(description="self | tree | other | tracer | interrupt")]
    wakeups: int
    blocked_ms: Annotated[float, Field(description="blocked time those wakeups ended, ms")]
    in_call_ms: Annotated[float, Field(description="of which inside CUDA calls, ms")]


class TimeBucket(Record):
    """One time bucket of a thread's breakdown (only non-zero parts are listed)."""

    start_s: Annotated[float, Field(description="bucket start, seconds since session start")]
    wall_ms: float
    ms: Annotated[dict[str, float], Field(description="part -> ms")]
    share: Annotated[dict[str, float], Field(description="part -> share of the bucket's wall time")]
    faults: int
    page_alloc_bytes: int


class AddUp(Record):
    """Do the per-second parts cover the thread's span? (exact recordings only)"""

    span_ms: Annotated[float, Field(description="threads.end_ns - threads.first_ns, ms")]
    accounted_ms: Annotated[float, Field(description="sum of the seconds' wall_ns, ms")]
    gap_ms: Annotated[float, Field(description="span - accounted, ms")]
    gap_pct: Annotated[float, Field(description="gap as a percent of the span")]
    parts_mismatch_ms: Annotated[float, Field(description="sum of the parts - sum of wall_ns (0 when consistent)")]


class ThreadSummary(Record):
    """One thread of the process, in brief: the culprit of a fault storm is often a thread with no CUDA call."""

    pid: int
    tid: int
    comm: str
    cuda_calls: int
    wall_ms: float
    cpu_ms: Annotated[float, Field(description="on CPU outside CUDA calls, ms")]
    in_calls_ms: float
    runq_ms: float
    blocked_ms: float
    faults: Annotated[int, Field(description="user page faults")]
    page_alloc_bytes: Annotated[int, Field(description="bytes of pages allocated in its context")]
    reclaim_ms: Annotated[float, Field(description="time in direct reclaim, ms")]


class ThreadBreakdown(Record):
    """Where one CUDA thread's wall time went, in total and per bucket."""

    pid: int
    tid: int
    comm: Annotated[str, Field(description="thread name")]
    process_comm: str
    role: Annotated[
        str,
        Field(
            description="training (the training thread) | driver (another process's main CUDA thread) | cuda "
            "(another CUDA thread) | thread (no CUDA call; shown when asked for by tid)"
        ),
    ]
    cuda_calls: int
    first_s: float
    end_s: float
    exited: bool
    wall_ms: Annotated[float, Field(description="accounted wall time, ms (the sum of the parts)")]
    parts: Annotated[list[PartTime], Field(description="every part, in a fixed order; shares sum to 1")]
    in_call_off_cpu_ms: Annotated[
        float, Field(description="of the time inside calls, off CPU (already in the call parts)")
    ]
    in_call_runq_ms: Annotated[float, Field(description="of that, waiting for a CPU")]
    io_ms: Annotated[float, Field(description="of blocked, uninterruptible: disk I/O, page-fault I/O, mmap lock")]
    faults: int
    page_alloc_bytes: int
    reclaim_ms: float
    holders: Annotated[list[Holder], Field(description="who held the CPU while it waited, most runq first")]
    holders_note: str
    wakers: Annotated[list[Waker], Field(description="who woke it, most blocked time first")]
    check: Annotated[AddUp | None, Field(description="coverage check (exact recordings)")]
    buckets: Annotated[list[TimeBucket], Field(description="per bucket (the training thread, or --tid)")]


class TracerCost(Record):
    """What the tracer itself cost on this host; never a culprit, reported on its own line."""

    cpu_ms: Annotated[
        float | None, Field(description="CPU the recorder and its helpers used (session.recorder_cpu_s), ms")
    ]
    sampled_cpu_ms: Annotated[float | None, Field(description="sum of host_samples.tracer_cpu_ms, ms")]
    share_of_host_cpu: Annotated[float | None, Field(description="cpu_ms / (duration x CPUs)")]
    runq_caused_ms: Annotated[float, Field(description="time traced threads waited for a CPU the tracer held, ms")]
    holds: Annotated[int | None, Field(description="times a target was stopped to attach to a library it opened")]
    held_ms: Annotated[float | None, Field(description="total time targets spent stopped by the tracer, ms")]
    peak_rss_bytes: int | None
    summary: Annotated[str, Field(description="one line: the tracer used N ms of CPU on this host")]


class Breakdown(Record):
    """Where the CUDA threads' time went (training thread first), every thread of its process in brief, and the
    tracer's own cost."""

    basis: Annotated[str, Field(description="exact (thread_breakdown) | estimated (older recording) | none")]
    note: Annotated[str, Field(description="caveats of the basis; empty when exact")]
    pid: Annotated[int | None, Field(description="the pid filter applied")]
    tid: Annotated[int | None, Field(description="the tid filter applied")]
    bucket_s: Annotated[int, Field(description="bucket width in seconds")]
    training_tid: Annotated[int | None, Field(description="the training thread: most launch + sync time")]
    threads: Annotated[list[ThreadBreakdown], Field(description="CUDA threads, the training thread first")]
    process_threads: Annotated[
        list[ThreadSummary],
        Field(description="every thread of the training thread's process (or --pid's), most page allocation first"),
    ]
    tracer: TracerCost


# ---------------------------------------------------------------------------------------------- analysis
def parts_of(t: ThreadTime, row: dict[str, int] | None = None) -> list[PartTime]:
    """Return the parts of ``row`` (default: the thread's totals) as PartTime, in PART_NAMES order."""
    row = row if row is not None else t.total
    wall = row.get("wall", 0)
    return [
        PartTime(part=p, ms=round(row.get(p, 0) / MS, 3), share=round(row.get(p, 0) / wall, 4) if wall else 0.0)
        for p in PART_NAMES
    ]


Scale = Callable[[int], float]


def holders_of(
    conn: duckdb.DuckDBPyConnection,
    info: RecordingInfo,
    t: ThreadTime,
    limit: int = TOP_N,
    scale: Scale | None = None,
) -> tuple[list[Holder], str]:
    """Return who held the CPU while thread ``t`` waited (most first), and a note when not per thread.

    Args:
        scale: per-second weight (0..1) of the rows, for a thread clipped to part of its seconds (chains' steps).
    """
    if not info.has("preemptors"):
        return [], "no preemptors table"
    has_tid = info.has("preemptors", "tid")
    flag = "bool_or(is_tracer)" if info.has("preemptors", "is_tracer") else "NULL"
    rows = conn.execute(
        f"SELECT pid, sec, min(comm), bool_or(is_target), {flag}, sum(preemptions), sum(runq_ns) "
        f"FROM preemptors WHERE sec BETWEEN $a AND $b {'AND tid = $tid' if has_tid else ''} GROUP BY pid, sec",
        {"a": t.first_ns // S, "b": max(t.end_ns - 1, t.first_ns) // S, **({"tid": t.tid} if has_tid else {})},
    ).fetchall()
    acc: dict[int, list] = {}
    for hp, sec, comm, is_target, is_tracer, n, runq in rows:
        k = scale(int(sec)) if scale else 1.0
        a = acc.setdefault(hp, [comm, is_target, is_tracer, 0.0, 0.0])
        # one name per pid whatever the rows' order: pid 0 is swapper/0, swapper/1, ... by CPU
        a[0] = min(a[0] or "", comm or "") or None
        a[3] += (n or 0) * k
        a[4] += (runq or 0) * k
    out = [
        Holder(
            pid=hp,
            comm=comm or "?",
            holder=holder_class(info, t.pid, hp, comm, is_target, is_tracer),
            preemptions=round(n),
            runq_ms=round(runq / MS, 3),
        )
        for hp, (comm, is_target, is_tracer, n, runq) in acc.items()
        if runq > 0 or n >= 0.5
    ]
    out.sort(key=lambda h: (-h.runq_ms, h.pid))
    note = "" if has_tid else "this recording does not say which thread waited: holders of every traced thread"
    return out[:limit], note


def wakers_of(
    conn: duckdb.DuckDBPyConnection,
    info: RecordingInfo,
    t: ThreadTime,
    limit: int | None = TOP_N,
    scale: Scale | None = None,
) -> list[Waker]:
    """Return who woke thread ``t`` from blocked intervals in its span, most blocked time first (``scale``: as
    in :func:`holders_of`)."""
    if not info.has_wakers:
        return []
    rows = conn.execute(
        "SELECT waker_pid, waker_tid, sec, min(waker_comm), sum(wakeups), sum(blocked_ns), "
        "sum(blocked_ns) FILTER (WHERE in_call) FROM thread_wakers WHERE tid = $tid AND sec BETWEEN $a AND $b "
        "GROUP BY waker_pid, waker_tid, sec",
        {"tid": t.tid, "a": t.first_ns // S, "b": max(t.end_ns - 1, t.first_ns) // S},
    ).fetchall()
    acc: dict[tuple[int, int], list] = {}
    for wp, wt, sec, comm, n, b, ic in rows:
        k = scale(int(sec)) if scale else 1.0
        a = acc.setdefault((int(wp or 0), int(wt or 0)), [comm, 0.0, 0.0, 0.0])
        a[0] = min(a[0] or "", comm or "") or None  # one name whatever the rows' order (as holders_of)
        a[1] += (n or 0) * k
        a[2] += (b or 0) * k
        a[3] += (ic or 0) * k
    out = [
        Waker(
            pid=wp,
            tid=wt,
            comm=comm or "?",
            # a v2 recording flags the tracer by pid: the name heuristic is only for v1 files
            holder=holder_class(info, t.pid, wp, comm, None, False if info.has("preemptors", "is_tracer") else None),
            wakeups=round(n),
            blocked_ms=round(b / MS, 3),
            in_call_ms=round(ic / MS, 3),
        )
        for (wp, wt), (comm, n, b, ic) in acc.items()
        if b > 0 or n >= 0.5
    ]
    out.sort(key=lambda w: (-w.blocked_ms, w.pid, w.tid))
    return out[:limit]


def summary_of(t: ThreadTime) -> ThreadSummary:
    return ThreadSummary(
        pid=t.pid,
        tid=t.tid,
        comm=t.comm,
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
        _add(acc.setdefault(sec // bucket_s, _zero()), row)
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


def auto_bucket(span_ns: int) -> int:
    """Return the smallest of BUCKET_CHOICES that splits ``span_ns`` into at most MAX_BUCKETS buckets."""
    for b in BUCKET_CHOICES:
        if span_ns <= b * S * MAX_BUCKETS:
            return b
    return BUCKET_CHOICES[-1]


def tracer_cost(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, threads: Iterable[ThreadTime]) -> TracerCost:
    """Return the tracer's own cost on this host: its CPU, the CPU waits it caused, the holds."""
    want = ("recorder_cpu_s", "holds", "held_ms", "recorder_peak_rss_bytes")
    sel = ", ".join(c if info.has("session", c) else "NULL" for c in want)
    row = conn.execute(f"SELECT {sel} FROM session ORDER BY session_id DESC LIMIT 1").fetchone() or (None,) * 4
    sampled = None
    if info.has("host_samples", "tracer_cpu_ms"):
        sampled = conn.execute("SELECT sum(tracer_cpu_ms) FROM host_samples").fetchone()[0]
    cpu_ms = row[0] * 1000 if row[0] is not None else sampled
    cap = info.duration_ns / MS * info.cpu_cores if info.duration_ns and info.cpu_cores else 0
    runq = sum(t.ns("runq_tracer") for t in threads)
    share = cpu_ms / cap if cpu_ms is not None and cap else None
    if cpu_ms is None:
        summary = "the tracer's own CPU use was not recorded in this recording"
    else:
        summary = f"the tracer used {cpu_ms:,.0f} ms of CPU on this host" + (
            f" ({share:.1%} of its {info.cpu_cores} CPUs over the recording)" if share is not None else ""
        )
    if runq:
        summary += f"; traced threads waited {runq / MS:,.1f} ms for a CPU it held"
    if row[2]:
        summary += f"; targets were held (stopped) {row[1] or 0} times, {row[2]:,.1f} ms in all"
    return TracerCost(
        cpu_ms=None if cpu_ms is None else round(cpu_ms, 1),
        sampled_cpu_ms=None if sampled is None else round(sampled, 1),
        share_of_host_cpu=None if share is None else round(share, 4),
        runq_caused_ms=round(runq / MS, 3),
        holds=row[1],
        held_ms=row[2],
        peak_rss_bytes=row[3],
        summary=summary,
    )


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
    shown = times.cuda_threads if tid is None else [t for t in times.threads if t.tid == tid]
    shown.sort(key=lambda t: (t is not training, t.tid not in drivers, [-x for x in t.gpu_work_key]))
    focus = shown[0] if shown else None
    bucket = bucket_s if bucket_s > 0 else auto_bucket(focus.span_ns if focus else 0)
    out = []
    for t in shown:
        hs, hnote = holders_of(conn, info, t)
        out.append(
            ThreadBreakdown(
                pid=t.pid,
                tid=t.tid,
                comm=t.comm,
                process_comm=info.comm(t.pid),
                role="training"
                if t is training
                else "driver"
                if t.tid in drivers
                else "cuda"
                if t.cuda_calls
                else "thread",
                cuda_calls=t.cuda_calls,
                first_s=round(t.first_ns / S, 3),
                end_s=round(t.end_ns / S, 3),
                exited=t.exited,
                wall_ms=round(t.wall / MS, 3),
                parts=parts_of(t),
                in_call_off_cpu_ms=round(t.ns("call_off_cpu") / MS, 3),
                in_call_runq_ms=round(t.ns("call_runq") / MS, 3),
                io_ms=round(t.ns("io") / MS, 3),
                faults=t.ns("faults"),
                page_alloc_bytes=t.ns("page_alloc_bytes"),
                reclaim_ms=round(t.ns("reclaim") / MS, 3),
                holders=hs,
                holders_note=hnote,
                wakers=wakers_of(conn, info, t),
                check=check_of(t) if times.basis == "exact" else None,
                buckets=buckets_of(t, bucket) if t is focus else [],
            )
        )
    scope = pid if pid is not None else (training.pid if training else None)
    siblings = [summary_of(t) for t in times.threads if t.pid == scope]
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
        tracer=tracer_cost(conn, info, times.threads),
    )


def _pid_of_tid(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, tid: int) -> int | None:
    for table in ("threads", "thread_breakdown", "cuda_calls"):
        if info.has(table):
            r = conn.execute(f"SELECT any_value(pid) FROM {table} WHERE tid = ?", [tid]).fetchone()
            if r and r[0] is not None:
                return int(r[0])
    return None
