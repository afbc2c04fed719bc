"""The scenarios the analyses must recognise, as hand-built recordings (:mod:`tests.support.builder`).

``SCENARIOS``: ``healthy``, ``cpu_contention``, ``process_churn``, ``memory_pressure``, ``allocation_churn``,
``sync_stall``, ``fault_storm``, ``dataloader_starvation``, ``launch_bound``, ``gpu_bound``, all but two built on
one training loop (:func:`_base`). ``build(name, path)`` writes one and returns its builder, whose rows are the
expected values.

    .venv/bin/python -m tests.support.scenarios OUTDIR   # write every scenario
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.builder import GIB, HOG_PID, MAIN_PID, MIB, MS, TRACER_PID, US, S, TraceBuilder

TRAIN_STACK = [
    ("python", "train.py", "<module>", "train.py", 140),
    ("python", "train.py", "main", "train.py", 131),
    ("python", "train.py", "train_step", "train.py", 88),
    ("native", "libtorch_cuda.so", "at::native::_local_scalar_dense_cuda", None, None),
    ("cuda", "libcudart.so.12", "cudaStreamSynchronize", None, None),
]
LAUNCH_STACK = [
    ("python", "train.py", "<module>", "train.py", 140),
    ("python", "train.py", "main", "train.py", 131),
    ("python", "train.py", "train_step", "train.py", 84),
    ("native", "libtorch_cuda.so", "at::native::gpu_kernel_impl", None, None),
    ("cuda", "libcudart.so.12", "cudaLaunchKernel", None, None),
]
ITEM_STACK = TRAIN_STACK[:2] + [
    ("python", "train.py", "train_step", "train.py", 92),
    ("native", "libtorch_cuda.so", "at::native::_local_scalar_dense_cuda", None, None),
    ("cuda", "libcudart.so.12", "cudaMemcpy", None, None),
]
ALLOC_STACK = [
    ("python", "alloc_stress.py", "<module>", "alloc_stress.py", 120),
    ("python", "alloc_stress.py", "main", "alloc_stress.py", 114),
    ("python", "alloc_stress.py", "allocate_batch", "alloc_stress.py", 74),
    ("native", "libc10_cuda.so", "c10::cuda::CUDACachingAllocator::malloc", None, None),
    ("cuda", "libcudart.so.12", "cudaMalloc", None, None),
]
FREE_STACK = ALLOC_STACK[:3] + [
    ("native", "libc10_cuda.so", "c10::cuda::CUDACachingAllocator::emptyCache", None, None),
    ("cuda", "libcudart.so.12", "cudaFree", None, None),
]

# The shared training loop: 100 ms steps. Per step, at its start: 5 launches (each with the driver launch inside
# it; 2 of 5 stored, as a sampled hot op), an async HtoD copy, then PYTHON_NS of host work (dispatching the rest
# of the step while the GPU runs), then a stream sync that waits until the GPU is done at GPU_NS, then a short
# wait for the next batch (woken by a DataLoader worker) and the next step.
STEP_NS = 100 * MS
PYTHON_NS = 20 * MS
GPU_NS = 98 * MS
BATCH_WAIT_NS = 500 * US


@dataclass
class Step:
    """What a scenario may change in one step of the loop."""

    i: int
    t0: int
    python_ns: int = PYTHON_NS
    gpu_end_ns: int = GPU_NS  # offset from t0 at which the GPU finishes the step's work
    batch_wait_ns: int = BATCH_WAIT_NS
    skip: bool = False  # no step at all (the thread is doing something else then)


def _base(
    b: TraceBuilder,
    rng: random.Random,
    *,
    workers: int = 2,
    shape: Callable[[Step], None] | None = None,
    python_gap: Callable[[Step, int, int], None] | None = None,
    sync: Callable[[Step, int, int], tuple[int, int, int, int | None]] | None = None,
) -> None:
    """The training loop every scenario shares (see STEP_NS), on a quiet host.

    Hooks: ``shape(step)`` edits a step; ``python_gap(step, a, b)`` adds off-CPU intervals inside the host-work
    gap [a, b) (and must keep the gap's end); ``sync(step, ts, wait_ns) -> (dur, off_cpu, runq, holder)`` shapes
    the sync that starts at ts and would wait ``wait_ns`` for the GPU.
    """
    b.process(MAIN_PID, "python3", ppid=1, cmdline="python train.py")
    for w in range(workers):
        pid = MAIN_PID + 1 + w
        b.process(pid, "pt_data_worker", ppid=MAIN_PID, first_ns=500 * MS)
        b.event(500 * MS, "fork", MAIN_PID, "python3", ppid=1, child=pid)
        b.event(501 * MS, "rename", pid, "pt_data_worker")
    launch = b.stack(LAUNCH_STACK)
    sync_stack = b.stack(TRAIN_STACK)
    for i in range(int(b.duration_s * S // STEP_NS)):
        st = Step(i=i, t0=i * STEP_NS)
        if shape:
            shape(st)
        if st.skip:
            continue
        t = st.t0 + 200 * US
        for k in range(5):
            d = rng.randint(6 * US, 12 * US)
            b.call(t, d, "cudaLaunchKernel", stack_id=launch, kernel=f"elementwise_kernel_{k}", stream=7, stored=k < 2)
            b.call(t + 1 * US, d - 2 * US, "cuLaunchKernel", stream=7, stored=k < 2)
            t += 40 * US
        b.call(t, rng.randint(18 * US, 25 * US), "cudaMemcpyAsync", bytes=4 << 20, kind="HtoD", stream=7)
        t += 100 * US
        if python_gap:
            python_gap(st, t, t + st.python_ns)
        t += st.python_ns
        wait = max(st.t0 + st.gpu_end_ns - t, 20 * US)
        dur, off, runq, holder = sync(st, t, wait) if sync else (wait, max(wait - 60 * US, 0), 0, None)
        b.call(t, dur, "cudaStreamSynchronize", stack_id=sync_stack, stream=7, off_cpu_ns=off, runq_ns=runq)
        if off:
            b.off_cpu(
                t + 30 * US,
                off,
                reason="sleep",
                runq_ns=runq,
                by_pid=holder,
                by_comm=_comm_of(b, holder),
            )
        t += dur
        if workers and st.batch_wait_ns:
            # the next batch is not quite ready: the main thread blocks until a worker hands it over
            w = MAIN_PID + 1 + st.i % workers
            b.off_cpu(t + 200 * US, st.batch_wait_ns, reason="sleep", waker_pid=w, waker_comm="pt_data_worker")
    for w in range(workers):
        pid = MAIN_PID + 1 + w
        for i in range(int(b.duration_s * S // STEP_NS)):
            # the workers' own blocking reads
            b.off_cpu(i * STEP_NS + 20 * MS, 5 * MS, pid=pid, comm="pt_data_worker", reason="io")
    for sec in range(int(b.duration_s)):
        b.host(sec, load1=2.0 + rng.random(), cpu_busy_pct=25 + 10 * rng.random())


def add_tracer(b: TraceBuilder) -> None:
    """Add the recorder's process (role tracer) to the scenario, as the recorder writes it."""
    b.process(TRACER_PID, "tracer", ppid=1, cmdline="tracer record -- python train.py", role="tracer")


def _comm_of(b: TraceBuilder, pid: int | None) -> str | None:
    if pid is None:
        return None
    if pid == HOG_PID:
        return "stress-ng"
    return next((p["comm"] for p in b.processes if p["pid"] == pid), "?")


def healthy(b: TraceBuilder) -> None:
    """GPU-bound and well fed: the thread waits for the GPU ~77 % of each step, its host work overlaps it."""
    _base(b, random.Random(1))


GPU_BOUND_PYTHON_NS = 8 * MS


def gpu_bound(b: TraceBuilder) -> None:
    """As healthy with less than half the host work: 89.5 % of each step waiting for the GPU."""

    def shape(st: Step) -> None:
        st.python_ns = GPU_BOUND_PYTHON_NS

    _base(b, random.Random(11), shape=shape)


def cpu_contention(b: TraceBuilder) -> None:
    """A foreign CPU hog (stress-ng, pid 4242) takes the training thread's CPU in t = 20..40 s: 60 ms of each
    step between calls (its Python work waits in the run queue) and 8-12 ms at the end of each sync."""
    rng = random.Random(2)
    hot = range(20 * S, 40 * S)

    def gap(st: Step, a: int, end: int) -> None:
        if st.t0 in hot:
            b.off_cpu(
                a + 5 * MS, 60 * MS, reason="preempted", runq_ns=60 * MS, by_pid=HOG_PID, by_comm="stress-ng", cpu=3
            )

    def shape(st: Step) -> None:
        if st.t0 in hot:
            st.python_ns = PYTHON_NS + 60 * MS  # the same work, stretched by the wait

    def sync(st: Step, ts: int, wait: int) -> tuple[int, int, int, int | None]:
        if st.t0 in hot:  # the GPU is done early; the thread then waits for the CPU the hog holds
            runq = rng.randint(8 * MS, 12 * MS)
            return wait, wait - 60 * US, runq, HOG_PID
        return wait, max(wait - 60 * US, 0), 0, None

    _base(b, rng, shape=shape, python_gap=gap, sync=sync)
    b.target = "pid 1000"
    # a little contention from the training job's own worker, for contrast (outside calls, in the Python gap)
    for sec in range(0, 60, 5):
        b.off_cpu(
            sec * S + 5 * MS,
            300 * US,
            reason="preempted",
            runq_ns=300 * US,
            by_pid=MAIN_PID + 1,
            by_comm="pt_data_worker",
            cpu=1,
        )
    for h in b.host_samples:
        if h["ts_ns"] in hot:
            h.update(load1=24.0, cpu_busy_pct=100.0, runnable=22)


def sync_stall(b: TraceBuilder) -> None:
    """train.py:92 reads the loss every step (``loss.item()``: a 4-byte DtoH cudaMemcpy): the thread does its
    45 ms of host work first while the GPU idles, then launches and waits for the GPU in the copy."""
    rng = random.Random(6)
    b.process(MAIN_PID, "python3", ppid=1, cmdline="python train.py")
    launch = b.stack(LAUNCH_STACK)
    item = b.stack(ITEM_STACK)
    for i in range(int(b.duration_s * S // STEP_NS)):
        t = i * STEP_NS + 45 * MS  # host work first: the GPU has nothing queued meanwhile
        for k in range(5):
            d = rng.randint(6 * US, 12 * US)
            b.call(t, d, "cudaLaunchKernel", stack_id=launch, stream=7, stored=k < 2)
            t += 40 * US
        wait = 50 * MS + rng.randint(-2 * MS, 2 * MS)
        b.call(t, wait, "cudaMemcpy", bytes=4, kind="DtoH", stack_id=item, off_cpu_ns=wait - 50 * US)
        b.call(t + 2 * US, wait - 4 * US, "cuMemcpyDtoH", bytes=4, kind="DtoH")
        b.off_cpu(t + 20 * US, wait - 50 * US, reason="sleep")
    for sec in range(int(b.duration_s)):
        b.host(sec)


def allocation_churn(b: TraceBuilder) -> None:
    """alloc_stress.py:74 allocate_batch: every 10 ms step a 64 MiB cudaMalloc (the driver's cuMemAlloc inside)
    and a cudaFree through empty_cache, ~28 % of the thread's time; every 50th allocation from line 46 (ctypes);
    every 10th step a stream-ordered cudaMallocAsync/cudaFreeAsync pair."""
    rng = random.Random(5)
    b.target = "python alloc_stress.py"
    b.process(MAIN_PID, "python3", ppid=1, cmdline="python alloc_stress.py")
    add_tracer(b)
    alloc = b.stack(ALLOC_STACK)
    free = b.stack(FREE_STACK)
    launch = b.stack(LAUNCH_STACK)
    direct = b.stack(
        ALLOC_STACK[:2]
        + [
            ("python", "alloc_stress.py", "direct_alloc", "alloc_stress.py", 46),
            ("native", "libffi.so.8", "ffi_call", None, None),
            ("cuda", "libcudart.so.12", "cudaMalloc", None, None),
        ]
    )
    # the loop's first launch comes before its first allocation and a sync after its last free: the thread's
    # steps hold every allocation call whole
    b.call(5 * S - 1 * MS, 10 * US, "cudaLaunchKernel", stack_id=launch, stream=7)
    b.call(55 * S, 50 * US, "cudaStreamSynchronize", stream=7)
    for i in range(5000):
        t = 5 * S + i * 10 * MS + 1 * MS
        d = rng.randint(1500 * US, 2500 * US)
        sid = direct if i % 50 == 0 else alloc
        b.call(t, d, "cudaMalloc", bytes=64 << 20, stack_id=sid)
        b.call(t + 5 * US, d - 50 * US, "cuMemAlloc", bytes=64 << 20)
        t += d + 100 * US
        b.call(t, rng.randint(6 * US, 12 * US), "cudaLaunchKernel", stack_id=launch, stream=7)
        t += 2 * MS
        b.call(t, rng.randint(500 * US, 1000 * US), "cudaFree", stack_id=free)
        if i % 10 == 0:
            b.call(t + 1500 * US, 200 * US, "cudaMallocAsync", bytes=1 << 20, stream=7, stack_id=alloc)
            b.call(t + 2000 * US, 100 * US, "cudaFreeAsync", stream=7)
    for sec in range(int(b.duration_s)):
        b.host(sec)


def process_churn(b: TraceBuilder) -> None:
    """DataLoader workers are forked for every 10 s epoch and exit at its end; each respawn blocks the main
    thread 3.5 s (forking, importing, then waiting for the new workers' first batch)."""
    rng = random.Random(3)
    epochs = [e * 10 * S for e in range(6)]
    stall = 3500 * MS

    def shape(st: Step) -> None:
        st.batch_wait_ns = 0
        st.skip = any(e <= st.t0 < e + stall for e in epochs[1:])

    _base(b, rng, workers=0, shape=shape)
    pid = MAIN_PID + 100
    for e_i, e in enumerate(epochs):
        first = pid + 1
        for w in range(4):
            pid += 1
            fork = e + (w + 1) * MS
            end = e + 10 * S - 50 * MS if e_i < len(epochs) - 1 else None
            b.process(pid, "pt_data_worker", ppid=MAIN_PID, first_ns=fork, exit_ns=end, exit_code=0 if end else None)
            b.event(fork, "fork", MAIN_PID, "python3", ppid=1, child=pid)
            b.event(fork + 300 * US, "rename", pid, "pt_data_worker")
            if end:
                b.event(end + w * MS, "exit", pid, "pt_data_worker", exit_code=0)
            b.off_cpu(fork + 1 * MS, 120 * MS + w * 10 * MS, pid=pid, comm="pt_data_worker", reason="io")
        if e_i:
            b.off_cpu(e + 10 * MS, stall - 20 * MS, reason="sleep", waker_pid=first, waker_comm="pt_data_worker")


def memory_pressure(b: TraceBuilder) -> None:
    """MemAvailable falls to 1.5 GiB and swap grows in t = 30..50 s: each step's host work stalls 70 ms in
    page-fault I/O (uninterruptible), outside any call."""
    hot = range(30 * S, 50 * S)

    def shape(st: Step) -> None:
        if st.t0 in hot:
            st.python_ns = PYTHON_NS + 70 * MS

    def gap(st: Step, a: int, end: int) -> None:
        if st.t0 in hot:
            b.off_cpu(a + 2 * MS, 70 * MS, reason="io")

    _base(b, random.Random(4), shape=shape, python_gap=gap)
    for h in b.host_samples:
        if h["ts_ns"] in hot:
            h.update(
                page_alloc_bytes=2 * GIB,
                target_page_alloc_bytes=GIB,
                mem_available_bytes=1536 << 20,
                swap_used_bytes=int(3 * GIB + (h["ts_ns"] - 30 * S) // S * 64 * MIB),
                page_faults=250_000,
            )


STORM_TID = MAIN_PID + 50


def fault_storm(b: TraceBuilder) -> None:
    """A Python thread of the training process (tid 1050, 'cache_fill') faults in 512 MiB/s of fresh pages in
    t = 10..50 s; each step the training thread blocks 30 ms on the GIL it holds (woken by it) and waits 15 ms for
    the CPU it holds."""
    hot = range(10 * S, 50 * S)

    def shape(st: Step) -> None:
        if st.t0 in hot:
            st.python_ns = PYTHON_NS + 45 * MS

    def gap(st: Step, a: int, end: int) -> None:
        if st.t0 in hot:
            b.off_cpu(
                a + 1 * MS, 30 * MS, reason="sleep", waker_pid=MAIN_PID, waker_tid=STORM_TID, waker_comm="cache_fill"
            )
            b.off_cpu(a + 40 * MS, 15 * MS, reason="preempted", runq_ns=15 * MS, by_pid=MAIN_PID, by_comm="cache_fill")

    _base(b, random.Random(7), shape=shape, python_gap=gap)
    b.thread(MAIN_PID, STORM_TID, "cache_fill", first_ns=5 * S, end_ns=55 * S)
    for sec in range(5, 55):
        if sec * S in hot:
            for q in range(4):  # four bursts a second
                b.faults(
                    sec * S + q * 250 * MS, STORM_TID, faults=32_768, page_alloc_bytes=128 * MIB, reclaim_ns=2 * MS
                )
            b.off_cpu(sec * S + 900 * MS, 20 * MS, tid=STORM_TID, comm="cache_fill", reason="io")
        else:
            b.faults(sec * S, STORM_TID, faults=100, page_alloc_bytes=400 << 10)
            b.off_cpu(sec * S + 10 * MS, 900 * MS, tid=STORM_TID, comm="cache_fill", reason="sleep")
    b.faults(1 * S, MAIN_PID, faults=2_000, page_alloc_bytes=8 * MIB)
    for h in b.host_samples:
        if h["ts_ns"] in hot:
            h.update(page_alloc_bytes=600 * MIB, target_page_alloc_bytes=530 * MIB, page_faults=140_000)


def dataloader_starvation(b: TraceBuilder) -> None:
    """Two DataLoader workers, on CPU nearly all the time, cannot keep up: the main thread blocks 40 ms a step
    until one of them hands over the batch."""

    def shape(st: Step) -> None:
        st.batch_wait_ns = 40 * MS
        st.gpu_end_ns = GPU_NS - 40 * MS  # the step's GPU work is the same; the wait is added after it

    _base(b, random.Random(8), shape=shape)
    b.sched = [r for r in b.sched if r["pid"] == MAIN_PID]  # workers: busy, barely ever off CPU
    for w in range(2):
        for sec in range(1, int(b.duration_s)):
            b.off_cpu(sec * S + 300 * MS, 2 * MS, pid=MAIN_PID + 1 + w, comm="pt_data_worker", reason="io")


def launch_bound(b: TraceBuilder) -> None:
    """A loop of tiny kernels: 50 steps/s of 20 launches with 0.9 ms of Python each, one sync per step that finds
    the GPU idle (15 µs): the host is the limit."""
    b.duration_s = 10.0
    rng = random.Random(9)
    b.process(MAIN_PID, "python3", ppid=1, cmdline="python train.py")
    launch = b.stack(LAUNCH_STACK)
    sync = b.stack(TRAIN_STACK)
    for i in range(int(b.duration_s * 50)):
        t = i * 20 * MS + 100 * US
        for k in range(20):
            d = rng.randint(6 * US, 12 * US)
            b.call(t, d, "cudaLaunchKernel", stack_id=launch, stream=7, stored=k % 4 == 0)
            t += 950 * US
        b.call(t, 15 * US, "cudaStreamSynchronize", stack_id=sync, stream=7)
    for sec in range(int(b.duration_s)):
        b.host(sec)


SCENARIOS: dict[str, Callable[[TraceBuilder], None]] = {
    "healthy": healthy,
    "cpu_contention": cpu_contention,
    "process_churn": process_churn,
    "memory_pressure": memory_pressure,
    "allocation_churn": allocation_churn,
    "sync_stall": sync_stall,
    "fault_storm": fault_storm,
    "dataloader_starvation": dataloader_starvation,
    "launch_bound": launch_bound,
    "gpu_bound": gpu_bound,
}


def builder(name: str) -> TraceBuilder:
    b = TraceBuilder()
    SCENARIOS[name](b)
    return b


def build(name: str, path: str | Path) -> TraceBuilder:
    """Write scenario ``name`` to ``path``; return the builder (its rows are the expected values)."""
    b = builder(name)
    b.write(path)
    return b


if __name__ == "__main__":
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for name in SCENARIOS:
        build(name, out / f"{name}.duckdb")
        print(out / f"{name}.duckdb")
