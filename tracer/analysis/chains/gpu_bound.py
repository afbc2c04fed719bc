"""gpu_bound: the training thread spends most of its steps waiting for the GPU: the GPU is the limit. This is
the healthy shape of a training loop, reported for information and never above LOW; the fixes are on the GPU
side (mixed precision, fused kernels, a larger batch if memory allows).

Not when those waits were mostly spent runnable, waiting for a CPU (``cuda_calls.runq_ns``; the wait-for graph's
sync edge, :func:`tracer.analysis.waitgraph.sync_runq_share`): the GPU had finished and the thread could not run,
so "the GPU is the limit" would contradict the chain that names the CPU's holders (issue 28).
"""

from __future__ import annotations

from tracer.analysis import waitgraph
from tracer.analysis.chains.context import ChainContext
from tracer.analysis.chains.model import CausalChain, Culprit, GpuBoundEvidence
from tracer.analysis.chains.sync_stall import sync_ops

CATEGORY = "gpu_bound"
# half of the steps' time waiting for the GPU: more than the host's own work and every other part together
SYNC_SHARE_MIN = 0.50
SEVERITY = "LOW"  # informational: nothing on the host to fix
MS = 1_000_000


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return an informational chain per subject that waited for the GPU >= SYNC_SHARE_MIN of its steps."""
    out = []
    for s in ctx.subjects:
        t = s.time
        # the syncs' time waiting for a CPU after the GPU was done (call_runq, all but a few µs of it in syncs)
        # is not the GPU's: a job whose syncs wait for a CPU is not GPU-bound (issue 28)
        sync = max(t.ns("sync") - t.ns("call_runq"), 0)
        # a description of the loop, not a cost: the plain share of its steps, however short they are
        share = t.share(sync)
        if share < SYNC_SHARE_MIN or waitgraph.sync_runq_share(ctx, s) >= waitgraph.RUNQ_IN_SYNC:
            continue
        ops = sync_ops(ctx, s.pid)
        calls = sum(o.calls for o in ops)
        top = max(ops, key=lambda o: o.total_ns).op if ops else ""
        out.append(
            ctx.chain(
                s,
                category=CATEGORY,
                severity=SEVERITY,
                cost_ns=sync,
                op=top,
                culprit=Culprit(kind="host", pid=None, tid=None, comm="GPU", relation="host", code_site=None),
                summary=(
                    f"Thread {s.tid} (pid {s.pid}) waited for the GPU {share:.0%} of its steps' time: the GPU is the "
                    "limit, not the host."
                ),
                evidence=GpuBoundEvidence(
                    sync_ms=round(sync / MS, 1),
                    sync_share=round(share, 4),
                    host_share=round(t.share(t.host_ns), 4),
                    syncs=calls,
                    avg_wait_ms=round(sync / calls / MS, 3) if calls else 0.0,
                ),
                recommendations=[
                    "Nothing to fix on the host. To go faster, make the GPU work cheaper: mixed precision "
                    "(torch.autocast), fused or compiled kernels (torch.compile), channels_last for convolutions; "
                    "check GPU utilisation with nvidia-smi.",
                ],
            )
        )
    return out
