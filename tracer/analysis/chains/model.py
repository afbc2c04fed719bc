"""The records a chain is made of: the chain, its culprit, and one typed evidence record per category.

Evidence records are a discriminated union on ``kind`` (= the chain's category), so the MCP output schema lists
every field of every category with its unit.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.breakdown import Holder

SEVERITIES = ("HIGH", "MEDIUM", "LOW")
CATEGORIES = (
    "cpu_contention",
    "sync_stall",
    "allocation_churn",
    "process_churn",
    "memory_pressure",
    "dataloader_starvation",
    "launch_bound",
    "gpu_bound",
)


class Culprit(Record):
    """Who or what caused the lost time. Never the tracer."""

    kind: Annotated[
        str, Field(description="process (another process) | thread (a thread of the job) | workers | code | host")
    ]
    pid: Annotated[
        int | None, Field(description="its process, when one is to blame (kind workers: the process forking them)")
    ]
    tid: Annotated[int | None, Field(description="its thread, when known")]
    comm: Annotated[str, Field(description="its name (process or thread)")]
    relation: Annotated[
        str, Field(description="own_thread | own_process | own_workers | other_process | host, seen from the job")
    ]
    code_site: Annotated[str | None, Field(description="'file:line function' of the Python code, where known")]


class OpTime(Record):
    """One CUDA op's calls and time in the affected process (exact, op_stats)."""

    op: str
    calls: int
    total_ms: float
    p50_us: float
    p99_us: float
    implicit_sync: Annotated[bool, Field(description="a synchronous copy: waits for the GPU without saying so")]


class SiteCount(Record):
    """A code site and how many stored calls came from it."""

    site: Annotated[str | None, Field(description="'file:line function', null when no Python frame")]
    calls: int
    total_ms: float
    bytes: int


class WorkerLoad(Record):
    """One data worker process, from its threads' breakdown."""

    pid: int
    comm: str
    cpu_share: Annotated[float, Field(description="share of its wall time on CPU")]
    blocked_share: float
    runq_share: float
    wakeups_of_main: Annotated[int, Field(description="times it woke the starved thread")]
    woke_blocked_ms: Annotated[float, Field(description="blocked time of the starved thread it ended, ms")]


class StormThread(Record):
    """A thread of the job faulting in fresh memory."""

    pid: int
    tid: int
    comm: str
    faults: int
    page_alloc_bytes: int
    page_alloc_bytes_per_s: float
    reclaim_ms: float
    cpu_ms: float


class WaveLoss(Record):
    """Time a respawn wave cost the affected thread."""

    start_s: float
    workers: int
    lost_ms: float


class CpuContentionEvidence(Record):
    """The thread was runnable but had no CPU: who held it."""

    kind: Literal["cpu_contention"] = "cpu_contention"
    holder_class: Annotated[
        str, Field(description="other (other tenants' processes) | own (its own process and workers)")
    ]
    runq_ms: Annotated[
        float, Field(description="time this class of holders kept the thread waiting, ms (in and out of calls)")
    ]
    runq_outside_calls_ms: float
    runq_inside_calls_ms: Annotated[float, Field(description="in-call run-queue time, split by the holders' shares")]
    via_workers_ms: Annotated[
        float,
        Field(
            description="of runq_ms: time blocked for batches that the data workers were late with because they "
            "queued behind these holders (other class only), ms"
        ),
    ] = 0.0
    runq_by_holder_ms: Annotated[dict[str, float], Field(description="outside calls: self | tree | other | tracer")]
    holders: Annotated[list[Holder], Field(description="the tasks that held the CPU, most first (tracer excluded)")]
    cpu_cores: int
    dataloader_workers: Annotated[
        int, Field(description="the most pt_data_worker processes of the traced tree alive at one time")
    ]
    max_load1: float | None
    max_cpu_busy_pct: float | None


