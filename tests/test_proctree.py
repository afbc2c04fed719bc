"""tracer/recorder/proctree.py: the process tree from lifecycle event batches (no BPF)."""

from __future__ import annotations

import numpy as np

from tracer.recorder import columns, events, rankenv
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
    assert tree.alive() == [100]


def test_tracer_processes_are_not_targets() -> None:
    tree = ProcessTree(START)
    tree.add_tracer(4242, "tracer")
    assert tree.targets() == [] and tree.procs[4242].role == "tracer"


def _churn(tree: ProcessTree, parent: int, pids: range, t0: int) -> None:
    """``parent`` forks each of ``pids``, which execs, ends its one thread and exits, 10 ns apart."""
    C = events.C
    rows = []
    for i, pid in enumerate(pids):
        ts = t0 + 10 * i
        rows += [
            (C.PROC_FORK, pid, parent, ts, b"python", {"child": pid}),
            (C.PROC_EXEC, pid, 0, ts + 1, b"true", {}),
            (C.PROC_THREAD_END, pid, 0, ts + 2, b"true", {"tid": pid, "aux": START + ts}),
            (C.PROC_EXIT, pid, 0, ts + 3, b"true", {"exit_code": 0}),
        ]
    tree.apply(_ev(*rows))


def test_exited_processes_retire_and_the_tree_is_back_to_its_size() -> None:
    # GIVEN a root that forked 1,000 short-lived processes, all exited
    tree = ProcessTree(START)
    tree.procs[100] = ProcInfo(100, 1, "python", "python churn.py", 0)
    before = (len(tree.procs), len(tree.threads))
    _churn(tree, 100, range(1000, 2000), 100)
    assert len(tree.procs) == 1001 and len(tree.threads) == 1000
    # WHEN retiring before the exits: nothing leaves (their last events may still be on their way)
    assert tree.retire(before_ns=100).procs == [] and len(tree.procs) == 1001
    # WHEN retiring after them
    gone = tree.retire(before_ns=1_000_000)
    # THEN the tree holds what it held before, and every retired row is final: its exit, code and span
    assert (len(tree.procs), len(tree.threads)) == before
    assert sorted(p.pid for p in gone.procs) == list(range(1000, 2000))
    assert all(p.exit_ns is not None and p.exit_code == 0 and p.comm == "true" for p in gone.procs)
    assert all(t.exited and t.end_ns is not None for t in gone.threads) and len(gone.threads) == 1000
    assert tree.target_count() == 1001 and tree.alive() == [100]


def test_a_parent_stays_while_a_child_is_in_the_tree() -> None:
    # GIVEN 100 forked 101, which forked 102; 101 exited, 102 still runs
    tree = ProcessTree(START)
    tree.procs[100] = ProcInfo(100, 1, "python", "python train.py", 0)
    C = events.C
    tree.apply(
        _ev(
            (C.PROC_FORK, 101, 100, 10, b"python", {"child": 101}),
            (C.PROC_FORK, 102, 101, 11, b"python", {"child": 102}),
            (C.PROC_EXIT, 101, 0, 12, b"python", {"exit_code": 0}),
        )
    )
    # THEN 101 stays (the walk up from 102 goes through it) until 102 has left too
    assert tree.retire(before_ns=1_000).procs == []
    assert (tree.procs[102].ppid, tree.procs[101].ppid) == (101, 100)
    tree.apply(_ev((C.PROC_EXIT, 102, 0, 20, b"python", {"exit_code": 0})))
    assert [p.pid for p in tree.retire(before_ns=1_000).procs] == [102]
    assert [p.pid for p in tree.retire(before_ns=1_000).procs] == [101]


def test_a_reused_pid_gets_a_record_of_its_own() -> None:
    # GIVEN pid 101 exited, and a new process got pid 101 before the first was retired (pids wrap at pid_max)
    tree = ProcessTree(START)
    tree.procs[100] = ProcInfo(100, 1, "python", "python churn.py", 0)
    _churn(tree, 100, range(101, 102), 10)
    tree.apply(_ev((events.C.PROC_FORK, 101, 100, 500, b"python", {"child": 101})))
    # THEN the new one is in the tree, and the old one's row comes out at the next retirement, however early
    assert tree.procs[101].first_ns == 500 and tree.procs[101].exit_ns is None
    (old,) = tree.retire(before_ns=0).procs
    assert (old.pid, old.first_ns, old.exit_ns) == (101, 10, 13)


def test_a_reused_pid_that_joins_the_node_agent_gets_a_record_of_its_own() -> None:
    # GIVEN pid 101 exited, not yet retired, and a process reusing pid 101 opens a CUDA library (no fork was seen)
    tree = ProcessTree(START)
    tree.procs[100] = ProcInfo(100, 1, "python", "python churn.py", 0)
    _churn(tree, 100, range(101, 102), 10)
    tree.release_exited(101)
    tree.release_exited(100)  # alive: it stays
    tree.add_target(101, ppid=1, first_ns=700)
    # THEN the new one has a record of its own, and the old one's row comes out at the next retirement
    assert tree.procs[101].first_ns == 700 and tree.procs[101].exit_ns is None and 100 in tree.procs
    (old,) = tree.retire(before_ns=0).procs
    assert (old.pid, old.first_ns, old.exit_ns) == (101, 10, 13)


def test_a_launcher_is_known_after_its_ranks_left() -> None:
    # GIVEN torchrun's agent 100 and its rank 101, which exited and retired
    tree = ProcessTree(START)
    tree.procs[100] = ProcInfo(100, 1, "pt_elastic", "torchrun train.py", 0)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "j1", "MASTER_ADDR": "x"}
    tree.procs[101] = ProcInfo(101, 100, "python", "python train.py", 5, dist=rankenv.identity(env))
    tree.procs[101].exit_ns = 50
    assert [p.pid for p in tree.retire(before_ns=100).procs] == [101]
    # THEN the agent's row, written without its rank beside it, still names it the launcher
    assert columns.process_columns(tree.procs.values())["launcher"] == ["torchrun"]


def test_exits_hidden_by_lost_events_are_noted() -> None:
    tree = ProcessTree(START)
    tree.procs[100] = ProcInfo(100, 1, "python", "python churn.py", 0)
    tree.procs[101] = ProcInfo(101, 100, "true", "true", 5)  # its exit event was lost
    assert tree.note_unseen_exits(77, alive=lambda pid: pid == 100) == 1
    assert tree.procs[101].exit_ns == 77 and tree.procs[100].exit_ns is None
    assert [p.pid for p in tree.retire(before_ns=100).procs] == [101]


def test_an_exec_keeps_what_ran_before_it() -> None:
    # GIVEN a launched `taskset -c 0 python train.py`: two execs read in one batch, after both happened (/proc
    # shows the last image only)
    tree = ProcessTree(START)
    tree.procs[100] = ProcInfo(100, 1, "tracer", "tracer record -- taskset -c 0 python train.py", 0)
    C = events.C
    ch = tree.apply(
        _ev(
            (C.PROC_EXEC, 100, 0, 10, b"taskset", {"filename": b"/usr/bin/taskset"}),
            (C.PROC_EXEC, 100, 0, 11, b"python3", {"filename": b"/usr/bin/python3"}),
        )
    )
    # THEN the second exec's predecessor is the launcher's file (the placement's setter), not the job itself
    assert ch.execs == [100, 100]
    assert ch.exec_from[100] == "/usr/bin/taskset"
