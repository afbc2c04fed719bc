"""run_sql: one read-only statement on the served recording, for what the other tools do not answer.

The exception to "one connection per call": the statement runs in a query worker process
(:mod:`tracer.analysis.sql.pool`) that can be killed, under the limits its description states, so no query can
wedge this process, starve the other tools or bloat its memory. What runs the query and checks it is the sandbox
(:mod:`tracer.analysis.sql`); this module picks where it runs, who asked (the workers' fair queue) and fits the
answer in one MCP message (:func:`sql_reply`).
"""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult
from pydantic import Field

from mcp_server.budget import call_stop, in_thread
from mcp_server.replies import compact_reply
from mcp_server.sessions import CLIENT_KEY
from mcp_server.state import state
from tracer.analysis.sql.limits import LIMITS
from tracer.analysis.sql.pool import LANE_TIMEOUT_S
from tracer.analysis.sql.result import SqlResult
from tracer.analysis.sql.run import execute
from tracer.errors import TracerError

# The SDK client refuses a server-sent event over 1 MiB, and a tool result carries the rows twice (structured
# content, and the same JSON as text for models that read only text): the result must fit in the event, and
# the rows get a little under half of it.
SQL_REPLY_BYTES = (1 << 20) - (16 << 10)
SQL_ROWS_BYTES = SQL_REPLY_BYTES // 2 - (8 << 10)

RUN_SQL_DESCRIPTION = f"""\
Run one read-only SQL statement (DuckDB dialect) on the trace DB, for questions the other tools do not answer:
time buckets, the microsecond timeline around a stall, per-PID scheduling, malloc/free balance.

Read the trace://schema resource for tables and columns. Timestamps are ns since session start
(ts_ns // 10000000000 buckets by 10 s); durations are ns. Writes, several statements, file or network access,
ATTACH, COPY, SET, PRAGMA and INSTALL/LOAD are refused; EXPLAIN [ANALYZE] only of a SELECT; so are the server's
settings and paths (duckdb_settings, current_setting, duckdb_databases) and query()/query_table().

Limits per query: {LIMITS.timeout_s:g} s of wall clock (a query still running then is stopped, even inside one long
function call); {LIMITS.memory_bytes >> 20} MiB of memory; about {SQL_ROWS_BYTES >> 10} KiB of rows per reply \
(column names count too), past which truncated is true and note says so (page with LIMIT/OFFSET, or aggregate); \
text values cut at {LIMITS.value_chars:,} characters. A stopped query never affects the next call. Calls from one \
client run one at a time (the other query worker stays free for other clients); a few more wait, beyond that they \
are refused. While other clients' queries hold every worker, a client with nothing running is answered in a short \
lane that stops its query after {LANE_TIMEOUT_S:g} s (send a longer one again later)."""


async def run_sql(
    query: Annotated[str, Field(description="One SELECT / WITH / DESCRIBE / SHOW / SUMMARIZE / EXPLAIN.")],
    limit: Annotated[
        int, Field(description="Row cap (1-10000); truncated says if more existed.", ge=1, le=10000)
    ] = 1000,
    *,
    ctx: Context,
) -> Annotated[CallToolResult, SqlResult]:
    """One read-only statement; the tool description (:data:`RUN_SQL_DESCRIPTION`) states the limits."""
    st = state(ctx)
    client = sql_client(ctx)
    if st.job:
        raise ToolError(
            f"run_sql reads one recording, and this server serves a job of {len(st.paths)} recordings "
            f"({st.served_name}): use the other tools, which analyse the job as one, or serve one recording "
            "(tracer mcp serve --db FILE) to query it"
        )
    timeout_s = st.limits.sql_timeout_s

    def run() -> SqlResult:
        if st.live:  # the recorder's live DB: only its own DuckDB instance can read it
            with st.connection() as c:
                return execute(c, query, limit, timeout_s, reply_bytes=SQL_ROWS_BYTES)
        if st.freshen is not None:
            st.freshen()
        stop = call_stop()
        cancel = stop.sql if stop is not None else None
        return st.pool.run(
            st.paths[0], query, limit, timeout_s, reply_bytes=SQL_ROWS_BYTES, client=client, cancel=cancel
        )

    failed: TracerError | None = None
    try:
        # cancelled (the client left, the server stopping): its query is stopped and the thread abandoned
        res = await in_thread(run, limiter=st.sql_threads)
    except TracerError as e:
        failed = e
    if failed is not None:
        raise st.error(failed)
    return sql_reply(res)


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


def sql_reply(res: SqlResult) -> CallToolResult:
    """Return the run_sql tool result for ``res`` (:func:`mcp_server.replies.compact_reply`).

    Rows are dropped from the end (``truncated``, ``note``) until the whole result fits in
    :data:`SQL_REPLY_BYTES`: text escaping can make the text copy larger than the rows' own JSON. A result that
    does not fit without any row (its column names alone) is an error, never an oversized message.
    """
    while True:
        out = compact_reply(res)
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
