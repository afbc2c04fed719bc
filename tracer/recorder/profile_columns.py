"""Column builders of the stacks outside calls: drained off-CPU and on-CPU stack aggregates (probes/offcpu.bpf.c,
probes/profile.bpf.c) -> the ``offcpu_stacks`` and ``cpu_samples`` tables.

Pure functions of the drained arrays and the stack ids the caller resolved (recorder/stack_resolver.py
``plain_stack_ids``), like recorder/columns.py, so the rows are tested without root.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from tracer.recorder import events
from tracer.recorder.columns import Aggregates, Columns
from tracer.vocabulary import WAKER_KINDS

# offcpu_key.state: the sleep state as ps(1) spells it
_STATES = {events.C.SCHED_SLEEP: "S", events.C.SCHED_IO: "D"}


def offcpu_stack_columns(agg: Aggregates, stack_ids: Sequence[int | None]) -> Columns:
    """offcpu_stacks columns of drained (stack, thread, second, state, waker) rows, one stack_id per row."""
    k, v = agg.keys, agg.vals
    irq = k["waker_irq"].tolist()
    comms = events.cstr(v["waker_comm"])
    return {
        "sec": k["sec"].astype(np.int64),
        "pid": v["pid"].astype(np.int32),
        "tid": k["tid"].astype(np.int32),
        "stack_id": pa.array(list(stack_ids), type=pa.int64()),
        "state": [_STATES.get(s, "S") for s in k["state"].tolist()],
        "in_call": k["in_call"].astype(bool),
        # no wakeup seen (the thread was woken before the probes were live): NULL
        "waker_pid": pa.array(k["waker_pid"].astype(np.int32), mask=np.array([not c for c in comms], dtype=bool)),
        "waker_tid": pa.array(v["waker_tid"].astype(np.int32), mask=v["waker_tid"] == 0),
        "waker_comm": [WAKER_KINDS.get(i, c) if i else (c or None) for i, c in zip(irq, comms, strict=True)],
        "intervals": v["count"].astype(np.int64),
        "blocked_ns": v["blocked_ns"].astype(np.int64),
    }


def cpu_sample_columns(agg: Aggregates, stack_ids: Sequence[int | None], period_ns: int) -> Columns:
    """cpu_samples columns of drained (stack, thread, second) rows; each sample stands for ``period_ns`` of CPU."""
    k, v = agg.keys, agg.vals
    n = v["count"].astype(np.int64)
    return {
        "sec": k["sec"].astype(np.int64),
        "pid": v["pid"].astype(np.int32),
        "tid": k["tid"].astype(np.int32),
        "stack_id": pa.array(list(stack_ids), type=pa.int64()),
        "in_call": k["in_call"].astype(bool),
        "kernel": k["kernel"].astype(bool),
        "samples": n,
        "cpu_ns": n * int(period_ns),
    }
