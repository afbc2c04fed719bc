"""The MCP surface: read-only tools over one trace DB (compare_traces also reads a second one, named by file
from the served DB's directory), its schema as a resource, and an investigation prompt.

Every tool calls one ``tracer.analysis`` function and returns its pydantic record, so the output schema and
``structuredContent`` are the record's. Tools are sync: the SDK runs them in worker threads, so each call opens its
own read-only connection (DuckDB connections must not be shared across threads). Two error channels: ``ToolError``
(bad argument, unreadable DB, refused SQL) becomes an ``is_error`` result the model reads and can correct from;
anything else is a server bug.

run_sql is the exception to "one connection per call": its statement runs in a query worker process
(:mod:`tracer.analysis.sql.pool`) that can be killed, under the limits its description states, so no query can
wedge this process, starve the other tools or bloat its memory. A DuckDB error inside any tool (a file damaged or
swapped underneath the server) becomes a ToolError, raised after the connection is closed.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, ParamSpec, TypeVar

import anyio
import duckdb
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, Field

from mcp_server.sessions import CLIENT_KEY
from tracer.analysis import compare
from tracer.analysis.arguments import check_args
from tracer.analysis.breakdown import Breakdown, time_breakdown
from tracer.analysis.chains import ChainsResult, compute_chains
from tracer.analysis.compare import Comparison
from tracer.analysis.db import open_trace, read_error, recordings
from tracer.analysis.ranks.report import RanksResult, ranks_report
from tracer.analysis.side_by_side import SideBySide
from tracer.analysis.side_by_side import compare_processes as side_by_side
from tracer.analysis.sql.limits import LIMITS
from tracer.analysis.sql.pool import LANE_TIMEOUT_S, Cancel, SqlPool, default_pool
from tracer.analysis.sql.result import SqlResult
from tracer.analysis.sql.run import execute
from tracer.analysis.stacks import StacksResult, UnknownOp, top_stacks
from tracer.analysis.stats import TraceStats, trace_stats
from tracer.analysis.steps import StepSeries, step_series
from tracer.analysis.thread_dump import ThreadDump
from tracer.analysis.thread_stacks import MODES, NoStacks, ThreadStacksResult, thread_stacks
from tracer.analysis.waits import Waits, waits
from tracer.errors import TracerError
from tracer.schema import schema_markdown

SQL_TIMEOUT_S = LIMITS.timeout_s
P = ParamSpec("P")
T = TypeVar("T")
# The SDK client refuses a server-sent event over 1 MiB, and a tool result carries the rows twice (structured
# content, and the same JSON as text for models that read only text): the result must fit in the event, and
# the rows get a little under half of it.
SQL_REPLY_BYTES = (1 << 20) - (16 << 10)
SQL_ROWS_BYTES = SQL_REPLY_BYTES // 2 - (8 << 10)
SQL_THREADS = 32  # run_sql calls in progress at once (waiting for a query worker, or running)
ECHO_CHARS = 80  # an argument quoted back in an error is cut to this (a 1 MB op name is not sent back)
RECORDING_SUFFIX = ".duckdb"  # compare_traces reads only files so named, in the served DB's directory
LIST_RECORDINGS = 20  # recordings named in compare_traces' error for a name it cannot find
# Issue 30: a crafted recording (cuda_calls a CPU-burning view) kept compare_traces busy for 300 s in the server,
# and compare_processes(pids=[3247]*2000) for 20 s. Every tool's DuckDB work is interrupted past this budget
# (an analysis answers in well under a second on a real recording), and pids lists are capped.
TOOL_BUDGET_S = 30.0
MAX_PIDS = 64  # pids one compare_processes call may name (it shows 8 columns)

# The investigation order, written once (issue 31): the server's instructions and the `investigate` prompt both
# give it, so an assistant meets one order whichever it reads.
INVESTIGATION_ORDER = """\
1. get_trace_stats: environment, per-op p50/p99 and tail ratio, processes, busy threads, host peaks, chain counts.
2. get_time_breakdown: where the training thread's time went (on CPU, in CUDA calls by class, waiting for a CPU
   and who held it, blocked and who woke it, page faults), per time bucket; the tracer's own cost. Cannot see
   what the GPU did (kernel time on the device) nor which code ran while the thread was on CPU.
