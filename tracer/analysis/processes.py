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

from collections.abc import Callable, Sequence
from typing import Annotated, NamedTuple

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


class _Members(NamedTuple):
    """One process, or processes summed that are sure to share a group (:func:`grouped_processes`): what a group
    adds up. Times in seconds (worst_stall_ms in ms), as ProcessStat has them."""

    pid: int  # the first of them in the analysis' ranking
    ppid: int | None
    comm: str
    role: str
    rank: int | None
    processes: int
    cuda_calls: int
    context_switches: int
    preemptions: int
    off_cpu_s: float
    runq_s: float
    worst_stall_ms: float
    first_s: float
    exited: int
    failed: int
    exit_s: float | None  # a single process's
    exit_code: int | None


Who = tuple[str, "int | None", str, "int | None"]  # a traced process's (comm, parent, role, rank)

# A child killed by one of these signals while its parent shut down was ended by the teardown, not failed: torch's
# DataLoader terminates its workers (SIGTERM) at the training process's exit, a shell's children get SIGHUP
# (issue 28: workers that exited with their parent showed ``failed: 2``).
TEARDOWN_SIGNALS = (1, 2, 9, 13, 15)  # SIGHUP, SIGINT, SIGKILL, SIGPIPE, SIGTERM
TEARDOWN_S = 2.0  # killed at most this long before its parent's exit (or after it): killed by the shutdown
_TEARDOWN_SQL = ", ".join(map(str, TEARDOWN_SIGNALS))
# the same rule in SQL, over PROCESS_FIGURES_SQL's columns (exit_ns, exit_code, parent_exit_ns)
FAILED_SQL = (
    f"exit_ns IS NOT NULL AND coalesce(exit_code, 0) <> 0 AND NOT (exit_code & 127 IN ({_TEARDOWN_SQL}) "
    f"AND parent_exit_ns IS NOT NULL AND exit_ns >= parent_exit_ns - {int(TEARDOWN_S * 1e9)})"
)


def failed(exit_s: float | None, exit_code: int | None, parent_exit_s: float | None) -> bool:
    """Return True when a process that exited failed: a non-zero status, unless a teardown signal killed it as
    its parent shut down (see :data:`TEARDOWN_SIGNALS`)."""
    if exit_s is None or not exit_code:
        return False
    torn = exit_code & 127 in TEARDOWN_SIGNALS and parent_exit_s is not None and exit_s >= parent_exit_s - TEARDOWN_S
    return not torn


def group_processes(procs: Sequence, info: RecordingInfo | None = None) -> list[ProcessGroup]:
    """Return ``procs`` (ProcessStat or stats.ProcessRow rows, in the analysis' ranking: main first, then by CUDA
    calls and off-CPU time) grouped by (comm, parent, role, rank), in the order of each group's first process.

    A parent that is itself traced stands for its group, not its pid: the ``uname`` that each of twelve start-up
    ``sh -c`` helpers ran is one row beside the ``sh`` row, not twelve rows of one (issue 23: a real recording with
    12 helpers answered get_trace_stats in 4.6 KB)."""
    by_pid = {p.pid: (p.comm, p.ppid, p.role, p.rank) for p in procs}
    exits = {p.pid: p.exit_s for p in procs}
    alone = [
        _Members(
            p.pid,
            p.ppid,
            p.comm,
            p.role,
            p.rank,
            1,
            p.cuda_calls,
            p.context_switches,
            p.preemptions,
            p.off_cpu_s,
            p.runq_s,
            p.worst_stall_ms,
            p.first_s,
            int(p.exit_s is not None),
            int(failed(p.exit_s, p.exit_code, exits.get(p.ppid))),
            p.exit_s,
            p.exit_code,
        )  # fmt: skip
        for p in procs
    ]
    return _groups(alone, by_pid.get)


def _groups(members: Sequence[_Members], who: Callable[[int | None], Who | None]) -> list[ProcessGroup]:
    """Sum ``members`` (in the ranking's order) by group: (comm, parent's group key or, untraced, its pid, role,
    rank), each traced process's key from ``who`` (the one walk up the tree both ways of grouping share)."""
    keys: dict[int, tuple] = {}

    def key(pid: int) -> tuple | None:
        # iterative: a fork chain can be deeper than Python's recursion limit
        chain, seen, q = [], set(), pid
        while q is not None and q not in keys and q not in seen and (me := who(q)) is not None:
            chain.append((q, me))
            seen.add(q)
            q = me[1]
        for c, (comm, ppid, role, rank) in reversed(chain):  # the topmost unkeyed ancestor first
            keys[c] = (comm, keys.get(ppid, ppid), role, rank)
        return keys.get(pid)

    groups: dict[tuple, list[_Members]] = {}
    for m in members:
        groups.setdefault(key(m.pid) or (m.comm, m.ppid, m.role, m.rank), []).append(m)
    out = []
    for ms in groups.values():
        first = ms[0]
        n = sum(m.processes for m in ms)
        one = first if n == 1 else None
        out.append(
            ProcessGroup(
                comm=first.comm,
                ppid=first.ppid,
                role=first.role,
                rank=first.rank,
                processes=n,
                pid=first.pid,
                cuda_calls=sum(m.cuda_calls for m in ms),
                context_switches=sum(m.context_switches for m in ms),
                preemptions=sum(m.preemptions for m in ms),
                off_cpu_s=round(sum(m.off_cpu_s for m in ms), 3),
                runq_s=round(sum(m.runq_s for m in ms), 3),
                worst_stall_ms=round(max(m.worst_stall_ms for m in ms), 2),
                first_s=round(min(m.first_s for m in ms), 3),
                exited=sum(m.exited for m in ms),
                failed=sum(m.failed for m in ms),
                exit_s=round(one.exit_s, 3) if one and one.exit_s is not None else None,
                exit_code=one.exit_code if one else None,
            )
        )
    return out


