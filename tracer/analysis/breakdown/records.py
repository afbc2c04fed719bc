"""The breakdown's records (what ``tracer breakdown --json`` and the MCP tool return) and :func:`parts_of`,
which turns a thread's time into them."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.breakdown.holders import Holder, Waker
from tracer.analysis.breakdown.thread_time import MS, ThreadTime
from tracer.analysis.breakdown.tracer_cost import TracerCost
from tracer.analysis.taxonomy import PART_NAMES


class PartTime(Record):
    """One part of a thread's wall time. Parts: cpu (on CPU outside CUDA calls), launch, sync (waiting for the
    GPU: synchronize and synchronous copies), alloc, free, copy (async copies), other (memset, stream waits),
    runq_self / runq_tree / runq_other / runq_tracer (runnable, waiting for a CPU held by its own process, its
    own workers, other processes, the tracer), blocked (sleep, futex such as the GIL or a queue, I/O)."""

    part: Annotated[str, Field(description=" | ".join(PART_NAMES))]
    ms: Annotated[float, Field(description="time in the part, ms")]
    share: Annotated[float, Field(description="of the thread's accounted wall time, 0..1")]


class TimeBucket(Record):
    """One time bucket of a thread's breakdown (only non-zero parts are listed)."""

    start_s: Annotated[float, Field(description="bucket start, seconds since session start")]
    wall_ms: float
    ms: Annotated[dict[str, float], Field(description="part -> ms")]
    share: Annotated[dict[str, float], Field(description="part -> share of the bucket's wall time")]
    faults: int
    page_alloc_bytes: int


class AddUp(Record):
    """Do the per-second parts cover the thread's span? (exact recordings only)"""

    span_ms: Annotated[float, Field(description="threads.end_ns - threads.first_ns, ms")]
    accounted_ms: Annotated[float, Field(description="sum of the seconds' wall_ns, ms")]
    gap_ms: Annotated[float, Field(description="span - accounted, ms")]
    gap_pct: Annotated[float, Field(description="gap as a percent of the span")]
    parts_mismatch_ms: Annotated[float, Field(description="sum of the parts - sum of wall_ns (0 when consistent)")]


# the thread by what it runs (tracer.analysis.stack_time.thread_name), for both records
NAME = (
    "the thread by what it runs: its OS name where that says something, 'pin_memory (1007)'; else (python3, "
    "pt_main_thread, its process's name) its tid and the Python function it was sampled in most, 'thread 1007 "
    "(aggregate_metrics, metrics.py:15)', or 'thread 1007' without samples"
)


class CpuWait(Record):
    """The thread's whole wait for a CPU: outside CUDA calls (the runq parts) and inside them (in the call
    parts, mostly ``sync``: a sync's wakeup that waited for the CPU's holder), by whose the CPU was."""

    ms: Annotated[float, Field(description="waiting for a CPU in all, ms: the runq parts plus in_calls_ms")]
    share: Annotated[float, Field(description="of the thread's accounted wall time, 0..1")]
    in_calls_ms: Annotated[float, Field(description="of ms, inside CUDA calls (counted in their parts, e.g. sync)")]
    by_holder_ms: Annotated[
        dict[str, float],
        Field(description="holder class -> ms, inside calls and outside (the in-call part split by preemptors)"),
    ]


class ThreadSummary(Record):
    """One thread of the process, in brief: the culprit of a fault storm is often a thread with no CUDA call."""

    pid: int
    tid: int
    comm: str
    name: Annotated[str, Field(description=NAME)]
    cuda_calls: int
    wall_ms: float
    cpu_ms: Annotated[float, Field(description="on CPU outside CUDA calls, ms")]
    in_calls_ms: float
    runq_ms: float
    blocked_ms: float
    faults: Annotated[int, Field(description="user page faults")]
    page_alloc_bytes: Annotated[int, Field(description="bytes of pages allocated in its context")]
    reclaim_ms: Annotated[float, Field(description="time in direct reclaim, ms")]


class ThreadBreakdown(Record):
    """Where one CUDA thread's wall time went, in total and per bucket."""

    pid: int
    tid: int
    comm: Annotated[str, Field(description="thread name (the OS's)")]
    name: Annotated[str, Field(description=NAME)]
    process_comm: str
    role: Annotated[
        str,
        Field(
            description="training (the training thread) | driver (another process's main CUDA thread) | cuda "
            "(another CUDA thread) | thread (no CUDA call; shown when asked for by tid)"
        ),
    ]
    cuda_calls: int
    first_s: float
    end_s: float
    exited: bool
    wall_ms: Annotated[float, Field(description="accounted wall time, ms (the sum of the parts)")]
    parts: Annotated[list[PartTime], Field(description="every part, in a fixed order; shares sum to 1")]
    in_call_off_cpu_ms: Annotated[
        float, Field(description="of the time inside calls, off CPU (already in the call parts)")
    ]
    in_call_runq_ms: Annotated[float, Field(description="of that, waiting for a CPU")]
    cpu_wait: Annotated[CpuWait, Field(description="waiting for a CPU in all, inside calls too")]
    io_ms: Annotated[float, Field(description="of blocked, uninterruptible: disk I/O, page-fault I/O, mmap lock")]
    faults: int
    page_alloc_bytes: int
    reclaim_ms: float
    holders: Annotated[list[Holder], Field(description="who held the CPU while it waited, most runq first")]
    holders_note: str
    wakers: Annotated[list[Waker], Field(description="who woke it, most blocked time first")]
    check: Annotated[AddUp | None, Field(description="coverage check (exact recordings)")]
    buckets: Annotated[list[TimeBucket], Field(description="per bucket (the training thread, or --tid)")]


class Breakdown(Record):
    """Where the CUDA threads' time went (training thread first), every thread of its process in brief, and the
    tracer's own cost."""

    basis: Annotated[str, Field(description="exact (thread_breakdown) | estimated (older recording) | none")]
    note: Annotated[str, Field(description="caveats of the basis; empty when exact")]
    pid: Annotated[int | None, Field(description="the pid filter applied")]
    tid: Annotated[int | None, Field(description="the tid filter applied")]
    bucket_s: Annotated[int, Field(description="bucket width in seconds")]
    training_tid: Annotated[int | None, Field(description="the training thread: most launch + sync time")]
    threads: Annotated[list[ThreadBreakdown], Field(description="CUDA threads, the training thread first")]
    process_threads: Annotated[
        list[ThreadSummary],
        Field(description="every thread of the training thread's process (or --pid's), most page allocation first"),
    ]
    tracer: TracerCost


def parts_of(t: ThreadTime, row: dict[str, int] | None = None) -> list[PartTime]:
    """Return the parts of ``row`` (default: the thread's totals) as PartTime, in PART_NAMES order."""
    row = row if row is not None else t.total
    wall = row.get("wall", 0)
    return [
        PartTime(part=p, ms=round(row.get(p, 0) / MS, 3), share=round(row.get(p, 0) / wall, 4) if wall else 0.0)
        for p in PART_NAMES
    ]
