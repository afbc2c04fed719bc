"""The statement check of ``run_sql``: what may run, decided by DuckDB's own parser, never by regexes (issue 17).

A regex comment stripper disagreed with DuckDB's lexer (DuckDB nests ``/* /* */ */`` and ends a ``--`` comment
at ``\\r``), so ``EXPLAIN ANALYZE /* /* */ SELECT 1 -- */ COPY (...) TO '<the served DB>'`` passed as an EXPLAIN
of a SELECT and overwrote the recording. Here every decision comes from DuckDB:

- :func:`duckdb.extract_statements` splits the text and types each statement: exactly one, of type SELECT (which
  covers WITH, FROM-first, VALUES, DESCRIBE, SHOW, SUMMARIZE, UNPIVOT and PIVOT with an IN list: one read) or
  EXPLAIN;
- an EXPLAIN is taken apart with :func:`duckdb.tokenize` (the same lexer, comments included): its options are
  rebuilt without comments, the statement after them is extracted and typed again on its own, and what runs is
  that rebuilt text, so what runs is what was checked;
- :func:`find_refused_names` allows only what :mod:`tracer.analysis.sql.allow` allows, read from DuckDB's parse
  tree with macros and views expanded (no server paths, settings, SQL built at run time or state kept).

The check is the first layer only: the query worker's DuckDB cannot write a file whatever runs
(:mod:`tracer.analysis.sql.pool`).
"""

from __future__ import annotations

import re
import threading

import duckdb

from tracer.analysis.sql.allow import SERVER_WHY, check_calls
from tracer.analysis.sql.limits import LIMITS, SqlError, SqlLimits

ALLOWED_TEXT = "one SELECT / WITH / FROM / VALUES / DESCRIBE / SHOW / SUMMARIZE / PIVOT … IN (…) / EXPLAIN statement"
# Messages that quote the caller's input (DuckDB's "LINE 1: <the query>") are cut to this: a 1 MB argument must
# not come back in full.
MAX_MESSAGE_CHARS = 1_000
# second words that belong to a statement's name (IMPORT DATABASE, FORCE INSTALL, CREATE SECRET)
_NAME_WORDS = frozenset(
    "DATABASE EXTENSIONS VARIABLE INSTALL CHECKPOINT TABLE VIEW SECRET MACRO FUNCTION TYPE SEQUENCE SCHEMA INDEX "
    "TRANSACTION ON".split()
)
_CREATE_MODIFIERS = frozenset("OR REPLACE TEMP TEMPORARY PERSISTENT UNIQUE".split())
_OPTION_TOKENS = frozenset({duckdb.token_type.identifier, duckdb.token_type.keyword, duckdb.token_type.string_const})


