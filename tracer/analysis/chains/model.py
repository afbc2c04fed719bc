"""The records a chain is made of: the chain, its culprit, and one typed evidence record per category.

Evidence records are a discriminated union on ``kind`` (= the chain's category), so the MCP output schema lists
every field of every category with its unit.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.breakdown.holders import Holder

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
    "straggler_rank",
    "gil_contention",
    "blocking_io",
    "host_python",
    "lock_contention",
    "cpu_placement",
    "gc_pause",
    "hang",
)


class Culprit(Record):
    """Who or what caused the lost time. Never the tracer."""

    kind: Annotated[
        str,
        Field(
            description="process (another process) | thread (a thread of the job) | workers | code | host | rank "
            "(another rank of a distributed job)"
        ),
    ]
    pid: Annotated[
        int | None, Field(description="its process, when one is to blame (kind workers: the process forking them)")
    ]
    tid: Annotated[int | None, Field(description="its thread, when known")]
    comm: Annotated[str, Field(description="its name (process or thread)")]
    relation: Annotated[
        str,
        Field(
            description="own_thread | own_process | own_workers | other_process | host | peer_rank, seen from the "
            "affected thread"
        ),
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


class LineTime(Record):
    """A Python line and the time spent at it."""

    site: Annotated[str | None, Field(description="'file:line function', null when no Python frame")]
    ms: float
    share: Annotated[float, Field(description="of the time this list covers, 0..1")]


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
    worker_hot_lines: Annotated[
        list[LineTime],
        Field(description="where the workers' CPU went: their heaviest Python lines, from their on-CPU samples"),
    ] = []


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


class RankWaitTime(Record):
    """A rank that waited in collectives for the straggler."""

    rank: int
    pid: int
    tid: int
    wait_ms: Annotated[float, Field(description="its time waiting in collectives over the common window, ms")]
    extra_wait_ms: Annotated[float, Field(description="of which above the straggler's own collective wait, ms")]
    extra_wait_ms_per_step: Annotated[float | None, Field(description="that per step; null without step marks")]


class StragglerRankEvidence(Record):
    """One rank of a distributed job is slower than the others, which wait for it in every collective."""

    kind: Literal["straggler_rank"] = "straggler_rank"
    rank: Annotated[int, Field(description="the straggler's rank")]
    pid: int
    tid: Annotated[int, Field(description="its training thread")]
    host: str
    world_size: int | None
    job_id: str | None
    phase: Annotated[str, Field(description="the phase it spends its extra time in (tracer ranks lists them)")]
    phase_label: str
    steps: Annotated[float | None, Field(description="steps in the common window (from the ranks' waits for the GPU)")]
    step_ms: Annotated[float | None, Field(description="the job's step time in the window, ms")]
    phase_excess_ms: Annotated[float, Field(description="its time in that phase above the others' median, ms")]
    phase_excess_ms_per_step: float | None
    excess_ms: Annotated[
        dict[str, float], Field(description="its time above the others' median, per phase with any, ms")
    ]
    lost_ms: Annotated[float, Field(description="each other rank's extra collective wait (median), ms")]
    lost_ms_per_step: float | None
    job_lost_ms: Annotated[float, Field(description="the others' extra waits summed, ms of rank time")]
    explained: Annotated[
        float, Field(description="its excess over the others' extra wait: near 1 when its extra time is their wait")
    ]
    waiting: Annotated[list[RankWaitTime], Field(description="the ranks that waited for it")]
    persistent: Annotated[bool, Field(description="slow in most of the window; else confined to start_s..end_s")]
    window_start_s: Annotated[float, Field(description="start of the window every rank stepped in, s")]
    window_end_s: float
    straggler_stretch: Annotated[
        str | None, Field(description="where in its step its extra time lies: between which two CUDA calls' lines")
    ]
    wait_stretch: Annotated[str | None, Field(description="where in their steps the others wait for it")]


class GilHolder(Record):
    """A thread of the same process that ran on CPU while the affected thread waited for the GIL."""

    tid: int
    name: Annotated[str, Field(description="its OS name, else 'thread TID (hottest function, file:line)'")]
    cpu_ms: Annotated[float, Field(description="its sampled CPU time in the affected thread's steps, ms")]
    hot_lines: Annotated[list[LineTime], Field(description="where that CPU time went, heaviest first")]


class GilContentionEvidence(Record):
    """The thread waited for CPython's interpreter lock (GIL) that other threads of its process held."""

    kind: Literal["gil_contention"] = "gil_contention"
    gil_wait_ms: Annotated[float, Field(description="time blocked taking the GIL (take_gil), ms")]
    gpu_overlap_ms: Annotated[
        float,
        Field(description="of that, GPU work the thread had queued ran meanwhile (its syncs waited less): not lost"),
    ] = 0.0
    waits: Annotated[int, Field(description="blocked intervals taking the GIL")]
    waited_at: Annotated[
        list[LineTime], Field(description="the thread's lines that waited (it re-takes the lock there)")
    ]
    holders: Annotated[list[GilHolder], Field(description="threads on CPU meanwhile, most CPU first")]
    woken_by: Annotated[
        dict[str, float],
        Field(description="who ended those waits, ms by waker ([timer]: the 5 ms switch interval ran out)"),
    ]


