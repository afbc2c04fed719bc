"""The code-path tools: the stacks into one CUDA op (get_stacks), the threads' stacks outside CUDA calls, on CPU
or blocked (get_thread_stacks), and what each thread was doing at its latest snapshot (get_thread_dump)."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from mcp_server.state import state
from tracer.analysis.stacks import StacksResult, UnknownOp, top_stacks
from tracer.analysis.thread_dump import ThreadDump, thread_dump
from tracer.analysis.thread_stacks import MODES, NoStacks, ThreadStacksResult, thread_stacks
from tracer.errors import echo


def get_stacks(
    op: Annotated[str, Field(description="CUDA op name exactly as in get_trace_stats, e.g. cudaMalloc.")],
    pid: Annotated[int | None, Field(description="Only calls from this process.")] = None,
    limit: Annotated[int, Field(description="Most stacks to return (1-100).", ge=1, le=100)] = 10,
    *,
    ctx: Context,
) -> StacksResult:
    """Code paths that called one CUDA op, ranked by calls, from the Python file:line through native code
    to the CUDA API.

    Per stack: calls, avg/min/max µs, total bytes, pids, and frames outermost first (kind python | native |
    cuda, module, function, file, line). Calls without a captured stack are grouped as "(no stack
    captured)"; coverage says how many calls have a stack and why the others have none (duty_cycle: the
    launch probes were off; row_budget: counted, not stored; stack_budget: stored, not walked, as launches
    are walked 1 in 8; lost_walk). Counts are of stored calls; op_calls_total is the exact count. Cannot
    see code outside CUDA calls. Next: run_sql on cuda_calls WHERE stack_id = N for when those calls
    happened.
    """
    st = state(ctx)
    with st.connection() as c:
        st.check(c, pid=pid)
        try:
            return top_stacks(c, op, pid=pid, limit=limit)
        except UnknownOp as e:
            known = ", ".join(e.known) or "(none)"
            raise ToolError(
                f"unknown op {echo(op)}; traced ops: {known}. Call get_stacks with one of those names."
            ) from None


def get_thread_stacks(
    mode: Annotated[
        str, Field(description="on-cpu: where CPU time went (samples); off-cpu: where threads blocked (exact).")
    ] = "off-cpu",
    pid: Annotated[int | None, Field(description="Only this process.")] = None,
    tid: Annotated[int | None, Field(description="Only this thread (e.g. a chain's tid).")] = None,
    limit: Annotated[int, Field(description="Most stacks to return (1-100).", ge=1, le=100)] = 10,
    *,
    ctx: Context,
) -> ThreadStacksResult:
    """Stacks of the job's threads outside the moments of their CUDA calls, most time first: on CPU (perf
    samples at session.sample_hz, every thread of the job) or blocked (every blocking switch, exact ns).

    Per stack: thread (its OS name, else 'thread TID (hottest function, file:line)'), site (innermost user
    Python line), ms, share of the thread's time in that mode, and frames outermost first. Off-CPU stacks
    carry the sleep state (S | D) and what they wait in: gil (CPython's interpreter lock), lock
    (threading.Lock, queues), io (disk, fsync), sleep, cuda (inside a call), other (pipes, sockets). Use it
    for time the breakdown shows outside calls (cpu, blocked) and chains name by line (gil_contention,
    blocking_io, host_python). Next: get_stacks(op) for code paths into a CUDA op.
    """
    if mode not in MODES:
        raise ToolError(f"unknown mode {echo(mode)}; use one of {', '.join(MODES)}.")
    st = state(ctx)
    with st.connection() as c:
        st.check(c, pid=pid, tid=tid)
        try:
            return thread_stacks(c, mode, pid=pid, tid=tid, limit=limit)
        except NoStacks as e:
            raise ToolError(f"{e}: use get_time_breakdown and get_waits instead.") from None


def get_thread_dump(
    pid: Annotated[int | None, Field(description="Only this process.")] = None,
    at_ms: Annotated[
        float | None, Field(description="The snapshots read at or before this ms since the start; omit: latest.")
    ] = None,
    *,
    ctx: Context,
) -> ThreadDump:
    """What each thread of the job was doing, from snapshots the recorder read without stopping it (at attach,
    when a thread had not run for a second, at the end): per thread its rank, kernel state (running, or
    sleeping in which system call on which kernel wait channel), how long it had been blocked (blocked_ms,
    since it last ran, approximate to a few ms), the native function of its system call, and its Python
    frames innermost first. Answers "where is a hung thread stuck, since when", also for a thread blocked
    since before the recording began (no switch-out, so no off-CPU stack). Empty with a note for recordings
    made before snapshots existed. Next: get_thread_stacks for time spent, get_ranks for a job's ranks."""
    st = state(ctx)
    with st.connection() as c:
        return thread_dump(c, pid=pid, at_ms=at_ms)
