"""A synthetic recording with millions of ``cuda_calls`` rows, written in SQL, for the query benchmarks.

What it records: one training process (pid 1000, one thread) that issues four ops in turn, one every
``duration_s / n_calls`` seconds: ``cudaLaunchKernel`` (with its Python stack), the driver's ``cuLaunchKernel``, a
4 MiB ``cudaMemcpyAsync`` and a ``cudaStreamSynchronize`` (with its stack). One sync in a hundred waits 20-35 ms,
19 ms of it off CPU, 18 ms of that in the run queue behind a CPU hog (stress-ng, pid 4242) that is not traced.

Every aggregate is computed from those rows as the recorder counts it, never by the analyses being timed:
``op_stats`` with the probes' log-linear histogram, ``sched_stats`` and ``preemptors`` from ``sched``, and with
``accounting`` the per-thread time (``threads``, ``thread_breakdown``). Calls can overlap here (a sync outlasts
the next launch); as in the kernel, a call that starts while another is in progress is nested in it, so each run
of overlapping calls counts as the part of the call that opened it. Without ``accounting`` the DB is one from a
recorder that did no time accounting, and the analyses estimate it on every query.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from tracer.schema import APP_ID, SCHEMA_VERSION, TABLES

S = 1_000_000_000
MS = 1_000_000
PID = 1000
HOG_PID = 4242
# the cycle of ops: (op, layer, breakdown part as the catalog classes it); call i issues OPS[i % 4]
OPS = (
    ("cudaLaunchKernel", "runtime", "launch"),
    ("cuLaunchKernel", "driver", "launch"),
    ("cudaMemcpyAsync", "runtime", "copy"),
    ("cudaStreamSynchronize", "runtime", "sync"),
)
LONG_SYNC_EVERY = 400  # calls: every 100th sync is a long one
LONG_OFF_CPU_NS, LONG_RUNQ_NS = 19 * MS, 18 * MS
# (stack_id, depth, kind, module, function, file, line), outermost first: 1 for the launches, 2 for the syncs
STACKS = [
    (1, 0, "python", "train.py", "<module>", "train.py", 140),
    (1, 1, "python", "train.py", "main", "train.py", 131),
    (1, 2, "python", "train.py", "train_step", "train.py", 84),
    (1, 3, "native", "libtorch_cuda.so", "at::native::gpu_kernel_impl", None, None),
    (1, 4, "cuda", "libcudart.so.12", "cudaLaunchKernel", None, None),
    (2, 0, "python", "train.py", "<module>", "train.py", 140),
    (2, 1, "python", "train.py", "main", "train.py", 131),
    (2, 2, "python", "train.py", "train_step", "train.py", 88),
    (2, 3, "native", "libtorch_cuda.so", "at::native::_local_scalar_dense_cuda", None, None),
    (2, 4, "cuda", "libcudart.so.12", "cudaStreamSynchronize", None, None),
]


def generate_large(path: str | Path, n_calls: int = 1_000_000, duration_s: int = 600, accounting: bool = True) -> Path:
    """Write the synthetic recording of ``n_calls`` calls over ``duration_s`` seconds to ``path``; return it."""
    path = Path(path)
    path.unlink(missing_ok=True)
    con = duckdb.connect(str(path))
    con.execute("SET enable_progress_bar = false")  # the benchmarks print their own figures
    try:
        for t in TABLES:
            con.execute(t.ddl())
        con.execute("INSERT INTO meta VALUES ('app', ?), ('schema_version', ?)", [APP_ID, str(SCHEMA_VERSION)])
        _write_calls(con, n_calls, duration_s * S // n_calls)
        _write_context(con, n_calls, duration_s)
        _write_op_stats(con)
        _write_sched(con)
        if accounting:
            _write_accounting(con, duration_s)
    finally:
        con.close()
    return path


def _write_calls(con: duckdb.DuckDBPyConnection, n_calls: int, step: int) -> None:
    ops = ", ".join(f"'{op}'" for op, _, _ in OPS)
    con.execute(f"""
        INSERT INTO cuda_calls BY NAME
        SELECT i * {step} AS ts_ns,
               CASE WHEN i % 4 = 3 AND i % {LONG_SYNC_EVERY} = 3 THEN 20000000 + (i * 7919) % 15000000
                    WHEN i % 4 = 3 THEN 900000 + (i * 7919) % 300000
                    ELSE 5000 + (i * 7919) % 10000 END AS dur_ns,
               {PID} AS pid, {PID} AS tid,
               [{ops}][i % 4 + 1] AS op,
               CASE WHEN i % 4 = 1 THEN 'driver' ELSE 'runtime' END AS layer,
               CASE WHEN i % 4 = 2 THEN 4194304 END AS bytes, 7 AS stream, 0 AS ret,
               CASE WHEN i % 4 = 3 THEN 2 WHEN i % 4 = 0 THEN 1 END AS stack_id,
               CASE WHEN i % {LONG_SYNC_EVERY} = 3 THEN {LONG_OFF_CPU_NS} ELSE 0 END AS off_cpu_ns,
               CASE WHEN i % {LONG_SYNC_EVERY} = 3 THEN {LONG_RUNQ_NS} ELSE 0 END AS runq_ns
        FROM range({n_calls}) t(i)""")


def _write_context(con: duckdb.DuckDBPyConnection, n_calls: int, duration_s: int) -> None:
    """The session row, the process, the two stacks and a host sample a second."""
    con.execute(
        """INSERT INTO session BY NAME SELECT
             1 AS session_id, TIMESTAMPTZ '2026-05-04 12:00:00+00' AS started_at, 123 * $s::BIGINT AS start_mono_ns,
             $duration AS duration_s, 'complete' AS status, 'gpu-box-1' AS host, '6.8.0-45-generic' AS kernel,
             'Intel Xeon Platinum 8358 @ 2.60GHz' AS cpu_model, 16 AS cpu_cores, 64 * (1::BIGINT << 30) AS mem_bytes,
             'NVIDIA A10' AS gpus, '570.148' AS driver, '3.11.9' AS python_version, '0.1.0' AS tracer_version,
             'python train.py' AS target, '/usr/lib/libcudart.so.12' AS libraries, $n AS events_traced,
             $n AS events_stored, 0 AS events_lost, 0.8 AS overhead_pct, '' AS notes,
             $duration * 0.0125 AS recorder_cpu_s, 180 * (1 << 20) AS recorder_peak_rss_bytes, 0 AS holds,
             0.0 AS held_ms""",
        {"s": S, "duration": float(duration_s), "n": n_calls},
    )
    con.execute(
        "INSERT INTO processes (pid, ppid, comm, cmdline, first_ns, exit_ns, exit_code, role) "
        "VALUES (?, 1, 'python3', 'python train.py', 0, NULL, NULL, 'target')",
        [PID],
    )
    con.executemany("INSERT INTO stacks VALUES (?, ?, ?, ?, ?, ?, ?, false)", STACKS)
    con.execute(f"""
        INSERT INTO host_samples
        SELECT sec * {S}, 2.0, 25.0, 2, 48 * (1::BIGINT << 30), 0, 50 << 20, 20 << 20, 100, 5000, 12.5
        FROM range({duration_s}) t(sec)""")


def _write_op_stats(con: duckdb.DuckDBPyConnection) -> None:
    # the histogram as the probes build it: log-linear buckets, 16 per power of two (tracer.hist.bucket_of)
    con.execute("""
        INSERT INTO op_stats BY NAME
        WITH b AS (
          SELECT pid, op, layer, dur_ns, floor(log2(dur_ns))::INT AS e FROM cuda_calls),
        bb AS (
          SELECT pid, op, layer, dur_ns,
                 (1::BIGINT << e) + ((dur_ns - (1::BIGINT << e)) // ((1::BIGINT << e) // 16))
                   * ((1::BIGINT << e) // 16) AS lo, (1::BIGINT << e) // 16 AS w FROM b),
        h AS (SELECT pid, op, layer, lo, lo + w AS hi, count(*) AS n FROM bb GROUP BY ALL)
        SELECT s.pid, s.op, s.layer, s.calls, s.total_ns, s.min_ns, s.max_ns, s.p50_ns, s.p95_ns, s.p99_ns,
               s.bytes, 1.0 AS sampled_fraction, 0.0 AS error_pct, h.hist
        FROM (SELECT pid, op, layer, count(*) AS calls, sum(dur_ns) AS total_ns, min(dur_ns) AS min_ns,
                     max(dur_ns) AS max_ns, quantile_disc(dur_ns, 0.5) AS p50_ns,
                     quantile_disc(dur_ns, 0.95) AS p95_ns, quantile_disc(dur_ns, 0.99) AS p99_ns,
                     coalesce(sum(bytes), 0) AS bytes FROM cuda_calls GROUP BY ALL) s
        JOIN (SELECT pid, op, layer,
                     list({'lo_ns': lo, 'hi_ns': hi, 'count': n} ORDER BY lo) AS hist
              FROM h GROUP BY ALL) h USING (pid, op, layer)""")


def _write_sched(con: duckdb.DuckDBPyConnection) -> None:
    """The long syncs' off-CPU intervals (asleep on the GPU, then queued behind the hog), and their aggregates."""
    con.execute(f"""
        INSERT INTO sched BY NAME
        SELECT ts_ns + {MS} AS ts_ns, off_cpu_ns AS dur_ns, pid, tid, 'python3' AS comm, 3 AS cpu, 'sleep' AS reason,
               runq_ns, {HOG_PID} AS preempted_by_pid, 'stress-ng' AS preempted_by_comm, true AS in_call
        FROM cuda_calls WHERE off_cpu_ns > 0""")
    con.execute(f"""
        INSERT INTO sched_stats
        SELECT ts_ns // {S} AS sec, pid, tid, count(*), count(*) FILTER (WHERE reason = 'preempted'), sum(dur_ns),
               sum(runq_ns), max(dur_ns)
        FROM sched GROUP BY ALL""")
    con.execute(f"""
        INSERT INTO preemptors
        SELECT ts_ns // {S} AS sec, tid, preempted_by_pid, preempted_by_comm, false, false, count(*), sum(runq_ns)
        FROM sched WHERE preempted_by_pid IS NOT NULL GROUP BY ALL""")


def _write_accounting(con: duckdb.DuckDBPyConnection, duration_s: int) -> None:
    """``threads`` and ``thread_breakdown`` of the one thread, from the calls as generated.

    Runs of overlapping calls ("islands": a call that starts before every earlier call has ended joins the run)
    count as the part of the run's first call, cut at the recording's end and split at second boundaries; a
    call's off-CPU and run-queue time is booked in the second it started. Nothing is off CPU outside a call, so
    the rest of each second is ``cpu``.
    """
    end = duration_s * S
    parts = " ".join(f"WHEN '{op}' THEN '{part}'" for op, _, part in OPS)
    con.execute(
        "INSERT INTO threads SELECT ?, ?, 'python3', 0, ?, false, (SELECT count(*) FROM cuda_calls)", [PID, PID, end]
    )
    con.execute(f"""
        INSERT INTO thread_breakdown BY NAME
        WITH calls AS (
          SELECT ts_ns AS a, least(ts_ns + dur_ns, {end}) AS b, CASE op {parts} END AS part, off_cpu_ns, runq_ns,
                 max(ts_ns + dur_ns) OVER (ORDER BY ts_ns ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
                   AS open_until
          FROM cuda_calls WHERE ts_ns < {end}),
        runs AS (
          -- a running sum, not count(*) FILTER over the default frame: that one is quadratic in DuckDB
          SELECT *, sum((open_until IS NULL OR a >= open_until)::INT) OVER (ORDER BY a ROWS UNBOUNDED PRECEDING) AS run
          FROM calls),
        island AS (
          SELECT min(a) AS a, max(b) AS b, arg_min(part, a) AS part, arg_min(off_cpu_ns, a) AS off_cpu_ns,
                 arg_min(runq_ns, a) AS runq_ns
          FROM runs GROUP BY run),
        per_sec AS (
          SELECT sec, part, least(b, (sec + 1) * {S}) - greatest(a, sec * {S}) AS ns,
                 CASE WHEN sec = a // {S} THEN off_cpu_ns ELSE 0 END AS off_cpu_ns,
                 CASE WHEN sec = a // {S} THEN runq_ns ELSE 0 END AS runq_ns
          FROM island, unnest(range(a // {S}, (b - 1) // {S} + 1)) AS t(sec)),
        secs AS (
          SELECT sec, coalesce(sum(ns) FILTER (WHERE part = 'launch'), 0) AS launch_ns,
                 coalesce(sum(ns) FILTER (WHERE part = 'copy'), 0) AS copy_ns,
                 coalesce(sum(ns) FILTER (WHERE part = 'sync'), 0) AS sync_ns,
                 sum(off_cpu_ns) AS call_off_cpu_ns, sum(runq_ns) AS call_runq_ns
          FROM per_sec GROUP BY sec)
        SELECT t.sec, {PID} AS pid, {PID} AS tid, {S} AS wall_ns,
               {S} - coalesce(launch_ns + copy_ns + sync_ns, 0) AS cpu_ns,
               coalesce(launch_ns, 0) AS launch_ns, coalesce(sync_ns, 0) AS sync_ns, 0 AS alloc_ns, 0 AS free_ns,
               coalesce(copy_ns, 0) AS copy_ns, 0 AS other_ns, 0 AS runq_self_ns, 0 AS runq_tree_ns,
               0 AS runq_other_ns, 0 AS runq_tracer_ns, 0 AS blocked_ns, 0 AS io_ns,
               coalesce(call_off_cpu_ns, 0) AS call_off_cpu_ns, coalesce(call_runq_ns, 0) AS call_runq_ns,
               0 AS faults, 0 AS page_alloc_bytes, 0 AS reclaim_ns, 1.0 AS launch_sampled
        FROM range({duration_s}) t(sec) LEFT JOIN secs USING (sec)
        ORDER BY t.sec""")
