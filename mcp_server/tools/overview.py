"""The overview tools: the recording at a glance (get_trace_stats), and where a thread's time went
(get_time_breakdown). Each is a thin view: it checks its arguments and returns one analysis's record."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from mcp_server.replies import compact_reply
from mcp_server.state import state
from mcp_server.tools.selectors import ContainerArg, RankArg
from tracer.analysis.breakdown import Breakdown, time_breakdown
from tracer.analysis.stats import TraceStats, trace_stats


def get_trace_stats(
    pid: Annotated[int | None, Field(description="Only this process; omit for the whole traced tree.")] = None,
    rank: RankArg = None,
    container: ContainerArg = None,
    detail: Annotated[
        bool, Field(description="Every process group, and one row per process (default: the top groups).")
    ] = False,
    *,
    ctx: Context,
) -> Annotated[CallToolResult, TraceStats]:
    """Overview of the recording. Call this first.

    Returns the environment (GPU, driver, CPU, RAM, kernel, Python), events traced/stored/lost, per CUDA op
    (runtime and driver layers kept apart) calls, p50/p95/p99/max in µs from the exact in-kernel histogram and
    the tail ratio p99/p50, the processes grouped by (comm, parent, role, rank) with CUDA calls, off-CPU
    seconds and worst stall, every thread busy on CPU (CUDA or not) with where its time went, host peaks,
    where the training thread's time went, and the causal chains by severity. Next: get_causal_chains for the
    why, get_time_breakdown for a thread, get_stacks(op) for an op with a large tail.
    """
    st = state(ctx)
    with st.connection() as c:
        pid = st.job_pid(c, pid, rank, container)
        st.check(c, pid=pid)
        return compact_reply(trace_stats(c, pid=pid, detail=detail))


def get_time_breakdown(
    pid: Annotated[int | None, Field(description="Only this process's threads; omit for the whole tree.")] = None,
    rank: RankArg = None,
    container: ContainerArg = None,
    tid: Annotated[int | None, Field(description="Only this thread (any thread, CUDA or not).")] = None,
    bucket_s: Annotated[
        int, Field(description="Bucket width in seconds for the per-bucket rows; 0 picks about 60 buckets.", ge=0)
    ] = 0,
    *,
    ctx: Context,
) -> Breakdown:
    """Where each CUDA thread's wall time went, the training thread (most launch + sync time) first.

    Per thread, in ms and as shares that add up to its wall time: cpu (Python/host work outside CUDA calls),
    launch, sync (waiting for the GPU: synchronize and synchronous copies such as .item()), alloc, free,
    copy, other, runq_self / runq_tree / runq_other / runq_tracer (runnable, waiting for a CPU held by its own
    process, its own workers, other processes, the tracer), blocked (sleep, futex such as the GIL, I/O).
    Also who held the CPU (holders), who woke it (wakers: the GIL holder, a DataLoader worker), page faults
    and page allocation, a coverage check (check.gap_pct), per-bucket shares for the first thread, every
    thread of its process in brief (the culprit of a fault storm is often a thread with no CUDA call), and the
    tracer's own cost. basis = estimated on a recording made before the time accounting existed. Next:
    get_causal_chains for the causes ranked by the time they cost.
    """
    st = state(ctx)
    with st.connection() as c:
        pid = st.job_pid(c, pid, rank, container)
        st.check(c, pid=pid, tid=tid, bucket_s=bucket_s)
        return time_breakdown(c, pid=pid, tid=tid, bucket_s=bucket_s)
