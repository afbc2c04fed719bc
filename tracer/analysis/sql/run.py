"""Guarded read-only SQL over a trace DB, shared by ``tracer sql`` and the MCP ``run_sql`` tool.

Layers, each closing a hole the others leave (see the research notes, DuckDB §3, and issues 11 and 17):
1. :func:`tracer.analysis.sql.check.check_statement`: DuckDB's own parser decides: exactly one statement, of type
   SELECT (WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE, PIVOT … IN) or EXPLAIN of one SELECT, the EXPLAIN rebuilt
   from its checked parts; :func:`~tracer.analysis.sql.check.find_refused_names` refuses functions and views that
   show the server (paths, settings) and SQL built at run time.
2. The connection is read-only and hardened (:data:`tracer.analysis.db.READ_CONFIG`): no file or network access,
   no extension autoload/install, no replacement scans, configuration locked; a query worker's DuckDB also has its
   local file system disabled (:mod:`tracer.analysis.sql.pool`), so no statement can write a file.
3. Each call runs on a fresh cursor (no variable, prepared statement or temp object outlives it) inside
   ``BEGIN TRANSACTION READ ONLY``.
4. Limits (:class:`SqlLimits`): a ``threading.Timer`` calls ``interrupt()`` after ``timeout_s``; at most
   ``limit + 1`` rows are read for an honest ``truncated``; the reply's JSON (column names and types included) is
   capped at ``reply_bytes`` and long text / blob values are shortened to ``value_chars``, both said in ``note``.
5. Hard limits, for what DuckDB cannot stop itself (it checks for interrupts only between vectors, so one
   ``levenshtein`` over two 100 K-char strings runs for half a minute; list functions allocate outside
   ``memory_limit``): given a path, :func:`run_sql` runs the query in a worker process
   (:mod:`tracer.analysis.sql.pool`) under an address-space limit, DuckDB ``memory_limit`` / ``threads``, and a
   wall clock that kills it.

Values round-trip exactly or come back as DuckDB's own text for them: timestamps as ISO strings, blobs as hex,
decimals as numbers when the JSON number is the same decimal (else DuckDB's text), NaN and infinities as
``"nan"`` / ``"inf"`` / ``"-inf"``. A value Python cannot represent (``'infinity'::DATE``, a BC date, year 294247,
nanoseconds) comes back as DuckDB's text (``'infinity'``, ``'0044-03-15 (BC)'``); TIME, TIMETZ, TIME_NS, BIT,
INTERVAL and GEOMETRY values (Arrow drops the offset, wraps 24:00:00, renders bits as bytes, overflows long
intervals, gives geometry as WKB) always do, and so does a nested value holding one; a UHUGEINT above 2^127 keeps
its value.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import re
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from tracer.analysis.db import LIVE_HINT, is_damaged, read_error
from tracer.analysis.sql.check import ALLOWED_TEXT, SET_ADVICE, check_statement, find_refused_names, short, too_deep
from tracer.analysis.sql.limits import LIMITS, MiB, QueryOutOfMemory, QueryTimeout, SqlError, SqlLimits
from tracer.analysis.sql.result import SqlResult
from tracer.errors import StoreError, TracerError
from tracer.sqltext import ident

MAX_LIMIT = 100_000
# Rows are converted and measured in slices of this many: small enough that a slice of 1 MB values stays small
# in Python, large enough that the per-slice overhead is noise for ordinary results.
SLICE_ROWS = 64
# Rows per Arrow batch read from DuckDB: a batch of 1 MB values is copied whole into Arrow, so keep it small
# enough to fit the worker's memory twice over (300 rows of repeat('x', 1000000) ran out of memory at 301).
READ_BATCH_ROWS = 64


# -- values ------------------------------------------------------------------------------------------------------
CUT_MARK = "…[cut: {n:,} more characters]"


def json_value(v: Any, value_chars: int | None = None, cuts: list[int] | None = None) -> Any:
    """Return ``v`` as a JSON-safe value (ints stay ints, even beyond 2^53).

    Args:
        value_chars: cut longer strings (and blobs, rendered as hex) to this many characters, ending them with
            :data:`CUT_MARK`. None: keep everything.
        cuts: if given, one entry is appended per value cut.
    """
    if v is None or isinstance(v, (bool, int)):
        return v
    if isinstance(v, str):
        if value_chars is None or len(v) <= value_chars:
            return v
        if cuts is not None:
            cuts.append(1)
        return _cut(v, value_chars)
    if isinstance(v, float):  # JSON has no NaN or infinity: DuckDB's text for them
        return v if math.isfinite(v) else ("nan" if math.isnan(v) else "inf" if v > 0 else "-inf")
    if isinstance(v, decimal.Decimal):
        if v.is_finite() and v == v.to_integral_value():
            return int(v)
        f = float(v)
        # a JSON number only when it reads back as this very decimal: 12345678901234567890.123456789 as a
        # double would lose its last ten digits
        return f if math.isfinite(f) and decimal.Decimal(repr(f)) == v else str(v)
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        if value_chars is None or 2 * len(b) <= value_chars:
            return b.hex()
        if cuts is not None:
            cuts.append(1)
        return _cut(b[: value_chars // 2].hex(), value_chars, total=2 * len(b))
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, dict):
        return {str(k): json_value(x, value_chars, cuts) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x, value_chars, cuts) for x in v]
    try:
        import numpy as np

        if isinstance(v, np.generic):
            return json_value(v.item(), value_chars, cuts)
    except ImportError:  # pragma: no cover
        pass
    return base64.b64encode(v).decode() if isinstance(v, bytes) else str(v)


def _cut(s: str, n: int, total: int | None = None) -> str:
    """``s`` cut to ``n`` characters plus the marker saying how many of ``total`` (default len(s)) were left out."""
    return s[:n] + CUT_MARK.format(n=(len(s) if total is None else total) - n)


def _duckdb_text(conn: duckdb.DuckDBPyConnection, col: pa.Array) -> list[str | None]:
    """Return DuckDB's VARCHAR rendering of each value of ``col`` ('infinity', '0044-03-15 (BC)')."""
    # Arrow date32 / timestamp hold DuckDB's own integer encodings (infinity is INT32_MAX days), so the round
    # trip back into DuckDB is exact.
    cur = conn.cursor()  # the query's own result is still open on ``conn``
    try:
        return [r[0] for r in cur.from_arrow(pa.table({"v": col})).project("CAST(v AS VARCHAR)").fetchall()]
    finally:
        cur.close()