class IoSite(Record):
    """A line of the thread that did blocking I/O."""

    site: Annotated[str | None, Field(description="'file:line function'")]
    ms: Annotated[float, Field(description="blocked there (and, for its function, in the kernel on CPU), ms")]
    call: Annotated[str | None, Field(description="the libc call it waited in (write, fsync, open, ...)")]
    state: Annotated[str, Field(description="D (uninterruptible) | S | cpu (kernel time on CPU doing the I/O)")]


class BlockingIoEvidence(Record):
    """The thread did file I/O itself: uninterruptible waits and file syncs, and the kernel work of the writes."""

    kind: Literal["blocking_io"] = "blocking_io"
    io_wait_ms: Annotated[float, Field(description="blocked in I/O (D state, fsync), ms")]
    io_cpu_ms: Annotated[
        float,
        Field(description="sampled kernel CPU in the functions that did the I/O (copying into the page cache), ms"),
    ]
    waits: int
    d_state_ms: float
    sites: Annotated[list[IoSite], Field(description="the lines, heaviest first")]
    page_cache_bytes: Annotated[int, Field(description="bytes the thread added to the page cache (its writes)")]
    woken_by: Annotated[dict[str, float], Field(description="who ended the waits ([block]: disk completion), ms")]


class HostPythonEvidence(Record):
    """The GPU waited while the thread ran Python between a sync and its next launch."""

    kind: Literal["host_python"] = "host_python"
    cpu_ms: Annotated[float, Field(description="its on-CPU time outside CUDA calls in its steps, ms")]
    sync_ms: Annotated[float, Field(description="its time waiting for the GPU, ms")]
    gpu_idle_ms: Annotated[
        float, Field(description="its own work between a sync's return and its next enqueue, over every sync, ms")
    ]
    idle_gap_us: Annotated[float, Field(description="that gap per sync (median), µs")]
    steps: Annotated[int, Field(description="syncs (one per step)")]
    hot_lines: Annotated[list[LineTime], Field(description="where its CPU time outside calls went (samples)")]
    samples: Annotated[int, Field(description="on-CPU samples behind hot_lines")]


class LockHolder(Record):
    """A thread that released the lock the affected thread waited for (it woke the waiter)."""

    tid: int
    name: Annotated[str, Field(description="its OS name, else 'thread TID (hottest function, file:line)'")]
    woke_ms: Annotated[float, Field(description="the affected thread's lock waits it ended, ms")]
    hot_lines: Annotated[list[LineTime], Field(description="where its time went meanwhile (on CPU or blocked)")]


class LockContentionEvidence(Record):
    """The thread waited for a lock (threading.Lock, a queue, a logging handler's lock) another thread held."""

    kind: Literal["lock_contention"] = "lock_contention"
    lock_wait_ms: Annotated[float, Field(description="time blocked acquiring the lock, ms")]
    waits: int
    waited_at: Annotated[list[LineTime], Field(description="the thread's lines that waited")]
    holders: Annotated[list[LockHolder], Field(description="the threads that released it, most first")]


