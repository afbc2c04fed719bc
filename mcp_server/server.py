"""The MCP surface: read-only tools over one trace DB (compare_traces also reads a second one, named by file
from the served DB's directory), its schema as a resource, and an investigation prompt.

Where things are: :func:`build_server` (here) settles what is served and makes the server; the state every tool
reads through its ``Context`` is :class:`mcp_server.state.ServerState`; the tools are module-level functions in
:mod:`mcp_server.tools` (listed in order in ``TOOLS``), each a thin view over one ``tracer.analysis`` function; a
call's time budget and cancellation are :mod:`mcp_server.budget`; its error channel, without the server's paths,
:mod:`mcp_server.errors`; the instructions, prompt and schema resource :mod:`mcp_server.guide`. The transports are
:mod:`mcp_server.http` (stdio and streamable HTTP).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import MCPServer

from mcp_server import guide, tools
from mcp_server.state import Connect, ServerState, ToolLimits, lifespan
from tracer.analysis.db import open_trace, recordings
from tracer.analysis.sql.pool import SqlPool
from tracer.errors import hidden_directories


def build_server(
    db_path: str | Path | Sequence[str | Path],
    *,
    connect: Connect | None = None,
    sql_pool: SqlPool | None = None,
    freshen: Callable[[], None] | None = None,
    recordings_dir: str | Path | None = None,
    limits: ToolLimits | None = None,
) -> MCPServer[Any]:
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
        limits: the tools' time limits (default :class:`mcp_server.state.ToolLimits`: what run_sql's description
            states).
    """
    paths = recordings(db_path) if connect is None else [Path(str(db_path))]
    siblings = Path(recordings_dir) if recordings_dir is not None else paths[0].resolve().parent
    make = functools.partial(
        ServerState,
        paths=tuple(paths),
        connect=connect or functools.partial(open_trace, paths if len(paths) > 1 else paths[0]),
        live=connect is not None,
        siblings=siblings,
        hidden=hidden_directories([*(p.parent for p in paths), siblings]),
        freshen=freshen,
        sql_pool=sql_pool,
        limits=limits or ToolLimits(),
    )
    mcp = MCPServer(
        "cuda-host-tracer",
        instructions=guide.INSTRUCTIONS,
        version="0.1.0",
        log_level="WARNING",
        lifespan=lifespan(make),
    )
    tools.register(mcp)
    mcp.resource("trace://schema", name="schema", title="Trace DB schema", mime_type="text/markdown")(guide.schema)
    mcp.prompt(name="investigate", title="Investigate this training run")(guide.investigate)
    return mcp
