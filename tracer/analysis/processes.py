"""The traced tree summarised for a reader: processes grouped by what they are, and the threads that used a core.

A fork-heavy job has thousands of processes (a monitoring loop's commands, DataLoader workers re-forked every
epoch): one row each made `get_trace_stats` megabytes long and hid the few that matter. Processes are grouped by
(comm, parent, role, rank): the workers one loader re-forked are one row, each rank stays its own. The busy threads
are listed whatever they do, CUDA or not: a metrics thread holding the interpreter lock uses a core and makes no
CUDA call. The overview lists the busiest :data:`TOP_BUSY_THREADS` and says how many it left out
(:func:`top_busy_threads`); a thread that trains (each rank's main thread, the main process's) is never left out
for another: on a 3-rank torchrun job the straggler rank's main thread was dropped for three gloo threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.recording import RecordingInfo
from tracer.vocabulary import MAIN_ROLE, RANK_ROLE, TRACER_ROLE

# a thread on CPU for at least this share of the recording (of one core) is listed among the busy threads
BUSY_CORE_SHARE = 0.05
TOP_BUSY_THREADS = 5


class ProcessGroup(Record):
    """Processes sharing (comm, parent, role, rank), summed: e.g. the DataLoader workers re-forked every epoch."""

    comm: str
    ppid: Annotated[int | None, Field(description="their parent")]
    role: Annotated[str, Field(description="as ProcessStat.role")]
    rank: Annotated[int | None, Field(description="their rank in a distributed job, else null")] = None
    processes: Annotated[int, Field(description="how many processes the group holds")]
    pid: Annotated[int, Field(description="the group's first process (the whole group when it has one)")]
    cuda_calls: int
    context_switches: int
    preemptions: int
    off_cpu_s: float
    runq_s: float
    worst_stall_ms: Annotated[float, Field(description="longest single off-CPU interval of any of them, ms")]
    first_s: Annotated[float, Field(description="the first one's start, seconds since session start")]
    exited: Annotated[int, Field(description="how many exited during the recording")]
    failed: Annotated[int, Field(description="of those, with a non-zero status")]
    exit_s: Annotated[float | None, Field(description="a group of one: its exit time, else null")] = None
    exit_code: Annotated[int | None, Field(description="a group of one: its wait(2) status, else null")] = None


class BusyThread(Record):
    """A thread that used a meaningful share of a core, CUDA or not, with where its time went."""

    pid: int
    tid: int
    comm: str
    process_comm: str
    role: Annotated[str, Field(description="its process's role")]
    core_share: Annotated[
        float, Field(description="its time on CPU over the recording's length: the share of one core")
    ]
    cuda_calls: int
    headline: Annotated[str, Field(description="its time by part, largest first, e.g. 'cpu 85%, blocked 12%'")]


def group_processes(procs: Sequence, info: RecordingInfo | None = None) -> list[ProcessGroup]:
    """Return ``procs`` (ProcessStat or stats.ProcessRow rows, in the analysis' ranking: main first, then by CUDA
    calls and off-CPU time) grouped by (comm, parent, role, rank), in the order of each group's first process.

    A parent that is itself traced stands for its group, not its pid: the ``uname`` that each of twelve start-up
    ``sh -c`` helpers ran is one row beside the ``sh`` row, not twelve rows of one (issue 23: a real recording with
    12 helpers answered get_trace_stats in 4.6 KB)."""
    by_pid = {p.pid: p for p in procs}
    keys: dict[int, tuple] = {}

    def key(p) -> tuple:
        parent = by_pid.get(p.ppid)
        if parent is None or parent.pid in keys:  # most processes: a root, or a child of a keyed parent
            k = keys[p.pid] = (p.comm, keys.get(p.ppid, p.ppid), p.role, p.rank)
            return k
        # iterative: a fork chain can be deeper than Python's recursion limit
        chain, seen, q = [], set(), p
        while q.pid not in keys and q.pid not in seen:
            chain.append(q)
            seen.add(q.pid)
            parent = by_pid.get(q.ppid)
            if parent is None:
                break
            q = parent
        for c in reversed(chain):  # the topmost unkeyed ancestor first: each parent is keyed before its children
            keys[c.pid] = (c.comm, keys.get(c.ppid, c.ppid), c.role, c.rank)
        return keys[p.pid]

    members: dict[tuple, list] = {}
    for p in procs:
        members.setdefault(key(p), []).append(p)
    out = []
    for (comm, _, role, rank), ps in members.items():
        ppid = ps[0].ppid
        exited = [p for p in ps if p.exit_s is not None]
        one = ps[0] if len(ps) == 1 else None
        out.append(
            ProcessGroup(
                comm=comm,
                ppid=ppid,
                role=role,
                rank=rank,
                processes=len(ps),
                pid=ps[0].pid,
                cuda_calls=sum(p.cuda_calls for p in ps),
                context_switches=sum(p.context_switches for p in ps),
                preemptions=sum(p.preemptions for p in ps),
                off_cpu_s=round(sum(p.off_cpu_s for p in ps), 3),
                runq_s=round(sum(p.runq_s for p in ps), 3),
                worst_stall_ms=round(max(p.worst_stall_ms for p in ps), 2),
                first_s=round(min(p.first_s for p in ps), 3),
                exited=len(exited),
                failed=sum(bool(p.exit_code) for p in exited),
                exit_s=round(one.exit_s, 3) if one and one.exit_s is not None else None,
                exit_code=one.exit_code if one else None,
            )
        )
    return out


# thread_breakdown's columns by the part of the headline they go to
_HEADLINE_PARTS = {
    "cpu": ("cpu_ns",),
    "CUDA calls": ("launch_ns", "sync_ns", "alloc_ns", "free_ns", "copy_ns", "other_ns"),
    "waiting for a CPU": ("runq_self_ns", "runq_tree_ns", "runq_other_ns", "runq_tracer_ns"),
    "blocked": ("blocked_ns",),
}


def busy_threads(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, pid: int | None = None) -> list[BusyThread]:
    """Return every thread on CPU for at least BUSY_CORE_SHARE of the recording, busiest first (the tracer's own
    left out: its cost has a line of its own)."""
    if not info.has("thread_breakdown") or info.duration_ns <= 0:
        return []
    sums = ", ".join(f"sum({' + '.join(cols)})" for cols in _HEADLINE_PARTS.values())
    calls = "max(t.cuda_calls)" if info.has("threads", "cuda_calls") else "0"
    rows = conn.execute(
        f"SELECT b.pid, b.tid, any_value(t.comm), sum(b.wall_ns), {calls}, {sums} FROM thread_breakdown b "
        "LEFT JOIN threads t ON t.pid = b.pid AND t.tid = b.tid WHERE ($pid IS NULL OR b.pid = $pid) "
        "GROUP BY b.pid, b.tid HAVING sum(b.cpu_ns) >= $floor ORDER BY sum(b.cpu_ns) DESC, b.tid",
        {"pid": pid, "floor": BUSY_CORE_SHARE * info.duration_ns},
    ).fetchall()
    out = []
    for tpid, tid, comm, wall, n_calls, *parts in rows:
        role = info.process_role(tpid)
        if role == TRACER_ROLE:
            continue
        shares = sorted(
            ((name, ns / wall) for name, ns in zip(_HEADLINE_PARTS, parts, strict=True) if wall and ns),
            key=lambda x: -x[1],
        )
        out.append(
            BusyThread(
                pid=tpid,
                tid=tid,
                comm=comm or info.comm(tpid),
                process_comm=info.comm(tpid),
                role=role,
                core_share=round(parts[0] / info.duration_ns, 3),
                cuda_calls=int(n_calls or 0),
                headline=", ".join(f"{name} {share:.0%}" for name, share in shares if share >= 0.01),
            )
        )
    return out


def trains(b: BusyThread) -> bool:
    """True for a thread that trains as the overview sees it: the main thread of a rank or of the main process."""
    return b.tid == b.pid and b.role in (RANK_ROLE, MAIN_ROLE)


def top_busy_threads(threads: list[BusyThread], limit: int = TOP_BUSY_THREADS) -> tuple[list[BusyThread], int]:
    """Return the busy threads the overview lists, busiest first, and how many it leaves out: every main thread
    of a rank or of the main process (:func:`trains`), then the busiest others up to ``limit`` in all."""
    keep = {id(b) for b in threads if trains(b)}
    for b in threads:
        if len(keep) >= limit:
            break
        keep.add(id(b))
    shown = [b for b in threads if id(b) in keep]
    return shown, len(threads) - len(shown)
