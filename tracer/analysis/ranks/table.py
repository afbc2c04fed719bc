"""Each rank's time over the window every rank was stepping: its phases (:mod:`.phases`), steps and step time.

A rank is the process a launcher started with a rank in its environment (``RecordingInfo.rank_pids``). Its
*thread* is the one that trains: the process's CUDA thread with the most launch + sync time (the breakdown's
driver thread), else its main thread. Its *steps* run from its first launch or sync to the end of its last, as
the chains clip a training thread (set-up and tear-down are not steps); a rank with no CUDA call steps over the
seconds it waited in collectives. The ranks are compared over the *common window*, where all of them were
stepping, so each rank's phases cover the same wall-clock time. The window is cut to whole seconds when it holds
one or more: the breakdown is counted per second, and an edge second that is partly outside the steps (set-up,
tear-down) would have to be pro-rated as if its time were spread evenly (a real 3-rank job of 100 steps, 2.65 s
with one whole second, had its edges pro-rated when two were needed: the ranks' tear-down CPU in them read 17.6 ms
of excess a step against 20.1 by the ranks' own clocks). The seconds that tell *when* a rank was slow
(``by_sec``) are the window's whole seconds when it holds :data:`MIN_WHOLE_S` of them, else its seconds with the
edges pro-rated: a straggler needs two hot seconds (:mod:`.straggler`), and whether a second is hot is a ratio
within it, which pro-rating does not bias.

A step is what :mod:`tracer.analysis.steps` says it is (:func:`~tracer.analysis.steps.step_markers`, the one
definition): the steps in the window are the exact count of the rank's most frequent waiting op (op_stats), over
that op's waits per step on the rank's thread (a loop that reads the loss and an accuracy with the same op waits
twice a step), times the share of its stored calls that lie in the window (the stored calls are all of them, or a
sample within the recorder's budget). A rank without one has no step count, and its table gives times only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb

from probes.catalog import OP_NAMES, OpClass, ops_where
from tracer.analysis.breakdown.thread_time import S, ThreadTime, ThreadTimes, window_shares
from tracer.analysis.ranks import phases
from tracer.analysis.recording import RecordingInfo
from tracer.analysis.steps import step_markers, step_spans
from tracer.analysis.taxonomy import part_name, waits_for_gpu

MIN_WHOLE_S = 2  # whole seconds the common window must hold for by_sec to be cut to them


@dataclass
class RankTime:
    """One rank's thread over the common window: phases per second (ns) and its steps."""

    rank: int
    pid: int
    thread: ThreadTime
    start_ns: int  # its own steps
    end_ns: int
    step_op: str | None = None  # the waiting op that marks its steps
    step_calls: int = 0  # exact calls of step_op over its own steps
    waits_per_step: int = 1  # calls of step_op that end one step (tracer.analysis.steps.StepMarkers.per_step_of)
    steps: float | None = None  # of those, in the common window
    by_sec: dict[int, dict[str, float]] = field(default_factory=dict)  # in the common window, to tell when
    total: dict[str, float] = field(default_factory=dict)  # over the common window (phases.window_total)

    @property
    def tid(self) -> int:
        return self.thread.tid


