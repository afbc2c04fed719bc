"""lock_contention: the thread waited for a lock another thread of its process held (a ``threading.Lock``, a
queue's condition, a logging handler's lock).

Blocked stacks (offcpu_stacks) classified ``lock`` (tracer.analysis.stack_time: PyThread_acquire_lock*,
sem_*wait, _PySemaphore_Wait) are the waits; the thread that woke the waiter released the lock, so the wakers of
those waits are the holders. Each holder is named with where its time went meanwhile (its sampled CPU and its
own blocked stacks: a handler that writes to a slow sink holds the lock while blocked). Cost: the blocked time
in the lock waits, in the thread's steps.
"""

from __future__ import annotations

from tracer.analysis.chains.blocked_waits import graded_waits
from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext
from tracer.analysis.chains.gil_contention import lines
from tracer.analysis.chains.model import CausalChain, Culprit, LockContentionEvidence, LockHolder
from tracer.analysis.stack_time import StackTime, blocked_stacks, sampled_stacks, thread_name

CATEGORY = "lock_contention"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
MAX_HOLDERS = 3


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject that lost time waiting for a lock."""
    out = []
    for s, waits, cost, sev in graded_waits(ctx, "lock"):
        weight = ctx.in_steps(s)
        ids = [b.stack_id for b in waits if b.stack_id is not None]
        woke: dict[int, float] = {}
        for sec, wt, ns in ctx.conn.execute(
            "SELECT sec, waker_tid, sum(blocked_ns) FROM offcpu_stacks WHERE tid = ? AND waker_pid = ? "
            "AND waker_tid IS NOT NULL AND list_contains(?, stack_id) GROUP BY ALL",
            [s.tid, s.pid, ids],
        ).fetchall():
            woke[wt] = woke.get(wt, 0.0) + ns * weight(int(sec))
        threads = {t.tid: t for t in ctx.threads_of(s.pid)}
        pcomm = ctx.info.comm(s.pid)
        holders = []
        for tid, ns in sorted(woke.items(), key=lambda kv: -kv[1])[:MAX_HOLDERS]:
            if tid == s.tid or ns <= 0:
                continue
            spent: list[StackTime] = [b for b in blocked_stacks(ctx.conn, tid, weight) if b.kind != "lock"]
            if ctx.info.has("cpu_samples"):
                spent += sampled_stacks(ctx.conn, [tid], weight).get(tid, [])
            spent.sort(key=lambda x: -x.ns)
            comm = threads[tid].comm if tid in threads else ""
            holders.append(
                LockHolder(
                    tid=tid,
                    name=thread_name(comm, pcomm, tid, spent),
                    woke_ms=round(ns / MS, 1),
                    hot_lines=lines(spent),
                )
            )
        waited = lines(waits)
        top = holders[0] if holders else None
        hot = top.hot_lines[0].site if top and top.hot_lines else None
        where = waited[0].site if waited else None
        out.append(
            ctx.chain(
                s,
                category=CATEGORY,
                severity=sev,
                cost_ns=cost,
                culprit=Culprit(
                    kind="thread", pid=s.pid, tid=top.tid, comm=top.name, relation="own_process", code_site=hot
                )
                if top
                else None,
                summary=(
                    f"Thread {s.tid} (pid {s.pid}) waited {cost / MS:,.0f} ms for a lock"
                    + (f" at {where}" if where else "")
                    + f", {s.share(cost):.0%} of its steps' time"
                    + (f"; {top.name} held it, at {hot}" if top and hot else "")
                    + "."
                ),
                evidence=LockContentionEvidence(
                    lock_wait_ms=round(cost / MS, 1),
                    waits=round(sum(b.intervals for b in waits)),
                    waited_at=waited,
                    holders=holders,
                ),
                recommendations=[
                    (
                        f"Shorten what {top.name} does with the lock held" + (f" ({hot})" if hot else "")
                        if top
                        else "Shorten what the holder does with the lock held"
                    )
                    + ": copy what it protects and release it before slow work (I/O, formatting, a flush).",
                    "Take the slow work off the lock's path: a logging.handlers.QueueHandler + QueueListener makes "
                    "the training thread's log calls non-blocking; a queue instead of a shared structure under a lock.",
                    "If the training thread only reads, give it a snapshot (swap a reference) instead of the lock.",
                ],
            )
        )
    return out