def short(text: str, n: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``n`` characters, saying how many more there were."""
    return text if len(text) <= n else f"{text[:n]}… ({len(text) - n:,} more characters)"


def _tokens(sql: str) -> list[tuple[int, duckdb.token_type, str]]:
    """DuckDB's tokens of ``sql`` without its comments: (offset, type, text)."""
    raw = duckdb.tokenize(sql)
    out = []
    for i, (start, kind) in enumerate(raw):
        if kind == duckdb.token_type.comment:
            continue
        end = raw[i + 1][0] if i + 1 < len(raw) else len(sql)
        out.append((start, kind, sql[start:end].strip()))
    return out


def statement_name(sql: str) -> str:
    """The name a person gives the statement ``sql``: its leading keywords (IMPORT DATABASE, FORCE INSTALL,
    CREATE TABLE), not DuckDB's internal type (IMPORT DATABASE is a PRAGMA, DEALLOCATE a DROP inside DuckDB)."""
    try:
        toks = _tokens(sql)
    except Exception:  # tokenizing never fails on text that parsed; belt and braces for the message only
        toks = []
    words: list[str] = []
    for _, kind, text in toks[:8]:
        if kind != duckdb.token_type.keyword:
            break
        word = text.split()[0].upper() if text.split() else ""
        if words == ["CREATE"] and word in _CREATE_MODIFIERS:
            continue
        words.append(word)
        if len(words) == 2:
            break
    if len(words) == 2 and words[0] != "CREATE" and words[1] not in _NAME_WORDS:
        words = words[:1]
    return " ".join(words)[:40] or "this"


# DuckDB's advice to change a setting: run_sql refuses SET, so the advice is dropped from the message it quotes
SET_ADVICE = re.compile(r'\s*(?:Use|use) "?(?:SET|RESET) [^\n]*')


def too_deep() -> SqlError:
    """The error for DuckDB's expression depth limit, with advice that works in run_sql (not its SET)."""
    return SqlError(
        "the query nests too deeply: DuckDB's expression depth limit is 1000 levels",
        "Nest less: write a long chain of AND / OR / + as an IN (...) list, a CASE, a join against VALUES, or an "
        "aggregate over a table; run_sql cannot raise the limit.",
    )


def _statements(sql: str) -> list[duckdb.Statement]:
    try:
        return duckdb.extract_statements(sql)
    except duckdb.Error as e:
        text = str(e).strip()
        if "expression depth" in text.lower():
            raise too_deep() from None
        raise SqlError(
            f"SQL does not parse: {short(SET_ADVICE.sub('', text))}",
            f"Fix the syntax (DuckDB's SQL dialect) and send {ALLOWED_TEXT}.",
        ) from None


def _statement_type(stmt: duckdb.Statement) -> duckdb.StatementType | None:
    try:
        return stmt.type
    except ValueError:  # a type this duckdb module has no enum member for (UPDATE EXTENSIONS)
        return None


def _refuse(sql: str, t: duckdb.StatementType | None) -> SqlError:
    """The error for a statement of a refused type, named as its author wrote it."""
    name = statement_name(sql)
    if t == duckdb.StatementType.MULTI and "PIVOT" in sql.upper() and _pivot_in_subquery(sql):
        return SqlError(
            "PIVOT … IN (subquery) is not allowed: DuckDB runs it as several statements (it first runs the "
            "subquery to create a type holding the values it returns)",
            "Name the values: PIVOT t ON col IN ('a', 'b') USING sum(x) (run the subquery first to list them), or "
            "use GROUP BY with FILTER.",
        )
    if t == duckdb.StatementType.MULTI and "PIVOT" in sql.upper():
        return SqlError(
            "PIVOT without an IN list is not allowed: DuckDB runs it as several statements (it first creates a "
            "type holding the values found)",
            "Name the values: PIVOT t ON col IN ('a', 'b') USING sum(x), or use GROUP BY with FILTER.",
        )
    return SqlError(
        f"{name} statements are not allowed: run_sql only reads the trace DB",
        f"Send {ALLOWED_TEXT}. Writes, COPY, EXPORT/IMPORT, ATTACH, SET/RESET, PRAGMA, CALL, PREPARE/EXECUTE, "
        "transactions, CHECKPOINT/VACUUM, INSTALL/LOAD and extension updates are refused.",
    )


def _pivot_in_subquery(sql: str) -> bool:
    """Whether the PIVOT ``sql`` has an IN list that is a subquery (``ON col IN (SELECT …)``), which DuckDB types
    MULTI like a PIVOT with no IN list: an ``IN (`` followed by a query, after ``ON``, both outside parentheses
    (DuckDB's tokens, comments skipped; a subquery in the PIVOT's source does not count)."""
    try:
        words = [text.upper() for _, _, text in _tokens(sql)]
    except Exception:  # the message only; the statement is refused either way
        return False
    depth, seen_on = 0, False
    for i, w in enumerate(words):
        if w == "(":
            depth += 1
        elif w == ")":
            depth -= 1
        elif depth == 0 and w == "ON":
            seen_on = True
        elif depth == 0 and seen_on and w == "IN" and words[i + 1 : i + 2] == ["("]:
            return words[i + 2 : i + 3] in (["SELECT"], ["WITH"], ["FROM"], ["VALUES"], ["("])
    return False


def _one(sql: str) -> tuple[duckdb.Statement, duckdb.StatementType | None]:
    stmts = _statements(sql)
    if len(stmts) != 1:
        raise SqlError(
            f"expected exactly one statement, got {len(stmts)}",
            f"Send {ALLOWED_TEXT}, without ';' between statements.",
        )
    return stmts[0], _statement_type(stmts[0])


def _explain_parts(sql: str) -> tuple[str, str]:
    """Split an EXPLAIN into its options, rebuilt from DuckDB's tokens without comments ("EXPLAIN ANALYZE",
    "EXPLAIN (FORMAT json)"), and the text of the statement it explains, from that statement's first token."""
    toks = _tokens(sql)
    if not toks or toks[0][2].upper() != "EXPLAIN":
        raise SqlError("this EXPLAIN is not allowed", "Send EXPLAIN [ANALYZE] SELECT ...")
    words, i = ["EXPLAIN"], 1
    if i < len(toks) and toks[i][2].upper() in ("ANALYZE", "ANALYSE"):
        words.append("ANALYZE")
        i += 1
    elif i < len(toks) and toks[i][2] == "(":
        words.append("(")
        i += 1
        while i < len(toks) and toks[i][2] != ")":
            start, kind, text = toks[i]
            if not (kind in _OPTION_TOKENS or text == ","):
                raise SqlError(
                    "this EXPLAIN's options are not allowed", "Send EXPLAIN (FORMAT json) SELECT ... or EXPLAIN SELECT"
                )
            words.append(text)
            i += 1
        words.append(")")
        i += 1
    if i >= len(toks):
        raise SqlError("this EXPLAIN explains nothing", "Send EXPLAIN [ANALYZE] SELECT ...")
    return " ".join(words), sql[toks[i][0] :]


def check_statement(query: str, limits: SqlLimits = LIMITS) -> str:
    """Return the text to run for ``query``, or raise :class:`SqlError` unless it is exactly one read-only
    statement (an EXPLAIN: of one SELECT).

    The text returned is DuckDB's extraction of the one statement; for an EXPLAIN it is rebuilt from the checked
    parts, so a comment cannot hide, from the check, what DuckDB then runs.
    """
    if len(query) > limits.query_chars:
        raise SqlError(
            f"the query is {len(query):,} characters long; the limit is {limits.query_chars:,}",
            "Send a shorter query: filter with WHERE, join tables rather than inlining values.",
        )
    stmt, t = _one(query)
    if t == duckdb.StatementType.SELECT:
        return stmt.query
    if t != duckdb.StatementType.EXPLAIN:
        raise _refuse(stmt.query, t)
    options, inner_text = _explain_parts(stmt.query)
    inner, inner_t = _one(inner_text)
    if inner_t != duckdb.StatementType.SELECT:
        e = _refuse(inner.query, inner_t)
        raise SqlError(f"EXPLAIN wraps a statement that is refused: {e.message}", e.hint)
    rebuilt = f"{options} {inner.query}"
    again, again_t = _one(rebuilt)
    if again_t != duckdb.StatementType.EXPLAIN:  # pragma: no cover - the parts came from a parsed EXPLAIN
        raise SqlError("this EXPLAIN is not allowed", "Send EXPLAIN [ANALYZE] SELECT ...")
    return again.query


_settings: frozenset[str] | None = None
_settings_lock = threading.Lock()


def _setting_names(conn: duckdb.DuckDBPyConnection) -> frozenset[str]:
    global _settings
    with _settings_lock:
        if _settings is None:
            _settings = frozenset(r[0].lower() for r in conn.execute("SELECT name FROM duckdb_settings()").fetchall())
        return _settings


def find_refused_names(conn: duckdb.DuckDBPyConnection, statement: str) -> None:
    """Raise :class:`SqlError` if the checked ``statement`` (from :func:`check_statement`) calls what run_sql does
    not allow (:func:`tracer.analysis.sql.allow.check_calls`: macros and views followed to their bodies) or SHOWs a
    setting; an EXPLAIN is looked into through the statement it explains."""
    sql = statement
    if _statement_type(_statements(sql)[0]) == duckdb.StatementType.EXPLAIN:
        sql = _explain_parts(sql)[1]
    calls = check_calls(conn, sql)
    shown = calls.shows & _setting_names(conn)
    if shown:
        raise SqlError(
            f"SHOW {sorted(shown)[0]} is not allowed in run_sql: {SERVER_WHY}",
            "Query the trace's tables (read trace://schema, or SHOW TABLES / DESCRIBE cuda_calls).",
        )