class SyncStallEvidence(Record):
    """The thread waited for the GPU in syncs (explicit and implicit) while the GPU could have overlapped its work."""

    kind: Literal["sync_stall"] = "sync_stall"
    sync_ms: Annotated[float, Field(description="time waiting for the GPU, ms")]
    sync_share: float
    host_ms: Annotated[float, Field(description="the thread's own work (on CPU, launches, copies, allocs), ms")]
    host_share: float
    syncs: Annotated[int, Field(description="calls that waited for the GPU (exact)")]
    syncs_per_s: float
    implicit_syncs: Annotated[int, Field(description="of which synchronous copies (cudaMemcpy, cuMemcpyDtoH...)")]
    ops: list[OpTime]
    blocked_share_of_sync: Annotated[
        float | None, Field(description="of the stored syncs' time, asleep (not runnable)")
    ]
    idle_gap_after_sync_us: Annotated[
        float | None,
        Field(description="median of the thread's own work between a sync and its next enqueue: the GPU idles, µs"),
    ]
    gpu_idle_ms: Annotated[float, Field(description="that gap over every sync: GPU time the syncs cost, ms")]


class AllocationChurnEvidence(Record):
    """Allocation and free calls (async ones included) on the thread's critical path."""

    kind: Literal["allocation_churn"] = "allocation_churn"
    alloc_ms: float
    free_ms: float
    calls: Annotated[int, Field(description="allocation and free calls (exact)")]
    calls_per_s: float
    async_calls: Annotated[int, Field(description="of which stream-ordered (cudaMallocAsync / cudaFreeAsync)")]
    bytes: Annotated[int, Field(description="bytes allocated")]
    ops: list[OpTime]
    top_sites: Annotated[list[SiteCount], Field(description="allocation call sites, most time first")]
    empty_cache_in_free_stacks: Annotated[bool, Field(description="torch.cuda.empty_cache() is on the frees' stacks")]


class ProcessChurnEvidence(Record):
    """Worker processes forked again and again, each wave stalling the thread."""

    kind: Literal["process_churn"] = "process_churn"
    fork_waves: int
    respawn_waves: int
    workers_per_wave: int
    worker_comm: str
    forks: int
    exits: int
    wave_times_s: list[float]
    lost_ms: Annotated[
        float,
        Field(
            description="the thread's stalls from each respawn's fork to its first batch, less CUDA time and its "
            "usual wait for a batch, ms"
        ),
    ]
    avg_lost_ms_per_respawn: float
    waves: list[WaveLoss]


class MemoryPressureEvidence(Record):
    """Memory: a thread of the job faulting in fresh pages, or host memory running out (swap, OOM kills)."""

    kind: Literal["memory_pressure"] = "memory_pressure"
    trigger: Annotated[str, Field(description="fault_storm | host_pressure | oom_kill")]
    storm_threads: Annotated[list[StormThread], Field(description="threads of the job allocating the most pages")]
    woken_by_culprit_ms: Annotated[
        float, Field(description="blocked time of the affected thread the culprit thread itself ended, ms")
    ]
    lock_waits_ms: Annotated[
        float,
        Field(
            description="its waits on locks the culprit held (GIL, mmap lock): blocked time in the storm's seconds "
            "not ended by a batch or the tracer, above its usual rate, ms"
        ),
    ]
    runq_behind_culprit_ms: Annotated[float, Field(description="time it waited for a CPU held by the culprit, ms")]
    faulting_cpu_ms: Annotated[
        float, Field(description="the affected thread faulting pages in itself: its CPU above its usual rate, ms")
    ]
    io_ms: Annotated[float, Field(description="uninterruptible waits (page-fault I/O, mmap lock) in the storm, ms")]
    reclaim_ms: Annotated[float, Field(description="direct reclaim in the affected thread, ms")]
    excess_off_cpu_ms: Annotated[float, Field(description="host pressure: off-CPU time above its usual rate, ms")]
    pressure_seconds: int
    min_mem_available_bytes: int | None
    max_swap_used_bytes: int | None
    peak_page_alloc_bytes_per_s: float | None
    oom_kills: Annotated[list[int], Field(description="pids the kernel's OOM killer killed")]


