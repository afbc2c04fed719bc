"""Guarded read-only SQL over a trace DB, shared by ``tracer sql`` and the MCP ``run_sql`` tool.

Layers, each closing a hole the others leave (see the research notes, DuckDB §3, and issue 11):
1. :func:`check_statement`: exactly one statement, of type SELECT or EXPLAIN (DESCRIBE / SHOW / SUMMARIZE parse as
   SELECT); an EXPLAIN is checked against the statement it wraps (``EXPLAIN ANALYZE CREATE ...`` runs the CREATE).
   ATTACH, COPY, SET, PRAGMA, CALL, INSTALL/LOAD, UPDATE EXTENSIONS and every write have other types. Without this
   check ``"COMMIT; INSERT ..."`` escapes the read-only transaction.
2. The connection is read-only and hardened (:data:`tracer.db.READ_CONFIG`): no file or network access
   (``read_csv('/etc/passwd')`` fails), no extension autoload/install, no replacement scans, configuration locked.
3. ``BEGIN TRANSACTION READ ONLY`` around the query.
4. Limits (:class:`SqlLimits`): a ``threading.Timer`` calls ``interrupt()`` after ``timeout_s``; at most
   ``limit + 1`` rows are read for an honest ``truncated``; the rows' JSON is capped at ``reply_bytes`` and long
   text / blob values are shortened to ``value_chars``, both said in ``note``.
5. Hard limits, for what DuckDB cannot stop itself (it checks for interrupts only between vectors, so one
   ``levenshtein`` over two 100 K-char strings runs for half a minute; list functions allocate outside
   ``memory_limit``): given a path, :func:`run_sql` runs the query in a worker process
   (:mod:`tracer.analysis.sqlpool`) under an address-space limit, DuckDB ``memory_limit`` / ``threads`` /
   ``max_temp_directory_size``, and a wall clock that kills it.

Values are made JSON-safe: timestamps as ISO strings, blobs as hex, NaN/inf as null, decimals as float. A value
Python cannot represent (``'infinity'::DATE``, a BC date, year 294247, nanoseconds) comes back as DuckDB's own
text for it (``'infinity'``, ``'0044-03-15 (BC)'``); a UHUGEINT above 2^127 keeps its value.
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
from typing import Annotated, Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.sqllimits import LIMITS, MiB, QueryOutOfMemory, QueryTimeout, SqlError, SqlLimits
from tracer.db import is_damaged, read_error
from tracer.errors import TracerError

ALLOWED_TYPES = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
ALLOWED_TEXT = "one SELECT / WITH / FROM / DESCRIBE / SHOW / SUMMARIZE / EXPLAIN statement"
MAX_LIMIT = 100_000
# Messages that quote the caller's input (DuckDB's "LINE 1: <the query>") are cut to this: a 1 MB argument must
# not come back in full.
MAX_MESSAGE_CHARS = 1_000
# Rows are converted and measured in slices of this many: small enough that a slice of 1 MB values stays small
# in Python, large enough that the per-slice overhead is noise for ordinary results.
SLICE_ROWS = 64
# Rows per Arrow batch read from DuckDB: a batch of 1 MB values is copied whole into Arrow, so keep it small
# enough to fit the worker's memory twice over (300 rows of repeat('x', 1000000) ran out of memory at 301).
READ_BATCH_ROWS = 64


class SqlResult(Record):
    """Rows of a read-only query."""

    columns: list[str]
    column_types: Annotated[list[str], Field(description="DuckDB type of each column")]
    rows: Annotated[
        list[list[Any]],
        Field(
            description="JSON-safe values: timestamps ISO, blobs hex, NaN -> null; values Python cannot hold "
            "(infinity or BC dates) as DuckDB's text"
        ),
    ]
    row_count: Annotated[int, Field(description="rows returned (<= limit)")]
    truncated: Annotated[
        bool, Field(description="true when the query had more rows than the limit or than fit in the reply")
    ]
    elapsed_ms: float
    note: Annotated[
        str | None,
        Field(description="why rows are missing or values were shortened (reply-size cap); null when neither"),
    ] = None


# -- the statement check ---------------------------------------------------------------------------------------
_SKIP = re.compile(r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*", re.S)  # whitespace and comments
_EXPLAIN = re.compile(r"explain\b", re.I)
_EXPLAIN_FLAG = re.compile(r"(?:analy[sz]e|verbose)\b", re.I)
_EXPLAIN_OPTIONS = re.compile(r"\(\s*(?:format|analy[sz]e|verbose|costs|settings)\b[^)]*\)", re.I)


def _explained(sql: str) -> str | None:
    """Return the statement an EXPLAIN wraps (the text after EXPLAIN [ANALYZE] [(options)]), None if unsure."""
    pos = _SKIP.match(sql).end()  # type: ignore[union-attr]
    m = _EXPLAIN.match(sql, pos)
    if not m:
        return None
    pos = m.end()
    while True:
        pos = _SKIP.match(sql, pos).end()  # type: ignore[union-attr]
        m = _EXPLAIN_FLAG.match(sql, pos) or _EXPLAIN_OPTIONS.match(sql, pos)
        if not m:
            return sql[pos:]
        pos = m.end()


def _short(text: str, n: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= n else f"{text[:n]}… ({len(text) - n:,} more characters)"


def check_statement(query: str, limits: SqlLimits = LIMITS, _depth: int = 0) -> None:
    """Raise :class:`SqlError` unless ``query`` is exactly one read-only statement (an EXPLAIN: of one)."""
    if len(query) > limits.query_chars:
        raise SqlError(
            f"the query is {len(query):,} characters long; the limit is {limits.query_chars:,}",
            "Send a shorter query: filter with WHERE, join tables rather than inlining values.",
        )
    try:
        stmts = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise SqlError(f"SQL does not parse: {_short(str(e).strip())}", f"Send {ALLOWED_TEXT}.") from None
    if len(stmts) != 1:
        raise SqlError(
            f"expected exactly one statement, got {len(stmts)}",
            f"Send {ALLOWED_TEXT}, without ';' between statements.",
        )
    try:
        t = stmts[0].type
    except ValueError:  # a statement type this duckdb module has no enum member for (UPDATE EXTENSIONS)
        t = None
    if t not in ALLOWED_TYPES:
        name = getattr(t, "name", None) or " ".join(w.upper() for w in stmts[0].query.split()[:2])[:40] or "these"
        raise SqlError(
            f"{name} statements are not allowed: the trace DB is read-only",
            f"Send {ALLOWED_TEXT}. File access, ATTACH, COPY, SET, PRAGMA, INSTALL/LOAD and extension updates "
            "are refused.",
        )
    if t == duckdb.StatementType.EXPLAIN:
        inner = _explained(stmts[0].query)
        if inner is None or _depth > 0:
            raise SqlError(
                "this EXPLAIN is not allowed: only EXPLAIN [ANALYZE] of one SELECT is",
                "Send EXPLAIN SELECT ... or EXPLAIN ANALYZE SELECT ...",
            )
        try:
            check_statement(inner, limits, _depth + 1)
        except SqlError as e:
            raise SqlError(f"EXPLAIN wraps a statement that is refused: {e.message}", e.hint) from None


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


def _python_values(conn: duckdb.DuckDBPyConnection, col: pa.Array) -> list[Any]:
    """Return ``col`` as Python values; a value Python cannot hold becomes DuckDB's text for it."""
    if isinstance(col.type, pa.ExtensionType) or isinstance(col.type, pa.BaseExtensionType):
        return _duckdb_text(conn, col)  # DuckDB's opaque types (BIGNUM) arrive as raw bytes
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
    kids = t.children
    if tid in ("list", "array"):
        return [_unsigned(x, kids[0][1]) for x in v]
    if tid == "struct" and isinstance(v, dict):
        return {k: _unsigned(v.get(k), ct) for k, ct in kids}
    if tid == "map":
        return [(_unsigned(k, kids[0][1]), _unsigned(x, kids[1][1])) for k, x in v]
    return v


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
    :class:`SqlError`; the result reader and the transaction are closed before this returns or raises, so no
    exception keeps the query alive.
    """
    limits = SqlLimits(timeout_s=timeout_s, reply_bytes=reply_bytes, value_chars=value_chars)
    check_statement(query, limits)
    limit = max(1, min(int(limit), MAX_LIMIT))
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        conn.interrupt()

    timer = threading.Timer(timeout_s, interrupt)
    t0 = time.perf_counter()
    failure: TracerError | None = None
    desc: list[Any] = []
    rows: list[list[Any]] = []
    truncated = False
    notes: list[str] = []
    reader = None
    try:
        conn.execute("BEGIN TRANSACTION READ ONLY")
        timer.start()
        try:
            # A relation streams: DuckDB computes the rows as they are read, where execute() would first
            # materialize all of them (twice the memory of 300 one-megabyte values).
            rel = conn.sql(query)
            if rel is not None:
                desc = list(zip(rel.columns, rel.types, strict=True))
                # Arrow, not fetchmany: Python conversion of TIMESTAMPTZ needs pytz; Arrow uses zoneinfo
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    reader = rel.to_arrow_reader(min(limit + 1, READ_BATCH_ROWS))
                rel = None
                rows, truncated, notes = _read_rows(conn, reader, desc, limit, reply_bytes, value_chars)
        finally:
            timer.cancel()
            if reader is not None:
                reader.close()
            reader = None
            try:
                conn.execute("ROLLBACK")
            except duckdb.Error:
                pass
    except duckdb.Error as e:
        failure = _sql_error(e, fired.is_set(), timeout_s)
    except MemoryError as e:  # Python's, or pyarrow's ArrowMemoryError
        failure = _oom(e)
    except Exception as e:  # a value that would not convert must not break the reply
        if "out of memory" in str(e).lower():  # DuckDB's Arrow export reports it as an OSError
            failure = _oom(e)
        else:
            failure = SqlError(
                f"could not convert the result: {type(e).__name__}: {_short(str(e), 200)}",
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


def _read_rows(
    conn: duckdb.DuckDBPyConnection,
    reader: pa.RecordBatchReader,
    desc: list[Any],
    limit: int,
    reply_bytes: int,
    value_chars: int,
) -> tuple[list[list[Any]], bool, list[str]]:
    """Return (JSON-safe rows, whether more rows exist, notes): at most ``limit`` rows within ``reply_bytes``."""
    types = [d[1] for d in desc]
    unsigned = {i for i, t in enumerate(types) if "UHUGEINT" in str(t)}
    rows: list[list[Any]] = []
    cuts: list[int] = []
    size = 2  # the enclosing []
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


def _sql_error(e: duckdb.Error, fired: bool, timeout_s: float) -> TracerError:
    if fired or isinstance(e, duckdb.InterruptException):
        return QueryTimeout(
            f"query interrupted after {timeout_s:g} s",
            "Narrow it (WHERE on ts_ns / pid / op, LIMIT, aggregate first).",
        )
    if isinstance(e, duckdb.OutOfMemoryException):
        return _oom(e)
    if is_damaged(e):  # the file changed or is cut short: say so, not "check your column names"
        return read_error("the trace DB", e)  # type: ignore[return-value]
    return SqlError(
        f"DuckDB: {_short(str(e).strip())}",
        "Check table and column names: read trace://schema or run SHOW TABLES / DESCRIBE cuda_calls.",
    )


def _oom(e: BaseException | None) -> QueryOutOfMemory:
    return QueryOutOfMemory(
        f"the query ran out of memory (limit {LIMITS.memory_bytes // MiB} MiB)"
        + (f": {_short(str(e).splitlines()[0], 200)}" if e is not None and str(e) else ""),
        "Aggregate or filter before building large values (lists, string_agg, repeat), and select fewer rows.",
    )


def run_sql(
    db: str | Path | duckdb.DuckDBPyConnection,
    query: str,
    limit: int = 1000,
    timeout_s: float = LIMITS.timeout_s,
    *,
    reply_bytes: int = LIMITS.reply_bytes,
) -> SqlResult:
    """Run one read-only statement on the trace DB and return at most ``limit`` rows.

    Args:
        db: path of the trace DB: the query runs in a query worker process under every limit of
            :class:`SqlLimits` (the one path for ``tracer sql`` and the MCP tool). An open read-only connection:
            the query runs here, with the timer, row and reply caps but no hard memory or wall-clock limit (the
            recorder's in-process server over a DB it is still writing).
        limit: row cap (1..100000); ``truncated`` says whether more rows existed.
        timeout_s: interrupt the query after this many seconds (raises :class:`QueryTimeout`).
        reply_bytes: cap on the JSON of the rows (``truncated`` and ``note`` say when it was hit).
    Raises:
        SqlError: refused statement, DuckDB error, timeout, out of memory. StoreError: unreadable DB.
    """
    if isinstance(db, duckdb.DuckDBPyConnection):
        return execute(db, query, limit, timeout_s, reply_bytes=reply_bytes)
    from tracer.analysis.sqlpool import default_pool

    return default_pool().run(db, query, limit, timeout_s, reply_bytes=reply_bytes)
