"""gil_contention: the thread waited for CPython's interpreter lock while other threads of its process ran Python.

Every blocking switch-out of a thread has its stack (offcpu_stacks); the stacks that end in the interpreter's
lock take (tracer.analysis.stack_time ``gil``) are waits for the GIL. A thread gives the lock up in every call
that releases it (each CUDA call through ctypes or a C extension, every I/O call) and must take it back before
it runs Python again; with a thread that runs Python without pause, each take waits up to the switch interval
(5 ms). The culprits are the same process's other threads that were on CPU meanwhile, named by their hottest
Python function and line (cpu_samples).

Cost: the blocked time in those waits, in the thread's steps, less the sync waits they displaced. A wait after a
launch overlaps the GPU running what the thread queued, and the step's sync then waits that much less: that part
of the wait was not lost. A sync of an undisturbed step waits for the step's whole GPU work (its 95th percentile
stands for it), so what each stored sync waited less than that is GPU work that ran while the thread was held up
(:func:`displaced_sync_ns`); the GIL waits take their part of it, by their share of the thread's time outside its
waits for the GPU. Measured on fixtures/workloads/gil_thread.py: 3.4 s of GIL waits, 0.8 s of them displaced
sync waits, against a with/without loss of the run of 2.6 s.
"""

from __future__ import annotations

from tracer.analysis.chains.applies import has_dataloader
from tracer.analysis.chains.blocked_waits import graded_waits
from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, Subject, grade
from tracer.analysis.chains.model import CausalChain, Culprit, GilContentionEvidence, GilHolder, LineTime
from tracer.analysis.chains.sync_stall import sync_ops
from tracer.analysis.stack_time import StackTime, sampled_stacks, thread_name, top_lines

CATEGORY = "gil_contention"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
# a holder is named when it ran at least 5 % of the time the thread waited for the lock
HOLDER_MIN_FRAC = 0.05


def lines(stacks: list[StackTime], limit: int = 3) -> list[LineTime]:
    total = sum(s.ns for s in stacks) or 1.0
    return [
        LineTime(site=x.site, ms=round(x.ns / MS, 1), share=round(x.ns / total, 3)) for x in top_lines(stacks, limit)
    ]


# the sync wait of an undisturbed step: this quantile of the thread's stored syncs
FULL_SYNC_QUANTILE = 0.95