class CpuPlacementEvidence(Record):
    """The thread waited for a CPU while CPUs outside the job's allowed set sat idle (affinity, cpuset), or while
    its cgroup's CPU quota was used up (cpu.max): the placement, not the CPUs, was the limit."""

    kind: Literal["cpu_placement"] = "cpu_placement"
    trigger: Annotated[str, Field(description="confined (affinity / cpuset) | throttled (cgroup quota) | both")]
    runq_ms: Annotated[float, Field(description="the thread's waits for a CPU, in and out of calls, ms")]
    confined_ms: Annotated[
        float, Field(description="of runq_ms, what the idle CPUs outside its allowed set could have run, ms")
    ]
    throttled_ms: Annotated[float, Field(description="of runq_ms, waits while its cgroup was throttled, ms")]
    cpus_allowed: Annotated[str, Field(description="the CPUs it may run on (affinity and cpuset), a CPU list")]
    cpus_online: Annotated[int, Field(description="CPUs of the host (cpu_idle)")]
    outside_idle_pct: Annotated[
        dict[str, float], Field(description="each CPU outside its set: idle % in the seconds the thread waited")
    ]
    set_by: Annotated[str, Field(description="who narrowed its placement, as far as the recording tells")]
    cgroup: Annotated[str | None, Field(description="the cgroup whose quota binds it")]
    quota_cpus: Annotated[float | None, Field(description="that quota in CPUs (quota / period); null: none")]
    throttled_periods: Annotated[int, Field(description="periods that ran out of quota")]
    job_demand_cpus: Annotated[
        float, Field(description="the job's CPUs in use plus waiting, averaged over the waiting seconds")
    ]
    holders: Annotated[list[Holder], Field(description="who held its CPU meanwhile, most first (tracer excluded)")]


class GcPauseEvidence(Record):
    """The thread's time inside CPython's cyclic garbage collector (gc_collections)."""

    kind: Literal["gc_pause"] = "gc_pause"
    gc_ms: Annotated[float, Field(description="time in collections that started in its steps, ms")]
    collections: int
    by_generation: Annotated[dict[str, int], Field(description="collections by generation (2: full)")]
    ms_by_generation: Annotated[dict[str, float], Field(description="their time by generation, ms")]
    p50_ms: float
    p99_ms: float
    max_ms: float
    oldest_generation: Annotated[str, Field(description="the oldest generation collected")]
    collected: Annotated[int, Field(description="objects the collections freed (few: the heap was alive)")]
    steps: Annotated[int, Field(description="its steps (waits for the GPU) in the range")]
    steps_share: Annotated[float, Field(description="the collector's share of its steps' time, 0..1")]
    triggered_at: Annotated[
        list[LineTime],
        Field(description="the lines whose allocations started the collections, by collection time, heaviest first"),
    ]
    source: Annotated[
        str,
        Field(
            description="probes (each collection, from USDT gc__start/gc__done or the collector's function) | samples "
            "(an interpreter with neither: the on-CPU samples inside the collector's functions; no count, duration or "
            "generation of the collections)"
        ),
    ] = "probes"


class HungThread(Record):
    """A thread of a hung job as its latest snapshot (thread_snapshots) found it."""

    rank: Annotated[int | None, Field(description="its process's rank, null outside a distributed job")]
    pid: int
    tid: int
    comm: str
    in_collective: Annotated[bool, Field(description="inside a collective (torch.distributed or NCCL) on its stack")]
    collective: Annotated[str | None, Field(description="which one (all_reduce, barrier, ...), when inside one")]
    doing: Annotated[str, Field(description="what it is stuck in, in a few words")]
    state: Annotated[str, Field(description="kernel state: running | sleeping | disk ...")]
    syscall: Annotated[str | None, Field(description="the system call it sits in")]
    wchan: Annotated[str, Field(description="the kernel function it waits in")]
    waits_on: Annotated[str, Field(description="the file its call waits on (path, pipe:[N], socket:[N]); '' none")]
    blocked_ms: Annotated[float | None, Field(description="off CPU for this long at its last snapshot, ms")]
    site: Annotated[str | None, Field(description="'file:line function' of its innermost frame in the job's code")]
    stack: Annotated[list[str], Field(description="its Python stack, innermost first, a few frames")]


