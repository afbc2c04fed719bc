"""tracer/recorder/proctree.py: the process tree from lifecycle event batches (no BPF)."""

from __future__ import annotations

import numpy as np

from tracer.recorder import events
from tracer.recorder.proctree import ProcessTree, ProcInfo

START = 5_000_000_000


def _ev(*rows: tuple) -> np.ndarray:
    ev = np.zeros(len(rows), dtype=events.PROC_DTYPE)
    for i, (kind, pid, ppid, ts, comm, extra) in enumerate(rows):
        ev[i]["kind"], ev[i]["pid"], ev[i]["ppid"], ev[i]["ts_ns"], ev[i]["comm"] = kind, pid, ppid, START + ts, comm
        for k, v in extra.items():
            ev[i][k] = v
    return ev


def test_fork_exec_rename_exit_and_thread_ends() -> None:
    # GIVEN a tree whose root 100 (a pid that does not exist here) forks a worker that renames itself and exits
    tree = ProcessTree(START)
    tree.procs[100] = ProcInfo(100, 1, "python", "python train.py", 0)
    C = events.C
    ch = tree.apply(
        _ev(
            (C.PROC_FORK, 101, 100, 10, b"python", {"child": 101}),
            (C.PROC_RENAME, 101, 0, 11, b"pt_data_worker", {}),
            (C.PROC_EXEC, 100, 0, 12, b"python3", {}),
            (C.PROC_THREAD_END, 101, 0, 30, b"pt_data_worker", {"tid": 102, "aux": START + 15}),
            (C.PROC_EXIT, 101, 0, 31, b"pt_data_worker", {"exit_code": 0}),
        )
    )
    # THEN the worker is known with its new name, exit time and code; the thread's span is kept
    w = tree.procs[101]
    assert (w.ppid, w.comm, w.exit_ns, w.exit_code) == (100, "pt_data_worker", 31, 0)
    assert ch.forks == [(100, 101)] and ch.execs == [100] and ch.exits == [101]
    t = tree.threads[102]
    assert (t.pid, t.first_ns, t.end_ns, t.exited) == (101, 15, 30, True)
    assert tree.ancestors(101) == [101, 100]
    assert tree.alive() == [100]


def test_tracer_processes_are_not_targets() -> None:
    tree = ProcessTree(START)
    tree.add_tracer(4242, "tracer")
    assert tree.targets() == [] and tree.procs[4242].role == "tracer"
