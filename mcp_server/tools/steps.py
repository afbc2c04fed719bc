"""The tools about one thread's loop and how threads compare: its steps (get_step_series), its waits by waker
(get_waits), and processes or threads side by side (compare_processes). Thin views over the analyses."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult
from pydantic import Field

from mcp_server.budget import cancellable
from mcp_server.replies import compact_reply
from mcp_server.state import state
from tracer.analysis.side_by_side import SideBySide
from tracer.analysis.side_by_side import compare_processes as side_by_side
from tracer.analysis.steps import StepSeries, step_series
from tracer.analysis.waits import Waits, waits

# pids one compare_processes call may name (it shows 8 columns): 2,000 of them kept the server busy 20 s (issue 30)
MAX_PIDS = 64


def get_step_series(
    pid: Annotated[
        int | None, Field(description="This process's main CUDA thread; omit for the training thread.")
    ] = None,
    tid: Annotated[int | None, Field(description="This thread.")] = None,
    detail: Annotated[bool, Field(description="Every step's ms too (at most 5000).")] = False,
    *,
    ctx: Context,
) -> Annotated[CallToolResult, StepSeries]:
    """Which steps are slow, and is it periodic? The thread's steps, each ended by its waits for the GPU (the
    loop's period: waits per step found from the repeating sequence of wait sites), the typical step and its
    jitter, the slow steps, their period ("every 40th step: +54.1 ms, 10 steps") with what those steps spent
    the extra time on (blocked and who woke it, waiting for a CPU, off CPU in calls, running), and the other
    slow steps. A thread that never waits for the GPU gets a per-second series (basis = seconds). Cannot see
    which code ran in a slow step. Next: get_waits for the thread's waits by waker; get_time_breakdown(tid) for
    its parts; get_stacks(op) for the marker op.
    """
    st = state(ctx)
    with st.connection() as c:
        st.check(c, pid=pid, tid=tid)
        return compact_reply(step_series(c, pid=pid, tid=tid, detail=detail))


def get_waits(
    pid: Annotated[
        int | None,
        Field(
            description="This process's main CUDA thread (a process without CUDA calls, a data worker or a "
            "helper: its main thread); omit for the training thread."
        ),
    ] = None,
    tid: Annotated[int | None, Field(description="This thread (any thread, CUDA or not).")] = None,
    *,
    ctx: Context,
) -> Annotated[CallToolResult, Waits]:
    """How long were the thread's waits, and who ended them? Per waker (a thread of the job, a DataLoader
    worker, another process, or an interrupt named by kind: [timer] = a sleep or timeout expired, [block] = a
    disk I/O completed, [net], [softirq], [irq]): exact wakeups and blocked ms, of which inside CUDA calls,
    the typical and longest single wait and a histogram of wait lengths (from sched: every wait >= 1 ms, a
    sample below). Cannot see what the thread waited on (the lock, the file), only who ended the wait. Next:
    get_step_series for when the waits fall in the loop; get_time_breakdown for the thread's other parts.
    """
    st = state(ctx)
    with st.connection() as c:
        st.check(c, pid=pid, tid=tid)
        return compact_reply(waits(c, pid=pid, tid=tid))


@cancellable
def compare_processes(
    pids: Annotated[
        list[int] | None, Field(description="Processes to set side by side; omit for every CUDA process/rank.")
    ] = None,
    threads_of: Annotated[int | None, Field(description="Instead: the threads of this process, busiest first.")] = None,
    *,
    ctx: Context,
) -> Annotated[CallToolResult, SideBySide]:
    """How do these processes (or threads) compare? One column each (a process by the thread that does its
    work: its main CUDA thread, else its busiest), with its role, top waker and CPU holder and step series
    headline; one row per measure with a value per column: wall ms, CUDA calls, each part's share of its time
    (cpu, launch, sync, ..., runq_*, blocked), faults, steps, steps/s, typical step, slow steps. At most 8
    columns. Cannot see the GPU side of each process. Next: get_step_series(pid) or get_waits(pid) for the
    column that stands out.
    """
    if pids is not None:
        if len(pids) > MAX_PIDS:
            raise ToolError(
                f"{len(pids):,} pids is too many: pass at most {MAX_PIDS} (the answer shows "
                "8 columns); omit pids for every CUDA process"
            )
        pids = list(dict.fromkeys(pids))  # a pid named twice is one column
    st = state(ctx)
    with st.connection() as c:
        for p in [*(pids or []), *([threads_of] if threads_of is not None else [])]:
            st.check(c, pid=p)
        return compact_reply(side_by_side(c, pids=pids or None, threads_of=threads_of))
