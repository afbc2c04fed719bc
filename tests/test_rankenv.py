"""tracer/recorder/rankenv.py and its use by the process tree: a process's rank from its launcher's environment,
read at exec and attach, inherited at fork, and the launcher that started the ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from tracer.recorder import columns, events, rankenv
from tracer.recorder.proctree import ProcessTree, ProcInfo
from tracer.recorder.rankenv import RankIdentity

START = 5_000_000_000
# what torchrun 2.13 puts in a rank's environment (from a real rank's /proc/PID/environ, trimmed)
TORCHRUN_RANK_2 = {
    "RANK": "2",
    "LOCAL_RANK": "2",
    "GROUP_RANK": "0",
    "ROLE_RANK": "2",
    "WORLD_SIZE": "3",
    "LOCAL_WORLD_SIZE": "3",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "dd39e6ef-5c7b-46fb-afcf-3e17c0988fbd",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "PATH": "/usr/bin",
}


def test_torchrun_rank():
    d = rankenv.identity(TORCHRUN_RANK_2)
    assert d == RankIdentity(2, 2, 0, 3, "dd39e6ef-5c7b-46fb-afcf-3e17c0988fbd", "torchrun")


def test_mpi_slurm_and_plain_torch_ranks():
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8"}
    ompi["PMIX_NAMESPACE"] = "prterun-host-123@1"
    assert rankenv.identity(ompi) == RankIdentity(5, 1, None, 8, "prterun-host-123@1", "mpirun")
    hydra = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3"}
    assert rankenv.identity(hydra) == RankIdentity(3, 3, None, 4, None, "mpi")
    slurm = {"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "SLURM_NTASKS": "16", "SLURM_NODEID": "1", "SLURM_JOB_ID": "42"}
    assert rankenv.identity(slurm) == RankIdentity(7, 3, 1, 16, "42", "srun")
    # DeepSpeed / Accelerate / a hand-set RANK: torch's variables, the rendezvous address as the job
    plain = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    assert rankenv.identity(plain) == RankIdentity(1, 1, None, 2, "10.0.0.1:1234", "torch")
    # torchrun under Slurm: RANK is the rank, SLURM_PROCID the node's task
    assert rankenv.identity({**slurm, **TORCHRUN_RANK_2}).rank == 2


def test_no_launcher_and_bad_values():
    assert rankenv.identity({"PATH": "/usr/bin", "HOME": "/root"}) is None
    # a value that is not a number is skipped, not fatal: the next variable in line answers
    d = rankenv.identity({"RANK": "x", "SLURM_PROCID": "4", "WORLD_SIZE": "8"})
    assert d is not None and (d.rank, d.world_size) == (4, 8)


def test_read_from_a_real_process_environment():
    # GIVEN a process started with a rank's environment (as a launcher execs it)
    env = {**os.environ, **TORCHRUN_RANK_2}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        deadline = time.monotonic() + 10
        d = None
        while d is None and time.monotonic() < deadline:  # /proc/PID/environ is the new image's once exec is done
            d = rankenv.read(p.pid)
            time.sleep(0.01)
        assert d == rankenv.identity(TORCHRUN_RANK_2)
    finally:
        p.kill()
        p.wait()
    # and a gone process has none
    assert rankenv.read(p.pid) is None


def _ev(*rows: tuple) -> np.ndarray:
    ev = np.zeros(len(rows), dtype=events.PROC_DTYPE)
    for i, (kind, pid, ppid, ts, comm, extra) in enumerate(rows):
        ev[i]["kind"], ev[i]["pid"], ev[i]["ppid"], ev[i]["ts_ns"], ev[i]["comm"] = kind, pid, ppid, START + ts, comm
        for k, v in extra.items():
            ev[i][k] = v
    return ev


def test_fork_inherits_the_rank_and_the_launcher_is_the_ranks_parent():
    # GIVEN torchrun's agent (no rank) whose rank 2 forks a DataLoader worker
    tree = ProcessTree(START)
    tree.procs[100] = ProcInfo(100, 1, "pt_elastic", "torchrun train.py", 0)
    d = rankenv.identity(TORCHRUN_RANK_2)
    tree.procs[101] = ProcInfo(101, 100, "python", "python train.py", 5, dist=d)
    tree.apply(_ev((events.C.PROC_FORK, 102, 101, 10, b"python", {"child": 102})))
    # THEN the worker has its rank's identity, read from no file (pid 102 does not exist here)
    assert tree.procs[102].dist == d
    # AND the agent, not the rank, is the launcher; the columns carry both
    assert rankenv.launchers(tree.procs.values()) == {100: "torchrun"}
    cols = columns.process_columns(tree.procs.values())
    rows = {pid: i for i, pid in enumerate(cols["pid"])}
    assert [cols["rank"][rows[p]] for p in (100, 101, 102)] == [None, 2, 2]
    assert [cols["launcher"][rows[p]] for p in (100, 101, 102)] == ["torchrun", None, None]
    assert cols["job_id"][rows[101]] == "dd39e6ef-5c7b-46fb-afcf-3e17c0988fbd" and cols["world_size"][rows[102]] == 3


def test_exec_reads_the_new_environment():
    # GIVEN a process of the tree that execs with a rank's environment (a real process: its environ is read)
    env = {**os.environ, **TORCHRUN_RANK_2}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        tree = ProcessTree(START)
        tree.procs[p.pid] = ProcInfo(p.pid, os.getpid(), "python", "", 0)
        deadline = time.monotonic() + 10
        while tree.procs[p.pid].dist is None and time.monotonic() < deadline:
            tree.apply(_ev((events.C.PROC_EXEC, p.pid, 0, 10, b"python", {})))
            time.sleep(0.01)
        assert tree.procs[p.pid].dist == rankenv.identity(TORCHRUN_RANK_2)
    finally:
        p.kill()
        p.wait()


def test_the_recorder_that_launched_a_rank_is_no_launcher():
    # GIVEN a recording of one rank, launched by the recorder itself (`srun tracer record -- python train.py`, one
    # recording per rank or host): the rank's parent is the tracer's process
    tree = ProcessTree(START)
    tree.procs[100] = ProcInfo(100, 1, "tracer", "tracer record -- python train.py", 0, role="tracer")
    tree.procs[101] = ProcInfo(101, 100, "python", "python train.py", 5, dist=rankenv.identity(TORCHRUN_RANK_2))
    cols = columns.process_columns(tree.procs.values())
    rows = {pid: i for i, pid in enumerate(cols["pid"])}
    # THEN neither process is a launcher: the rank is still rank 2, and the tracer is no part of the job
    assert [cols["launcher"][rows[p]] for p in (100, 101)] == [None, None]
    assert cols["rank"][rows[101]] == 2
    # AND the same tree with a target parent (torchrun's agent) keeps its launcher
    tree.procs[100] = ProcInfo(100, 1, "pt_elastic", "torchrun train.py", 0)
    assert columns.process_columns(tree.procs.values())["launcher"][0] == "torchrun"