@dataclass
class RankTable:
    """Every rank of the recording over the common window [start_ns, end_ns)."""

    ranks: list[RankTime]
    start_ns: int
    end_ns: int
    job_id: str | None
    world_size: int | None
    launchers: list[int]
    note: str = ""

    @property
    def window_ns(self) -> int:
        return max(self.end_ns - self.start_ns, 0)

    def steps(self) -> float | None:
        """Return the job's steps in the window: the median of the ranks' counts (they step in lockstep)."""
        counts = sorted(r.steps for r in self.ranks if r.steps is not None)
        return counts[len(counts) // 2] if counts else None


def _step_op(conn: duckdb.DuckDBPyConnection, pid: int) -> tuple[str | None, int]:
    rows = conn.execute("SELECT op, sum(calls) FROM op_stats WHERE pid = ? GROUP BY op", [pid]).fetchall()
    waits = [(int(n or 0), op) for op, n in rows if waits_for_gpu(op)]
    if not waits:
        return None, 0
    n, op = max(waits)
    return op, n


def _count_steps(conn: duckdb.DuckDBPyConnection, ranks: list[RankTime], start: int, end: int) -> None:
    """Set each rank's steps in [start, end): its exact step-op calls times the share of its stored ones there."""
    for r in ranks:
        if not r.step_op or not r.step_calls:
            continue
        inside, stored = conn.execute(
            "SELECT count(*) FILTER (WHERE ts_ns >= $a AND ts_ns < $b), count(*) FROM cuda_calls "
            "WHERE pid = $pid AND op = $op",
            {"a": start, "b": end, "pid": r.pid, "op": r.step_op},
        ).fetchone()
        r.steps = r.step_calls / r.waits_per_step * inside / stored if stored else None


def _gpu_collective(conn: duckdb.DuckDBPyConnection, tids: list[int]) -> dict[int, dict[int, float]]:
    """Return {tid: {sec: ns}} of the syncs that waited for an NCCL collective: each first sync after a collective
    call on the thread (phases' module docstring), by the second it started in. A nested driver sync follows its
    runtime one, not the collective, so it is never counted twice."""
    coll = list(ops_where(lambda s: s.op_class == OpClass.COLLECTIVE))
    syncs = [op for op in OP_NAMES if part_name(op) == "sync"]
    if not tids:
        return {}
    rows = conn.execute(
        "WITH c AS (SELECT tid, ts_ns, dur_ns, list_contains($coll, op) AS is_coll FROM cuda_calls "
        "  WHERE list_contains($tids, tid) AND (list_contains($coll, op) OR list_contains($syncs, op))), "
        "m AS (SELECT *, lag(is_coll) OVER (PARTITION BY tid ORDER BY ts_ns) AS after FROM c) "
        "SELECT tid, ts_ns // 1000000000, sum(dur_ns) FROM m WHERE NOT is_coll AND after GROUP BY ALL",
        {"tids": tids, "coll": coll, "syncs": syncs},
    ).fetchall()
    out: dict[int, dict[int, float]] = {}
    for tid, sec, ns in rows:
        out.setdefault(int(tid), {})[int(sec)] = float(ns or 0)
    return out


def _wakers(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, tids: list[int]) -> dict[int, list]:
    if not info.has_wakers or not tids:
        return {}
    out: dict[int, list] = {}
    for tid, sec, wp, comm, ns in conn.execute(
        # by name too: pid 0 is every interrupt kind ([timer], [block], [net]), told apart only by its name
        "SELECT tid, sec, waker_pid, waker_comm, sum(blocked_ns) FROM thread_wakers "
        "WHERE list_contains($tids, tid) AND NOT coalesce(in_call, false) GROUP BY tid, sec, waker_pid, waker_comm",
        {"tids": tids},
    ).fetchall():
        out.setdefault(int(tid), []).append((int(sec), int(wp or 0), comm, int(ns or 0)))
    return out


def rank_table(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, times: ThreadTimes) -> RankTable | None:
    """Return the ranks' table, or None when the recording holds fewer than two ranks with accounted time.

    One job is compared: of several in the recording (two torchruns), the one with the most ranks. A rank that
    appears more than once (torchrun restarted its workers) is its latest process."""
    jobs: dict[str | None, dict[int, tuple[int, int, ThreadTime]]] = {}
    for pid, rank in info.rank_pids.items():
        t = times.rank_thread(pid)
        if t is None or t.wall <= 0:
            continue
        ranks_of = jobs.setdefault(info.procs[pid].job_id, {})
        old = ranks_of.get(rank)
        if old is None or (info.procs[pid].first_ns, pid) > (info.procs[old[1]].first_ns, old[1]):
            ranks_of[rank] = (rank, pid, t)
    if not jobs:
        return None
    job = max(jobs, key=lambda j: (len(jobs[j]), j or ""))
    found = sorted(jobs[job].values())
    if len(found) < 2:
        return None
    tids = [t.tid for _, _, t in found]
    spans, wakers, gpu_coll = step_spans(conn, tids), _wakers(conn, info, tids), _gpu_collective(conn, tids)
    ranks = []
    for rank, pid, t in found:
        a, b = spans.get(t.tid, (t.first_ns, t.end_ns))
        r = RankTime(rank, pid, t, max(a, t.first_ns), min(b, t.end_ns))
        r.step_op, r.step_calls = _step_op(conn, pid)
        if r.step_op:
            r.waits_per_step = step_markers(conn, t.tid).per_step_of(r.step_op)
        if t.tid not in spans:
            # no CUDA steps: the seconds it waited in collectives (its whole span when it never did)
            whole = phases.phases_by_second(info, t, wakers.get(t.tid, []), window_shares(t, 0, 1 << 62))
            busy = [s for s, ph in whole.items() if ph[phases.COLLECTIVE] > 0]
            if busy:
                r.start_ns, r.end_ns = max(min(busy) * S, t.first_ns), min((max(busy) + 1) * S, t.end_ns)
        ranks.append(r)
    start, end = max(r.start_ns for r in ranks), min(r.end_ns for r in ranks)
    note = ""
    if end <= start:
        note = "the ranks' steps do not overlap in time: nothing to compare"
        end = start
    when = (start, end)  # the seconds by_sec covers
    whole = (-(-start // S) * S, end // S * S)
    if whole[1] > whole[0]:
        start, end = whole
        if whole[1] - whole[0] >= MIN_WHOLE_S * S:
            when = whole
    _count_steps(conn, ranks, start, end)
    for r in ranks:
        g = gpu_coll.get(r.tid)
        waits = wakers.get(r.tid, [])
        r.by_sec = phases.phases_by_second(info, r.thread, waits, window_shares(r.thread, *when), g)
        r.total = phases.window_total(info, r.thread, waits, window_shares(r.thread, start, end), g)
    if not info.has_wakers:
        note = (note + "; " if note else "") + "no wakers in this recording: blocked time is not split by who ended it"
    procs = [info.procs[pid] for _, pid, _ in found]
    if len(jobs) > 1:
        note = (note + "; " if note else "") + f"{len(jobs)} jobs in this recording: job {job} compared"
    sizes = {p.world_size for p in procs if p.world_size}
    return RankTable(
        ranks=ranks,
        start_ns=start,
        end_ns=end,
        job_id=job,
        world_size=sizes.pop() if len(sizes) == 1 else None,
        launchers=[p.pid for p in info.launchers()],
        note=note,
    )
