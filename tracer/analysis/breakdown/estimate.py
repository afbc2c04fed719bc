"""The estimate of every thread's time for a recording without ``thread_breakdown`` (made before the time
accounting existed, or by a recorder that did not run it): ``basis = "estimated"``.

Sources: ``op_stats`` (exact per-process call time), ``sched_stats`` (exact per-thread off-CPU and run-queue
time), ``preemptors`` (who held the CPU) and the stored calls (which thread, which second). It has no page faults
and no wakers: those exist only in the recorder's accounting.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import duckdb

from probes.catalog import Layer, spec_of
from tracer.analysis.breakdown.holders import holder_class
from tracer.analysis.breakdown.thread_time import S, ThreadTime, add_row, zero_row
from tracer.analysis.recording import RecordingInfo
from tracer.analysis.taxonomy import CALL_PART_NAMES, part_name


def estimate_thread_times(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, pid: int | None) -> list[ThreadTime]:
    """Return every thread with CUDA calls (of ``pid`` only when given), its per-second parts estimated from
    what an older recording has (see the module docstring)."""
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
    calls_in: dict[int, dict[int, dict[str, int]]] = defaultdict(lambda: defaultdict(zero_row))
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
            pid=pp,
            tid=tid,
            comm=info.comm(pp),
            first_ns=int(t0),
            end_ns=end,
            exited=False,
            cuda_calls=0,
            total=zero_row(),
        )
        carry = (0, 0)
        for sec in range(int(t0) // S, (end - 1) // S + 1):
            wall = min(end, (sec + 1) * S) - max(int(t0), sec * S)
            if wall <= 0:
                continue
            row = zero_row()
            add_row(row, calls_in[tid].get(sec, {}))
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
            add_row(t.total, row)
        # exact per process (op_stats); split between a process's CUDA threads by their stored calls
        t.cuda_calls = round(calls_by_pid.get(pp, 0) * n_stored / stored_by_pid[pp]) if stored_by_pid[pp] else 0
        out.append(t)
    return sorted(out, key=lambda t: (t.pid, t.tid))


def _layer_of(op: str) -> str:
    """Return the layer (runtime | driver) of ``op`` by the probe catalog, for rows that do not say."""
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