# Each process with its figures and its place in the analysis' ranking (rn: main first, then by CUDA calls and
# off-CPU time): what stats.process_rows lists one by one and grouped_processes sums by group in DuckDB.
PROCESS_FIGURES_SQL = """
    SELECT p.pid, p.ppid, coalesce(p.comm, '') AS comm, {rank} AS rank, p.first_ns, p.exit_ns, p.exit_code,
           par.parent_exit_ns,
           coalesce(o.calls, 0)::BIGINT AS calls, coalesce(s.sw, 0)::BIGINT AS sw, coalesce(s.pre, 0)::BIGINT AS pre,
           coalesce(s.off, 0) AS off, coalesce(s.rq, 0) AS rq,
           greatest(coalesce(s.worst, 0), coalesce(b.worst, 0)) AS worst,
           row_number() OVER (ORDER BY (p.pid = $main) DESC, coalesce(o.calls, 0) DESC, coalesce(s.off, 0) DESC,
                              p.pid) AS rn
    FROM processes p
    LEFT JOIN (SELECT pid AS parent, max(exit_ns) AS parent_exit_ns FROM processes GROUP BY pid) par
           ON par.parent = p.ppid
    LEFT JOIN (SELECT pid, sum(calls) AS calls FROM op_stats GROUP BY pid) o USING (pid)
    LEFT JOIN (SELECT pid, sum(switches) AS sw, sum(preemptions) AS pre, sum(off_cpu_ns) AS off,
                      sum(runq_ns) AS rq, max(max_off_cpu_ns) AS worst FROM sched_stats GROUP BY pid) s USING (pid)
    LEFT JOIN ({blocked}) b USING (pid)
    WHERE ($pid IS NULL OR p.pid = $pid)
"""
# A thread blocked since before the recording never switches out in it, so sched_stats has no interval of it: its
# snapshots' since-when, clipped to the recording, is its stall (issue 29: a hung rank's worst stall was a gloo
# thread's 13 ms timer wait, not its main thread's 10 s in a collective).
SNAPSHOT_STALLS_SQL = (
    "SELECT pid, max(ts_ns - greatest(blocked_since_ns, 0)) AS worst FROM thread_snapshots "
    "WHERE state <> 'running' AND blocked_since_ns IS NOT NULL GROUP BY pid"
)
NO_STALLS_SQL = "SELECT NULL::INTEGER AS pid, NULL::BIGINT AS worst WHERE false"  # a recording before snapshots


def process_figures_sql(info: RecordingInfo, rank: str) -> str:
    """PROCESS_FIGURES_SQL for this recording (``rank``: the rank column's expression)."""
    blocked = SNAPSHOT_STALLS_SQL if info.has("thread_snapshots") else NO_STALLS_SQL
    return PROCESS_FIGURES_SQL.format(rank=rank, blocked=blocked)


def grouped_processes(conn: duckdb.DuckDBPyConnection, info: RecordingInfo) -> list[ProcessGroup]:
    """Return every process grouped as :func:`group_processes` groups them, summed in DuckDB.

    A fork-heavy recording has 200 K processes: a Python row each was most of `get_trace_stats` (issue 21). The
    processes whose role their name does not tell (the main process, each rank, a launcher, the tracer's, one that
    took its rank from an NCCL communicator) are rows of their own; the rest are summed per (comm, parent, rank),
    which share a role (the name tells a DataLoader worker from another child) and so a group; those sums are then
    grouped as group_processes groups processes, each keyed by its first process."""
    procs = info.procs
    special = set(info.tracer_pids) | set(info.rank_pids) | set(info.nccl_ranked) | {p.pid for p in info.launchers()}
    if info.main_pid is not None:
        special.add(info.main_pid)
    rank = "p.rank" if info.has("processes", "rank") else "NULL"
    rows = conn.execute(
        f"""
        WITH p AS ({process_figures_sql(info, rank)})
        SELECT arg_min(pid, rn), ppid, comm, count(*), sum(calls)::BIGINT, sum(sw)::BIGINT, sum(pre)::BIGINT,
               sum(off) / 1e9, sum(rq) / 1e9, max(worst) / 1e6, min(coalesce(first_ns, 0)) / 1e9, count(exit_ns),
               count(*) FILTER (WHERE {FAILED_SQL}),
               any_value(exit_ns) / 1e9, any_value(exit_code)
        FROM p GROUP BY comm, ppid, rank, CASE WHEN list_contains($special, pid) THEN pid END
        ORDER BY min(rn)""",
        {"main": info.main_pid, "pid": None, "special": sorted(special)},
    ).fetchall()
    role = info.process_role

    def who(pid: int | None) -> Who | None:
        p = procs.get(pid) if pid is not None else None
        return None if p is None else (p.comm, p.ppid, role(p.pid), p.rank)

    members = []
    for pid, ppid, comm, *figures in rows:
        p = procs.get(pid)
        members.append(_Members(pid, ppid, comm, role(pid), p.rank if p else None, *figures))
    return _groups(members, who)


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
