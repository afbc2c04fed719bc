"""The diagnosis tools: the causal chains, worst first (get_causal_chains), and a distributed job's ranks with
its straggler (get_ranks). Thin views over :mod:`tracer.analysis.chains` and :mod:`tracer.analysis.ranks`."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context
from pydantic import Field

from mcp_server.state import state
from mcp_server.tools.selectors import ContainerArg, RankArg
from tracer.analysis.chains import ChainsResult, compute_chains
from tracer.analysis.ranks.report import RanksResult, ranks_report


def get_causal_chains(
    pid: Annotated[int | None, Field(description="Only chains affecting this process.")] = None,
    rank: RankArg = None,
    container: ContainerArg = None,
    severity: Annotated[str | None, Field(description="high, medium or low; omit for all.")] = None,
    limit: Annotated[int, Field(description="Most chains to return (1-100).", ge=1, le=100)] = 10,
    *,
    ctx: Context,
) -> ChainsResult:
    """Diagnoses of why CUDA calls were slow, worst first.

    Each chain has a category (cpu_contention, sync_stall, allocation_churn, process_churn, memory_pressure,
    dataloader_starvation, launch_bound, gpu_bound, straggler_rank, gil_contention, blocking_io, host_python,
    lock_contention, gc_pause: CPython's garbage collector, cpu_placement: the job waited for a CPU because of its
    affinity, cpuset or cgroup quota, hang: the job made no step for longer than its steps allow; which ranks wait
    in a collective, which one is not and where it is stuck, from the thread snapshots), a severity from the share
    of the affected thread's time it cost (HIGH >= 20%, MEDIUM >= 5%; gpu_bound is informational; a hang is listed
    first), that share and its ms, the culprit (process, thread, comm, Python file:line where known, a peer rank;
    never the tracer), the time range (ns since start), pids, the op involved with its p50/p99 µs, typed evidence
    (kind = category) and recommendations written for this trace; explained_by names the chain whose cause a chain's
    time is (a rank waiting for a straggler rank). coverage: each part of the training thread's time of at least 5%
    of its steps, with the chain categories that explain it, or, unexplained, where it went; unexplained_share sums
    those (all chains count, whatever the filter). Next: get_time_breakdown for the thread's whole picture;
    get_stacks(op) for the chain's op; get_ranks for a distributed job's ranks; run_sql for the timeline around
    start_ns.
    """
    st = state(ctx)
    with st.connection() as c:
        pid = st.job_pid(c, pid, rank, container)
        st.check(c, pid=pid, severity=severity)
        return compute_chains(c, pid=pid, severity=severity, limit=limit)


def get_ranks(*, ctx: Context) -> RanksResult:
    """Each rank of a distributed training job (torchrun, DeepSpeed, MPI, Slurm: read from the processes'
    environment at exec) and the straggler the others wait for.

    Per rank, over the window every rank was stepping: pid, training thread, steps (from its waits for the
    GPU), its time by phase in ms and ms per step (cpu, launch, sync = waiting for the GPU, runq = waiting for
    a CPU, collective = waiting in collectives (woken by the communication library's threads, e.g. gloo's
    pt_gloo_runloop, or by another rank), asleep = woken by a timer, disk_io, data_workers, ...; legend in the
    result), and its share of time waiting in collectives. The straggler is the rank that waits least while
    the others wait for it: its slow phase, how much more per step, where in its step (between which two
    CUDA calls' lines), how long each other rank waits for it, and whether it is persistent or confined to a
    window. Empty with a note when the recording holds no ranks. Next: get_causal_chains (category
    straggler_rank), get_time_breakdown(pid=the straggler's pid).
    """
    st = state(ctx)
    with st.connection() as c:
        return ranks_report(c)
