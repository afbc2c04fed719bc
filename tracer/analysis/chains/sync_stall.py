"""sync_stall: the thread waits for the GPU every step (explicit synchronize or an implicit one: a synchronous
copy such as ``loss.item()``'s 4-byte DtoH ``cudaMemcpy``), so host and GPU take turns instead of overlapping.

Which calls wait for the GPU comes from the catalog (``ProbeSpec.waits_for_gpu``); their time is the ``sync``
part of the breakdown. Cost: a sync returns when the GPU's queue is empty, and the queue stays empty until the
thread enqueues again (launch, async copy, memset): the thread's own work in that gap is GPU time lost to the
sync. It is measured per stored sync (the gap to the next stored enqueue on the thread, less the off-CPU time in
it: waiting for a batch is not the sync's fault), its median scaled to the exact number of syncs, and capped by
the sync time and by the thread's own work: ``min(sync, host work, syncs x median idle gap)``. A loop that
enqueues right after each sync loses little here even when it waits long (gpu_bound); one that does its Python
work between the sync and the next launch (``loss.item()`` then data preparation) loses that work's time.
"""

from __future__ import annotations

import numpy as np

from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, OpLatency, grade
from tracer.analysis.chains.model import CausalChain, Culprit, OpTime, SyncStallEvidence
from tracer.analysis.taxonomy import is_implicit_sync, part_name, waits_for_gpu

CATEGORY = "sync_stall"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
S = 1_000_000_000
# "every step": at least 10 waits in all and one per second; a loop that syncs once a minute is not serialised
MIN_SYNCS = 10
MIN_SYNCS_PER_S = 1.0
# what a thread does to give the GPU work again after a sync drained it
ENQUEUE_PARTS = ("launch", "copy", "other")


def sync_ops(ctx: ChainContext, pid: int) -> list[OpLatency]:
    """Return the pid's ops that wait for the GPU (a runtime call and its driver call counted once)."""
    return ctx.ops_of(pid, lambda o: waits_for_gpu(o.op))


def op_times(ops: list[OpLatency]) -> list[OpTime]:
    return [
        OpTime(
            op=o.op,
            calls=o.calls,
            total_ms=round(o.total_ns / MS, 1),
            p50_us=round(o.p50_ns / 1e3, 1),
            p99_us=round(o.p99_ns / 1e3, 1),
            implicit_sync=is_implicit_sync(o.op),
        )
        for o in ops
    ]


