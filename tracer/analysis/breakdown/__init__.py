"""Where each CUDA thread's wall time went: on CPU, inside CUDA calls by class, waiting for a CPU by holder,
blocked (with the waker), plus page faults, in total and per time bucket; and what the tracer itself cost.

Source: ``thread_breakdown``, counted in kernel per (thread, second) with parts that add up to ``wall_ns``
(:data:`tracer.analysis.taxonomy.PART_NAMES`); ``preemptors`` (by waiting thread) names who held the CPU,
``thread_wakers`` who ended each blocked interval. A recording without them (made before the time accounting
existed, or by a recorder that did not run it) gets an *estimate* (``basis = "estimated"``) from ``op_stats``,
``sched_stats`` and the stored calls; it has no faults and no wakers, and says so in ``note``.

The modules, from the model up:
- :mod:`.thread_time`: :class:`ThreadTime`, one thread's time per second, the model the breakdown, the chains
  and compare share, and the training-thread rule;
- :mod:`.holders`: who held the CPU and who woke the thread (the chains' culprits come from them too);
- :mod:`.estimate`: the estimate for recordings without ``thread_breakdown``;
- :mod:`.load`: :func:`load_thread_times`, the exact accounting as stored or the estimate;
- :mod:`.tracer_cost`: the tracer's own cost;
- :mod:`.records`: the records ``tracer breakdown`` and its MCP tool return;
- :mod:`.report`: :func:`time_breakdown`, the analysis.

The names below are this package's face for the CLI, the MCP server and compare; inside ``tracer.analysis`` a
module imports from the submodule that holds what it needs.
"""

from __future__ import annotations

from tracer.analysis.breakdown.holders import Holder, HolderClass, Waker, holder_class, holders_of, wakers_of
from tracer.analysis.breakdown.load import NO_BREAKDOWN, load_thread_times
from tracer.analysis.breakdown.records import (
    AddUp,
    Breakdown,
    PartTime,
    ThreadBreakdown,
    ThreadSummary,
    TimeBucket,
    parts_of,
)
from tracer.analysis.breakdown.report import MAX_BUCKETS, auto_bucket, time_breakdown
from tracer.analysis.breakdown.thread_time import COUNTS, FIELDS, Basis, ThreadTime, ThreadTimes
from tracer.analysis.breakdown.tracer_cost import TracerCost, tracer_cost

__all__ = [
    "COUNTS",
    "FIELDS",
    "MAX_BUCKETS",
    "NO_BREAKDOWN",
    "AddUp",
    "Basis",
    "Breakdown",
    "Holder",
    "HolderClass",
    "PartTime",
    "ThreadBreakdown",
    "ThreadSummary",
    "ThreadTime",
    "ThreadTimes",
    "TimeBucket",
    "TracerCost",
    "Waker",
    "auto_bucket",
    "holder_class",
    "holders_of",
    "load_thread_times",
    "parts_of",
    "time_breakdown",
    "tracer_cost",
    "wakers_of",
]
