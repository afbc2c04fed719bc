"""allocation_churn: the thread allocates and frees device or pinned memory inside its loop (the caching
allocator defeated, ``torch.cuda.empty_cache()`` in a loop, stream-ordered ``cudaMallocAsync`` per step).

Which ops allocate or free comes from the catalog (``OpClass.ALLOC`` / ``FREE``, async ones included); their
time is the ``alloc`` and ``free`` parts of the breakdown. Cost: that time (a free often waits for the device as
well). The culprit is the Python line behind the most allocation time.
"""

from __future__ import annotations

from collections.abc import Callable

from probes.catalog import OpClass
from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, OpLatency, grade
from tracer.analysis.chains.model import AllocationChurnEvidence, CausalChain, Culprit, SiteCount
from tracer.analysis.chains.sync_stall import op_times
from tracer.analysis.taxonomy import spec

CATEGORY = "allocation_churn"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
S = 1_000_000_000
# a handful of allocations at start-up is set-up, not churn: at least 100 calls and 10 per second of steps
MIN_CALLS = 100
MIN_CALLS_PER_S = 10.0
_ASYNC_STREAM_ORDERED = ("cudaMallocAsync", "cudaFreeAsync")


def _of_class(cls: OpClass) -> Callable[[OpLatency], bool]:
    """Return a filter for the ops of ``cls`` (the catalog's taxonomy)."""
    return lambda o: bool((x := spec(o.op)) and x.op_class == cls)


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject whose allocation and free calls cost it >= LOW_SHARE of its steps."""
    out = []
    for s in ctx.subjects:
        t = s.time
        allocs = ctx.ops_of(s.pid, _of_class(OpClass.ALLOC))
        frees = ctx.ops_of(s.pid, _of_class(OpClass.FREE))
        calls = sum(o.calls for o in allocs + frees)
        rate = calls / (t.wall / S) if t.wall else 0.0
        if calls < MIN_CALLS or rate < MIN_CALLS_PER_S:
            continue
        cost = t.ns("alloc", "free")
        sev = grade(s.share(cost), HIGH, MEDIUM, LOW)
        if sev is None:
            continue
        main = max(allocs or frees, key=lambda o: o.total_ns)
        sites = [
            SiteCount(site=site, calls=n, total_ms=round(ns / MS, 1), bytes=b)
            for site, n, ns, b in ctx.top_sites(s.pid, [o.op for o in allocs], s.tid)
        ]
        site = sites[0].site if sites else None
        free_ops = [o.op for o in frees]
        empty_cache = bool(
            free_ops
            and ctx.conn.execute(
                "SELECT count(*) FROM stacks WHERE (function ILIKE '%empty_cache%' OR function ILIKE '%emptyCache%') "
                "AND stack_id IN (SELECT DISTINCT stack_id FROM cuda_calls WHERE pid = ? AND list_contains(?, op))",
                [s.pid, free_ops],
            ).fetchone()[0]
        )
        n_async = sum(o.calls for o in allocs + frees if o.op in _ASYNC_STREAM_ORDERED)
        nbytes = sum(o.bytes for o in allocs)
        where = f" at {site}" if site else ""
        recs = [
            f"Allocate once and reuse{where}: create the largest buffer outside the loop (torch.empty(max_size, "
            f"device='cuda')) and take views of it; pid {s.pid} called {main.op} {main.calls:,} times "
            f"({nbytes / 1e9:,.1f} GB)."
        ]
        if empty_cache:
            recs.append(
                "Do not call torch.cuda.empty_cache() inside the loop: it returns the cached blocks, so every next "
                "allocation goes back to cudaMalloc."
            )
        if n_async:
            recs.append(
                f"{n_async:,} of the calls are stream-ordered (cudaMallocAsync/cudaFreeAsync): raise the pool's "
                "release threshold (cudaMemPoolAttrReleaseThreshold) so freed memory stays in the pool."
            )
        recs.append(
            "If block sizes vary, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so the caching allocator "
            "can grow segments instead of allocating new ones."
        )
        out.append(
            ctx.chain(
                s,
                category=CATEGORY,
                severity=sev,
                cost_ns=cost,
                op=main.op,
                culprit=Culprit(kind="code", pid=s.pid, tid=s.tid, comm=t.comm, relation="own_thread", code_site=site),
                summary=(
                    f"Thread {s.tid} (pid {s.pid}) made {calls:,} allocation/free calls ({rate:,.0f}/s){where} and "
                    f"spent {cost / MS:,.0f} ms in them, {s.share(cost):.0%} of its steps' time."
                ),
                evidence=AllocationChurnEvidence(
                    alloc_ms=round(t.ns("alloc") / MS, 1),
                    free_ms=round(t.ns("free") / MS, 1),
                    calls=calls,
                    calls_per_s=round(rate, 1),
                    async_calls=n_async,
                    bytes=nbytes,
                    ops=op_times(allocs + frees),
                    top_sites=sites,
                    empty_cache_in_free_stacks=empty_cache,
                ),
                recommendations=recs,
            )
        )
    return out