def idle_gap_after_sync(ctx: ChainContext, tid: int, syncs: list[str]) -> float | None:
    """Return the median ns of the thread's own work between a sync's return and its next enqueue (launch, async
    copy, memset), over the stored calls; None when no stored sync is followed by a stored enqueue."""
    enqueue = [op for op in {o for (_, o) in ctx.ops} if part_name(op) in ENQUEUE_PARTS]
    if not syncs or not enqueue:
        return None
    # The calls read as columns and paired in numpy: DuckDB's window (lead() over the calls by start) sorted a
    # training thread's 5 M calls for most of this query (issue 28's cost on the 1-hour recording), and the rows are
    # stored in time order, so a check replaces the sort. By start only: two calls of one thread never enter in the
    # same ns, a nested call enters after its caller.
    c = ctx.conn.execute(
        "SELECT ts_ns, ts_ns + dur_ns AS end_ns, list_contains($syncs, op) AS is_sync FROM cuda_calls "
        "WHERE tid = $tid AND (list_contains($syncs, op) OR list_contains($enq, op)) "
        "AND ts_ns IS NOT NULL AND dur_ns IS NOT NULL",
        {"tid": tid, "syncs": syncs, "enq": enqueue},
    ).fetchnumpy()
    ts, end, is_sync = _sorted_by_start(c["ts_ns"], c["end_ns"], c["is_sync"])
    # a gap: from a sync's return to the start of the next call, an enqueue
    gap = is_sync[:-1] & ~is_sync[1:] & (ts[1:] > end[:-1])
    a, b = end[:-1][gap], ts[1:][gap]
    if not len(a):
        return None
    # A thread's off-CPU intervals do not overlap, so the off-CPU time inside a gap [a, b) is F(b) - F(a), with
    # F(t) the off-CPU time before t: the running total before the last interval starting at or before t, plus
    # that interval's part before t (binary searches; a range join of every gap with every interval is quadratic)
    r = ctx.conn.execute(
        "SELECT ts_ns, dur_ns FROM sched WHERE tid = $tid AND ts_ns IS NOT NULL AND dur_ns IS NOT NULL",
        {"tid": tid},
    ).fetchnumpy()
    st, sd = _sorted_by_start(r["ts_ns"], r["dur_ns"])
    before = np.concatenate(([0], np.cumsum(sd)))

    def off_before(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(st, t, side="right") - 1
        j = np.maximum(i, 0)
        inside = before[j] + np.minimum(t - st[j], sd[j]) if len(st) else np.zeros(len(t), dtype=np.int64)
        return np.where(i >= 0, inside, 0)

    return float(np.median(np.maximum(b - a - (off_before(b) - off_before(a)), 0)))


def _sorted_by_start(ts: np.ndarray, *cols: np.ndarray) -> tuple[np.ndarray, ...]:
    """Return ``ts`` and ``cols`` as plain arrays (int64, bool kept), ordered by ``ts`` (stable; already in order,
    as stored, they are not sorted again)."""
    ts = np.asarray(ts, dtype=np.int64)
    out = [np.asarray(x) if np.asarray(x).dtype == bool else np.asarray(x, dtype=np.int64) for x in cols]
    if len(ts) > 1 and (np.diff(ts) < 0).any():
        order = np.argsort(ts, kind="stable")
        ts, out = ts[order], [x[order] for x in out]
    return (ts, *out)


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject whose per-step waits for the GPU kept it from overlapping its work."""
    out = []
    for s in ctx.subjects:
        t = s.time
        ops = sync_ops(ctx, s.pid)
        calls = sum(o.calls for o in ops)
        secs = t.wall / S
        rate = calls / secs if secs > 0 else 0.0
        if calls < MIN_SYNCS or rate < MIN_SYNCS_PER_S:
            continue
        sync, host = t.ns("sync"), t.host_ns
        gap = idle_gap_after_sync(ctx, s.tid, [o.op for o in ops])
        idle = gap * calls if gap is not None else float(host)
        cost = min(sync, host, idle)
        sev = grade(s.share(cost), HIGH, MEDIUM, LOW)
        if sev is None:
            continue
        implicit = [o for o in ops if is_implicit_sync(o.op)]
        top = max(ops, key=lambda o: o.total_ns)
        site = ctx.code_site(s.pid, [top.op], s.tid) or ctx.code_site(s.pid, [o.op for o in ops], s.tid)
        r = ctx.conn.execute(
            "SELECT sum(dur_ns), sum(off_cpu_ns - runq_ns) FROM cuda_calls WHERE tid = ? AND list_contains(?, op)",
            [s.tid, [o.op for o in ops]],
        ).fetchone()
        blocked_share = round(r[1] / r[0], 3) if r and r[0] else None
        n_implicit = sum(o.calls for o in implicit)
        where = f" at {site}" if site else ""
        recs = []
        if implicit:
            io = max(implicit, key=lambda o: o.total_ns)
            recs.append(
                f"{io.op} is a synchronous copy{where if top is io else ''}: it waits for every kernel queued before "
                f"it ({io.calls:,} times, {rate:.0f}/s with the other syncs). In PyTorch that is .item(), .cpu(), "
                ".tolist() or print(tensor) on a CUDA tensor: accumulate the value on the GPU and read it every N "
                "steps, or copy with .to('cpu', non_blocking=True) into pinned memory and read it a step later."
            )
        explicit = [o for o in ops if not is_implicit_sync(o.op)]
        if explicit:
            e = max(explicit, key=lambda o: o.total_ns)
            recs.append(
                f"Remove the per-step {e.op}{where if top is e else ''} ({e.calls:,} calls): "
                "torch.cuda.synchronize() is only needed for timing; wait on a CUDA event recorded N steps ago "
                "instead of draining the queue every step."
            )
        recs.append(
            f"Expected gain: up to {cost / MS:,.0f} ms of the thread's {t.wall / MS:,.0f} ms "
            f"({s.share(cost):.0%}), the part of its own work the GPU could overlap once the host runs ahead."
        )
        out.append(
            ctx.chain(
                s,
                category=CATEGORY,
                severity=sev,
                cost_ns=cost,
                op=top.op,
                culprit=Culprit(kind="code", pid=s.pid, tid=s.tid, comm=t.comm, relation="own_thread", code_site=site),
                summary=(
                    f"Thread {s.tid} (pid {s.pid}) waited for the GPU {calls:,} times ({rate:.0f}/s, "
                    f"{n_implicit:,} of them implicit in synchronous copies){where}: {sync / MS:,.0f} ms in syncs "
                    f"against {host / MS:,.0f} ms of its own work, up to {s.share(cost):.0%} of its steps' time "
                    "lost to not overlapping them."
                ),
                evidence=SyncStallEvidence(
                    sync_ms=round(sync / MS, 1),
                    sync_share=round(s.share(sync), 4),
                    host_ms=round(host / MS, 1),
                    host_share=round(s.share(host), 4),
                    syncs=calls,
                    syncs_per_s=round(rate, 1),
                    implicit_syncs=n_implicit,
                    ops=op_times(ops),
                    blocked_share_of_sync=blocked_share,
                    idle_gap_after_sync_us=None if gap is None else round(gap / 1e3, 1),
                    gpu_idle_ms=round(min(idle, sync + host) / MS, 1),
                ),
                recommendations=recs,
            )
        )
    return out
