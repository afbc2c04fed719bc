"""Build small trace DBs by hand from :mod:`tracer.schema`, one per scenario the analyses must recognise.

Analysis tests need DBs whose every number is known. :class:`TraceBuilder` collects rows the way the recorder
would write them and derives the exact aggregates (``op_stats`` with its log-linear histogram,
``sched_stats``,
``preemptors``) from the stored rows, so a test can recompute any expected value from the builder itself.

Scenarios (``SCENARIOS``): ``healthy``, ``cpu_contention``, ``process_churn``, ``memory_pressure``,
``allocation_churn``, ``sync_stall``. ``build(name, path)`` writes one; ``generate_large(path, n_calls)``
writes a
synthetic DB with millions of ``cuda_calls`` rows for benchmarks (``bench/`` imports it from here).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tracer.schema import APP_ID, SCHEMA_VERSION, TABLE_BY_NAME, TABLES

MS = 1_000_000
US = 1_000
S = 1_000_000_000
MAIN_PID = 1000
GIB = 1 << 30


def hist_bucket(v: int) -> tuple[int, int]:
    """Return the log-linear bucket [lo, hi) holding ``v`` ns: 16 sub-buckets per power of two (as the probes)."""  # noqa: E501
    if v < 16:
        return v, v + 1
    e = v.bit_length() - 1
    width = (1 << e) // 16
    lo = (1 << e) + ((v - (1 << e)) // width) * width
    return lo, lo + width


@dataclass
class TraceBuilder:
    duration_s: float = 60.0
    target: str = "python train.py"
    status: str = "complete"
    mem_bytes: int = 64 * GIB
    session: dict[str, Any] = field(default_factory=dict)
    processes: list[dict[str, Any]] = field(default_factory=list)
    cuda_calls: list[dict[str, Any]] = field(default_factory=list)
    unstored: list[dict[str, Any]] = field(default_factory=list)
    sched: list[dict[str, Any]] = field(default_factory=list)
    process_events: list[dict[str, Any]] = field(default_factory=list)
    host_samples: list[dict[str, Any]] = field(default_factory=list)
    stacks: list[dict[str, Any]] = field(default_factory=list)
    sampled_fraction: float = 1.0
    _stack_ids: dict[tuple[tuple[Any, ...], ...], int] = field(default_factory=dict)

    # -- rows
    # -------------------------------------------------------------------------------------------------
    def process(
        self,
        pid: int,
        comm: str,
        ppid: int = 1,
        first_ns: int = 0,
        exit_ns: int | None = None,
        exit_code: int | None = None,
        cmdline: str = "",
    ) -> None:
        self.processes.append(
            dict(
                pid=pid,
                ppid=ppid,
                comm=comm,
                cmdline=cmdline or comm,
                first_ns=first_ns,
                exit_ns=exit_ns,
                exit_code=exit_code,
            )
        )

    def call(
        self,
        ts_ns: int,
        dur_ns: int,
        op: str,
        pid: int = MAIN_PID,
        tid: int | None = None,
        layer: str | None = None,
        bytes: int | None = None,
        kind: str | None = None,
        stream: int | None = None,
        kernel: str | None = None,
        stack_id: int | None = None,
        off_cpu_ns: int = 0,
        runq_ns: int = 0,
        stored: bool = True,
    ) -> None:
        row = dict(
            ts_ns=int(ts_ns),
            dur_ns=int(dur_ns),
            pid=pid,
            tid=tid or pid,
            op=op,
            layer=layer or ("driver" if op.startswith("cu") and not op.startswith("cuda") else "runtime"),
            bytes=bytes,
            kind=kind,
            stream=stream,
            kernel=kernel,
            ret=0,
            stack_id=stack_id,
            off_cpu_ns=int(off_cpu_ns),
            runq_ns=int(runq_ns),
        )
        (self.cuda_calls if stored else self.unstored).append(row)

    def off_cpu(
        self,
        ts_ns: int,
        dur_ns: int,
        pid: int = MAIN_PID,
        tid: int | None = None,
        comm: str = "python3",
        reason: str = "sleep",
        runq_ns: int = 0,
        by_pid: int | None = None,
        by_comm: str | None = None,
        cpu: int = 0,
    ) -> None:
        self.sched.append(
            dict(
                ts_ns=int(ts_ns),
                dur_ns=int(dur_ns),
                pid=pid,
                tid=tid or pid,
                comm=comm,
                cpu=cpu,
                reason=reason,
                runq_ns=int(runq_ns),
                preempted_by_pid=by_pid,
                preempted_by_comm=by_comm,
            )
        )

    def event(
        self,
        ts_ns: int,
        kind: str,
        pid: int,
        comm: str,
        ppid: int | None = None,
        child: int | None = None,
        filename: str | None = None,
        exit_code: int | None = None,
    ) -> None:
        self.process_events.append(
            dict(
                ts_ns=int(ts_ns),
                kind=kind,
                pid=pid,
                ppid=ppid,
                child=child,
                comm=comm,
                filename=filename,
                exit_code=exit_code,
            )
        )

    def host(
        self,
        sec: int,
        load1: float = 2.0,
        cpu_busy_pct: float = 20.0,
        runnable: int = 2,
        mem_available_bytes: int = 48 * GIB,
        swap_used_bytes: int = 0,
        page_alloc_bytes: int = 50 << 20,
        target_page_alloc_bytes: int = 20 << 20,
        page_faults: int = 100,
        ctx_switches: int = 5000,
    ) -> None:
        self.host_samples.append(
            dict(
                ts_ns=sec * S,
                load1=load1,
                cpu_busy_pct=cpu_busy_pct,
                runnable=runnable,
                mem_available_bytes=mem_available_bytes,
                swap_used_bytes=swap_used_bytes,
                page_alloc_bytes=page_alloc_bytes,
                target_page_alloc_bytes=target_page_alloc_bytes,
                page_faults=page_faults,
                ctx_switches=ctx_switches,
            )
        )

    def stack(self, frames: Sequence[tuple[str, str, str, str | None, int | None]]) -> int:
        """Intern a stack given outermost first as (kind, module, function, file, line); return its stack_id."""  # noqa: E501
        key = tuple(tuple(f) for f in frames)
        if key not in self._stack_ids:
            sid = len(self._stack_ids) + 1
            self._stack_ids[key] = sid
            for depth, (kind, module, function, file, line) in enumerate(frames):
                self.stacks.append(
                    dict(
                        stack_id=sid,
                        depth=depth,
                        kind=kind,
                        module=module,
                        function=function,
                        file=file,
                        line=line,
                    )
                )
        return self._stack_ids[key]

    # -- derived aggregates
    # -----------------------------------------------------------------------------------
    def op_stats_rows(self) -> list[dict[str, Any]]:
        groups: dict[tuple[int, str, str], list[dict[str, Any]]] = defaultdict(list)
        for r in self.cuda_calls + self.unstored:
            groups[(r["pid"], r["op"], r["layer"])].append(r)
        out = []
        for (pid, op, layer), rows in sorted(groups.items()):
            durs = sorted(r["dur_ns"] for r in rows)
            buckets: dict[tuple[int, int], int] = defaultdict(int)
            for d in durs:
                buckets[hist_bucket(d)] += 1
            hist = [dict(lo_ns=lo, hi_ns=hi, count=c) for (lo, hi), c in sorted(buckets.items())]

            def q(p: float, durs: list[int] = durs) -> int:
                return durs[min(len(durs) - 1, int(p * len(durs)))]

            out.append(
                dict(
                    pid=pid,
                    op=op,
                    layer=layer,
                    calls=len(durs),
                    total_ns=sum(durs),
                    min_ns=durs[0],
                    max_ns=durs[-1],
                    p50_ns=q(0.5),
                    p95_ns=q(0.95),
                    p99_ns=q(0.99),
                    bytes=sum(r["bytes"] or 0 for r in rows),
                    sampled_fraction=self.sampled_fraction,
                    hist=hist,
                )
            )
        return out

    def sched_stats_rows(self) -> list[dict[str, Any]]:
        agg: dict[tuple[int, int, int], dict[str, int]] = {}
        for r in self.sched:
            k = (r["ts_ns"] // S, r["pid"], r["tid"])
            a = agg.setdefault(k, dict(switches=0, preemptions=0, off_cpu_ns=0, runq_ns=0, max_off_cpu_ns=0))
            a["switches"] += 1
            a["preemptions"] += r["reason"] == "preempted"
            a["off_cpu_ns"] += r["dur_ns"]
            a["runq_ns"] += r["runq_ns"]
            a["max_off_cpu_ns"] = max(a["max_off_cpu_ns"], r["dur_ns"])
        return [dict(sec=k[0], pid=k[1], tid=k[2], **v) for k, v in sorted(agg.items())]

    def preemptor_rows(self) -> list[dict[str, Any]]:
        pids = {p["pid"] for p in self.processes}
        agg: dict[tuple[int, int, str], list[int]] = {}
        for r in self.sched:
            if r["preempted_by_pid"] is None:
                continue
            k = (r["ts_ns"] // S, r["preempted_by_pid"], r["preempted_by_comm"])
            a = agg.setdefault(k, [0, 0])
            a[0] += 1
            a[1] += r["runq_ns"]
        return [
            dict(sec=k[0], pid=k[1], comm=k[2], is_target=k[1] in pids, preemptions=v[0], runq_ns=v[1])
            for k, v in sorted(agg.items())
        ]

    # -- output
    # -----------------------------------------------------------------------------------------------
    def write(self, path: str | Path) -> Path:
        path = Path(path)
        if path.exists():
            path.unlink()
        n_traced = len(self.cuda_calls) + len(self.unstored)
        session = dict(
            session_id=1,
            started_at=datetime(2026, 5, 4, 12, 0, 0, tzinfo=timezone.utc),
            start_mono_ns=123 * S,
            duration_s=self.duration_s,
            status=self.status,
            host="gpu-box-1",
            kernel="6.8.0-45-generic",
            cpu_model="Intel Xeon Platinum 8358 @ 2.60GHz",
            cpu_cores=16,
            mem_bytes=self.mem_bytes,
            gpus="NVIDIA A10",
            driver="570.148",
            python_version="3.11.9",
            tracer_version="0.1.0",
            target=self.target,
            libraries="/usr/lib/libcudart.so.12",
            events_traced=n_traced,
            events_stored=len(self.cuda_calls),
            events_lost=0,
            overhead_pct=0.8,
            notes="",
        )
        session.update(self.session)
        con = duckdb.connect(str(path))
        try:
            for t in TABLES:
                con.execute(t.ddl())
            con.execute(
                "INSERT INTO meta VALUES ('app', ?), ('schema_version', ?)", [APP_ID, str(SCHEMA_VERSION)]
            )
            tables: dict[str, list[dict[str, Any]]] = {
                "session": [session],
                "processes": self.processes,
                "cuda_calls": self.cuda_calls,
                "op_stats": self.op_stats_rows(),
                "sched": self.sched,
                "sched_stats": self.sched_stats_rows(),
                "preemptors": self.preemptor_rows(),
                "process_events": self.process_events,
                "host_samples": self.host_samples,
                "stacks": self.stacks,
            }
            for name, rows in tables.items():
                insert_rows(con, name, rows)
        finally:
            con.close()
        return path


def insert_rows(con: duckdb.DuckDBPyConnection, table: str, rows: list[dict[str, Any]]) -> None:
    """Append dict rows to ``table`` through one Arrow batch (executemany is ~1000x slower)."""
    if not rows:
        return
    cols = TABLE_BY_NAME[table].column_names
    batch = pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in rows])  # noqa: F841 (scanned by name)
    con.register("_batch", batch)
    con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _batch")
    con.unregister("_batch")


# -- scenarios
# ------------------------------------------------------------------------------------------------
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


def _base(
    b: TraceBuilder,
    rng: random.Random,
    *,
    steps_per_s: int = 10,
    workers: int = 2,
    sync_dur: Callable[[int], tuple[int, int, int]] | None = None,
    syncs_per_step: int = 1,
) -> None:
    """The training loop every scenario shares: launches, one H2D copy and a sync per step, quiet host.

    ``sync_dur(ts_ns) -> (dur_ns, off_cpu_ns, runq_ns)`` lets a scenario shape the syncs.
    """
    b.process(MAIN_PID, "python3", ppid=1, cmdline="python train.py")
    for w in range(workers):
        pid = MAIN_PID + 1 + w
        b.process(pid, "pt_data_worker", ppid=MAIN_PID, first_ns=500 * MS)
        b.event(500 * MS, "fork", MAIN_PID, "python3", ppid=1, child=pid)
        b.event(501 * MS, "rename", pid, "pt_data_worker")
    launch = b.stack(LAUNCH_STACK)
    sync = b.stack(TRAIN_STACK)
    step_ns = S // steps_per_s
    for i in range(int(b.duration_s * steps_per_s)):
        t = i * step_ns + MS
        for k in range(5):
            d = rng.randint(6 * US, 12 * US)
            b.call(
                t,
                d,
                "cudaLaunchKernel",
                stack_id=launch,
                kernel=f"elementwise_kernel_{k}",
                stream=7,
                stored=(k < 2),
            )
            b.call(t + 1 * US, d - 2 * US, "cuLaunchKernel", stream=7, stored=(k < 2))
            t += 40 * US
        b.call(t, rng.randint(18 * US, 25 * US), "cudaMemcpyAsync", bytes=4 << 20, kind="HtoD", stream=7)
        t += 100 * US
        for _ in range(syncs_per_step):
            dur, off, runq = sync_dur(t) if sync_dur else (rng.randint(900 * US, 1200 * US), 0, 0)
            dur = max(dur, 20 * US)
            b.call(t, dur, "cudaStreamSynchronize", stack_id=sync, stream=7, off_cpu_ns=off, runq_ns=runq)
            if off:
                b.off_cpu(t + 5 * US, off - runq, reason="sleep")
            t += dur + 30 * US
        # a short voluntary sleep per step (data wait) and the workers' own blocking reads
        b.off_cpu(i * step_ns + 50 * MS, 2 * MS, reason="sleep")
        for w in range(workers):
            b.off_cpu(i * step_ns + 20 * MS, 5 * MS, pid=MAIN_PID + 1 + w, comm="pt_data_worker", reason="io")
    for sec in range(int(b.duration_s)):
        b.host(sec, load1=2.0 + rng.random(), cpu_busy_pct=25 + 10 * rng.random())


def healthy(b: TraceBuilder) -> None:
    _base(b, random.Random(1))


def cpu_contention(b: TraceBuilder) -> None:
    """A foreign CPU hog (stress-ng, pid 4242) preempts the main thread during syncs in t = 20..40 s."""
    rng = random.Random(2)

    def sync(ts: int) -> tuple[int, int, int]:
        if 20 * S <= ts < 40 * S:
            runq = rng.randint(20 * MS, 35 * MS)
            return runq + 1 * MS, runq + 200 * US, runq
        return rng.randint(900 * US, 1200 * US), 0, 0

    _base(b, rng, sync_dur=sync)
    b.target = "pid 1000"
    for r in b.cuda_calls:
        if r["op"] == "cudaStreamSynchronize" and r["runq_ns"]:
            # the preemption itself: the hog took the CPU while the thread was runnable inside the call
            b.off_cpu(
                r["ts_ns"] + 10 * US,
                r["runq_ns"],
                reason="preempted",
                runq_ns=r["runq_ns"],
                by_pid=4242,
                by_comm="stress-ng",
                cpu=3,
            )
    # a little contention from the training job's own worker, for contrast
    for sec in range(0, 60, 5):
        b.off_cpu(
            sec * S + 300 * MS,
            300 * US,
            reason="preempted",
            runq_ns=300 * US,
            by_pid=MAIN_PID + 1,
            by_comm="pt_data_worker",
            cpu=1,
        )
    for h in b.host_samples:
        if 20 * S <= h["ts_ns"] < 40 * S:
            h.update(load1=24.0, cpu_busy_pct=100.0, runnable=22)


def process_churn(b: TraceBuilder) -> None:
    """DataLoader workers are forked at every 10 s epoch and exit at its end; the main thread stalls each time."""  # noqa: E501
    rng = random.Random(3)
    epochs = [e * 10 * S for e in range(6)]

    def sync(ts: int) -> tuple[int, int, int]:
        # the first syncs of an epoch wait for the new workers' first batches (blocked, not runnable)
        if any(0 < ts - e < 400 * MS for e in epochs[1:]):
            d = rng.randint(150 * MS, 300 * MS)
            return d, d - 1 * MS, 200 * US
        return rng.randint(900 * US, 1200 * US), 0, 0

    _base(b, rng, workers=0, sync_dur=sync)
    pid = MAIN_PID + 100
    for e_i, e in enumerate(epochs):
        for w in range(4):
            pid += 1
            fork = e + (w + 1) * MS
            end = e + 10 * S - 50 * MS if e_i < len(epochs) - 1 else None
            b.process(
                pid, "pt_data_worker", ppid=MAIN_PID, first_ns=fork, exit_ns=end, exit_code=0 if end else None
            )
            b.event(fork, "fork", MAIN_PID, "python3", ppid=1, child=pid)
            b.event(fork + 300 * US, "rename", pid, "pt_data_worker")
            if end:
                b.event(end + w * MS, "exit", pid, "pt_data_worker", exit_code=0)
            b.off_cpu(fork + 1 * MS, 120 * MS + w * 10 * MS, pid=pid, comm="pt_data_worker", reason="io")


def memory_pressure(b: TraceBuilder) -> None:
    """Page allocation surges and MemAvailable falls to 1.5 GiB in t = 30..40 s; H2D copies stall in D state."""  # noqa: E501
    rng = random.Random(4)
    _base(b, rng)
    stack = b.stack(
        TRAIN_STACK[:3]
        + [
            ("native", "libtorch_cuda.so", "at::native::copy_kernel_cuda", None, None),
            ("cuda", "libcudart.so.12", "cudaMemcpy", None, None),
        ]
    )
    for i in range(30 * 10, 40 * 10):
        t = i * (S // 10) + 60 * MS
        d = rng.randint(40 * MS, 80 * MS)
        off = d - 2 * MS
        b.call(
            t, d, "cudaMemcpy", bytes=64 << 20, kind="HtoD", stack_id=stack, off_cpu_ns=off, runq_ns=500 * US
        )
        b.off_cpu(t + 100 * US, off, reason="io", runq_ns=500 * US)
    for i in [*range(0, 30 * 10), *range(40 * 10, 60 * 10)]:
        b.call(
            i * (S // 10) + 60 * MS,
            rng.randint(3 * MS, 4 * MS),
            "cudaMemcpy",
            bytes=64 << 20,
            kind="HtoD",
            stack_id=stack,
        )
    for h in b.host_samples:
        if 30 * S <= h["ts_ns"] < 40 * S:
            h.update(
                page_alloc_bytes=2 * GIB,
                target_page_alloc_bytes=GIB,
                mem_available_bytes=1536 << 20,
                swap_used_bytes=3 * GIB,
                page_faults=250_000,
            )


def allocation_churn(b: TraceBuilder) -> None:
    """alloc_stress.py:74 allocate_batch runs thousands of cudaMalloc/cudaFree pairs (t = 5..55 s)."""
    rng = random.Random(5)
    _base(b, rng, workers=0)
    b.target = "python alloc_stress.py"
    b.processes[0]["cmdline"] = "python alloc_stress.py"
    alloc = b.stack(ALLOC_STACK)
    free = b.stack(FREE_STACK)
    direct = b.stack(
        ALLOC_STACK[:2]
        + [
            ("python", "alloc_stress.py", "direct_alloc", "alloc_stress.py", 46),
            ("native", "libffi.so.8", "ffi_call", None, None),
            ("cuda", "libcudart.so.12", "cudaMalloc", None, None),
        ]
    )
    n = 5000
    for i in range(n):
        t = 5 * S + i * 10 * MS + 3 * MS
        d = rng.randint(700 * US, 1300 * US)
        sid = direct if i % 50 == 0 else alloc
        b.call(t, d, "cudaMalloc", bytes=64 << 20, stack_id=sid)
        b.call(t + 5 * US, d - 50 * US, "cuMemAlloc", bytes=64 << 20)
        b.call(t + d + 100 * US, rng.randint(300 * US, 600 * US), "cudaFree", stack_id=free)


def sync_stall(b: TraceBuilder) -> None:
    """train.py:88 calls .item() 40 times per step: each cudaStreamSynchronize sleeps ~1 ms waiting for the GPU."""  # noqa: E501
    rng = random.Random(6)

    def sync(ts: int) -> tuple[int, int, int]:
        d = rng.randint(800 * US, 1200 * US)
        return d, d - 60 * US, 10 * US

    _base(b, rng, sync_dur=sync, syncs_per_step=40)


SCENARIOS: dict[str, Callable[[TraceBuilder], None]] = {
    "healthy": healthy,
    "cpu_contention": cpu_contention,
    "process_churn": process_churn,
    "memory_pressure": memory_pressure,
    "allocation_churn": allocation_churn,
    "sync_stall": sync_stall,
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


def generate_large(path: str | Path, n_calls: int = 1_000_000, duration_s: int = 600) -> Path:
    """Write a synthetic DB with ``n_calls`` cuda_calls rows (and matching op_stats) in pure SQL, for
    benchmarks.

    Shape: one main process, four ops, a CPU hog preempting a slice of the syncs, a stack per op.
    """
    path = Path(path)
    b = builder("cpu_contention")
    b.duration_s = duration_s
    b.cuda_calls = b.cuda_calls[:0]
    b.write(path)
    con = duckdb.connect(str(path))
    try:
        step = duration_s * S // n_calls
        con.execute(f"""
            INSERT INTO cuda_calls BY NAME
            SELECT i * {step} AS ts_ns,
                   CASE WHEN i % 4 = 3 AND i % 400 = 3 THEN 20000000 + (i * 7919) % 15000000
                        WHEN i % 4 = 3 THEN 900000 + (i * 7919) % 300000
                        ELSE 5000 + (i * 7919) % 10000 END AS dur_ns,
                   {MAIN_PID} AS pid, {MAIN_PID} AS tid,
                   ['cudaLaunchKernel', 'cuLaunchKernel', 'cudaMemcpyAsync', 'cudaStreamSynchronize'][i % 4 +
                   1] AS op,
                   CASE WHEN i % 4 = 1 THEN 'driver' ELSE 'runtime' END AS layer,
                   CASE WHEN i % 4 = 2 THEN 4194304 END AS bytes, 7 AS stream, 0 AS ret,
                   CASE WHEN i % 4 = 3 THEN 2 WHEN i % 4 = 0 THEN 1 END AS stack_id,
                   CASE WHEN i % 4 = 3 AND i % 400 = 3 THEN 19000000 ELSE 0 END AS off_cpu_ns,
                   CASE WHEN i % 4 = 3 AND i % 400 = 3 THEN 18000000 ELSE 0 END AS runq_ns
            FROM range({n_calls}) t(i)""")
        con.execute("DELETE FROM op_stats")
        # histogram as the probes build it: log-linear buckets, 16 per power of two
        con.execute("""
            INSERT INTO op_stats BY NAME
            WITH b AS (
              SELECT pid, op, layer, dur_ns, floor(log2(dur_ns))::INT AS e FROM cuda_calls),
            bb AS (
              SELECT pid, op, layer, dur_ns,
                     (1::BIGINT << e) + ((dur_ns - (1::BIGINT << e)) // ((1::BIGINT << e) // 16))
                       * ((1::BIGINT << e) // 16) AS lo, (1::BIGINT << e) // 16 AS w FROM b),
            h AS (SELECT pid, op, layer, lo, lo + w AS hi, count(*) AS n FROM bb GROUP BY ALL)
            SELECT s.pid, s.op, s.layer, s.calls, s.total_ns, s.min_ns, s.max_ns, s.p50_ns, s.p95_ns,
            s.p99_ns,
                   s.bytes, 1.0 AS sampled_fraction, h.hist
            FROM (SELECT pid, op, layer, count(*) AS calls, sum(dur_ns) AS total_ns, min(dur_ns) AS min_ns,
                         max(dur_ns) AS max_ns, quantile_disc(dur_ns, 0.5) AS p50_ns,
                         quantile_disc(dur_ns, 0.95) AS p95_ns, quantile_disc(dur_ns, 0.99) AS p99_ns,
                         coalesce(sum(bytes), 0) AS bytes FROM cuda_calls GROUP BY ALL) s
            JOIN (SELECT pid, op, layer,
                         list({'lo_ns': lo, 'hi_ns': hi, 'count': n} ORDER BY lo) AS hist
                  FROM h GROUP BY ALL) h USING (pid, op, layer)""")
        con.execute(
            "UPDATE session SET events_traced = ?, events_stored = ?, duration_s = ?",
            [n_calls, n_calls, float(duration_s)],
        )
    finally:
        con.close()
    return path


def percentile_from_hist(hist: list[dict[str, int]], q: float) -> float:
    """Reference implementation for tests: the q-quantile in ns, linear within the bucket."""
    total = sum(h["count"] for h in hist)
    rank = q * total
    cum = 0
    for h in sorted(hist, key=lambda h: h["lo_ns"]):
        if cum + h["count"] >= rank:
            return h["lo_ns"] + (h["hi_ns"] - h["lo_ns"]) * (rank - cum) / h["count"]
        cum += h["count"]
    return float(hist[-1]["hi_ns"]) if hist else math.nan


if __name__ == "__main__":  # python tests/tracedb.py OUTDIR: write every scenario
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for name in SCENARIOS:
        build(name, out / f"{name}.duckdb")
        print(out / f"{name}.duckdb")
