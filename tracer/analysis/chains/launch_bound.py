"""launch_bound: the host is the limit. The training thread is on CPU issuing work nearly all the time and the
GPU's queue runs dry: it seldom waits in a sync (little ``sync`` time), and when it does the wait is short, so
the GPU had finished everything queued before the host got there.

Shares are judged on the time the thread could run: its wall time less its waits for a CPU (another cause's, on
a loaded host; a loop can be both contended and launch-bound). Cost: the thread's own CPU work (Python between
calls, the launches, copies): without it the GPU would not wait.
"""

from __future__ import annotations

from tracer.analysis.chains.applies import has_dataloader
from tracer.analysis.chains.context import HIGH_SHARE, MEDIUM_SHARE, ChainContext, grade
from tracer.analysis.chains.model import CausalChain, Culprit, LaunchBoundEvidence
from tracer.analysis.chains.sync_stall import sync_ops

CATEGORY = "launch_bound"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
MS = 1_000_000
S = 1_000_000_000
# "on CPU all the time": the host's own work is >= 80 % of its steps (less its waits for a CPU), waiting for the
# GPU <= 5 %
HOST_SHARE_MIN = 0.80
SYNC_SHARE_MAX = 0.05
HOST_PARTS = ("cpu", "launch", "copy", "other")
# a sync whose median wait is under 100 µs found the queue (nearly) empty: the GPU was idle, waiting
DRY_SYNC_P50_NS = 100_000
# launching is the loop's business: at least 200 launches per second (a step of tens of kernels every 0.1 s)
MIN_LAUNCHES_PER_S = 200.0


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject busy issuing work while the GPU queue ran dry."""
    out = []
    for s in ctx.subjects:
        t = s.time
        if not s.launches or t.wall <= 0:
            continue
        # the host's work of issuing the step: Python, launches, copies (allocations are allocation_churn's)
        host = t.ns(*HOST_PARTS)
        sync = t.ns("sync")
        launches = [o for o in ctx.ops_of(s.pid) if o.part == "launch"]
        n = sum(o.calls for o in launches)
        rate = n / (t.wall / S)
        syncs = sync_ops(ctx, s.pid)
        sync_calls = sum(o.calls for o in syncs)
        p50 = (
            sum(o.p50_ns * o.calls for o in syncs) / sync_calls if sync_calls else None
        )  # the sync ops' medians, weighted by their calls: the typical wait
        dry = p50 is None or p50 <= DRY_SYNC_P50_NS
        runnable = max(t.wall - t.runq_ns, 1)  # the time it had a CPU, or did not want one
        if host / runnable < HOST_SHARE_MIN or sync / runnable > SYNC_SHARE_MAX or not dry or rate < MIN_LAUNCHES_PER_S:
            continue
        cost = host
        sev = grade(s.share(cost), HIGH, MEDIUM)
        if sev is None:
            continue
        top = max(launches, key=lambda o: o.total_ns) if launches else None
        site = ctx.code_site(s.pid, [o.op for o in launches], s.tid) if launches else None
        out.append(
            ctx.chain(
                s,
                category=CATEGORY,
                severity=sev,
                cost_ns=cost,
                op=top.op if top else "",
                culprit=Culprit(kind="code", pid=s.pid, tid=s.tid, comm=t.comm, relation="own_thread", code_site=site),
                summary=(
                    f"Thread {s.tid} (pid {s.pid}) was busy on CPU {s.share(host):.0%} of its steps' time issuing "
                    f"{rate:,.0f} launches/s and waited for the GPU only {s.share(sync):.0%}"
                    + (f" (median sync {p50 / 1e3:.0f} µs: the queue was empty)" if p50 is not None else "")
                    + ": the GPU waits for the host."
                ),
                evidence=LaunchBoundEvidence(
                    cpu_ms=round(t.ns("cpu") / MS, 1),
                    launch_ms=round(t.ns("launch") / MS, 1),
                    host_share=round(s.share(host), 4),
                    sync_share=round(s.share(sync), 4),
                    launches=n,
                    launches_per_s=round(rate, 1),
                    launch_p50_us=round(top.p50_ns / 1e3, 1) if top else 0.0,
                    sync_p50_us=None if p50 is None else round(p50 / 1e3, 1),
                ),
                recommendations=[
                    "Cut the per-launch host cost: capture the step in a CUDA graph (torch.cuda.graphs / "
                    "torch.compile(mode='reduce-overhead')) so one launch replays all its kernels"
                    + (f"; the launches come from {site}." if site else "."),
                    "Give the GPU more work per launch: a larger batch, fused ops (torch.compile), fewer tiny "
                    "elementwise kernels.",
                    "Move Python work out of the step (logging, metric bookkeeping, data reshaping)"
                    + (" or into the DataLoader workers." if has_dataloader(ctx) else "."),
                ],
            )
        )
    return out