3. get_causal_chains: diagnoses worst first, ranked by the share of the training thread's time each cost, with
   the culprit (process, thread, Python line), the wait path followed from the thread to its root (a line on
   CPU, an external wait, CPU capacity, placement, the interpreter's collector, the GPU), evidence and fixes.
   Filter with pid/severity. Cannot see a cause no root explains: coverage gives the share of the lost time
   whose root was found, and what is left is yours to explain. A distributed job (torchrun, MPI ranks):
   get_ranks gives each rank's time by phase and the straggler rank.
4. get_step_series: the training thread's steps (ended by its waits for the GPU), the slow ones and their period
   ("every 40th step: +54 ms") with what they spent the extra time on; get_waits: its waits by waker and length
   ("[timer], 5.1 ms each"); compare_processes: processes or threads side by side. Cannot see steps of a loop
   that never waits for the GPU (it gets a per-second series) nor which code ran in a slow step.
5. get_stacks(op): for the op a chain names, the code paths from the Python file:line to the CUDA call; coverage
   says why calls have no stack. Cannot see code outside CUDA calls (CPU work, waits): get_thread_stacks does,
   on CPU (sampled) or blocked (exact, classified gil | lock | io | sleep | cuda | other), per thread; and
   get_thread_dump says what each thread was doing at its latest snapshot, even one blocked since before the
   recording began.
6. compare_traces(before=FILE): did a change work? This recording against another of the same workload
   (a .duckdb file next to it): steps/s, the training thread's parts, per-op deltas, chains gained or lost,
   each judged against the recordings' own noise.
7. run_sql: anything else (time buckets, the microsecond timeline around a stall, per-PID scheduling).
   Read the trace://schema resource first. Timestamps are ns since session start; ts_ns // 10000000000 buckets
   by 10 s."""

INSTRUCTIONS = f"""\
You are investigating one recording of a GPU training job: every CUDA API call with its latency, what the
calling thread did during it (off CPU, waiting for a CPU, who preempted it), the process tree, and host samples.
Investigation order (each step says what its tool cannot see):
{INVESTIGATION_ORDER}
Quote the numbers the tools return; op_stats counts are exact, cuda_calls rows are a sample that keeps the tail."""

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False, idempotent_hint=True, destructive_hint=False)

Connect = Callable[[], duckdb.DuckDBPyConnection]


def build_server(
    db_path: str | Path | Sequence[str | Path],
    *,
    connect: Connect | None = None,
    sql_pool: SqlPool | None = None,
    freshen: Callable[[], None] | None = None,
    recordings_dir: str | Path | None = None,
) -> MCPServer:
    """Return the MCP server for the trace DB at ``db_path``: one recording, or several analysed as one job (a
    list, a directory of ``*.duckdb`` files or a glob: :func:`tracer.analysis.job.recordings`), on which run_sql is
    refused (its query worker reads one file).

    Args:
        connect: open a read connection per tool call. Default: :func:`tracer.analysis.db.open_trace` on ``db_path``.
            The recorder passes a factory on its own DuckDB instance to serve a DB it is still writing; run_sql
            then runs in-process, with the timer, row and reply caps but without a worker to kill.
        sql_pool: the query workers for run_sql. Default: this process's pool
            (:func:`tracer.analysis.sql.pool.default_pool`); ``tracer mcp serve`` starts it before serving.
        freshen: run before each tool call: a live recording's server asks for a new snapshot (tracer/live.py).
        recordings_dir: where compare_traces finds the other recording, by file name. Default: the served DB's
            directory, the one the user pointed the server at. Only ``*.duckdb`` files directly in it that open
            as trace DBs are read (:func:`tracer.analysis.db.open_trace`); a name with a path in it is refused.
    """
    paths = recordings(db_path) if connect is None else [Path(str(db_path))]
    job = len(paths) > 1
    path = paths[0]
    served_name = "+".join(p.name for p in paths)  # the name answers give the served recording(s)
    opener: Connect = connect or (lambda: open_trace(paths if job else path))
    siblings = Path(recordings_dir) if recordings_dir is not None else path.resolve().parent
    _hide_directories(*(p.parent for p in paths), siblings)

    @contextmanager
    def conn() -> Iterator[duckdb.DuckDBPyConnection]:
        if freshen is not None:
            freshen()
        try:
            c = opener()
        except TracerError as e:
            raise ToolError(_tool_message(e)) from None
        failed: TracerError | None = None
        try:
            with budget(c):
                yield c
        except duckdb.InterruptException:
            failed = over_budget()
        except duckdb.Error as e:  # the file changed or is damaged (or an analysis bug): a clear answer, not a crash
            failed = read_error(served_name, e)
        finally:
            c.close()
        if failed is not None:  # raised here, outside the except block: no traceback keeps the query alive
            raise ToolError(_tool_message(failed))

    mcp = MCPServer("cuda-host-tracer", instructions=INSTRUCTIONS, version="0.1.0", log_level="WARNING")

    @mcp.tool(title="Trace overview", annotations=READ_ONLY)
    def get_trace_stats(
        pid: Annotated[int | None, Field(description="Only this process; omit for the whole traced tree.")] = None,
        detail: Annotated[
            bool, Field(description="Every process group, and one row per process (default: the top groups).")
        ] = False,
    ) -> Annotated[CallToolResult, TraceStats]:
        """Overview of the recording. Call this first.

        Returns the environment (GPU, driver, CPU, RAM, kernel, Python), events traced/stored/lost, per CUDA op
        (runtime and driver layers kept apart) calls, p50/p95/p99/max in µs from the exact in-kernel histogram and
        the tail ratio p99/p50, the processes grouped by (comm, parent, role, rank) with CUDA calls, off-CPU
        seconds and worst stall, every thread busy on CPU (CUDA or not) with where its time went, host peaks,
        where the training thread's time went, and the causal chains by severity. Next: get_causal_chains for the
        why, get_time_breakdown for a thread, get_stacks(op) for an op with a large tail.
        """
        with conn() as c:
            _check(c, pid=pid)
            return compact_reply(trace_stats(c, pid=pid, detail=detail))

    @mcp.tool(title="Causal chains", annotations=READ_ONLY)
    def get_causal_chains(
        pid: Annotated[int | None, Field(description="Only chains affecting this process.")] = None,
        severity: Annotated[str | None, Field(description="high, medium or low; omit for all.")] = None,
        limit: Annotated[int, Field(description="Most chains to return (1-100).", ge=1, le=100)] = 10,
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
        with conn() as c:
            _check(c, pid=pid, severity=severity)
            return compute_chains(c, pid=pid, severity=severity, limit=limit)

    @mcp.tool(title="Time breakdown", annotations=READ_ONLY)
    def get_time_breakdown(
        pid: Annotated[int | None, Field(description="Only this process's threads; omit for the whole tree.")] = None,
        tid: Annotated[int | None, Field(description="Only this thread (any thread, CUDA or not).")] = None,
        bucket_s: Annotated[
            int, Field(description="Bucket width in seconds for the per-bucket rows; 0 picks about 60 buckets.", ge=0)
        ] = 0,
    ) -> Breakdown:
        """Where each CUDA thread's wall time went, the training thread (most launch + sync time) first.

        Per thread, in ms and as shares that add up to its wall time: cpu (Python/host work outside CUDA calls),
        launch, sync (waiting for the GPU: synchronize and synchronous copies such as .item()), alloc, free,
        copy, other, runq_self / runq_tree / runq_other / runq_tracer (runnable, waiting for a CPU held by its own
        process, its own workers, other processes, the tracer), blocked (sleep, futex such as the GIL, I/O).
        Also who held the CPU (holders), who woke it (wakers: the GIL holder, a DataLoader worker), page faults
        and page allocation, a coverage check (check.gap_pct), per-bucket shares for the first thread, every
        thread of its process in brief (the culprit of a fault storm is often a thread with no CUDA call), and the
        tracer's own cost. basis = estimated on a recording made before the time accounting existed. Next:
        get_causal_chains for the causes ranked by the time they cost.
        """
        with conn() as c:
            _check(c, pid=pid, tid=tid, bucket_s=bucket_s)
            return time_breakdown(c, pid=pid, tid=tid, bucket_s=bucket_s)

    @mcp.tool(title="Ranks of a distributed job", annotations=READ_ONLY)
    def get_ranks() -> RanksResult:
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
        with conn() as c:
            return ranks_report(c)

    @mcp.tool(title="Step times of a thread", annotations=READ_ONLY)
    def get_step_series(
        pid: Annotated[
            int | None, Field(description="This process's main CUDA thread; omit for the training thread.")
        ] = None,
        tid: Annotated[int | None, Field(description="This thread.")] = None,
        detail: Annotated[bool, Field(description="Every step's ms too (at most 5000).")] = False,
    ) -> Annotated[CallToolResult, StepSeries]:
        """Which steps are slow, and is it periodic? The thread's steps, each ended by its waits for the GPU (the
        loop's period: waits per step found from the repeating sequence of wait sites), the typical step and its
        jitter, the slow steps, their period ("every 40th step: +54.1 ms, 10 steps") with what those steps spent
        the extra time on (blocked and who woke it, waiting for a CPU, off CPU in calls, running), and the other
        slow steps. A thread that never waits for the GPU gets a per-second series (basis = seconds). Cannot see
        which code ran in a slow step. Next: get_waits for the thread's waits by waker; get_time_breakdown(tid) for
        its parts; get_stacks(op) for the marker op.
        """
        with conn() as c:
            _check(c, pid=pid, tid=tid)
            return compact_reply(step_series(c, pid=pid, tid=tid, detail=detail))

    @mcp.tool(title="Waits of a thread by waker", annotations=READ_ONLY)
    def get_waits(
        pid: Annotated[
            int | None,
            Field(
                description="This process's main CUDA thread (a process without CUDA calls, a data worker or a "
                "helper: its main thread); omit for the training thread."
            ),
        ] = None,
        tid: Annotated[int | None, Field(description="This thread (any thread, CUDA or not).")] = None,
    ) -> Annotated[CallToolResult, Waits]:
        """How long were the thread's waits, and who ended them? Per waker (a thread of the job, a DataLoader
        worker, another process, or an interrupt named by kind: [timer] = a sleep or timeout expired, [block] = a
        disk I/O completed, [net], [softirq], [irq]): exact wakeups and blocked ms, of which inside CUDA calls,
        the typical and longest single wait and a histogram of wait lengths (from sched: every wait >= 1 ms, a
        sample below). Cannot see what the thread waited on (the lock, the file), only who ended the wait. Next:
        get_step_series for when the waits fall in the loop; get_time_breakdown for the thread's other parts.
        """
        with conn() as c:
            _check(c, pid=pid, tid=tid)
            return compact_reply(waits(c, pid=pid, tid=tid))

    @mcp.tool(title="Processes or threads side by side", annotations=READ_ONLY)
    @cancellable
    def compare_processes(
        pids: Annotated[
            list[int] | None, Field(description="Processes to set side by side; omit for every CUDA process/rank.")
        ] = None,
        threads_of: Annotated[
            int | None, Field(description="Instead: the threads of this process, busiest first.")
        ] = None,
    ) -> Annotated[CallToolResult, SideBySide]:
        """How do these processes (or threads) compare? One column each (a process by the thread that does its
        work: its main CUDA thread, else its busiest), with its role, top waker and CPU holder and step series
        headline; one row per measure with a value per column: wall ms, CUDA calls, each part's share of its time
        (cpu, launch, sync, ..., runq_*, blocked), faults, steps, steps/s, typical step, slow steps. At most 8
        columns. Cannot see the GPU side of each process. Next: get_step_series(pid) or get_waits(pid) for the
        column that stands out.
        """
        if pids is not None:
            if len(pids) > MAX_PIDS:
                raise ToolError(
                    f"{len(pids):,} pids is too many: pass at most {MAX_PIDS} (the answer shows "
                    "8 columns); omit pids for every CUDA process"
                )
            pids = list(dict.fromkeys(pids))  # a pid named twice is one column
        with conn() as c:
            for p in [*(pids or []), *([threads_of] if threads_of is not None else [])]:
                _check(c, pid=p)
            return compact_reply(side_by_side(c, pids=pids or None, threads_of=threads_of))

    @mcp.tool(name="compare_traces", title="Compare two recordings", annotations=READ_ONLY)
    @cancellable
    def compare_traces(
        before: Annotated[
            str | None,
            Field(
                description="File name of the recording before the change, e.g. baseline.duckdb: a .duckdb file in "
                "the served recording's directory. Omit for the served recording."
            ),
        ] = None,
        after: Annotated[
            str | None,
            Field(description="File name of the recording after the change, likewise. Omit for the served recording."),
        ] = None,
    ) -> Comparison:
        """Did a change work? Compare two recordings of the same workload, before and after it. Name the other
        recording by file name (a .duckdb next to the served one; a wrong name lists them); the served recording
        is the side you omit.

        Returns a headline of the differences beyond noise; steps/s and how a step was detected (the training
        thread's waits for the GPU, or launches per step when one side waits less often); the training thread's
        parts (cpu, launch, sync, ..., runq_*, blocked) as ms, shares and ms per step before and after; per op
        calls/s, ms per second, p50/p99 µs (exact histograms); chains that appeared, went away or changed
        severity; and warnings (different programs, workloads, machines, options, too short). Each difference
        has a verdict (beyond_noise | within_noise | too_short | not_tested) and an interval from the
        recordings' own second-to-second variance; noise_test names the tests. Next: get_causal_chains and
        get_stacks(op) on the served recording for a chain that remains or appeared.
        """
        if before is None and after is None:
            raise ToolError(
                "name the other recording: before='baseline.duckdb' compares it with the served recording as "
                f"after (or pass after=...); recordings here: {_recordings(siblings)}"
            )
        named = {k: _sibling(siblings, v) for k, v in (("before", before), ("after", after)) if v is not None}
        failed: TracerError | None = None
        with ExitStack() as stack:
            conns: dict[str, duckdb.DuckDBPyConnection] = {}
            for k, p in named.items():
                try:
                    conns[k] = stack.enter_context(open_trace(p))
                except TracerError as e:
                    raise ToolError(_tool_message(e)) from None
            if len(conns) < 2:  # the side left out is the served recording (live: its latest snapshot)
                served = stack.enter_context(conn())
                conns.setdefault("before", served)
                conns.setdefault("after", served)
            names = {k: named[k].name if k in named else served_name for k in ("before", "after")}
            where = {
                k: named[k].resolve() if k in named else (None if connect or job else path.resolve()) for k in names
            }
            try:
                with budget(*(conns[k] for k in named)):  # the served side's conn() has its own
                    return compare.compare_traces(
                        conns["before"],
                        conns["after"],
                        before_name=names["before"],
                        after_name=names["after"],
                        same_file=where["before"] is not None and where["before"] == where["after"],
                    )
            except duckdb.InterruptException:
                failed = over_budget()
            except duckdb.Error as e:  # a file damaged or changed while read: one clear answer, no traceback
                failed = read_error(" or ".join(dict.fromkeys(names.values())), e)
        assert failed is not None
        raise ToolError(_tool_message(failed))

    @mcp.tool(title="Call stacks of an op", annotations=READ_ONLY)
    def get_stacks(
        op: Annotated[str, Field(description="CUDA op name exactly as in get_trace_stats, e.g. cudaMalloc.")],
        pid: Annotated[int | None, Field(description="Only calls from this process.")] = None,
        limit: Annotated[int, Field(description="Most stacks to return (1-100).", ge=1, le=100)] = 10,
    ) -> StacksResult:
        """Code paths that called one CUDA op, ranked by calls, from the Python file:line through native code
        to the CUDA API.

        Per stack: calls, avg/min/max µs, total bytes, pids, and frames outermost first (kind python | native |
        cuda, module, function, file, line). Calls without a captured stack are grouped as "(no stack
        captured)"; coverage says how many calls have a stack and why the others have none (duty_cycle: the
        launch probes were off; row_budget: counted, not stored; stack_budget: stored, not walked, as launches
        are walked 1 in 8; lost_walk). Counts are of stored calls; op_calls_total is the exact count. Cannot
        see code outside CUDA calls. Next: run_sql on cuda_calls WHERE stack_id = N for when those calls
        happened.
        """
        with conn() as c:
            _check(c, pid=pid)
            try:
                return top_stacks(c, op, pid=pid, limit=limit)
            except UnknownOp as e:
                known = ", ".join(e.known) or "(none)"
                raise ToolError(
                    f"unknown op {_echo(op)}; traced ops: {known}. Call get_stacks with one of those names."
                ) from None

    @mcp.tool(title="Where threads spend time outside CUDA calls", annotations=READ_ONLY)
    def get_thread_stacks(
        mode: Annotated[
            str, Field(description="on-cpu: where CPU time went (samples); off-cpu: where threads blocked (exact).")
        ] = "off-cpu",
        pid: Annotated[int | None, Field(description="Only this process.")] = None,
        tid: Annotated[int | None, Field(description="Only this thread (e.g. a chain's tid).")] = None,
        limit: Annotated[int, Field(description="Most stacks to return (1-100).", ge=1, le=100)] = 10,
    ) -> ThreadStacksResult:
        """Stacks of the job's threads outside the moments of their CUDA calls, most time first: on CPU (perf
        samples at session.sample_hz, every thread of the job) or blocked (every blocking switch, exact ns).

        Per stack: thread (its OS name, else 'thread TID (hottest function, file:line)'), site (innermost user
        Python line), ms, share of the thread's time in that mode, and frames outermost first. Off-CPU stacks
        carry the sleep state (S | D) and what they wait in: gil (CPython's interpreter lock), lock
        (threading.Lock, queues), io (disk, fsync), sleep, cuda (inside a call), other (pipes, sockets). Use it
        for time the breakdown shows outside calls (cpu, blocked) and chains name by line (gil_contention,
        blocking_io, host_python). Next: get_stacks(op) for code paths into a CUDA op.
        """
        if mode not in MODES:
            raise ToolError(f"unknown mode {_echo(mode)}; use one of {', '.join(MODES)}.")
        with conn() as c:
            _check(c, pid=pid, tid=tid)
            try:
                return thread_stacks(c, mode, pid=pid, tid=tid, limit=limit)
            except NoStacks as e:
                raise ToolError(f"{e}: use get_time_breakdown and get_waits instead.") from None

    @mcp.tool(title="What every thread was doing (thread dump)", annotations=READ_ONLY)
    def get_thread_dump(
        pid: Annotated[int | None, Field(description="Only this process.")] = None,
        at_ms: Annotated[
            float | None, Field(description="The snapshots read at or before this ms since the start; omit: latest.")
        ] = None,
    ) -> ThreadDump:
        """What each thread of the job was doing, from snapshots the recorder read without stopping it (at attach,
        when a thread had not run for a second, at the end): per thread its rank, kernel state (running, or
        sleeping in which system call on which kernel wait channel), how long it had been blocked (blocked_ms,
        since it last ran, approximate to a few ms), the native function of its system call, and its Python
        frames innermost first. Answers "where is a hung thread stuck, since when", also for a thread blocked
        since before the recording began (no switch-out, so no off-CPU stack). Empty with a note for recordings
        made before snapshots existed. Next: get_thread_stacks for time spent, get_ranks for a job's ranks."""
        from tracer.analysis.thread_dump import thread_dump

        with conn() as c:
            return thread_dump(c, pid=pid, at_ms=at_ms)

    # run_sql's own threads: its calls block while they wait for a query worker, and on anyio's shared
    # 40-thread pool 45 of them made every other tool wait behind them (issue 17)
    sql_threads = anyio.CapacityLimiter(SQL_THREADS)

    @mcp.tool(title="Read-only SQL", annotations=READ_ONLY, description=RUN_SQL_DESCRIPTION)
    async def run_sql(
        query: Annotated[str, Field(description="One SELECT / WITH / DESCRIBE / SHOW / SUMMARIZE / EXPLAIN.")],
        limit: Annotated[
            int, Field(description="Row cap (1-10000); truncated says if more existed.", ge=1, le=10000)
        ] = 1000,
        ctx: Context | None = None,
    ) -> Annotated[CallToolResult, SqlResult]:
        """One read-only statement; the tool description (:data:`RUN_SQL_DESCRIPTION`) states the limits."""
        client = sql_client(ctx)
        if job:
            raise ToolError(
                f"run_sql reads one recording, and this server serves a job of {len(paths)} recordings "
                f"({served_name}): use the other tools, which analyse the job as one, or serve one recording "
                "(tracer mcp serve --db FILE) to query it"
            )

        def run() -> SqlResult:
            if connect is not None:  # the recorder's live DB: only its own DuckDB instance can read it
                with conn() as c:
                    return execute(c, query, limit, SQL_TIMEOUT_S, reply_bytes=SQL_ROWS_BYTES)
            if freshen is not None:
                freshen()
            pool = sql_pool or default_pool()
            stop = _call_stop.get()
            cancel = stop.sql if stop is not None else None
            return pool.run(path, query, limit, SQL_TIMEOUT_S, reply_bytes=SQL_ROWS_BYTES, client=client, cancel=cancel)

        failed: TracerError | None = None
        try:
            # cancelled (the client left, the server stopping): its query is stopped and the thread abandoned
            res = await _in_thread(run, limiter=sql_threads)
        except TracerError as e:
            failed = e
        if failed is not None:
            raise ToolError(_tool_message(failed))
        return sql_reply(res)

    @mcp.resource("trace://schema", name="schema", title="Trace DB schema", mime_type="text/markdown")
    def schema() -> str:
        """Every table and column of the trace DB with its meaning and units, plus example queries."""
        return schema_markdown()

    @mcp.prompt(name="investigate", title="Investigate this training run")
    def investigate(question: str = "How did my last training go, and how do I make it faster?") -> str:
        """Walk through the trace in the recommended order and answer the engineer's question."""
        return f"{question}\n\n{INVESTIGATE_STEPS}"

    return mcp


INVESTIGATE_STEPS = f"""\
Use the cuda-host-tracer tools in this order, and before concluding, say what each could not see:
{INVESTIGATION_ORDER}
Answer with the measured numbers (step ms, shares, p50/p99, who woke or preempted the thread, Python file:line)
and the recommended fixes, most effective first, each from the root of its chain's path."""


RUN_SQL_DESCRIPTION = f"""\
Run one read-only SQL statement (DuckDB dialect) on the trace DB, for questions the other tools do not answer:
time buckets, the microsecond timeline around a stall, per-PID scheduling, malloc/free balance.

Read the trace://schema resource for tables and columns. Timestamps are ns since session start
(ts_ns // 10000000000 buckets by 10 s); durations are ns. Writes, several statements, file or network access,
ATTACH, COPY, SET, PRAGMA and INSTALL/LOAD are refused; EXPLAIN [ANALYZE] only of a SELECT; so are the server's
settings and paths (duckdb_settings, current_setting, duckdb_databases) and query()/query_table().

Limits per query: {SQL_TIMEOUT_S:g} s of wall clock (a query still running then is stopped, even inside one long
function call); {LIMITS.memory_bytes >> 20} MiB of memory; about {SQL_ROWS_BYTES >> 10} KiB of rows per reply \
(column names count too), past which truncated is true and note says so (page with LIMIT/OFFSET, or aggregate); \
text values cut at {LIMITS.value_chars:,} characters. A stopped query never affects the next call. Calls from one \
client run one at a time (the other query worker stays free for other clients); a few more wait, beyond that they \
are refused. While other clients' queries hold every worker, a client with nothing running is answered in a short \
lane that stops its query after {LANE_TIMEOUT_S:g} s (send a longer one again later)."""


def sql_client(ctx: Context | None) -> str | None:
    """Who calls run_sql, for the query workers' fair queue (:mod:`tracer.analysis.sql.fairqueue`): what the client
    cannot choose (issue 30). Over HTTP, what :class:`mcp_server.sessions.SessionLimits` wrote into the request:
    a session this server issued, else the peer's address; never a header or the ``clientInfo`` the client sends
    (a new name or a forged ``mcp-session-id`` per call bought a new share). Over stdio or in memory, the session
    object: one client.
    """
    if ctx is None:
        return None
    try:
        rc = ctx.request_context
    except Exception:  # no request in progress: not a tool call the queue can tell apart
        return None
    scope = getattr(rc.request, "scope", None)
    key = scope.get(CLIENT_KEY) if isinstance(scope, dict) else None
    return str(key) if key else f"session-object:{id(rc.session)}"


def compact_reply(record: BaseModel) -> CallToolResult:
    """Return ``record`` as structured content plus the same JSON as compact text: the SDK's default text is
    indented, which made an answer a model reads in full a third longer."""
    data = record.model_dump(mode="json")
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=data)


