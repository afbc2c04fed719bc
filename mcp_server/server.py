"""The MCP surface: four read-only tools over one trace DB, its schema as a resource, and an investigation
prompt.

Every tool calls one ``tracer.analysis`` function and returns its pydantic record, so the output schema and
``structuredContent`` are the record's. Tools are sync: the SDK runs them in worker threads, so each call
opens
its own read-only connection (DuckDB connections must not be shared across threads). Two error channels:
``ToolError`` (bad argument, unreadable DB, refused SQL) becomes an ``is_error`` result the model reads and
can
correct from; anything else is a server bug.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import duckdb
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from tracer.analysis.chains import ChainsResult, compute_chains
from tracer.analysis.sql import SqlResult
from tracer.analysis.sql import run_sql as _run_sql
from tracer.analysis.stacks import StacksResult, UnknownOp, top_stacks
from tracer.analysis.stats import TraceStats, trace_stats
from tracer.db import open_trace
from tracer.errors import TracerError
from tracer.schema import schema_markdown

SQL_TIMEOUT_S = 10.0

INSTRUCTIONS = """\
You are investigating one recording of a GPU training job: every CUDA API call with its latency, what the
calling
thread did during it (off CPU, waiting for a CPU, who preempted it), the process tree, and host samples.
Investigation order:
1. get_trace_stats: environment, per-op p50/p99 and tail ratio, per-process off-CPU, host peaks, chain counts.
2. get_causal_chains: diagnoses worst first, each with evidence and fixes for this trace. Filter with
   pid/severity.
3. get_stacks(op): for the op a chain names, the code paths from the Python file:line to the CUDA call.
4. run_sql: anything else (time buckets, the microsecond timeline around a stall, per-PID scheduling). Read
   the
   trace://schema resource first. Timestamps are ns since session start; ts_ns // 10000000000 buckets by 10 s.
