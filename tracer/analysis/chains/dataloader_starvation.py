"""dataloader_starvation: the training thread blocked, off CPU, until one of its data workers woke it: it was
waiting for a batch.

Source: ``thread_wakers``, exact per waker. Cost: the thread's blocked time outside CUDA calls that a worker
process of the traced tree ended (a process that launches kernels itself is another rank, not a worker). What
the workers were doing meanwhile (their own breakdown) decides the fix: busy on CPU means too few workers or
too costly a ``__getitem__``; mostly blocked means a slow hand-off (IPC, prefetch too shallow) or slow storage.
The extra wait for a respawn wave's first batch is process_churn's. A recording without wakers
cannot tell a batch from a sleep: no chain, and the chains' note says so.

Workers that were slow because they queued for a CPU behind other tenants' processes do not starve the loader
by themselves: that part of the wait (the workers' run-queue time behind other processes, as a share of their
working time) is cpu_contention's, against the process that held the CPU (:func:`loader_wait`). Without it, a
CPU hog on the training cores ranked as a starved loader with the hog second.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.analysis.breakdown.holders import Holder, Waker
from tracer.analysis.chains.applies import helper_pids, is_dataloader_worker
from tracer.analysis.chains.context import (
    HIGH_SHARE,
    LOW_SHARE,
    MEDIUM_SHARE,
    ChainContext,
    Subject,
    clip,
    grade,
)
from tracer.analysis.chains.gil_contention import lines
from tracer.analysis.chains.model import CausalChain, Culprit, DataloaderStarvationEvidence, WorkerLoad
from tracer.analysis.chains.process_churn import respawn_stalls, respawn_windows
from tracer.analysis.recording import most_alive_at_once
from tracer.analysis.stack_time import sampled_stacks

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


@dataclass(frozen=True)
class LoaderWait:
    """A subject's waits for its data workers, and the part of them that other tenants' processes caused."""

    wakers: list[Waker]  # the workers that ended its blocked intervals
    woken_ns: float  # its blocked time outside calls that they ended (respawn waves' first seconds left out)
    foreign_ns: float  # of woken_ns, the share the workers spent queued for a CPU held by other processes
    foreign_holders: list[Holder]  # those processes; runq_ms: the subject's wait each caused through the workers


def loader_wait(ctx: ChainContext, s: Subject) -> LoaderWait:
    """Return how long subject ``s`` blocked until its data workers woke it, and how much of that wait the
    workers' queueing behind other processes explains (their run-queue time behind other processes over their
    working time, on CPU or runnable, within the subject's steps: removing the other process removes that share
    of each batch's latency, to first order)."""
    key = ("loader_wait", s.tid)
    if key in ctx.memo:
        return ctx.memo[key]
    if not ctx.info.has_wakers:  # an older recording cannot tell a batch from a sleep
        return LoaderWait([], 0.0, 0.0, [])
    trainers = {x.pid for x in ctx.subjects if x.launches}
    helpers = helper_pids(ctx, s.tid)  # commands it waited for to finish deliver no batches
    wakers = [
        w
        for w in ctx.wakers(s)
        if w.holder == "tree"
        and w.pid not in trainers
        and w.pid not in helpers
        and ctx.info.process_role(w.pid) != "tracer"
    ]
    woken = sum((w.blocked_ms - w.in_call_ms) * MS for w in wakers)
    stalls = respawn_stalls(ctx, s)
    if stalls is None:  # no wakers in sched: the respawns' windows, whole seconds
        woken -= _respawn_waits(ctx, s, respawn_windows(ctx, s))
    else:  # each respawn's first batch, beyond a usual batch's wait, is process_churn's cost
        woken -= sum(min(st.batch_wait_ns, st.cost_ns) for st in stalls)
    working = foreign = 0.0
    clipped = []
    for pid in {w.pid for w in wakers}:
        for t in ctx.threads_of(pid):
            t = clip(t, s.start_ns, s.end_ns)
            if t.wall <= 0:
                continue
            working += t.wall - t.ns("blocked")
            foreign += t.ns("runq_other")
            clipped.append(t)
    held = {h.pid: h for h in ctx.other_holders(clipped)}
    foreign_ns = woken * foreign / working if woken > 0 and working > 0 else 0.0
    # each holder's part of the workers' queueing, as the subject's wait it caused through them
    total = sum(h.runq_ms for h in held.values())
    holders = sorted(
        (
            h.model_copy(update={"runq_ms": round(foreign_ns / MS * h.runq_ms / total, 3)})
            for h in held.values()
            if total
        ),
        key=lambda h: (-h.runq_ms, h.pid),
    )
    out = LoaderWait(wakers, max(woken, 0.0), foreign_ns, holders if foreign_ns > 0 else [])
    ctx.memo[key] = out
    return out


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject that blocked waiting for its data workers >= LOW_SHARE of its steps."""
    if not ctx.info.has_wakers:
        return []
    out = []
    trainers = {s.pid for s in ctx.subjects if s.launches}
    for s in ctx.subjects:
        t = s.time
        lw = loader_wait(ctx, s)
        wakers = lw.wakers
        woken = lw.woken_ns - lw.foreign_ns  # what the loader itself cost; the rest is cpu_contention's
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
        # the pool's size: the most alive at once (a loader that respawns its workers has forked hundreds)
        live = [p for p in all_workers if p.exit_ns is None or p.exit_ns > s.start_ns]
        n_workers = most_alive_at_once(live, ctx.info.duration_ns) or len(loads)
        walls = [x for p in by_pid for x in ctx.threads_of(p)]
        wall = sum(x.wall for x in walls)
        busy = sum(x.ns("cpu") for x in walls) / wall if wall else 0.0
        queued = sum(x.runq_ns for x in walls) / wall if wall else 0.0
        cores = ctx.info.cpu_cores
        top = loads[0]
        blocked = t.ns("blocked")
        # where the workers' CPU went (their on-CPU samples): the transform or decode line to make cheaper
        hot = lines([x for st in sampled_stacks(ctx.conn, [x.tid for x in walls]).values() for x in st])
        hot = [h for h in hot if h.site]
        site = hot[0].site if hot else None
        # DataLoader settings only for a DataLoader's workers; another producer (a multiprocessing queue) gets
        # the same advice in its own terms
        dl = any(is_dataloader_worker(ctx, p) for p in by_pid)
        n_knob = "num_workers" if dl else "the number of worker processes"
        recs = []
        if busy + queued >= BUSY_WORKERS and queued > busy:
            recs.append(
                f"The {n_workers} workers waited for a CPU {queued:.0%} of their time (on CPU {busy:.0%}): they "
                f"are short of cores, not slow. Give the job cores nothing else uses and keep {n_knob} below "
                f"the cores left for them{f' (this host has {cores} CPUs)' if cores else ''}."
            )
        elif busy >= BUSY_WORKERS:
            more = min(max(cores - 1, 1), n_workers * 2) if cores else n_workers * 2
            recs.append(
                f"The {n_workers} workers were on CPU {busy:.0%} of their time and still too slow: "
                + (
                    f"raise {n_knob} to {more} (this host has {cores} CPUs)"
                    if cores and more > n_workers
                    else "the CPUs are all used: make each batch cheaper"
                )
                + ", and move decoding/augmentation to the GPU or precompute it"
                + (f"; {hot[0].share:.0%} of their CPU is {site}." if site else ".")
            )
        else:
            recs.append(
                f"The workers were on CPU only {busy:.0%} of their time while the training thread waited: the "
                + (
                    "hand-off is slow. Raise prefetch_factor, use pin_memory=True and persistent_workers=True, and "
                    "check the storage the dataset reads from."
                    if dl
                    else "hand-off is slow. Queue more items ahead (a deeper queue between the workers and the "
                    "training loop) and check the storage they read from."
                )
            )
        recs.append("Check the fix with tracer breakdown: the training thread's blocked share should fall.")
        out.append(
            ctx.chain(
                s,
                category=CATEGORY,
                severity=sev,
                cost_ns=woken,
                culprit=Culprit(
                    kind="workers", pid=top.pid, tid=None, comm=top.comm, relation="own_workers", code_site=site
                ),
                pids=list(by_pid),
                summary=(
                    f"Thread {s.tid} (pid {s.pid}) blocked {woken / MS:,.0f} ms ({s.share(woken):.0%} of its steps' "
                    f"time) until a data worker woke it: it was waiting for batches from {n_workers} worker "
                    f"process{'es' if n_workers != 1 else ''}"
                    + (f" ({len(loads)} over the recording, re-forked)" if len(loads) > n_workers else "")
                    + f" ({busy:.0%} of their time on CPU"
                    + (f", {hot[0].share:.0%} of it at {site}" if site else "")
                    + ")"
                    + (
                        f"; {lw.foreign_ns / MS:,.0f} ms more, while the workers queued behind other processes, "
                        "is counted under cpu_contention."
                        if lw.foreign_ns >= MS
                        else "."
                    )
                ),
                evidence=DataloaderStarvationEvidence(
                    blocked_ms=round(blocked / MS, 1),
                    woken_by_workers_ms=round(woken / MS, 1),
                    behind_other_processes_ms=round(lw.foreign_ns / MS, 1),
                    wakeups=sum(w.wakeups for w in wakers),
                    workers=loads[:8],
                    worker_count=n_workers,
                    workers_cpu_share=round(busy, 4),
                    cpu_cores=cores,
                    worker_hot_lines=hot,
                ),
                recommendations=recs,
            )
        )
    return out
