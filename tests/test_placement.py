"""tracer/recorder/placement.py: placement rows at attach and exec (one per change), per-CPU idle samples."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.support.need import need
from tracer.recorder.placement import PlacementWatch


def test_rows_only_when_the_placement_or_its_setter_changes():
    w = PlacementWatch()
    me = os.getpid()
    w.note(me, 0)
    w.note(me, 5, exec_from="/usr/bin/taskset")
    w.note(me, 6, exec_from="/usr/bin/taskset")  # the same exec, seen twice in one batch
    w.recheck([me], 9, lambda pid: None)  # unchanged at the end: no row
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


def test_a_forked_child_pinned_later_gets_a_row_at_the_end():
    # GIVEN this process read at attach, and a child of it that pinned itself after the fork (worker_init_fn)
    need(len(os.sched_getaffinity(0)) >= 2, "needs 2 CPUs (a child pinned to fewer than its parent)")
    w = PlacementWatch()
    me = os.getpid()
    w.note(me, 0)
    w.take_rows()
    cpu = min(os.sched_getaffinity(0))
    p = subprocess.Popen([sys.executable, "-c", f"import os,time; os.sched_setaffinity(0, {{{cpu}}}); time.sleep(5)"])
    q = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        deadline = time.monotonic() + 5
        while os.sched_getaffinity(p.pid) != {cpu} and time.monotonic() < deadline:
            time.sleep(0.02)
        w.recheck([p.pid, q.pid], 7, lambda pid: me if pid in (p.pid, q.pid) else None)
    finally:
        for c in (p, q):
            c.kill()
            c.wait()
    # THEN the pinned child has a row of its own; the other still has its parent's placement, with no row
    rows = w.take_rows()
    assert rows["pid"] == [p.pid] and rows["cpus_allowed"] == [str(cpu)]
