"""The server's state, one typed record the tools reach through their ``Context``
(``ctx.request_context.lifespan_context``, the MCP SDK's lifespan pattern): what is served (one recording or a
job's), how a tool opens it, where compare_traces looks for the other recording, run_sql's query workers, and the
limits. :func:`build_server <mcp_server.server.build_server>` settles the arguments; :func:`lifespan` makes the
state each time the server starts serving (once per stdio run or HTTP app, once per in-memory client).

Tools are sync, run by the SDK in worker threads, so each call opens its own read-only connection
(:meth:`ServerState.connection`: DuckDB connections must not be shared across threads), under the call's time
budget (:mod:`mcp_server.budget`). A DuckDB error inside a tool (a file damaged or swapped underneath the server)
becomes a ToolError, raised after the connection is closed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import duckdb
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from mcp_server.budget import TOOL_BUDGET_S, budget, over_budget
from mcp_server.errors import tool_error
from tracer.analysis.arguments import check_args, job_pid
from tracer.analysis.db import read_error
from tracer.analysis.sql.limits import LIMITS
from tracer.analysis.sql.pool import SqlPool, default_pool
from tracer.errors import TracerError

Connect = Callable[[], duckdb.DuckDBPyConnection]
# run_sql calls in progress at once (waiting for a query worker, or running): its calls block while they wait for
# a worker, and on anyio's shared 40-thread pool 45 of them made every other tool wait behind them (issue 17)
SQL_THREADS = 32


@dataclass(frozen=True)
class ToolLimits:
    """How long a tool call may work: every tool's DuckDB work (:func:`mcp_server.budget.budget`), and run_sql's
    query (its description states the default)."""

    tool_budget_s: float = TOOL_BUDGET_S
    sql_timeout_s: float = LIMITS.timeout_s


@dataclass(frozen=True)
class ServerState:
    """What every tool call reads. Frozen: one state serves concurrent calls in many threads."""

    paths: tuple[Path, ...]  # the recordings served: one, or a job's (analysed as one)
    connect: Connect  # a new read connection to them (a live recording: on the recorder's latest snapshot)
    live: bool  # served from the recorder's own DuckDB instance (run_sql runs in-process, with no worker to kill)
    siblings: Path  # the directory compare_traces reads the other recording from, by file name
    hidden: tuple[str, ...]  # directories no error may name (tracer.errors.hidden_directories)
    freshen: Callable[[], None] | None = None  # run before each call: a live recording's new snapshot
    sql_pool: SqlPool | None = None  # run_sql's query workers; None: this process's default pool
    limits: ToolLimits = field(default_factory=ToolLimits)
    # run_sql's own threads (SQL_THREADS), made with the state: a limiter belongs to the event loop serving
    sql_threads: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(SQL_THREADS))

    @property
    def job(self) -> bool:
        return len(self.paths) > 1

    @property
    def served_name(self) -> str:
        """The name answers give the served recording(s)."""
        return "+".join(p.name for p in self.paths)

    @property
    def pool(self) -> SqlPool:
        return self.sql_pool or default_pool()

    def error(self, e: TracerError) -> ToolError:
        """The ToolError for ``e``, without this server's directories."""
        return tool_error(e, self.hidden)

    @contextmanager
    def connection(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read connection to the served recording(s) for one tool call, under its time budget; closed after.

        Raises:
            ToolError: the recording cannot be opened or read, or the call ran past its budget.
        """
        if self.freshen is not None:
            self.freshen()
        try:
            c = self.connect()
        except TracerError as e:
            raise self.error(e) from None
        failed: TracerError | None = None
        try:
            with budget(c, seconds=self.limits.tool_budget_s):
                yield c
        except duckdb.InterruptException:
            failed = over_budget(self.limits.tool_budget_s)
        except duckdb.Error as e:  # the file changed or is damaged (or an analysis bug): a clear answer, not a crash
            failed = read_error(self.served_name, e)
        finally:
            c.close()
        if failed is not None:  # raised here, outside the except block: no traceback keeps the query alive
            raise self.error(failed)

    def check(self, c: duckdb.DuckDBPyConnection, **args: Any) -> None:
        """Check a tool's arguments as the CLI does (:func:`tracer.analysis.arguments.check_args`).

        Raises:
            ToolError: an argument the recording refuses, with what it holds.
        """
        failed: TracerError | None = None
        try:
            check_args(c, **args)
        except TracerError as e:
            failed = e
        if failed is not None:
            raise self.error(failed)

    def job_pid(
        self, c: duckdb.DuckDBPyConnection, pid: int | None, rank: int | None, container: str | None
    ) -> int | None:
        """The process a tool's job selectors name (:func:`tracer.analysis.arguments.job_pid`: a pid, a rank's
        process, or a container's job).

        Raises:
            ToolError: a selector the recording cannot resolve, with what it holds.
        """
        failed: TracerError | None = None
        try:
            return job_pid(c, pid=pid, rank=rank, container=container)
        except TracerError as e:
            failed = e
        raise self.error(failed)


def lifespan(make: Callable[[], ServerState]) -> Callable[[MCPServer[Any]], AbstractAsyncContextManager[ServerState]]:
    """The server's lifespan: the state ``make`` builds, for as long as the server serves."""

    @asynccontextmanager
    async def serving(_: MCPServer[Any]) -> AsyncIterator[ServerState]:
        yield make()

    return serving


def state(ctx: Context) -> ServerState:
    """The state of the server ``ctx``'s call runs on."""
    found = ctx.request_context.lifespan_context
    if not isinstance(found, ServerState):
        raise TypeError(f"the MCP server's lifespan state is a {type(found).__name__}, not a ServerState")
    return found