class HangEvidence(Record):
    """The job stopped making progress: no step for longer than its steps allow, its threads blocked."""

    kind: Literal["hang"] = "hang"
    trigger: Annotated[
        str,
        Field(
            description="steps_stopped (it stepped, then made no step for stalled_ms) | no_step (no step in the "
            "whole recording, its threads blocked in their snapshots)"
        ),
    ]
    stalled_ms: Annotated[float, Field(description="time without a step at the recording's end, ms")]
    threshold_ms: Annotated[float, Field(description="no step for this long is a hang: its step time x N, floored")]
    step_ms: Annotated[float | None, Field(description="its median step before it stopped, ms; null: no step seen")]
    waiting: Annotated[
        list[HungThread], Field(description="threads inside a collective: they wait for the ones in stuck")
    ]
    stuck: Annotated[
        list[HungThread],
        Field(description="threads not inside a collective: the ones the others wait for, or the job's stuck loop"),
    ]
    ranks_stuck: Annotated[list[int], Field(description="ranks not inside a collective while others are")]
    behind: Annotated[
        list[str],
        Field(
            description="ranks that entered fewer NCCL collectives on a communicator than its other ranks (counted "
            "per call: nccl_progress), e.g. 'rank 1 is one collective behind ...'; [] without NCCL"
        ),
    ] = []


Evidence = Annotated[
    CpuContentionEvidence
    | SyncStallEvidence
    | AllocationChurnEvidence
    | ProcessChurnEvidence
    | MemoryPressureEvidence
    | DataloaderStarvationEvidence
    | LaunchBoundEvidence
    | GpuBoundEvidence
    | StragglerRankEvidence
    | GilContentionEvidence
    | BlockingIoEvidence
    | HostPythonEvidence
    | LockContentionEvidence
    | CpuPlacementEvidence
    | GcPauseEvidence
    | HangEvidence,
    Field(discriminator="kind"),
]


ROOT_KINDS = ("on_cpu", "external_wait", "cpu_capacity", "placement", "gpu", "interpreter", "hung")


class Hop(Record):
    """One hop of a chain's wait path (issue 28): a thread that the affected thread's lost time waited on,
    directly or through the hops before it. The first hop is the affected thread itself; the last is the root."""

    tid: Annotated[int | None, Field(description="the thread, when one")]
    pid: Annotated[int | None, Field(description="its process")]
    comm: Annotated[str, Field(description="its name (thread or process)")]
    role: Annotated[
        str,
        Field(description="training | worker | helper | rank | job_thread | other_process | kernel | gpu"),
    ]
    edge: Annotated[
        str,
        Field(
            description="how the previous hop waited on this one: start (the affected thread) | woken_by (blocked "
            "until this thread woke it: futex, pipe, socket, lock, GIL) | cpu_held_by (runnable while this held "
            "its CPU) | gpu (waited in a CUDA call for queued GPU work) | collective (waited in a collective for "
            "this rank, which is not inside it)"
        ),
    ]
    state: Annotated[str, Field(description="what this hop was doing: on_cpu | blocked | io | runq | gpu")]
    share: Annotated[float, Field(description="share of the affected thread's lost time through this hop, 0..1")]
    ms: Annotated[float, Field(description="that time, ms")]
    site: Annotated[str | None, Field(description="'file:line function' where it ran or waited, where known")]


