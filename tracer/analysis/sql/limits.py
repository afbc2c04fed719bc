"""The limits of one ``run_sql`` query and the errors it raises: light enough (standard library only) for the
query-worker pool to import before DuckDB, so a worker can start while its caller is still importing.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.errors import UsageError

MiB = 1 << 20
WORKER_NICE = 5  # a query worker's query runs this far below the server's priority (its DuckDB threads too)
LANE_NICE = 2  # a short-lane query's, and an idle worker's (the pool's lane time limit bounds what it spends)


@dataclass(frozen=True)
class SqlLimits:
    """What one ``run_sql`` query may use. The defaults are what ``tracer sql`` and the MCP tool apply.

    Attributes:
        timeout_s: wall clock per query. DuckDB is interrupted at ``timeout_s``; a query worker still busy
            ``kill_grace_s`` later (inside one long scalar function) is killed and replaced.
        memory_bytes: how much a query worker's address space may grow above its idle size (RLIMIT_AS). A query
            that needs more fails with an out-of-memory error; the worker is then replaced.
        duckdb_memory_bytes: DuckDB ``memory_limit`` (its buffer manager). Nothing spills to disk (a query
            worker's DuckDB has no file system: issue 17), so a sort or join that needs more fails with an
            out-of-memory error.
        threads: DuckDB threads per query worker.
        reply_bytes: cap on the JSON of the returned rows; more rows come back with ``truncated`` and a note.
        value_chars: longer text values (and blobs, in bytes) are cut to this many characters, with a note.
        query_chars: longer queries are refused before they are parsed.
        queue_wait_s: how long a query waits for a free query worker before it is refused as busy: one query
            ahead of it, stopped at ``timeout_s`` and killed ``kill_grace_s`` later, plus the start of a worker.
    """

    timeout_s: float = 10.0
    kill_grace_s: float = 1.0
    memory_bytes: int = 768 * MiB
    duckdb_memory_bytes: int = 384 * MiB
    threads: int = 2
    reply_bytes: int = 1 * MiB
    value_chars: int = 16_384
    query_chars: int = 100_000
    queue_wait_s: float = 15.0


LIMITS = SqlLimits()


class SqlError(UsageError):
    """The query was refused or DuckDB rejected it; the message carries DuckDB's own text."""


class QueryTimeout(SqlError):
    """The query ran past its time limit and was interrupted."""


class QueryOutOfMemory(SqlError):
    """The query needed more memory than its limit."""
