"""tracer/recorder/placement.py: placement rows at attach and exec (one per change), per-CPU idle samples."""

from __future__ import annotations

import os
import time

from tracer.recorder.placement import PlacementWatch


def test_rows_only_when_the_placement_or_its_setter_changes():
    w = PlacementWatch()
    me = os.getpid()
    w.note(me, 0)
    w.note(me, 5, exec_from="/usr/bin/taskset")
    w.note(me, 6, exec_from="/usr/bin/taskset")  # the same exec, seen twice in one batch
    w.recheck([me], 9)  # unchanged at the end: no row
    rows = w.take_rows()
    assert rows["ts_ns"] == [0, 5] and rows["exec_from"] == [None, "/usr/bin/taskset"]
    assert rows["cpus"][0] == len(os.sched_getaffinity(me))
    assert w.take_rows()["pid"] == []


def test_idle_samples_per_cpu_add_up_to_the_interval():
    w = PlacementWatch()
    time.sleep(0.3)
    _, idle = w.sample(1)
    n = len(set(idle["cpu"]))
    assert n >= len(os.sched_getaffinity(0))
    total = sum(idle["idle_ns"]) + sum(idle["busy_ns"])
    # /proc/stat counts in clock ticks: n CPUs x 0.3 s, within a few ticks each
    assert abs(total - n * 0.3e9) <= n * 0.05e9
