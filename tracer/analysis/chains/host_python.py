"""host_python: the GPU waits while the training thread runs Python. The thread drains the GPU's queue at a sync,
then works on the CPU before it enqueues again (building the next batch in Python), so the GPU idles for that
work's time every step.

Judged only when the thread is host-bound: its CPU time outside calls is at least HOST_BOUND_RATIO times its
waits for the GPU (otherwise the sync is the story: sync_stall). Cost: its own work between a sync's return and
its next enqueue over every sync (sync_stall.idle_gap_after_sync), at most its CPU time outside calls. Where the
CPU time goes comes from its on-CPU samples outside calls (cpu_samples), by Python line.
"""

from __future__ import annotations

from tracer.analysis.chains.applies import has_dataloader
from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, grade
from tracer.analysis.chains.gil_contention import lines
from tracer.analysis.chains.model import CausalChain, Culprit, HostPythonEvidence
from tracer.analysis.chains.sync_stall import idle_gap_after_sync, sync_ops
from tracer.analysis.stack_time import sampled_stacks

CATEGORY = "host_python"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
# host-bound: the thread's Python between calls takes at least 1.5x its waits for the GPU (a loop whose host work
# and GPU work are about equal is sync_stall's: removing the per-step sync overlaps them)
HOST_BOUND_RATIO = 1.5
MIN_SYNCS = 10


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per host-bound subject whose Python work leaves the GPU idle."""
    if not ctx.info.has("cpu_samples"):
        return []
    out = []
    for s in ctx.subjects:
        t = s.time
        cpu, sync = t.ns("cpu"), t.ns("sync")
        if not s.launches or cpu < HOST_BOUND_RATIO * sync:
            continue
        syncs = sync_ops(ctx, s.pid)
        n = sum(o.calls for o in syncs)
        gap = idle_gap_after_sync(ctx, s.tid, [o.op for o in syncs]) if n >= MIN_SYNCS else None
        if not gap:
            continue
        cost = min(cpu, n * gap)
        sev = grade(s.share(cost), HIGH, MEDIUM, LOW)
        if sev is None:
            continue
        st = sampled_stacks(ctx.conn, [s.tid], ctx.in_steps(s), outside_calls=True).get(s.tid, [])
        hot = lines(st)
        site = hot[0].site if hot else None
        # the function, not the comprehension inside it ("build_batch", not "build_batch.<locals>.<listcomp>")
        fn = site.split(" ", 1)[1].split(".<locals>", 1)[0] if site and " " in site else site
        out.append(
            ctx.chain(
                s,
                category=CATEGORY,
                severity=sev,
                cost_ns=cost,
                culprit=Culprit(kind="code", pid=s.pid, tid=s.tid, comm=t.comm, relation="own_thread", code_site=site),
                summary=(
                    f"The GPU waits while thread {s.tid} (pid {s.pid}) runs Python between a sync and its next "
                    f"launch: {gap / 1e3:,.0f} µs a step, {s.share(cost):.0%} of its steps' time"
                    + (f"; {hot[0].share:.0%} of that CPU time is {fn} ({site.split(' ', 1)[0]})" if site else "")
                    + "."
                ),
                evidence=HostPythonEvidence(
                    cpu_ms=round(cpu / MS, 1),
                    sync_ms=round(sync / MS, 1),
                    gpu_idle_ms=round(n * gap / MS, 1),
                    idle_gap_us=round(gap / 1e3, 1),
                    steps=n,
                    hot_lines=hot,
                    samples=round(sum(x.intervals for x in st)),
                ),
                recommendations=[
                    (f"Move {fn} off the training thread" if fn else "Move the Python work off the training thread")
                    # DataLoader settings only for a job that has its workers (issue 23)
                    + (
                        ": build batches in DataLoader workers (num_workers > 0, a collate_fn there) so the next batch "
                        "is ready when the step starts."
                        if has_dataloader(ctx)
                        else ": build the next batch in a worker process while the GPU runs the step, so it is ready "
                        "when the step starts."
                    ),
                    "Vectorise it: numpy / torch operations on whole arrays instead of per-element Python loops.",
                    "Queue the next step's kernels before the Python work (or drop the per-step sync), so the GPU "
                    "has work while the host prepares the batch after.",
                ],
            )
        )
    return out