class Root(Record):
    """Where a chain's wait path ends (issue 28)."""

    kind: Annotated[
        str,
        Field(
            description="on_cpu (a thread running: its lines) | external_wait (disk, network, timer, a pipe or "
            "socket whose writer is outside the job) | cpu_capacity (every CPU the job may use was busy) | "
            "placement (the job waited for a CPU while CPUs outside its allowed set were idle, or its cgroup was "
            "throttled) | gpu | interpreter (CPython's own work: the cyclic GC) | hung (blocked since before "
            "the recording)"
        ),
    ]
    detail: Annotated[str, Field(description="one line: what the root is, in the trace's own terms")]
    site: Annotated[str | None, Field(description="'file:line function' of the root, where known")] = None
    stack: Annotated[list[str], Field(description="the root's stack, innermost first, a few frames")] = []


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
    path: Annotated[
        list[Hop],
        Field(description="the waits followed from the affected thread to the root, one hop each (issue 28)"),
    ] = []
    root: Annotated[Root | None, Field(description="where the path ends: the cause to act on")] = None
    branches: Annotated[
        list[Hop],
        Field(
            description="where the rest of the lost time went at the path's first fork, when several ways compete: "
            "up to 2 more first hops besides the path's own (path[1]), heaviest first, each with its share"
        ),
    ] = []
    explained_by: Annotated[
        str | None,
        Field(
            description="id of the chain whose cause this one's time is (a rank's waits for a straggler rank, GIL "
            "waits behind a fault storm): not a cause of its own; fix that one first"
        ),
    ] = None

    def explained(self, by: CausalChain, why: str) -> CausalChain:
        """Return this chain marked as explained by chain ``by``, its summary ending with ``why``."""
        return self.model_copy(update={"explained_by": by.id, "summary": f"{self.summary} {why}"})


class PartCoverage(Record):
    """One part of the training thread's breakdown of at least 5% of its steps, and what explains it."""

    part: Annotated[str, Field(description="the breakdown part (tracer breakdown): cpu, sync, blocked, runq_other...")]
    ms: Annotated[float, Field(description="its time in the thread's steps, ms")]
    share: Annotated[float, Field(description="its share of the steps, 0..1")]
    explained_by: Annotated[
        list[str],
        Field(
            description="the categories of the thread's chains that account for it; no chain but 'root:gpu' when "
            "the thread waits because the GPU is the limit (the wait-for graph's root, not a chain), 'tracer' for "
            "the tracer's own CPU; empty: unexplained"
        ),
    ]
    top_sites: Annotated[
        list[str], Field(description="unexplained only: where the time went, heaviest first (code sites or holders)")
    ]
    root: Annotated[
        str | None,
        Field(
            description="lost time only (blocked, run queue, waits for the GPU): the kind of root its wait path ends at"
        ),
    ] = None
    unexplained_share: Annotated[
        float,
        Field(
            description="the share of the steps of this part that nothing explains: its share when unexplained, 0 "
            "when explained, in between for CPU time partly under a chain's code site"
        ),
    ] = 0.0


class Coverage(Record):
    """How much of the training thread's time the chains explain (issue 18): every part of at least 5% of its
    steps is explained by a chain or listed as unexplained with its top sites."""

    tid: int
    pid: int
    steps_ms: Annotated[float, Field(description="the thread's steps (first to last CUDA call), ms")]
    parts: list[PartCoverage]
    unexplained_share: Annotated[float, Field(description="share of the steps in parts no chain explains, 0..1")]
    lost_share: Annotated[
        float,
        Field(
            description="share of the steps lost: blocked (not on the tracer), waiting for a CPU (not the tracer's) "
            "or for the GPU"
        ),
    ] = 0.0
    root_found_share: Annotated[
        float, Field(description="of that lost time, the share whose root the wait-for graph found, 0..1")
    ] = 0.0


class ChainsResult(Record):
    """Causal chains, worst first (severity, then share of the thread's time)."""

    chains: list[CausalChain]
    total: Annotated[int, Field(description="chains found before the limit")]
    by_severity: Annotated[dict[str, int], Field(description="chains found, by severity (before the limit)")]
    basis: Annotated[str, Field(description="exact | estimated | none: what the shares are computed from")]
    note: Annotated[str, Field(description="caveats of the basis; empty when exact")]
    training_tid: Annotated[int | None, Field(description="the training thread (most launch + sync time)")]
    coverage: Annotated[
        Coverage | None,
        Field(description="which parts of the training thread's time the chains explain, and where the rest goes"),
    ] = None
