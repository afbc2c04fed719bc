"""The MCP tools, one module-level function each, grouped by what they answer; :data:`TOOLS` lists them in the
order the server registers them (and a client lists them), with the title and annotations each is served under.

Every tool reads the server's state through its ``Context`` (:func:`mcp_server.state.state`), calls one
``tracer.analysis`` function and returns its pydantic record, so the output schema and ``structuredContent`` are
the record's. The tool's docstring is its description (run_sql's states its limits: ``RUN_SQL_DESCRIPTION``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

from mcp_server.tools import chains, compare, overview, sql, stacks, steps

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False, idempotent_hint=True, destructive_hint=False)


@dataclass(frozen=True)
class Tool:
    fn: Callable[..., Any]
    title: str
    description: str | None = None  # None: the function's docstring

    def describe(self) -> str:
        """The tool's description: without the docstring's indentation, which the SDK would send as it is (a
        model would read 4 to 8 spaces a line)."""
        return self.description or inspect.cleandoc(self.fn.__doc__ or "")


TOOLS = (
    Tool(overview.get_trace_stats, "Trace overview"),
    Tool(chains.get_causal_chains, "Causal chains"),
    Tool(overview.get_time_breakdown, "Time breakdown"),
    Tool(chains.get_ranks, "Ranks of a distributed job"),
    Tool(steps.get_step_series, "Step times of a thread"),
    Tool(steps.get_waits, "Waits of a thread by waker"),
    Tool(steps.compare_processes, "Processes or threads side by side"),
    Tool(compare.compare_traces, "Compare two recordings"),
    Tool(stacks.get_stacks, "Call stacks of an op"),
    Tool(stacks.get_thread_stacks, "Where threads spend time outside CUDA calls"),
    Tool(stacks.get_thread_dump, "What every thread was doing (thread dump)"),
    Tool(sql.run_sql, "Read-only SQL", sql.RUN_SQL_DESCRIPTION),
)


def register(mcp: MCPServer[Any]) -> None:
    """Add every tool of :data:`TOOLS` to ``mcp``, read-only."""
    for t in TOOLS:
        mcp.add_tool(t.fn, title=t.title, description=t.describe(), annotations=READ_ONLY)