# DuckDB's timestamp infinities, of every unit: the largest int64 and its negation
_INFINITIES = pa.array([(1 << 63) - 1, -((1 << 63) - 1)], pa.int64())


def _python_values(conn: duckdb.DuckDBPyConnection, col: pa.Array) -> list[Any]:
    """Return ``col`` as Python values; a value Python cannot hold becomes DuckDB's text for it."""
    if isinstance(col.type, pa.ExtensionType) or isinstance(col.type, pa.BaseExtensionType):
        return _duckdb_text(conn, col)  # DuckDB's opaque types (BIGNUM) arrive as raw bytes
    if pa.types.is_timestamp(col.type):  # 'infinity'::TIMESTAMP_NS read as 2262-04-11T23:47:16.854775807
        infinite = pc.is_in(col.cast(pa.int64()), value_set=_INFINITIES)
        if pc.any(infinite).as_py():  # those values alone become DuckDB's text (issue 30)
            text = _duckdb_text(conn, col)
            finite = _python_values(conn, pc.if_else(infinite, pa.scalar(None, col.type), col))
            return [t if inf else v for t, v, inf in zip(text, finite, infinite.to_pylist(), strict=True)]
    if col.type.num_fields and _holds_timestamp(col.type):
        # a list or struct of timestamps: an infinity inside read as year 2262 too, so a value holding one comes
        # back as DuckDB's text of it, as a top-level one does
        text = _duckdb_text(conn, col)
        if any(t is not None and "infinity" in t for t in text):
            plain = _plain_values(conn, col)
            return [t if t is not None and "infinity" in t else v for t, v in zip(text, plain, strict=True)]
    return _plain_values(conn, col)


def _holds_timestamp(t: pa.DataType) -> bool:
    """True when Arrow type ``t`` is a timestamp or a nested type with one inside."""
    return pa.types.is_timestamp(t) or any(_holds_timestamp(t.field(i).type) for i in range(t.num_fields))


