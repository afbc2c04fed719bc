"""Which rank of a distributed job a process is: read from the variables its launcher put in its environment.

torchrun (torch.distributed.elastic), DeepSpeed and Accelerate set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
``GROUP_RANK`` (the node), torchrun also ``TORCHELASTIC_RUN_ID``; Open MPI sets ``OMPI_COMM_WORLD_*``, MPICH's and
Intel MPI's hydra ``PMI_*``, Slurm's srun ``SLURM_*``. They are read from ``/proc/PID/environ``, which holds the
environment a process was exec'd with: it is read when the recorder sees the exec (after it has happened) and at
attach. A forked child (a DataLoader worker) has its parent's environment, so it inherits its parent's identity
without a read: the rank's *own* process is the one whose parent is not the same rank (the analysis tells them
apart). Variables a process sets for itself later (``os.environ[...] =``) are not in that file.

A *launcher* is a process of the traced tree that started ranks without being one of them: torchrun's agent
(which has no ``RANK`` itself), ``mpirun``, a shell script that runs ``srun``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from tracer import procfs

# Tried in order: the first one set wins. torch's own variables come first, as a torchrun job under Slurm or MPI
# also has the outer launcher's (whose SLURM_PROCID is the node's task, not the rank).
RANK_VARS: tuple[str, ...] = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
LOCAL_RANK_VARS: tuple[str, ...] = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
NODE_RANK_VARS: tuple[str, ...] = ("GROUP_RANK", "OMPI_COMM_WORLD_NODE_RANK", "SLURM_NODEID")
WORLD_SIZE_VARS: tuple[str, ...] = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
# what names one run of a job on every host: the same value on every rank
JOB_ID_VARS: tuple[str, ...] = ("TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID")


@dataclass(frozen=True)
class RankIdentity:
    """What a process's environment says about its place in a distributed job."""

    rank: int | None
    local_rank: int | None
    node_rank: int | None
    world_size: int | None
    job_id: str | None
    launcher: str  # whose variables: torchrun | torch (RANK without torchelastic) | mpirun | mpi | srun


def _int(env: Mapping[str, str], names: Iterable[str]) -> int | None:
    for n in names:
        v = env.get(n)
        if v is not None:
            try:
                return int(v.strip())
            except ValueError:
                continue
    return None


def _launcher(env: Mapping[str, str]) -> str | None:
    if "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env:
        return "torchrun"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torch"
    if "OMPI_COMM_WORLD_RANK" in env:
        return "mpirun"
    if "PMI_RANK" in env:
        return "mpi"
    if "SLURM_PROCID" in env:
        return "srun"
    return None


def identity(env: Mapping[str, str]) -> RankIdentity | None:
    """Return the rank identity that environment ``env`` gives, or None when no launcher variable is set."""
    launcher = _launcher(env)
    if launcher is None:
        return None
    job = next((env[n] for n in JOB_ID_VARS if env.get(n)), None)
    if job is None and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        job = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"  # the rendezvous every rank of one job dials
    return RankIdentity(
        rank=_int(env, RANK_VARS),
        local_rank=_int(env, LOCAL_RANK_VARS),
        node_rank=_int(env, NODE_RANK_VARS),
        world_size=_int(env, WORLD_SIZE_VARS),
        job_id=job,
        launcher=launcher,
    )


def read(pid: int) -> RankIdentity | None:
    """Return process ``pid``'s rank identity from /proc/PID/environ (None: none, or it could not be read)."""
    env = procfs.environ(pid)
    return identity(env) if env else None


class _Proc(Protocol):
    pid: int
    ppid: int
    dist: RankIdentity | None


def launchers(procs: Iterable[_Proc]) -> dict[int, str]:
    """Return {pid: launcher kind} of the processes that started ranks without being one: the parent of a process
    with a rank, when the parent does not have that same rank of that same job (a rank's forked workers inherit
    its identity, so the rank is not their launcher)."""
    by_pid = {p.pid: p for p in procs}
    out: dict[int, str] = {}
    for p in by_pid.values():
        d = p.dist
        parent = by_pid.get(p.ppid)
        if d is None or d.rank is None or parent is None:
            continue
        pd = parent.dist
        if pd is None or (pd.rank, pd.job_id, pd.launcher) != (d.rank, d.job_id, d.launcher):
            out[parent.pid] = d.launcher
    return out
