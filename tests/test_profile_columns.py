"""recorder/profile_columns.py: drained off-CPU and sample aggregates become offcpu_stacks / cpu_samples rows."""

from __future__ import annotations

import numpy as np

from tracer.recorder import events
from tracer.recorder.columns import Aggregates
from tracer.recorder.profile_columns import cpu_sample_columns, offcpu_stack_columns


def test_offcpu_rows_name_interrupt_wakers_and_states():
    keys = np.zeros(3, dtype=events.OFFCPU_KEY_DTYPE)
    vals = np.zeros(3, dtype=events.OFFCPU_VAL_DTYPE)
    keys["stack_ref"], keys["tid"], keys["sec"] = [11, 12, 0], [7, 7, 8], [2, 2, 3]
    keys["state"] = [events.C.SCHED_SLEEP, events.C.SCHED_IO, events.C.SCHED_SLEEP]
    keys["waker_irq"] = [1, 5, 0]  # [timer], [block], a task
    keys["waker_pid"] = [0, 0, 40]
    vals["pid"], vals["count"], vals["blocked_ns"] = 5, [3, 1, 2], [5_000_000, 9_000_000, 7]
    vals["waker_comm"] = [b"[timer]", b"[block]", b"python3"]
    vals["waker_tid"] = [0, 0, 41]
    cols = offcpu_stack_columns(Aggregates(keys, vals), [1, 2, None])
    assert cols["state"] == ["S", "D", "S"] and cols["waker_comm"] == ["[timer]", "[block]", "python3"]
    assert cols["stack_id"].to_pylist() == [1, 2, None] and cols["waker_tid"].to_pylist() == [None, None, 41]
    assert cols["blocked_ns"].tolist() == [5_000_000, 9_000_000, 7] and cols["intervals"].tolist() == [3, 1, 2]


def test_samples_stand_for_their_period():
    keys = np.zeros(2, dtype=events.SAMPLE_KEY_DTYPE)
    vals = np.zeros(2, dtype=events.SAMPLE_VAL_DTYPE)
    keys["tid"], keys["kernel"], keys["in_call"] = [7, 8], [0, 1], [1, 0]
    vals["pid"], vals["count"] = 5, [99, 3]
    cols = cpu_sample_columns(Aggregates(keys, vals), [4, None], period_ns=10_101_010)
    assert cols["samples"].tolist() == [99, 3] and cols["cpu_ns"].tolist() == [999_999_990, 30_303_030]
    assert cols["kernel"].tolist() == [False, True] and cols["in_call"].tolist() == [True, False]