def _plain_values(conn: duckdb.DuckDBPyConnection, col: pa.Array) -> list[Any]:
    """``col`` as Python values, a value Python cannot hold as DuckDB's text."""
    try:
        return col.to_pylist()
    except Exception:  # OverflowError, ValueError: a value datetime cannot represent
        pass
    text: list[str | None] | None = None
    out: list[Any] = []
    for i in range(len(col)):
        try:
            out.append(col[i].as_py())
        except Exception:  # as above, one value at a time
            if text is None:
                text = _duckdb_text(conn, col)
            out.append(text[i])
    return out


def _unsigned(v: Any, t: Any) -> Any:
    """Undo Arrow's signed decimal128 for UHUGEINT values (2^128 - 1 arrives as -1), nested types included."""
    if v is None or isinstance(v, str):
        return v
    tid = t.id
    if tid == "uhugeint":
        return int(v) + (1 << 128) if v < 0 else v  # int first: Decimal arithmetic rounds to 28 digits
    if tid not in _NESTED:  # only nested types have children (asking a scalar for them raises)
        return v
    kids = t.children
    if tid in ("list", "array"):
        return [_unsigned(x, kids[0][1]) for x in v]
    if tid == "struct" and isinstance(v, dict):
        return {k: _unsigned(v.get(k), ct) for k, ct in kids}
    if tid == "map":
        return [(_unsigned(k, kids[0][1]), _unsigned(x, kids[1][1])) for k, x in v]
    return v


# DuckDB types whose Arrow form loses the value: TIMETZ loses its offset, TIME 24:00:00 wraps to 00:00:00, TIME_NS
# is cut to µs by Python, BIT becomes its internal bytes, an INTERVAL past 292 years overflows Arrow's
# nanoseconds; a GEOMETRY would be WKB bytes, not its text. Such a column is cast to VARCHAR in DuckDB before
# it reaches Arrow.
# A VARIANT arrives as its raw encoding (issue 30): DuckDB's text of the value it holds.
_TEXT_TYPES = frozenset({"time", "time with time zone", "time_ns", "bit", "interval", "geometry", "variant"})
_NESTED = frozenset({"list", "array", "struct", "map", "union"})


def _needs_text(t: Any) -> bool:
    """True when values of DuckDB type ``t`` must come back as DuckDB's text: a type of :data:`_TEXT_TYPES`, or a
    nested type holding one (or a UNION holding a UHUGEINT, which :func:`_unsigned` cannot place)."""
    tid = t.id
    if tid in _TEXT_TYPES:
        return True
    if tid not in _NESTED:
        return False
    kids = [k for _, k in t.children if not isinstance(k, (int, str))]  # an ARRAY's size is not a type
    if tid == "union" and any("UHUGEINT" in str(k) for k in kids):
        return True
    return any(_needs_text(k) for k in kids)


def _as_text(rel: duckdb.DuckDBPyRelation) -> duckdb.DuckDBPyRelation:
    """``rel`` with each column :func:`_needs_text` picks cast to VARCHAR in DuckDB; the others untouched."""
    if not any(_needs_text(t) for t in rel.types):
        return rel
    cols = []
    for i, (name, t) in enumerate(zip(rel.columns, rel.types, strict=True), 1):
        cols.append(f"CAST(#{i} AS VARCHAR) AS {ident(name)}" if _needs_text(t) else f"#{i} AS {ident(name)}")
    return rel.project(", ".join(cols))  # by position: duplicate column names stay apart