def sql_reply(res: SqlResult) -> CallToolResult:
    """Return the run_sql tool result for ``res``: structured content plus the same JSON, compact, as text.

    Rows are dropped from the end (``truncated``, ``note``) until the whole result fits in
    :data:`SQL_REPLY_BYTES`: text escaping can make the text copy larger than the rows' own JSON. A result that
    does not fit without any row (its column names alone) is an error, never an oversized message.
    """
    while True:
        data = res.model_dump(mode="json")
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        out = CallToolResult(content=[TextContent(type="text", text=text)], structured_content=data)
        size = len(out.model_dump_json(by_alias=True).encode())
        if size <= SQL_REPLY_BYTES:
            return out
        if res.row_count == 0:
            raise ToolError(
                f"the result's column names and types alone take {size:,} bytes, over the "
                f"{SQL_REPLY_BYTES >> 10} KiB message limit. Select fewer columns, or give them short names "
                "(expr AS a)."
            )
        keep = min(res.row_count - 1, res.row_count * SQL_REPLY_BYTES // size)
        res = res.model_copy(
            update={
                "rows": res.rows[:keep],
                "row_count": keep,
                "truncated": True,
                "note": f"reply cut to {keep} rows to fit the {SQL_REPLY_BYTES >> 10} KiB message limit; "
                "select fewer or narrower columns, or page with LIMIT/OFFSET",
            }
        )


# Directories no error may name (issue 30): the served recording's and compare_traces' directory, as given and
# resolved. A file there is named relative to it ("locked.duckdb is being written"), the directory itself so.
_hidden_dirs: set[str] = set()


def _hide_directories(*dirs: Path) -> None:
    for d in dirs:
        for v in {os.path.abspath(d), os.path.realpath(d)}:
            if len(v) > 1:
                _hidden_dirs.add(v.rstrip(os.sep))


def redact(text: str) -> str:
    """``text`` with the hidden directories (and the home directory) taken out of every path it holds."""
    for d in sorted(_hidden_dirs, key=len, reverse=True):  # the deepest first: /srv/a before /srv
        text = text.replace(d + os.sep, "")
        text = re.sub(re.escape(d) + r"(?![\w.-])", "the served directory", text)
    home = os.path.expanduser("~")
    return text.replace(home + os.sep, "~" + os.sep) if len(home) > 1 else text


class _Stop:
    """Stops one tool call's work once its client has left (issue 30: compare_processes burned 20 s of CPU and
    run_sql its query's 10 s after the client disconnected): interrupts the DuckDB connections under
    :func:`budget` in the call's thread, and cancels its run_sql query (:class:`tracer.analysis.sql.pool.Cancel`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stopped = False
        self._conns: list[duckdb.DuckDBPyConnection] = []
        self.sql = Cancel()

    def add(self, conns: Sequence[duckdb.DuckDBPyConnection]) -> bool:
        """Interrupt ``conns`` when the call is stopped; False if it is already (nothing more should run)."""
        with self._lock:
            self._conns.extend(conns)
            return not self.stopped

    def remove(self, conns: Sequence[duckdb.DuckDBPyConnection]) -> None:
        with self._lock:
            for c in conns:
                if c in self._conns:
                    self._conns.remove(c)

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            conns = list(self._conns)
        self.sql.cancel()
        for c in conns:
            try:
                c.interrupt()
            except duckdb.Error:  # closed meanwhile
                pass


# the current tool call's _Stop, set by _in_thread: anyio runs the thread in a copy of the caller's context
_call_stop: ContextVar[_Stop | None] = ContextVar("tracer_call_stop", default=None)


async def _in_thread(fn: Callable[[], T], limiter: anyio.CapacityLimiter | None = None) -> T:
    """Run ``fn`` in a worker thread; if the call is cancelled (its client disconnected, the server stopping),
    stop its work (:class:`_Stop`) and leave the thread to end, which it then does within moments."""
    stop = _Stop()
    token = _call_stop.set(stop)
    try:
        return await anyio.to_thread.run_sync(fn, limiter=limiter, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        stop.stop()
        raise
    finally:
        _call_stop.reset(token)


def cancellable(fn: Callable[P, T]) -> Callable[P, Awaitable[T]]:
    """A sync tool made async so its work stops when the client leaves: the SDK runs a sync tool in a thread it
    waits for (cancelling the call waits too), so a heavy tool ran on after its client was gone."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        return await _in_thread(functools.partial(fn, *args, **kwargs))

    return call


@contextmanager
def budget(*conns: duckdb.DuckDBPyConnection, seconds: float | None = None) -> Iterator[None]:
    """Interrupt the DuckDB work on ``conns`` once ``seconds`` (default :data:`TOOL_BUDGET_S`) have passed, or
    once the call's client has left (:class:`_Stop`): the tool then fails with :func:`over_budget` rather than
    burning the server's CPU."""
    stop = _call_stop.get()
    if stop is not None and not stop.add(conns):
        stop.remove(conns)
        raise duckdb.InterruptException("the call was cancelled")
    timer = threading.Timer(TOOL_BUDGET_S if seconds is None else seconds, lambda: [c.interrupt() for c in conns])
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if stop is not None:
            stop.remove(conns)


def over_budget() -> TracerError:
    return TracerError(
        f"the analysis was stopped after {TOOL_BUDGET_S:g} s, its time budget: a recording this slow to read is "
        "damaged or crafted",
        "Check the recording (tracer info FILE), or record again.",
    )


def _tool_message(e: TracerError) -> str:
    """The tool-error text for ``e``: its message and hint (the hint says how to fix the call), without the
    server's directories."""
    return redact(f"{e.message}. {e.hint}".strip() if e.hint else e.message)


def _echo(value: str) -> str:
    """``value`` quoted for an error message, cut to :data:`ECHO_CHARS` characters."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}… ({len(value):,} characters)"


def _recordings(directory: Path) -> str:
    """Return the recordings compare_traces can read in ``directory``, comma-separated (at most LIST_RECORDINGS)."""
    try:
        names = sorted(
            p.name
            for p in directory.iterdir()
            if p.name.endswith(RECORDING_SUFFIX) and not p.name.startswith(".") and _inside(directory, p) is not None
        )
    except OSError:
        names = []
    shown = ", ".join(names[:LIST_RECORDINGS])
    return (shown + (f" … ({len(names)} in all)" if len(names) > LIST_RECORDINGS else "")) or "(none)"


def _sibling(directory: Path, name: str) -> Path:
    """Return the recording ``name`` in ``directory``: a bare ``*.duckdb`` file name, nothing else (a model must
    not reach other files through this server); raise ToolError saying what it can name."""
    bad = (
        not name
        or len(name) > 255
        or any(ch in name for ch in ("/", "\\", "\0"))
        or name.startswith(".")
        or not name.endswith(RECORDING_SUFFIX)
    )
    if bad:
        raise ToolError(
            f"{_echo(name)} is not a recording's file name: pass the bare name of a {RECORDING_SUFFIX} file in the "
            f"served recording's directory, without a path; recordings here: {_recordings(directory)}"
        )
    p = directory / name
    if not p.exists():
        raise ToolError(f"no recording {_echo(name)} here; recordings here: {_recordings(directory)}")
    real = _inside(directory, p)
    if real is None:
        raise ToolError(
            f"{_echo(name)} is a link that leads out of the served recording's directory (or to a file not named "
            f"{RECORDING_SUFFIX}): nothing outside it is read; recordings here: {_recordings(directory)}"
        )
    return real  # the checked target, not the link: a link swapped after this check is not followed


def _inside(directory: Path, p: Path) -> Path | None:
    """Return ``p`` with every symlink resolved when that stays within ``directory`` and names a
    ``*.duckdb`` file, else None (issue 17: a link in the directory led to any file on the host)."""
    try:
        real = p.resolve(strict=True)
        root = directory.resolve(strict=True)
    except (OSError, RuntimeError):  # a dangling link, a loop
        return None
    return real if real.is_relative_to(root) and real.name.endswith(RECORDING_SUFFIX) else None


def _check(c: duckdb.DuckDBPyConnection, **args: object) -> None:
    """Check the tool's arguments as the CLI does (:func:`tracer.analysis.arguments.check_args`)."""
    failed: TracerError | None = None
    try:
        check_args(c, **args)  # type: ignore[arg-type]
    except TracerError as e:
        failed = e
    if failed is not None:
        raise ToolError(_tool_message(failed))
