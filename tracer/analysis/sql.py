"""Guarded read-only SQL over a trace DB, shared by ``tracer sql`` and the MCP ``run_sql`` tool.

Layers, each closing a hole the others leave (see the research notes, DuckDB §3):
1. ``duckdb.extract_statements``: exactly one statement, of type SELECT or EXPLAIN (DESCRIBE / SHOW /
   SUMMARIZE
   parse as SELECT). ATTACH, COPY, SET, PRAGMA, CALL, INSTALL/LOAD and every write have other types. Without
   this
   check ``"COMMIT; INSERT ..."`` escapes the read-only transaction.
2. The connection is read-only and hardened (:data:`tracer.db.READ_CONFIG`): no file or network access
   (``read_csv('/etc/passwd')`` fails), no extension autoload/install, no replacement scans, configuration
   locked.
3. ``BEGIN TRANSACTION READ ONLY`` around the query.
4. Fetching at most ``limit + 1`` rows gives an honest ``truncated``; a ``threading.Timer`` calls
   ``interrupt()`` after
   ``timeout_s`` and the query fails with :class:`QueryTimeout`.
Values are made JSON-safe: timestamps as ISO strings, blobs as hex, NaN/inf as null, decimals as float.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import math
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Annotated, Any

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.db import open_trace
from tracer.errors import UsageError

ALLOWED_TYPES = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
ALLOWED_TEXT = "one SELECT / WITH / FROM / DESCRIBE / SHOW / SUMMARIZE / EXPLAIN statement"
MAX_LIMIT = 100_000


class SqlError(UsageError):
    """The query was refused or DuckDB rejected it; the message carries DuckDB's own text."""


class QueryTimeout(SqlError):
    """The query ran past its time limit and was interrupted."""


class SqlResult(Record):
    """Rows of a read-only query."""

    columns: list[str]
    column_types: Annotated[list[str], Field(description="DuckDB type of each column")]
    rows: Annotated[list[list[Any]], Field(description="JSON-safe values: timestamps ISO, blobs hex, NaN -> null")]
    row_count: Annotated[int, Field(description="rows returned (<= limit)")]
    truncated: Annotated[bool, Field(description="true when the query had more rows than the limit")]
    elapsed_ms: float


def check_statement(query: str) -> None:
    """Raise :class:`SqlError` unless ``query`` is exactly one read-only statement."""
    try:
        stmts = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise SqlError(f"SQL does not parse: {e}", f"Send {ALLOWED_TEXT}.") from None
    if len(stmts) != 1:
        raise SqlError(
            f"expected exactly one statement, got {len(stmts)}",
            f"Send {ALLOWED_TEXT}, without ';' between statements.",
        )
    t = stmts[0].type
    if t not in ALLOWED_TYPES:
        name = getattr(t, "name", str(t))
        raise SqlError(
            f"{name} statements are not allowed: the trace DB is read-only",
            f"Send {ALLOWED_TEXT}. File access, ATTACH, COPY, SET, PRAGMA, INSTALL/LOAD are refused.",
        )


def json_value(v: Any) -> Any:
    """Return ``v`` as a JSON-safe value (ints stay ints, even beyond 2^53)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, decimal.Decimal):
        if v.is_finite() and v == v.to_integral_value():
            return int(v)
        f = float(v)
        return f if math.isfinite(f) else None
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    try:
        import numpy as np

        if isinstance(v, np.generic):
            return json_value(v.item())
    except ImportError:  # pragma: no cover
        pass
    return base64.b64encode(v).decode() if isinstance(v, bytes) else str(v)


def run_sql(
    db: str | Path | duckdb.DuckDBPyConnection, query: str, limit: int = 1000, timeout_s: float = 10.0
) -> SqlResult:
    """Run one read-only statement on the trace DB and return at most ``limit`` rows.

    Args:
        db: path of the trace DB (opened read-only and closed here) or an open read-only connection.
        limit: row cap (1..100000); ``truncated`` says whether more rows existed.
        timeout_s: interrupt the query after this many seconds (raises :class:`QueryTimeout`).
    Raises:
        SqlError: refused statement or DuckDB error (its message included). StoreError: unreadable DB.
    """
    check_statement(query)
    limit = max(1, min(int(limit), MAX_LIMIT))
    own = not isinstance(db, duckdb.DuckDBPyConnection)
    conn = open_trace(db) if own else db  # type: ignore[arg-type]
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        conn.interrupt()

    timer = threading.Timer(timeout_s, interrupt)
    t0 = time.perf_counter()
    try:
        conn.execute("BEGIN TRANSACTION READ ONLY")
        timer.start()
        try:
            cur = conn.execute(query)
            desc = cur.description or []
            # Arrow, not fetchmany: Python conversion of TIMESTAMPTZ needs pytz; Arrow uses zoneinfo
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reader = cur.to_arrow_reader(min(limit + 1, 10_000))
            rows = []
            for batch in reader:
                rows.extend(tuple(r.values()) for r in batch.to_pylist())
                if len(rows) > limit:
                    break
        finally:
            timer.cancel()
            try:
                conn.execute("ROLLBACK")
            except duckdb.Error:
                pass
    except duckdb.Error as e:
        if fired.is_set() or isinstance(e, duckdb.InterruptException):
            raise QueryTimeout(
                f"query interrupted after {timeout_s:g} s",
                "Narrow it (WHERE on ts_ns / pid / op, LIMIT, aggregate first).",
            ) from None
        raise SqlError(
            f"DuckDB: {str(e).strip()}",
            "Check table and column names: read trace://schema or run SHOW TABLES / DESCRIBE cuda_calls.",
        ) from None
    finally:
        if own:
            conn.close()
    truncated = len(rows) > limit
    rows = rows[:limit]
    return SqlResult(
        columns=[d[0] for d in desc],
        column_types=[str(d[1]) for d in desc],
        rows=[[json_value(v) for v in r] for r in rows],
        row_count=len(rows),
        truncated=truncated,
        elapsed_ms=round((time.perf_counter() - t0) * 1e3, 2),
    )
