"""dataloader_starvation: the training thread blocked, off CPU, until one of its data workers woke it: it was
waiting for a batch.

Source: ``thread_wakers``, exact per waker. Cost: the thread's blocked time outside CUDA calls that a worker
process of the traced tree ended (a process that launches kernels itself is another rank, not a worker). What
the workers were doing meanwhile (their own breakdown) decides the fix: busy on CPU means too few workers or
too costly a ``__getitem__``; mostly blocked means a slow hand-off (IPC, prefetch too shallow) or slow storage.
Waits for workers of a respawn wave in their first seconds are process_churn's. A recording without wakers
cannot tell a batch from a sleep: no chain, and the chains' note says so.
"""

from __future__ import annotations

from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, Subject, grade
from tracer.analysis.chains.model import CausalChain, Culprit, DataloaderStarvationEvidence, WorkerLoad
from tracer.analysis.chains.process_churn import respawn_windows

CATEGORY = "dataloader_starvation"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
S = 1_000_000_000
# workers on CPU >= 70 % of their time are saturated: more of them (or cheaper batches) is the fix
BUSY_WORKERS = 0.70


def _respawn_waits(ctx: ChainContext, s: Subject, respawned: dict[int, tuple[int, int]]) -> float:
    """Return the subject's blocked time (outside calls) ended by freshly respawned workers in their first
    seconds: process_churn's cost, not a steady loader's."""
    if not respawned:
        return 0.0
    total = 0.0
    for wp, sec, ns in ctx.conn.execute(
        "SELECT waker_pid, sec, sum(blocked_ns) FROM thread_wakers WHERE tid = ? AND NOT in_call "
        "AND list_contains(?, waker_pid) AND sec BETWEEN ? AND ? GROUP BY 1, 2",
        [s.tid, list(respawned), s.start_ns // S, s.end_ns // S],
    ).fetchall():
        a, b = respawned[wp]
        if a // S <= sec <= (b - 1) // S:
            total += ns or 0
    return total


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject that blocked waiting for its data workers >= LOW_SHARE of its steps."""
    if not ctx.info.has_wakers:
        return []
    out = []
    trainers = {s.pid for s in ctx.subjects if s.launches}
    for s in ctx.subjects:
        t = s.time
        wakers = [
            w
            for w in ctx.wakers(s)
            if w.holder == "tree" and w.pid not in trainers and ctx.info.process_role(w.pid) != "tracer"
        ]
        woken = sum((w.blocked_ms - w.in_call_ms) * MS for w in wakers)
        woken -= _respawn_waits(ctx, s, respawn_windows(ctx, s.tid))
        sev = grade(s.share(woken), HIGH, MEDIUM, LOW)
        if sev is None:
            continue
        by_pid: dict[int, list] = {}
        for w in wakers:
            by_pid.setdefault(w.pid, []).append(w)
        loads = []
        for pid, ws in sorted(by_pid.items(), key=lambda kv: -sum(w.blocked_ms for w in kv[1])):
            ths = ctx.threads_of(pid)
            wall = sum(x.wall for x in ths)
            loads.append(
                WorkerLoad(
                    pid=pid,
                    comm=ctx.info.comm(pid) if pid in ctx.info.procs else ws[0].comm,
                    cpu_share=round(sum(x.ns("cpu") for x in ths) / wall, 4) if wall else 0.0,
                    blocked_share=round(sum(x.ns("blocked") for x in ths) / wall, 4) if wall else 0.0,
                    runq_share=round(sum(x.runq_ns for x in ths) / wall, 4) if wall else 0.0,
                    wakeups_of_main=sum(w.wakeups for w in ws),
                    woke_blocked_ms=round(sum(w.blocked_ms - w.in_call_ms for w in ws), 1),
                )
            )
        all_workers = [p for p in ctx.info.descendants(s.pid) if p.pid not in trainers]
        n_workers = len({p.pid for p in all_workers if p.exit_ns is None or p.exit_ns > s.start_ns}) or len(loads)
        walls = [x for p in by_pid for x in ctx.threads_of(p)]
        wall = sum(x.wall for x in walls)
        busy = sum(x.ns("cpu") for x in walls) / wall if wall else 0.0
        cores = ctx.info.cpu_cores
        top = loads[0]
        blocked = t.ns("blocked")
        recs = []
        if busy >= BUSY_WORKERS:
            more = min(max(cores - 1, 1), n_workers * 2) if cores else n_workers * 2
            recs.append(
                f"The {n_workers} workers were on CPU {busy:.0%} of their time and still too slow: "
                + (
                    f"raise num_workers to {more} (this host has {cores} CPUs)"
                    if cores and more > n_workers
                    else "the CPUs are all used: make each batch cheaper"
                )
                + ", and move decoding/augmentation to the GPU or precompute it."
            )
        else:
            recs.append(
                f"The workers were mostly idle ({busy:.0%} on CPU) while the training thread waited: the hand-off "
                "is slow. Raise prefetch_factor, use pin_memory=True and persistent_workers=True, and check the "
                "storage the dataset reads from."
            )
        recs.append("Check the fix with tracer breakdown: the training thread's blocked share should fall.")
        out.append(
            ctx.chain(
                s,
                category=CATEGORY,
                severity=sev,
                cost_ns=woken,
                culprit=Culprit(
                    kind="workers", pid=top.pid, tid=None, comm=top.comm, relation="own_workers", code_site=None
                ),
                pids=list(by_pid),
                summary=(
                    f"Thread {s.tid} (pid {s.pid}) blocked {woken / MS:,.0f} ms ({s.share(woken):.0%} of its steps' "
                    f"time) until a data worker woke it: it was waiting for batches from {len(loads)} worker "
                    f"process{'es' if len(loads) != 1 else ''} ({busy:.0%} of their time on CPU)."
                ),
                evidence=DataloaderStarvationEvidence(
                    blocked_ms=round(blocked / MS, 1),
                    woken_by_workers_ms=round(woken / MS, 1),
                    wakeups=sum(w.wakeups for w in wakers),
                    workers=loads[:8],
                    worker_count=n_workers,
                    workers_cpu_share=round(busy, 4),
                    cpu_cores=cores,
                ),
                recommendations=recs,
            )
        )
    return out