def displaced_sync_ns(ctx: ChainContext, s: Subject) -> float:
    """Return how much less the subject's syncs waited than an undisturbed step's sync, over its steps: the GPU
    work that ran while the thread was held up elsewhere (stored syncs, scaled to the exact count).

    A sync's wait for the GPU is its time less its wait for a CPU once woken (runq_ns): on a loaded host that wait
    made the 95th percentile 7.0 ms against the GPU's 4.0 ms a step, and the waits' cost read 0.24 of the steps
    against a loss of 0.53."""
    syncs = sync_ops(ctx, s.pid)
    if not syncs:
        return 0.0
    r = ctx.conn.execute(
        """WITH c AS (SELECT dur_ns - coalesce(runq_ns, 0) AS dur_ns, ts_ns >= $a AND ts_ns < $b AS inside
                      FROM cuda_calls WHERE tid = $tid AND list_contains($ops, op)),
           q AS (SELECT quantile_disc(dur_ns, $q) AS full_ns FROM c WHERE inside)
           SELECT sum(greatest(q.full_ns - c.dur_ns, 0)) FILTER (WHERE inside),
                  (SELECT count(*) FROM cuda_calls WHERE pid = $pid AND list_contains($ops, op)) FROM c, q""",
        {
            "tid": s.tid,
            "pid": s.pid,
            "ops": [o.op for o in syncs],
            "a": s.start_ns,
            "b": s.end_ns,
            "q": FULL_SYNC_QUANTILE,
        },
    ).fetchone()
    if not r or not r[1] or r[0] is None:
        return 0.0
    # stored syncs may be a sample of the process's (op_stats counts them exactly): scale by that fraction
    return float(r[0]) * max(1.0, sum(o.calls for o in syncs) / r[1])


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject that lost time waiting for the GIL."""
    out = []
    for s, gil, blocked, _ in graded_waits(ctx, "gil"):
        # the syncs waited less because the GPU ran during all of the thread's time outside its waits for the GPU
        # (its own work, its waits for a CPU, every block), not during the GIL waits alone: their part of it
        held_up = s.time.host_ns + s.time.runq_ns + s.time.ns("blocked")
        displaced = min(blocked, displaced_sync_ns(ctx, s) * min(1.0, blocked / held_up)) if held_up else 0.0
        cost = blocked - displaced
        sev = grade(s.share(cost), HIGH, MEDIUM, LOW)
        if sev is None:
            continue
        weight = ctx.in_steps(s)
        holders: list[GilHolder] = []
        if ctx.info.has("cpu_samples"):
            others = {t.tid: t for t in ctx.threads_of(s.pid) if t.tid != s.tid}
            by_tid = sampled_stacks(ctx.conn, others, weight)
            pcomm = ctx.info.comm(s.pid)
            for tid, st in sorted(by_tid.items(), key=lambda kv: -sum(x.ns for x in kv[1])):
                cpu = sum(x.ns for x in st)
                if cpu < HOLDER_MIN_FRAC * cost:
                    break
                name = thread_name(others[tid].comm, pcomm, tid, st)
                holders.append(GilHolder(tid=tid, name=name, cpu_ms=round(cpu / MS, 1), hot_lines=lines(st)))
        woken: dict[str, float] = {}
        for b in gil:
            for k, v in b.wakers.items():
                woken[k] = woken.get(k, 0.0) + v
        waited = lines(gil)
        top = holders[0] if holders else None
        hot = top.hot_lines[0].site if top and top.hot_lines else None
        culprit = (
            Culprit(kind="thread", pid=s.pid, tid=top.tid, comm=top.name, relation="own_process", code_site=hot)
            if top
            else None
        )
        who = f"{top.name}, on CPU {top.cpu_ms / 1e3:.2f} s meanwhile" if top else "other threads of its process"
        out.append(
            ctx.chain(
                s,
                category=CATEGORY,
                severity=sev,
                cost_ns=cost,
                culprit=culprit,
                summary=(
                    f"Thread {s.tid} (pid {s.pid}) waited {blocked / MS:,.0f} ms for the interpreter lock (GIL), "
                    + (
                        f"{displaced / MS:,.0f} ms of it while the GPU ran what it had queued, so it lost "
                        if displaced >= MS
                        else ""
                    )
                    + f"{cost / MS:,.0f} ms, {s.share(cost):.0%} of its steps' time, held by {who}"
                    + (f" at {hot}" if hot else "")
                    + (f"; it waited at {waited[0].site}" if waited and waited[0].site else "")
                    + "."
                ),
                evidence=GilContentionEvidence(
                    gil_wait_ms=round(blocked / MS, 1),
                    gpu_overlap_ms=round(displaced / MS, 1),
                    waits=round(sum(b.intervals for b in gil)),
                    waited_at=waited,
                    holders=holders,
                    woken_by={k: round(v / MS, 1) for k, v in sorted(woken.items(), key=lambda kv: -kv[1])},
                ),
                recommendations=[
                    (
                        f"Move the work of {top.name}" + (f" ({hot})" if hot else "")
                        if top
                        else "Move the Python work of the other threads"
                    )
                    + " out of the training process: a multiprocessing.Process"
                    + (" or a DataLoader worker" if has_dataloader(ctx) else "")
                    + " has its own interpreter lock.",
                    "Run it less often (aggregate metrics every N steps, not continuously) or let it sleep between "
                    "rounds, so the training thread gets the lock back at once after each CUDA call.",
                    "Do it in code that releases the lock: numpy / torch operations on arrays instead of Python "
                    "loops, or a C extension that drops the GIL (Py_BEGIN_ALLOW_THREADS).",
                ],
            )
        )
    return out
