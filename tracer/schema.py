"""The DuckDB schema: one declaration that yields the DDL, the docs served as an MCP resource, and the checks
that tell a trace DB from any other file.

Timestamps are nanoseconds since the session start (``ts_ns``), so ``ts_ns // 10_000_000_000`` buckets by 10 s.
Bump :data:`SCHEMA_VERSION` on any incompatible change; readers refuse a DB from a newer schema. v3 added the
distributed-job columns of ``processes`` (rank, local_rank, node_rank, world_size, job_id, launcher): readers
check for them (``RecordingInfo.has``), so v2 files stay readable. ``session.realtime_at_start_ns`` and
``clock_read_ns`` came later without a bump: a job of several recordings (tracer.analysis.job) falls back to
``started_at`` where they are missing. ``session.recording_s`` too (issue 33: only bench/ reads it). So did
``process_placement``, ``cgroup_cpu`` and ``cpu_idle`` (issue 28): readers check for them (``RecordingInfo.has``)
and an older recording gets no placement chain.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 3
APP_ID = "cuda-host-tracer"
# the table of the chains' whole answer, stored at a recording's end (tracer.analysis.chains.stored)
CHAINS_RESULT = "chains_result"


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    doc: str


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    columns: tuple[Column, ...]

    def ddl(self) -> str:
        cols = ",\n  ".join(f"{c.name} {c.type}" for c in self.columns)
        return f"CREATE TABLE IF NOT EXISTS {self.name} (\n  {cols}\n)"

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]


def _t(name: str, doc: str, *cols: tuple[str, str, str]) -> Table:
    return Table(name, doc, tuple(Column(*c) for c in cols))


TABLES: tuple[Table, ...] = (
    _t(
        "meta",
        "Identifies the file as a cuda-host-tracer DB: key/value rows (app, schema_version).",
        ("key", "VARCHAR", "app | schema_version"),
        ("value", "VARCHAR", "value"),
    ),
    _t(
        "session",
        "One row per recording session: environment, target, and how many events were traced/stored/lost.",
        ("session_id", "INTEGER", "1 for the first recording in the file"),
        ("started_at", "TIMESTAMPTZ", "wall-clock start (UTC)"),
        ("start_mono_ns", "BIGINT", "CLOCK_MONOTONIC at start; ts_ns columns are relative to it"),
        (
            "realtime_at_start_ns",
            "BIGINT",
            "CLOCK_REALTIME (Unix ns) read right after start_mono_ns: lines up recordings of one job made on several "
            "hosts (tracer ... --db a.duckdb --db b.duckdb)",
        ),
        (
            "clock_read_ns",
            "BIGINT",
            "bound of that read: the realtime at start_mono_ns is within clock_read_ns before realtime_at_start_ns",
        ),
        ("duration_s", "DOUBLE", "recording length in seconds"),
        (
            "status",
            "VARCHAR",
            "recording (or a recorder that died: see recorder_pid) | complete | interrupted (Ctrl-C) | "
            "target_exited | failed | disk_full | snapshot (a live copy served by tracer record --mcp-http)",
        ),
        ("host", "VARCHAR", "hostname"),
        ("kernel", "VARCHAR", "uname -r"),
        ("cpu_model", "VARCHAR", "CPU model name"),
        ("cpu_cores", "INTEGER", "logical CPUs"),
        ("mem_bytes", "BIGINT", "physical memory"),
        ("gpus", "VARCHAR", "GPU names (NVML/nvidia-smi when present), comma-separated, empty if none"),
        ("driver", "VARCHAR", "NVIDIA driver version, empty if none"),
        ("python_version", "VARCHAR", "target's Python version when known"),
        ("tracer_version", "VARCHAR", "cuda-host-tracer version"),
        ("target", "VARCHAR", "pid N or the launched command"),
        ("libraries", "VARCHAR", "CUDA library files probed, comma-separated"),
        ("events_traced", "BIGINT", "CUDA calls counted in kernel (every call, exact)"),
        ("events_stored", "BIGINT", "cuda_calls rows written"),
        ("events_lost", "BIGINT", "events dropped because a ring buffer was full (kernel-side count)"),
        ("overhead_pct", "DOUBLE", "estimated tracing overhead on the target, percent of its CPU time"),
        ("notes", "VARCHAR", "warnings raised during recording (skipped symbols, late attaches)"),
        ("recorder_pid", "INTEGER", "pid of the recorder process (role tracer in processes)"),
        (
            "recorder_start_ticks",
            "BIGINT",
            "the recorder's start time in clock ticks since boot (/proc/PID/stat field 22): with recorder_pid, tells "
            "a live recording from one whose recorder is gone",
        ),
        ("boot_id", "VARCHAR", "/proc/sys/kernel/random/boot_id of the recording host (pids are per boot)"),
        ("recorder_cpu_s", "DOUBLE", "CPU seconds (user + system) the recorder and its helpers used"),
        ("recorder_peak_rss_bytes", "BIGINT", "the recorder's peak resident memory"),
        ("startup_s", "DOUBLE", "seconds from the start of `tracer record` to the probes being live"),
        (
            "compile_s",
            "DOUBLE",
            "compiling (or taking from the compile cache) and loading the BPF program, timed in the thread that does "
            "it from the command's start: it overlaps the imports, so startup_s holds only part of it",
        ),
        ("attach_s", "DOUBLE", "of startup_s, attaching the probes"),
        (
            "startup_cpu_s",
            "DOUBLE",
            "CPU seconds (user + system, every thread) the recorder used until the probes were live: start-up's "
            "cost without the waits for a busy machine's CPUs",
        ),
        ("first_event_s", "DOUBLE", "seconds from the start of `tracer record` to the first recorded CUDA call"),
        ("flush_s", "DOUBLE", "seconds the final flush took (aggregates, processes, session row, chains)"),
        (
            "recording_cpu_pct",
            "DOUBLE",
            "the recorder's CPU from the probes being live to the job's end, % of one core: the steady cost, apart "
            "from start-up (startup_s) and finish (flush_s)",
        ),
        (
            "recording_s",
            "DOUBLE",
            "seconds from the probes being live to the final flush: the span recording_cpu_pct is taken over (NULL in "
            "recordings made before it was stored)",
        ),
        ("holds", "INTEGER", "times a target was stopped (SIGSTOP) to attach to a CUDA library it opened"),
        ("held_ms", "DOUBLE", "total milliseconds targets spent stopped by the tracer"),
        (
            "command_fate",
            "VARCHAR",
            "for a launched command: exited | stopped (SIGTERM/SIGKILL at the end) | left running | interrupted",
        ),
        (
            "flushed_ns",
            "BIGINT",
            "ts_ns up to which the detail rows (calls, off-CPU intervals, stacks) have been written (advances while "
            "recording)",
        ),
        (
            "summaries_flushed_ns",
            "BIGINT",
            "ts_ns up to which the per-second summary tables have been written (written every 10 s while recording)",
        ),
        ("sample_hz", "INTEGER", "on-CPU samples per second of each target thread's CPU time (cpu_samples); 0: off"),
        ("offcpu_stacks", "BOOLEAN", "true when blocked stacks were captured (offcpu_stacks)"),
        (
            "max_db_bytes",
            "BIGINT",
            "tracer record --max-db-size in bytes (NULL: no cap); dropped_rows says what was thinned to stay under it",
        ),
    ),
    _t(
        "processes",
        "Every process of the traced tree: the target and each descendant seen.",
        ("pid", "INTEGER", "process id (tgid)"),
        ("ppid", "INTEGER", "parent pid"),
        ("comm", "VARCHAR", "last process name (DataLoader workers rename themselves pt_data_worker)"),
        ("cmdline", "VARCHAR", "command line"),
        ("first_ns", "BIGINT", "first seen (ts_ns); 0 for processes alive at attach"),
        ("exit_ns", "BIGINT", "exit time (ts_ns), NULL if still alive at the end"),
        ("exit_code", "INTEGER", "exit status (code << 8 | signal, as wait(2)); NULL if unknown"),
        ("role", "VARCHAR", "target (the traced tree) | tracer (the recorder and its helpers: never a culprit)"),
        (
            "rank",
            "INTEGER",
            "its global rank in a distributed job, from the environment its launcher gave it (RANK, "
            "OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID; read at exec and attach); NULL outside one. A forked child "
            "(a DataLoader worker) has its parent's: a rank's own process is the one whose parent is not that rank",
        ),
        ("local_rank", "INTEGER", "its rank on this host (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID)"),
        ("node_rank", "INTEGER", "its host's rank in the job (GROUP_RANK, OMPI_COMM_WORLD_NODE_RANK, SLURM_NODEID)"),
        ("world_size", "INTEGER", "ranks in the job (WORLD_SIZE, OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS)"),
        (
            "job_id",
            "VARCHAR",
            "the run every rank shares (TORCHELASTIC_RUN_ID, PMIX_NAMESPACE, SLURM_JOB_ID, else MASTER_ADDR:PORT)",
        ),
        (
            "launcher",
            "VARCHAR",
            "set on a process that started ranks without being one (torchrun's agent, mpirun): whose ranks, "
            "torchrun | torch | mpirun | mpi | srun; NULL otherwise",
        ),
    ),
    _t(
        "threads",
        "Every thread of the traced tree that the time accounting saw: the span thread_breakdown covers.",
        ("pid", "INTEGER", "process id"),
        ("tid", "INTEGER", "thread id (= pid for a main thread)"),
        ("comm", "VARCHAR", "thread name"),
        ("first_ns", "BIGINT", "start of its accounted span (attach, or its first event)"),
        ("end_ns", "BIGINT", "end of its accounted span (its exit, or the end of the recording)"),
        ("exited", "BOOLEAN", "true when the thread exited during the recording"),
        ("cuda_calls", "BIGINT", "CUDA calls it made (exact, except launches while their probes were duty-cycled off)"),
    ),
    _t(
        "thread_breakdown",
        "Exact per-(thread, second) split of each target thread's wall time into parts that add up: wall_ns = "
        "cpu_ns + launch_ns + sync_ns + alloc_ns + free_ns + copy_ns + other_ns + runq_self_ns + runq_tree_ns + "
        "runq_other_ns + runq_tracer_ns + blocked_ns. Counted in kernel from the call probes and sched_switch; an "
        "interval that spans seconds is split between them. A (tid, sec) can have more than one row (a long interval "
        "closed late): sum them, e.g. GROUP BY tid, sec.",
        ("sec", "BIGINT", "second since session start"),
        ("pid", "INTEGER", "process id"),
        ("tid", "INTEGER", "thread id"),
        ("wall_ns", "BIGINT", "accounted time of the thread in this second (the sum of the parts)"),
        ("cpu_ns", "BIGINT", "on CPU outside CUDA calls: Python and host work"),
        ("launch_ns", "BIGINT", "inside kernel launches (estimated from the live windows when launch_sampled < 1)"),
        (
            "sync_ns",
            "BIGINT",
            "inside calls that wait for the GPU: synchronize and synchronous copies (implicit syncs)",
        ),
        ("alloc_ns", "BIGINT", "inside allocations (cudaMalloc*, cuMemAlloc, host alloc; async ones too)"),
        ("free_ns", "BIGINT", "inside frees"),
        ("copy_ns", "BIGINT", "inside asynchronous copies"),
        ("other_ns", "BIGINT", "inside other CUDA calls (memset, stream waits)"),
        ("runq_self_ns", "BIGINT", "outside calls, runnable and waiting for a CPU held by a thread of its own process"),
        ("runq_tree_ns", "BIGINT", "... held by another process of the traced tree (its own workers)"),
        ("runq_other_ns", "BIGINT", "... held by a process outside the traced tree (other tenants)"),
        ("runq_tracer_ns", "BIGINT", "... held by the tracer"),
        ("blocked_ns", "BIGINT", "outside calls, off CPU and not runnable: sleep, futex (GIL, queues), I/O"),
        ("io_ns", "BIGINT", "of blocked_ns, uninterruptible (disk I/O, page-fault I/O, mmap lock)"),
        ("call_off_cpu_ns", "BIGINT", "of the time inside calls, off CPU (informational; already in the call parts)"),
        ("call_runq_ns", "BIGINT", "of call_off_cpu_ns, runnable and waiting for a CPU"),
        ("faults", "BIGINT", "user page faults taken by the thread"),
        ("page_alloc_bytes", "BIGINT", "bytes of pages allocated in the thread's context (mm_page_alloc)"),
        ("reclaim_ns", "BIGINT", "time in direct reclaim (vmscan direct_reclaim_begin..end)"),
        (
            "page_cache_bytes",
            "BIGINT",
            "of page_alloc_bytes, pages the thread added to the page cache (file writes and reads, not faults)",
        ),
        ("launch_sampled", "DOUBLE", "share of this second the launch probes were live (1.0: launch_ns exact)"),
    ),
    _t(
        "thread_wakers",
        "Exact per-(thread, second, waker) totals of blocked intervals: who woke the thread (sched_waking), e.g. "
        "the GIL holder or the worker that delivered a batch.",
        ("sec", "BIGINT", "second since session start (of the wakeup)"),
        ("pid", "INTEGER", "blocked thread's process id"),
        ("tid", "INTEGER", "blocked thread"),
        ("in_call", "BOOLEAN", "true when the thread was blocked inside a CUDA call"),
        ("waker_pid", "INTEGER", "process of the waking task (0: an interrupt, the idle task, or no waker seen)"),
        ("waker_tid", "INTEGER", "waking thread"),
        (
            "waker_comm",
            "VARCHAR",
            "its name; pid 0: the interrupt's kind [timer] [block] [net] [softirq] [irq], [idle], or [unseen] (the "
            "thread became runnable with no wakeup the probes saw)",
        ),
        ("wakeups", "BIGINT", "wakeups of the thread by that waker"),
        ("blocked_ns", "BIGINT", "blocked time that those wakeups ended"),
    ),
    _t(
        "cuda_calls",
        "Individual CUDA API calls (sampled within a budget; slow calls always kept). Counts: use op_stats.",
        ("ts_ns", "BIGINT", "call entry, ns since session start"),
        ("dur_ns", "BIGINT", "call latency in ns (entry to return)"),
        ("pid", "INTEGER", "process id"),
        ("tid", "INTEGER", "thread id"),
        ("op", "VARCHAR", "API function, e.g. cudaMalloc, cudaStreamSynchronize, cuLaunchKernel"),
        ("layer", "VARCHAR", "runtime (libcudart, and libnccl's collectives) | driver (libcuda)"),
        ("bytes", "BIGINT", "bytes allocated / copied / set, NULL when not applicable"),
        ("kind", "VARCHAR", "memcpy direction HtoD | DtoH | DtoD | HtoH | default, NULL otherwise"),
        ("stream", "UBIGINT", "CUDA stream handle (0 = legacy default stream), NULL when not applicable"),
        ("kernel", "VARCHAR", "launched kernel's demangled name (launches only), NULL if unresolved"),
        ("ret", "INTEGER", "return code (0 = cudaSuccess / CUDA_SUCCESS)"),
        ("stack_id", "BIGINT", "stacks.stack_id of the call's stack, NULL if not captured"),
        ("off_cpu_ns", "BIGINT", "time the calling thread was off CPU during the call"),
        ("runq_ns", "BIGINT", "part of off_cpu_ns spent runnable, waiting for a CPU"),
        (
            "kernel_note",
            "VARCHAR",
            "launches only: why kernel is NULL (e.g. a stripped library, with its build-id; a driver handle whose "
            "cuModuleGetFunction was not seen)",
        ),
    ),
    _t(
        "op_stats",
        "Exact per-(pid, op) aggregates over every call, counted in kernel. Histogram buckets are log-linear "
        "(16 per power of two, <= 3.1% error at the bucket midpoint).",
        ("pid", "INTEGER", "process id"),
        ("op", "VARCHAR", "API function"),
        ("layer", "VARCHAR", "runtime | driver"),
        ("calls", "BIGINT", "number of calls (scaled up when sampled_fraction < 1)"),
        ("total_ns", "BIGINT", "sum of latencies"),
        ("min_ns", "BIGINT", "fastest call"),
        ("max_ns", "BIGINT", "slowest call"),
        ("p50_ns", "BIGINT", "median latency from the histogram"),
        ("p95_ns", "BIGINT", "95th percentile"),
        ("p99_ns", "BIGINT", "99th percentile"),
        ("bytes", "BIGINT", "total bytes moved / allocated"),
        ("sampled_fraction", "DOUBLE", "1.0 = every call counted; < 1 = probe duty-cycled, counts scaled"),
        (
            "error_pct",
            "DOUBLE",
            "bound on the relative error of scaled calls/total_ns in percent (0 when exact): from the parts of the "
            "process's active span not covered by a live window",
        ),
        ("hist", "STRUCT(lo_ns BIGINT, hi_ns BIGINT, count BIGINT)[]", "latency histogram buckets"),
    ),
    _t(
        "sched",
        "Off-CPU intervals of target threads (within a budget that always keeps intervals >= 1 ms and those "
        "overlapping a stored CUDA call). Totals for every interval: sched_stats.",
        ("ts_ns", "BIGINT", "when the thread left the CPU"),
        ("dur_ns", "BIGINT", "how long it was off CPU"),
        ("pid", "INTEGER", "process id"),
        ("tid", "INTEGER", "thread id"),
        ("comm", "VARCHAR", "thread name"),
        ("cpu", "INTEGER", "CPU it left"),
        (
            "reason",
            "VARCHAR",
            "preempted (switched out while runnable) | sleep (blocked) | io (uninterruptible)",
        ),
        ("runq_ns", "BIGINT", "of dur_ns, time runnable but waiting for a CPU"),
        ("preempted_by_pid", "INTEGER", "process that held the CPU until the thread got it back (NULL: no wait)"),
        ("preempted_by_comm", "VARCHAR", "its name"),
        (
            "waker_pid",
            "INTEGER",
            "for a blocked interval, the process that woke the thread (0: an interrupt; NULL: preempted, or no "
            "waker seen)",
        ),
        ("waker_tid", "INTEGER", "the waking thread"),
        (
            "waker_comm",
            "VARCHAR",
            "its name, or an interrupt's kind as in thread_wakers; [unseen] for a blocked interval whose wakeup the "
            "probes did not see",
        ),
        ("in_call", "BOOLEAN", "true when a CUDA call was in flight on the thread"),
    ),
    _t(
        "sched_stats",
        "Exact per-(tid, second) scheduling aggregates for every target thread.",
        ("sec", "BIGINT", "second since session start (ts_ns // 1e9)"),
        ("pid", "INTEGER", "process id"),
        ("tid", "INTEGER", "thread id"),
        ("switches", "BIGINT", "times switched out"),
        ("preemptions", "BIGINT", "of those, while runnable"),
        ("off_cpu_ns", "BIGINT", "total off-CPU time"),
        ("runq_ns", "BIGINT", "total run-queue wait"),
        ("max_off_cpu_ns", "BIGINT", "worst single off-CPU interval"),
    ),
    _t(
        "preemptors",
        "Per-second CPU time taken from target threads by each other task, by (pid, comm) and waiting thread.",
        ("sec", "BIGINT", "second since session start"),
        ("tid", "INTEGER", "the target thread that waited"),
        ("pid", "INTEGER", "preempting task's process id"),
        ("comm", "VARCHAR", "its name"),
        ("is_target", "BOOLEAN", "true when the preemptor is itself in the traced tree"),
        ("is_tracer", "BOOLEAN", "true when the preemptor is the tracer (never a culprit)"),
        ("preemptions", "BIGINT", "times it took the CPU from a target thread"),
        ("runq_ns", "BIGINT", "run-queue wait it caused to target threads"),
    ),
    _t(
        "process_events",
        "Process lifecycle of the traced tree: never sampled or dropped.",
        ("ts_ns", "BIGINT", "when"),
        ("kind", "VARCHAR", "fork | exec | exit | rename | oom_kill"),
        ("pid", "INTEGER", "process id"),
        ("ppid", "INTEGER", "parent (fork), NULL otherwise"),
        ("child", "INTEGER", "new child pid (fork), NULL otherwise"),
        ("comm", "VARCHAR", "process name (after exec/rename: the new one)"),
        ("filename", "VARCHAR", "exec'd file (exec)"),
        ("exit_code", "INTEGER", "exit status (exit)"),
    ),
    _t(
        "host_samples",
        "About 1 Hz host samples: /proc plus BPF counters.",
        ("ts_ns", "BIGINT", "when"),
        ("load1", "DOUBLE", "1-minute load average"),
        ("cpu_busy_pct", "DOUBLE", "CPU busy percent over the last interval, all CPUs"),
        ("runnable", "INTEGER", "runnable tasks (procs_running)"),
        ("mem_available_bytes", "BIGINT", "MemAvailable"),
        ("swap_used_bytes", "BIGINT", "SwapTotal - SwapFree"),
        ("page_alloc_bytes", "BIGINT", "bytes of pages allocated host-wide in the interval (mm_page_alloc)"),
        ("target_page_alloc_bytes", "BIGINT", "of those, by the traced tree"),
        ("page_faults", "BIGINT", "user page faults in the traced tree in the interval"),
        ("ctx_switches", "BIGINT", "context switches host-wide in the interval"),
        ("tracer_cpu_ms", "DOUBLE", "CPU ms the tracer's own processes used in the interval"),
    ),
    _t(
        "process_placement",
        "Where each process of the traced tree may run (issue 28): its CPU affinity and its cgroup's cpuset and CPU "
        "quota. Read at attach and at each exec, and again at the end for a process whose placement changed; a "
        "forked child has its parent's until a row of its own says otherwise. Older recordings lack this table.",
        ("ts_ns", "BIGINT", "when it was read"),
        ("pid", "INTEGER", "process id"),
        ("cpus_allowed", "VARCHAR", "its main thread's CPU affinity (sched_getaffinity), a CPU list: '0', '0-3,6'"),
        ("cpus", "INTEGER", "CPUs in cpus_allowed"),
        ("cgroup", "VARCHAR", "its cgroup (/proc/PID/cgroup: the v2 path, or the v1 cpu controller's)"),
        ("cpuset_cpus", "VARCHAR", "the cgroup's effective cpuset, a CPU list (NULL: unknown)"),
        ("limit_cgroup", "VARCHAR", "the cgroup (it or an ancestor) whose CPU quota binds it; NULL: no quota"),
        ("quota_us", "BIGINT", "that quota: CPU us per period (cpu.max / cpu.cfs_quota_us); NULL: no limit"),
        ("period_us", "BIGINT", "its period, us"),
        (
            "exec_from",
            "VARCHAR",
            "at an exec: the command line of the image it replaced (a launcher such as `taskset -c 0 python ...` "
            "that set the affinity and exec'd the job)",
        ),
        (
            "env",
            "VARCHAR",
            "launcher settings in its environment that place it, space-separated KEY=VALUE (SLURM_CPUS_PER_TASK, "
            "SLURM_CPU_BIND, KUBERNETES_SERVICE_HOST, container)",
        ),
        (
            "container_id",
            "VARCHAR",
            "the container it runs in, the 64-hex id its cgroup path names (docker, containerd/CRI, CRI-O, podman; "
            "tracer/containers.py); NULL outside a container. Recordings before issue 32 lack these four columns",
        ),
        ("pod_uid", "VARCHAR", "the Kubernetes pod UID its cgroup path names (kubepods...pod<uid>); NULL: none"),
        (
            "pod_name",
            "VARCHAR",
            "the pod's name, from its environment: a downward-API POD_NAME (or MY_POD_NAME, K8S_POD_NAME), else "
            "HOSTNAME inside a pod (the kubelet sets it to the pod name); NULL: not in a pod",
        ),
        ("pod_namespace", "VARCHAR", "the pod's namespace, from a downward-API POD_NAMESPACE; NULL: not set"),
    ),
    _t(
        "cgroup_cpu",
        "About 1 Hz CPU throttling of each cgroup whose quota binds a traced process (cpu.stat, cumulative: take "
        "differences between rows). Older recordings lack this table.",
        ("ts_ns", "BIGINT", "when"),
        ("cgroup", "VARCHAR", "the cgroup (process_placement.limit_cgroup)"),
        ("quota_us", "BIGINT", "its CPU quota per period, us"),
        ("period_us", "BIGINT", "its period, us"),
        ("nr_periods", "BIGINT", "periods with runnable tasks so far"),
        ("nr_throttled", "BIGINT", "of those, periods that ran out of quota"),
        ("throttled_ns", "BIGINT", "time its runqueues spent throttled so far, summed over CPUs"),
    ),
    _t(
        "cpu_idle",
        "About 1 Hz per-CPU busy and idle time (/proc/stat): which CPUs sat idle while the job waited for one. "
        "Older recordings lack this table.",
        ("ts_ns", "BIGINT", "when the interval ended"),
        ("cpu", "INTEGER", "CPU number"),
        ("idle_ns", "BIGINT", "idle (and iowait) time in the interval"),
        ("busy_ns", "BIGINT", "busy time in the interval (user, system, irq, steal)"),
    ),
    _t(
        "stacks",
        "Deduplicated call stacks: one row per frame, outermost first (depth 0). Python frames carry the "
        "executing line.",
        ("stack_id", "BIGINT", "id referenced by cuda_calls, offcpu_stacks and cpu_samples .stack_id"),
        ("depth", "INTEGER", "0 = outermost"),
        ("kind", "VARCHAR", "python | native | cuda"),
        ("module", "VARCHAR", "shared object (native) or module file (python)"),
        ("function", "VARCHAR", "demangled function / Python qualname"),
        ("file", "VARCHAR", "source file when known"),
        ("line", "INTEGER", "source line when known"),
        (
            "line_approx",
            "BOOLEAN",
            "true when line is the function's def line because the executing line could not be decoded",
        ),
    ),
    _t(
        "offcpu_stacks",
        "Exact blocked time of every target thread by where it blocked: per (second, thread, stack, sleep state, "
        "waker), counted in kernel at each blocking switch-out (the stack is captured then) and wakeup. Outside "
        "calls the rows of a thread sum to its thread_breakdown.blocked_ns; the wait for a CPU after the wakeup "
        "is not here (thread_breakdown runq_*). E.g. where the training thread waits: GROUP BY stack_id.",
        ("sec", "BIGINT", "second since session start (of the wakeup)"),
        ("pid", "INTEGER", "process id"),
        ("tid", "INTEGER", "thread id"),
        ("stack_id", "BIGINT", "stacks.stack_id where it blocked (innermost frame last), NULL if not captured"),
        ("state", "VARCHAR", "S (sleeping: futex, GIL, sleep, poll) | D (uninterruptible: disk I/O, fsync)"),
        ("in_call", "BOOLEAN", "true when blocked inside a CUDA call"),
        ("waker_pid", "INTEGER", "process of the waking task (0: an interrupt handler, see waker_comm)"),
        ("waker_tid", "INTEGER", "waking thread (NULL: an interrupt handler)"),
        ("waker_comm", "VARCHAR", "its name, or the handler's kind: [timer] [block] [net] [softirq] [irq]"),
        ("intervals", "BIGINT", "blocked intervals"),
        ("blocked_ns", "BIGINT", "time blocked, switch-out to wakeup"),
    ),
    _t(
        "cpu_samples",
        "Where target threads spend CPU: perf cpu-clock samples at session.sample_hz, counted in kernel per "
        "(second, thread, stack). Every thread of the job, CUDA-calling or not. Python stacks are the Python frames "
        "alone (the executing lines); threads without Python have native stacks.",
        ("sec", "BIGINT", "second since session start"),
        ("pid", "INTEGER", "process id"),
        ("tid", "INTEGER", "thread id"),
        ("stack_id", "BIGINT", "stacks.stack_id (innermost frame last), NULL if not captured"),
        ("in_call", "BOOLEAN", "true when the sample fell inside a CUDA call"),
        ("kernel", "BOOLEAN", "true when the sample interrupted kernel code (a syscall, a page fault)"),
        ("samples", "BIGINT", "samples"),
        ("cpu_ns", "BIGINT", "CPU time they stand for: samples x 1e9 / sample_hz"),
    ),
    _t(
        "gc_collections",
        "Collections of CPython's cyclic garbage collector in target threads, one row each: from the interpreter's "
        "USDT probes python:gc__start/gc__done where it has them (Debian's and Ubuntu's system Pythons), else from "
        "the collector's function (gc_collect_main). Absent from recordings made before it existed, and empty when "
        "Python stacks were off (--no-python-stacks) or the interpreter has neither.",
        ("ts_ns", "BIGINT", "ns since session start: the collection's start"),
        ("dur_ns", "BIGINT", "its duration: the thread's time inside the collector"),
        (
            "off_cpu_ns",
            "BIGINT",
            "of that, off CPU (preempted, or blocked in a finalizer): dur_ns - off_cpu_ns is the collector's CPU",
        ),
        ("runq_ns", "BIGINT", "of off_cpu_ns, runnable but waiting for a CPU"),
        ("pid", "INTEGER", "process id"),
        ("tid", "INTEGER", "thread id"),
        ("generation", "INTEGER", "0 (youngest) .. 2 (full collection); NULL unknown"),
        ("collected", "BIGINT", "objects collected; NULL unknown"),
        (
            "stack_id",
            "BIGINT",
            "stacks.stack_id of the allocation that crossed the collector's threshold (or the gc.collect() call), "
            "its innermost Python line that allocation's: up to 3.11 the thread's stack as the collection started "
            "(it runs inside the allocation); from 3.12 the stack of the allocation that scheduled it (it runs at "
            "the next eval-breaker check, often another line), else the start's; NULL not captured",
        ),
    ),
    _t(
        "causal_chains",
        "Diagnoses with severity, evidence and fixes. Append-only history (computed_at).",
        ("id", "VARCHAR", "stable id of the chain"),
        ("computed_at", "TIMESTAMPTZ", "when the analysis ran"),
        ("severity", "VARCHAR", "HIGH | MEDIUM | LOW"),
        (
            "category",
            "VARCHAR",
            "cpu_contention | sync_stall | allocation_churn | process_churn | memory_pressure | dataloader_starvation "
            "| launch_bound | gpu_bound | straggler_rank | gil_contention | blocking_io | host_python "
            "| lock_contention | cpu_placement | gc_pause | hang",
        ),
        ("start_ns", "BIGINT", "start of the affected time range"),
        ("end_ns", "BIGINT", "end"),
        ("pids", "INTEGER[]", "affected processes"),
        ("op", "VARCHAR", "affected CUDA op"),
        ("summary", "VARCHAR", "one-sentence diagnosis"),
        ("evidence", "JSON", "measured numbers behind it, and the wait path: evidence->'path' (hops), ->'root'"),
        ("recommendations", "JSON", "fixes specific to this trace"),
    ),
    _t(
        CHAINS_RESULT,
        "The causal chains' whole answer as `tracer record` computed it at the recording's end (every chain, the "
        "counts and the coverage): get_causal_chains, get_trace_stats and compare_traces serve it when they ask of "
        "the whole recording, if the same analysis code reads the same rows. A job of several recordings, a "
        "Parquet dataset, a live snapshot or a pid filter computes the chains afresh.",
        ("analysis", "VARCHAR", "hash of the tracer's analysis code that computed it"),
        ("row_counts", "VARCHAR", "every table's row count then (table:count,...): rows changed since, it is stale"),
        ("computed_at", "TIMESTAMPTZ", "when"),
        ("result", "JSON", "the answer: get_causal_chains' output with every chain"),
    ),
    _t(
        "kernel_names",
        "Launch targets resolved to names: (pid, function pointer or CUfunction) -> demangled symbol.",
        ("pid", "INTEGER", "process id"),
        ("func", "UBIGINT", "host stub address (cudaLaunchKernel) or CUfunction handle (cuLaunchKernel)"),
        ("name", "VARCHAR", "demangled kernel name"),
    ),
    _t(
        "nccl_comms",
        "NCCL communicators each process joined (ncclCommInitRank / ncclCommInitRankConfig): its rank in each, the "
        "size, and the unique id's hash that every rank of one communicator shares (across processes and hosts).",
        ("ts_ns", "BIGINT", "ns since session start: the call's entry"),
        ("dur_ns", "BIGINT", "until it returned: the set-up waits for every rank to join"),
        ("pid", "INTEGER", "process id"),
        ("tid", "INTEGER", "thread id"),
        ("comm", "UBIGINT", "the ncclComm_t handle the call made (0 if it failed before making one)"),
        ("id_hash", "UBIGINT", "FNV-1a of the 128-byte ncclUniqueId: equal for every rank of one communicator"),
        ("nranks", "INTEGER", "ranks in the communicator"),
        ("rank", "INTEGER", "this process's rank in it"),
        ("ret", "INTEGER", "ncclResult_t: 0 is ncclSuccess"),
    ),
    _t(
        "nccl_progress",
        "NCCL collectives each process entered, per op and communicator, counted in kernel at every call's entry "
        "(never sampled; rewritten at the end and at each live snapshot). Join nccl_comms on (pid, comm) for the rank "
        "and id_hash: ranks of one communicator whose counts differ are out of step, and the lowest is the one the "
        "others wait for. Absent from recordings made before it.",
        ("pid", "INTEGER", "process id"),
        (
            "op",
            "VARCHAR",
            "collective: ncclAllReduce, ncclAllGather, ncclReduceScatter, ncclBroadcast, ncclReduce, "
            "ncclSend, ncclRecv",
        ),
        ("comm", "UBIGINT", "the ncclComm_t handle the calls passed (nccl_comms.comm)"),
        ("calls", "BIGINT", "calls entered (a call still blocked inside is counted)"),
        ("first_ns", "BIGINT", "ns since session start: the first call's entry"),
        ("last_ns", "BIGINT", "ns since session start: the last call's entry"),
    ),
    _t(
        "thread_snapshots",
        "What each target thread was doing at a moment, read from /proc and the interpreter's memory without "
        "stopping it (tracer.snapshot): every thread at attach and at the end, and a thread again once it has not run "
        "for a second. A thread blocked for the whole recording has no switch-out and so no off-CPU stack: this is "
        "its stack and since-when. Absent from recordings made before it.",
        ("ts_ns", "BIGINT", "ns since session start: when the snapshot was read"),
        ("reason", "VARCHAR", "attach | idle (not run for a second) | end"),
        ("pid", "INTEGER", "process id"),
        ("tid", "INTEGER", "thread id"),
        ("comm", "VARCHAR", "thread name"),
        ("rank", "INTEGER", "the process's rank from its environment (NULL: none)"),
        ("state", "VARCHAR", "running | sleeping | disk | stopped | zombie ..."),
        ("syscall", "VARCHAR", "the system call it sits in ('' in user space or running, NULL unreadable)"),
        ("wchan", "VARCHAR", "the kernel function it waits in"),
        ("blocked_since_ns", "BIGINT", "ns since session start when it last ran (may be negative; NULL: unknown)"),
        ("native", "VARCHAR", "the native function its system call was made from"),
        ("frames", "VARCHAR", "Python frames innermost first, JSON [{function, file, line}]"),
        (
            "waits_on",
            "VARCHAR",
            "the file its blocking call waits on: what its fd names (a path, pipe:[N], socket:[N]) or the path it "
            "is opening; '' none (absent from recordings made before it)",
        ),
    ),
    _t(
        "dropped_rows",
        "Detail rows thinned to keep the file under `tracer record --max-db-size`: one row per table thinned "
        "(cuda_calls, sched, offcpu_stacks, cpu_samples), oldest first by whole time ranges. Every row of that table "
        "before to_ns was dropped; op_stats, threads, thread_breakdown, sched_stats, thread_wakers and preemptors "
        "are never thinned and cover the whole recording. Empty when nothing was thinned. cuda_calls rows + its "
        "rows here = session.events_stored.",
        ("table_name", "VARCHAR", "the table thinned"),
        ("rows", "BIGINT", "rows dropped from it"),
        ("from_ns", "BIGINT", "time of the oldest row dropped (ns since session start; a per-second row: its sec)"),
        (
            "to_ns",
            "BIGINT",
            "the cut, ns since session start: no row of the table before it is left, every row from it on is kept",
        ),
        ("thinnings", "INTEGER", "times it was thinned"),
    ),
)

TABLE_BY_NAME: dict[str, Table] = {t.name: t for t in TABLES}


def schema_markdown() -> str:
    """Return the schema as Markdown: every table and column with its meaning, plus example queries."""
    out = [
        "# cuda-host-tracer trace DB schema",
        "",
        "Timestamps `ts_ns` are ns since session start; `ts_ns // 10_000_000_000` buckets by 10 s.",
        "",
    ]
    for t in TABLES:
        out += [f"## {t.name}", t.doc, "", "| column | type | meaning |", "|---|---|---|"]
        out += [f"| {c.name} | {c.type} | {c.doc} |" for c in t.columns]
        out.append("")
    out += [
        "## Example queries",
        "```sql",
        "-- slowest syncs and how much of each was spent off CPU",
        "SELECT ts_ns, pid, tid, dur_ns/1e3 AS us, off_cpu_ns/1e3 AS off_us FROM cuda_calls",
        "WHERE op LIKE '%Synchronize' ORDER BY dur_ns DESC LIMIT 20;",
        "-- 10 s buckets",
        "SELECT ts_ns // 10000000000 * 10 AS t_s, op, count(*), quantile_cont(dur_ns, 0.99)/1e3 AS p99_us",
        "FROM cuda_calls GROUP BY ALL ORDER BY ALL;",
        "-- who preempted the traced threads",
        "SELECT comm, pid, sum(preemptions), sum(runq_ns)/1e6 AS runq_ms FROM preemptors GROUP BY ALL",
        "ORDER BY runq_ms DESC;",
        "```",
    ]
    return "\n".join(out)