class DataloaderStarvationEvidence(Record):
    """The thread blocked waiting for batches that its data workers delivered."""

    kind: Literal["dataloader_starvation"] = "dataloader_starvation"
    blocked_ms: Annotated[float, Field(description="all its blocked time outside calls, ms")]
    woken_by_workers_ms: Annotated[
        float, Field(description="of which ended by a data worker's wakeup, less behind_other_processes_ms, ms")
    ]
    behind_other_processes_ms: Annotated[
        float,
        Field(
            description="left out of woken_by_workers_ms: the share of the wait the workers spent queued for a CPU "
            "held by other processes (counted in cpu_contention), ms"
        ),
    ] = 0.0
    wakeups: int
    workers: list[WorkerLoad]
    worker_count: int
    workers_cpu_share: Annotated[float, Field(description="the workers' time on CPU / their wall time")]
    cpu_cores: int


class LaunchBoundEvidence(Record):
    """The thread was on CPU issuing work nearly all the time and the GPU had nothing queued when it synced."""

    kind: Literal["launch_bound"] = "launch_bound"
    cpu_ms: Annotated[float, Field(description="on CPU outside CUDA calls (Python between launches), ms")]
    launch_ms: float
    host_share: Annotated[float, Field(description="(cpu + launch + copies) / wall")]
    sync_share: float
    launches: int
    launches_per_s: float
    launch_p50_us: float
    sync_p50_us: Annotated[float | None, Field(description="median sync: near zero means the GPU queue was empty")]


class GpuBoundEvidence(Record):
    """The GPU is the limit: the thread mostly waits for it. Informational."""

    kind: Literal["gpu_bound"] = "gpu_bound"
    sync_ms: float
    sync_share: float
    host_share: float
    syncs: int
    avg_wait_ms: float


Evidence = Annotated[
    CpuContentionEvidence
    | SyncStallEvidence
    | AllocationChurnEvidence
    | ProcessChurnEvidence
    | MemoryPressureEvidence
    | DataloaderStarvationEvidence
    | LaunchBoundEvidence
    | GpuBoundEvidence,
    Field(discriminator="kind"),
]


class CausalChain(Record):
    """One diagnosis: how much of the affected thread's time a cause cost, who caused it, and what to change."""

    id: Annotated[str, Field(description="stable id: category, thread, culprit and time range hashed")]
    severity: Annotated[str, Field(description="HIGH (>= 20% of the thread's time) | MEDIUM (>= 5%) | LOW")]
    category: Annotated[str, Field(description=" | ".join(CATEGORIES))]
    start_ns: Annotated[int, Field(description="start of the affected range, ns since session start")]
    end_ns: Annotated[int, Field(description="end of the affected range, ns since session start")]
    pids: Annotated[list[int], Field(description="affected processes (and the culprit's, when in the job)")]
    tid: Annotated[int | None, Field(description="the affected thread (the training thread, usually)")]
    thread_comm: str
    share: Annotated[float, Field(description="share of the affected thread's wall time this cost, 0..1 (ranking key)")]
    impact_ms: Annotated[float, Field(description="that time, ms")]
    basis: Annotated[str, Field(description="exact (thread_breakdown) | estimated (older recording)")]
    culprit: Culprit | None
    op: Annotated[str, Field(description="the CUDA op involved, '' when none: call get_stacks(op) for its code paths")]
    op_p50_us: Annotated[float, Field(description="the op's median latency in the affected pid, µs")]
    op_p99_us: Annotated[float, Field(description="its 99th percentile, µs")]
    summary: Annotated[str, Field(description="one-sentence diagnosis")]
    evidence: Evidence
    recommendations: Annotated[list[str], Field(description="fixes for this trace, most effective first")]


class ChainsResult(Record):
    """Causal chains, worst first (severity, then share of the thread's time)."""

    chains: list[CausalChain]
    total: Annotated[int, Field(description="chains found before the limit")]
    by_severity: Annotated[dict[str, int], Field(description="chains found, by severity (before the limit)")]
    basis: Annotated[str, Field(description="exact | estimated | none: what the shares are computed from")]
    note: Annotated[str, Field(description="caveats of the basis; empty when exact")]
    training_tid: Annotated[int | None, Field(description="the training thread (most launch + sync time)")]