def _flat_text(col: pa.Array, value_chars: int, cuts: list[int]) -> list[Any] | None:
    """JSON values of a text or blob column, long ones cut in Arrow before they become Python objects.

    Returns None for any other column, or when no value needs cutting (the ordinary path converts it).
    """
    text = pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
    if not (text or pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)):
        return None
    lengths = pc.utf8_length(col) if text else pc.multiply(pc.binary_length(col), 2)  # blobs render as hex
    longest = pc.max(lengths).as_py()
    if longest is None or longest <= value_chars:
        return None
    heads = pc.utf8_slice_codeunits(col, 0, value_chars) if text else pc.binary_slice(col, 0, value_chars // 2)
    out: list[Any] = []
    for h, n in zip(heads.to_pylist(), lengths.to_pylist(), strict=True):
        if h is None:
            out.append(None)
            continue
        s = h if text else h.hex()
        if n > value_chars:
            cuts.append(1)
            s = _cut(s, value_chars, total=n)
        out.append(s)
    return out


# -- running a query ---------------------------------------------------------------------------------------------
def execute(
    conn: duckdb.DuckDBPyConnection,
    query: str,
    limit: int = 1000,
    timeout_s: float = LIMITS.timeout_s,
    *,
    reply_bytes: int = LIMITS.reply_bytes,
    value_chars: int = LIMITS.value_chars,
) -> SqlResult:
    """Run one read-only statement on the open connection ``conn``, in this process; return at most ``limit`` rows.

    Every failure (refusal, DuckDB error, interrupt, out of memory, a value that will not convert) raises a
    :class:`SqlError`; the result reader, the transaction and the call's own cursor are closed before this
    returns or raises, so no exception keeps the query alive and nothing the statement set (a variable, a
    prepared statement, a temp object) outlives the call.
    """
    limits = SqlLimits(timeout_s=timeout_s, reply_bytes=reply_bytes, value_chars=value_chars)
    statement = check_statement(query, limits)
    limit = max(1, min(int(limit), MAX_LIMIT))
    cur = conn.cursor()
    try:
        return _execute(cur, conn, statement, limit, timeout_s, reply_bytes, value_chars)
    finally:
        cur.close()


def _execute(
    cur: duckdb.DuckDBPyConnection,
    conn: duckdb.DuckDBPyConnection,
    statement: str,
    limit: int,
    timeout_s: float,
    reply_bytes: int,
    value_chars: int,
) -> SqlResult:
    """:func:`execute` of the checked ``statement`` on the call's cursor ``cur`` (``conn``: its connection)."""
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        cur.interrupt()

    timer = threading.Timer(timeout_s, interrupt)
    t0 = time.perf_counter()
    failure: TracerError | None = None
    desc: list[Any] = []
    rows: list[list[Any]] = []
    truncated = False
    notes: list[str] = []
    reader = None
    try:
        find_refused_names(cur, statement)
        cur.execute("BEGIN TRANSACTION READ ONLY")
        timer.start()
        try:
            # A relation streams: DuckDB computes the rows as they are read, where execute() would first
            # materialize all of them (twice the memory of 300 one-megabyte values).
            rel = cur.sql(statement)
            if rel is not None:
                desc = list(zip(rel.columns, rel.types, strict=True))
                used = _header_bytes(desc, reply_bytes)
                rel = _as_text(rel)
                # Arrow, not fetchmany: Python conversion of TIMESTAMPTZ needs pytz; Arrow uses zoneinfo
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    reader = rel.to_arrow_reader(min(limit + 1, READ_BATCH_ROWS))
                rel = None
                rows, truncated, notes = _read_rows(conn, reader, desc, limit, reply_bytes, value_chars, used)
        finally:
            timer.cancel()
            if reader is not None:
                reader.close()
            reader = None
            try:
                cur.execute("ROLLBACK")
            except duckdb.Error:
                pass
    except TracerError as e:  # a refusal by name, or column names over the reply cap
        failure = e
    except duckdb.Error as e:
        failure = _sql_error(e, fired.is_set(), timeout_s)
    except MemoryError as e:  # Python's, or pyarrow's ArrowMemoryError
        failure = _oom(e)
    except Exception as e:  # a value that would not convert must not break the reply
        if "out of memory" in str(e).lower():  # DuckDB's Arrow export reports it as an OSError
            failure = _oom(e)
        else:
            failure = SqlError(
                f"could not convert the result: {type(e).__name__}: {short(str(e), 200)}",
                "Cast the column to VARCHAR in the query (col::VARCHAR).",
            )
    if failure is not None:  # raised outside the except blocks: no traceback holds the query's objects
        raise failure
    return SqlResult(
        columns=[d[0] for d in desc],
        column_types=[str(d[1]) for d in desc],
        rows=rows,
        row_count=len(rows),
        truncated=truncated,
        elapsed_ms=round((time.perf_counter() - t0) * 1e3, 2),
        note="; ".join(notes) or None,
    )


# What a reply holds besides its columns and rows (row_count, truncated, elapsed_ms, a note): counted against
# the reply cap with them, generously.
RESULT_OVERHEAD_BYTES = 1024


def _header_bytes(desc: list[Any], reply_bytes: int) -> int:
    """Bytes of the reply that are not rows: column names and types plus :data:`RESULT_OVERHEAD_BYTES`.

    Raises:
        SqlError: they alone exceed ``reply_bytes`` (a thousand 2,000-character column names are 2 MB).
    """
    names = [d[0] for d in desc]
    head = {"columns": names, "column_types": [str(d[1]) for d in desc]}
    n = len(json.dumps(head, ensure_ascii=False, separators=(",", ":")).encode()) + RESULT_OVERHEAD_BYTES
    if n > reply_bytes:
        raise SqlError(
            f"the result's {len(names):,} column names and types alone take {n:,} bytes, over the "
            f"{reply_bytes:,}-byte reply cap",
            "Select fewer columns, or give them short names (expr AS a).",
        )
    return n


def _read_rows(
    conn: duckdb.DuckDBPyConnection,
    reader: pa.RecordBatchReader,
    desc: list[Any],
    limit: int,
    reply_bytes: int,
    value_chars: int,
    used: int = 0,
) -> tuple[list[list[Any]], bool, list[str]]:
    """Return (JSON-safe rows, whether more rows exist, notes): at most ``limit`` rows within ``reply_bytes``, of
    which ``used`` bytes are already taken (column names and types)."""
    types = [d[1] for d in desc]
    unsigned = {i for i, t in enumerate(types) if "UHUGEINT" in str(t) and not _needs_text(t)}
    rows: list[list[Any]] = []
    cuts: list[int] = []
    size = used + 2  # the enclosing []
    for batch in reader:
        start = 0
        while start < batch.num_rows:
            if len(rows) == limit:  # a row past the limit exists: that is all `truncated` needs
                return rows, True, _cut_note(rows, cuts, value_chars)
            n = min(SLICE_ROWS, batch.num_rows - start, limit - len(rows))
            part = batch.slice(start, n)
            start += n
            cols = []
            for j, col in enumerate(part.columns):
                vals = _flat_text(col, value_chars, cuts)
                if vals is None:
                    vals = _python_values(conn, col)
                    if j in unsigned:
                        vals = [_unsigned(v, types[j]) for v in vals]
                    vals = [json_value(v, value_chars, cuts) for v in vals]
                cols.append(vals)
            part_rows = [list(r) for r in zip(*cols, strict=True)]
            part_bytes = len(json.dumps(part_rows, ensure_ascii=False, separators=(",", ":")).encode()) - 1
            if size + part_bytes <= reply_bytes:
                rows += part_rows
                size += part_bytes
                continue
            for row in part_rows:  # the slice overflows the cap: keep the rows that fit
                row_bytes = len(json.dumps(row, ensure_ascii=False, separators=(",", ":")).encode()) + 1
                if size + row_bytes > reply_bytes:
                    note = (
                        f"reply cut at {reply_bytes:,} bytes of rows: {len(rows)} rows returned, more exist; "
                        "select fewer or narrower columns, aggregate, or page with LIMIT/OFFSET"
                    )
                    return rows, True, [note, *_cut_note(rows, cuts, value_chars)]
                rows.append(row)
                size += row_bytes
    return rows, False, _cut_note(rows, cuts, value_chars)


_CUT_RE = re.compile(r"…\[cut: [\d,]+ more characters\]$")


def _count_cut(v: Any) -> int:
    if isinstance(v, str):
        return 1 if _CUT_RE.search(v[-40:]) else 0
    if isinstance(v, list):
        return sum(_count_cut(x) for x in v)
    if isinstance(v, dict):
        return sum(_count_cut(x) for x in v.values())
    return 0


def _cut_note(rows: list[list[Any]], cuts: list[int], value_chars: int) -> list[str]:
    """The note on shortened values among ``rows`` (``cuts`` is non-empty when any value read was cut)."""
    n = _count_cut(rows) if cuts else 0
    if not n:
        return []
    return [f"{n} long values were cut to {value_chars:,} characters (marked …[cut: N more characters])"]


NAMES_HINT = "Check table and column names: read trace://schema or run SHOW TABLES / DESCRIBE cuda_calls."


def is_lock_conflict(e: BaseException) -> bool:
    """True when DuckDB could not take the file's lock: another process writes the DB (not a damaged file)."""
    low = str(e).lower()
    return "could not set lock" in low or "conflicting lock" in low


def _sql_error(e: duckdb.Error, fired: bool, timeout_s: float) -> TracerError:
    """The error to report for DuckDB's ``e``, with advice that works in run_sql."""
    if fired or isinstance(e, duckdb.InterruptException):
        return QueryTimeout(
            f"query interrupted after {timeout_s:g} s",
            "Narrow it (WHERE on ts_ns / pid / op, LIMIT, aggregate first).",
        )
    if isinstance(e, duckdb.OutOfMemoryException):
        return _oom(e)
    text = str(e).strip()
    low = text.lower()
    if is_lock_conflict(e):  # before is_damaged: a lock conflict is an IOException too
        return StoreError("the trace DB is held by another process (it holds the file lock)", LIVE_HINT)
    if isinstance(e, duckdb.PermissionException) or "file system operations are disabled" in low:
        return SqlError(
            "file system operations are disabled in run_sql: it reads the trace DB's tables and nothing else "
            f"(no files, URLs or extensions) ({short(text.splitlines()[0], 200)})",
            "Query the trace's tables: read trace://schema or run SHOW TABLES.",
        )
    if _damaged_while_read(e):  # the file changed or is cut short: say so, not "check your column names"
        return read_error("the trace DB", e)  # type: ignore[return-value]
    if "expression depth" in low:
        return too_deep()
    if "lambda arrow" in low:
        return SqlError(
            "DuckDB refuses the arrow lambda syntax (x -> x + 1)",
            "Write lambdas as lambda x: x + 1, e.g. list_transform(l, lambda x: x + 1).",
        )
    message = f"DuckDB: {short(SET_ADVICE.sub('', text))}"
    if isinstance(e, (duckdb.CatalogException, duckdb.BinderException)):
        return SqlError(message, NAMES_HINT)
    if isinstance(e, duckdb.ParserException):
        return SqlError(message, f"Fix the syntax (DuckDB's SQL dialect) and send {ALLOWED_TEXT}.")
    if isinstance(e, (duckdb.ConversionException, duckdb.OutOfRangeException)):
        return SqlError(message, "Cast or filter the values that do not fit: TRY_CAST gives NULL instead of failing.")
    return SqlError(message, "Change the query as DuckDB's message says.")


# What DuckDB says when the file's bytes are wrong. An IO Error alone is not enough during a query: DuckDB also
# reports a function's failure so (destroy_external_resource: deleter function "query" failed: Invalid Input
# Error: ...), which is the query's error, not a damaged file (issue 30).
_DAMAGE_MARKS = ("corrupt", "could not read enough bytes", "checksum", "failed to deserialize", "could not read from")


def _damaged_while_read(e: duckdb.Error) -> bool:
    low = str(e).lower()
    return is_damaged(e) and any(m in low for m in _DAMAGE_MARKS)


def _oom(e: BaseException | None) -> QueryOutOfMemory:
    return QueryOutOfMemory(
        f"the query ran out of memory (limit {LIMITS.memory_bytes // MiB} MiB)"
        + (f": {short(str(e).splitlines()[0], 200)}" if e is not None and str(e) else ""),
        "Aggregate or filter before building large values (lists, string_agg, repeat), and select fewer rows.",
    )


def run_sql(
    db: str | Path | duckdb.DuckDBPyConnection,
    query: str,
    limit: int = 1000,
    timeout_s: float = LIMITS.timeout_s,
    *,
    reply_bytes: int = LIMITS.reply_bytes,
    client: str | None = None,
) -> SqlResult:
    """Run one read-only statement on the trace DB and return at most ``limit`` rows.

    Args:
        db: path of the trace DB: the query runs in a query worker process under every limit of
            :class:`SqlLimits` (the one path for ``tracer sql`` and the MCP tool). An open read-only connection:
            the query runs here, with the timer, row and reply caps but no hard memory or wall-clock limit (the
            recorder's in-process server over a DB it is still writing).
        limit: row cap (1..100000); ``truncated`` says whether more rows existed.
        timeout_s: interrupt the query after this many seconds (raises :class:`QueryTimeout`).
        reply_bytes: cap on the JSON of the result, column names and types included (``truncated`` and ``note``
            say when rows were left out for it).
        client: who asks (an MCP session id), for the query workers' fair queue; None: this process.
    Raises:
        SqlError: refused statement, DuckDB error, timeout, out of memory. StoreError: unreadable DB.
    """
    if isinstance(db, duckdb.DuckDBPyConnection):
        return execute(db, query, limit, timeout_s, reply_bytes=reply_bytes)
    from tracer.analysis.sql.pool import default_pool

    return default_pool().run(db, query, limit, timeout_s, reply_bytes=reply_bytes, client=client)