Quote the numbers the tools return; op_stats counts are exact, cuda_calls rows are a sample that keeps the tail."""  # noqa: E501

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False, idempotent_hint=True, destructive_hint=False)

Connect = Callable[[], duckdb.DuckDBPyConnection]


def build_server(db_path: str | Path, *, connect: Connect | None = None) -> MCPServer:
    """Return the MCP server for the trace DB at ``db_path``.

    Args:
        connect: open a read connection per tool call. Default: :func:`tracer.db.open_trace` on ``db_path``.
            The recorder passes a factory on its own DuckDB instance to serve a DB it is still writing.
    """
    path = Path(db_path)
    opener: Connect = connect or (lambda: open_trace(path))

    @contextmanager
    def conn() -> Iterator[duckdb.DuckDBPyConnection]:
        try:
            c = opener()
        except TracerError as e:
            raise ToolError(f"{e.message}. {e.hint}".strip()) from None
        try:
            yield c
        finally:
            c.close()

    mcp = MCPServer("cuda-host-tracer", instructions=INSTRUCTIONS, version="0.1.0", log_level="WARNING")

    @mcp.tool(title="Trace overview", annotations=READ_ONLY)
    def get_trace_stats(
        pid: Annotated[int | None, Field(description="Only this process; omit for the whole traced tree.")] = None,
    ) -> TraceStats:
        """Overview of the recording. Call this first.

        Returns the environment (GPU, driver, CPU, RAM, kernel, Python), events traced/stored/lost, per CUDA
        op
        (runtime and driver layers kept apart) calls, p50/p95/p99/max in µs from the exact in-kernel histogram
        and
        the tail ratio p99/p50, per process (main, dataloader_worker, child) CUDA calls, context switches,
        off-CPU
        seconds and worst stall, host peaks (load, CPU busy, MemAvailable, page allocation, swap) and the
        number of
        causal chains by severity. Next: get_causal_chains for the why, get_stacks(op) for an op with a large
        tail.
        """
        with conn() as c:
            _check_pid(c, pid)
            return trace_stats(c, pid=pid)

    @mcp.tool(title="Causal chains", annotations=READ_ONLY)
    def get_causal_chains(
        pid: Annotated[int | None, Field(description="Only chains affecting this process.")] = None,
        severity: Annotated[str | None, Field(description="high, medium or low; omit for all.")] = None,
        limit: Annotated[int, Field(description="Most chains to return (1-100).", ge=1, le=100)] = 10,
    ) -> ChainsResult:
        """Diagnoses of why CUDA calls were slow, worst first.

        Each chain has a category (cpu_contention, sync_stall, gpu_bound, process_churn, memory_pressure,
        allocation_churn), severity, time range (ns since start), pids, the affected op with its p50/p99 µs,
        the
        measured evidence (per-call off-CPU and run-queue time, who preempted, fork/exit timing, host samples)
        and
        recommendations written for this trace. No chain means no host-side cause was measured. Next:
        get_stacks(op) for the chain's op; run_sql for the timeline around start_ns.
        """
        if severity is not None and severity.lower() not in ("high", "medium", "low"):
            raise ToolError(f"unknown severity {severity!r}: use high, medium or low (or omit it)")
        with conn() as c:
            _check_pid(c, pid)
            return compute_chains(c, pid=pid, severity=severity, limit=limit)

    @mcp.tool(title="Call stacks of an op", annotations=READ_ONLY)
    def get_stacks(
        op: Annotated[str, Field(description="CUDA op name exactly as in get_trace_stats, e.g. cudaMalloc.")],
        pid: Annotated[int | None, Field(description="Only calls from this process.")] = None,
        limit: Annotated[int, Field(description="Most stacks to return (1-100).", ge=1, le=100)] = 10,
    ) -> StacksResult:
        """Code paths that called one CUDA op, ranked by calls, from the Python file:line through native code
        to
        the CUDA API.

        Per stack: calls, avg/min/max µs, total bytes, pids, and frames outermost first (kind python | native
        |
        cuda, module, function, file, line). Calls without a captured stack are grouped as "(no stack
        captured)".
        Counts are of stored calls; op_calls_total is the exact count. Next: run_sql on cuda_calls WHERE
        stack_id = N for when those calls happened.
        """
        with conn() as c:
            try:
                return top_stacks(c, op, pid=pid, limit=limit)
            except UnknownOp as e:
                raise ToolError(f"{e}. Call get_stacks with one of those names.") from None

    @mcp.tool(title="Read-only SQL", annotations=READ_ONLY)
    def run_sql(
        query: Annotated[str, Field(description="One SELECT / WITH / DESCRIBE / SHOW / SUMMARIZE / EXPLAIN.")],
        limit: Annotated[
            int, Field(description="Row cap (1-10000); truncated says if more existed.", ge=1, le=10000)
        ] = 1000,
    ) -> SqlResult:
        """Run one read-only SQL statement (DuckDB dialect) on the trace DB, for questions the other tools do
        not
        answer: time buckets, the microsecond timeline around a stall, per-PID scheduling, malloc/free
        balance.

        Read the trace://schema resource for tables and columns. Timestamps are ns since session start
        (ts_ns // 10000000000 buckets by 10 s); durations are ns. Writes, several statements, file or network
        access, ATTACH, COPY, SET, PRAGMA and INSTALL/LOAD are refused; queries stop after 10 s.
        """
        with conn() as c:
            try:
                return _run_sql(c, query, limit=limit, timeout_s=SQL_TIMEOUT_S)
            except TracerError as e:
                raise ToolError(f"{e.message}. {e.hint}".strip()) from None

    @mcp.resource("trace://schema", name="schema", title="Trace DB schema", mime_type="text/markdown")
    def schema() -> str:
        """Every table and column of the trace DB with its meaning and units, plus example queries."""
        return schema_markdown()

    @mcp.prompt(name="investigate", title="Investigate this training run")
    def investigate(question: str = "How did my last training go, and how do I make it faster?") -> str:
        """Walk through the trace in the recommended order and answer the engineer's question."""
        return (
            f"{question}\n\nUse the cuda-host-tracer tools in this order: get_trace_stats, get_causal_chains, "  # noqa: E501
            "get_stacks for the op each chain names, then run_sql for timelines (read trace://schema first). "
            "Answer with the measured numbers (p50/p99, off-CPU ms, who preempted, Python file:line) and the "
            "recommended fixes, most effective first."
        )

    return mcp


def _check_pid(c: duckdb.DuckDBPyConnection, pid: int | None) -> None:
    if pid is None:
        return
    if not c.execute("SELECT 1 FROM processes WHERE pid = ?", [pid]).fetchone():
        pids = [r[0] for r in c.execute("SELECT pid FROM processes ORDER BY pid LIMIT 20").fetchall()]
        raise ToolError(
            f"pid {pid} is not in this trace; traced pids: {', '.join(map(str, pids))}. Omit pid for the whole tree."
        )
