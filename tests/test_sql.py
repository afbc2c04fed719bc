"""tracer.analysis.sql: one read-only statement, JSON-safe values, honest truncation, refusals, timeout."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import duckdb
import pytest
from tracedb import build

from tracer.analysis.sql.check import check_statement
from tracer.analysis.sql.limits import QueryTimeout, SqlError
from tracer.analysis.sql.run import run_sql


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    p = tmp_path_factory.mktemp("sql") / "h.duckdb"
    build("healthy", p)
    return p


def test_select_and_truncation(db):
    r = run_sql(db, "SELECT op, count(*) AS n FROM cuda_calls GROUP BY op ORDER BY op", limit=2)
    assert r.columns == ["op", "n"] and r.column_types == ["VARCHAR", "BIGINT"]
    assert r.row_count == 2 and r.truncated
    assert not run_sql(db, "SELECT 1", limit=1).truncated
    for q in (
        "DESCRIBE cuda_calls",
        "SHOW TABLES",
        "SUMMARIZE meta",
        "EXPLAIN SELECT 1",
        "WITH x AS (SELECT 1 AS a) SELECT * FROM x",
        "FROM meta",
    ):
        assert run_sql(db, q).row_count >= 1, q


def test_json_safe_values(db):
    r = run_sql(
        db,
        "SELECT started_at, 'nan'::DOUBLE, '\\xAA\\xBB'::BLOB, 9007199254740993::BIGINT, "
        "170141183460469231731687303715884105727::HUGEINT, 1.25::DECIMAL(5,2), [1, 2], "
        "{'a': 1}, 'x\"y\\n' FROM session",
    )
    row = r.rows[0]
    assert row[0] == "2026-05-04T12:00:00+00:00" and row[1] == "nan" and row[2] == "aabb"
    assert row[3] == 9007199254740993 and row[4] == 2**127 - 1 and row[5] == 1.25
    assert row[6] == [1, 2] and row[7] == {"a": 1}
    json.dumps(r.model_dump())  # everything serialises


@pytest.mark.parametrize(
    "q",
    [
        "INSERT INTO meta VALUES ('a', 'b')",
        "DELETE FROM meta",
        "DROP TABLE meta",
        "CREATE TABLE x (a INT)",
        "SELECT 1; SELECT 2",
        "COMMIT; INSERT INTO meta VALUES ('a', 'b')",
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/passwd')",
        "ATTACH '/tmp/x.duckdb'",
        "COPY meta TO '/tmp/meta.csv'",
        "COPY (SELECT 1) TO '/tmp/x.parquet'",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET threads = 1",
        "PRAGMA version",
        "PRAGMA enable_profiling",
        "CALL pragma_version()",
        "SELECT * FROM 'https://example.com/x.csv'",
        "not sql at all",
    ],
)
def test_refused(db, q):
    with pytest.raises(SqlError) as e:
        run_sql(db, q)
    assert e.value.message and e.value.hint


def test_duckdb_message_carried(db):
    with pytest.raises(SqlError, match="nope"):
        run_sql(db, "SELECT nope FROM meta")


def test_timeout_then_still_works(db):
    t = time.perf_counter()
    with pytest.raises(QueryTimeout):
        run_sql(
            db,
            "SELECT count(*) FROM range(1000000) a, range(1000000) b WHERE a.range + b.range = 7",
            timeout_s=0.5,
        )
    assert time.perf_counter() - t < 5
    assert run_sql(db, "SELECT 42").rows == [[42]]


# -- issue 11: values Python cannot represent, EXPLAIN, refusals with clear text, reply caps -------------------
@pytest.mark.parametrize(
    "expr,want",
    [
        ("'infinity'::DATE", "infinity"),
        ("'-infinity'::DATE", "-infinity"),
        ("'infinity'::TIMESTAMP", "infinity"),
        ("'-infinity'::TIMESTAMPTZ", "-infinity"),
        # issue 30: every timestamp unit's infinities, which Arrow reads as the largest time it holds
        ("'infinity'::TIMESTAMP_NS", "infinity"),
        ("'-infinity'::TIMESTAMP_NS", "-infinity"),
        ("'infinity'::TIMESTAMP_MS", "infinity"),
        ("'-infinity'::TIMESTAMP_S", "-infinity"),
        ("'infinity'::TIMESTAMP_S", "infinity"),
        ("'infinity'::TIMESTAMPTZ", "infinity"),
        # issue 30: the same infinities inside a list or a struct (they read as year 2262 there too)
        ("['infinity'::TIMESTAMP_NS, '-infinity'::TIMESTAMP_NS]", "[infinity, -infinity]"),
        ("{'t': 'infinity'::TIMESTAMP_NS}", "{'t': infinity}"),
        ("[TIMESTAMP_NS '2020-01-01 00:00:00.000000001']", ["2020-01-01T00:00:00.000000001"]),  # finite: a list
        # issue 30: a VARIANT as the value it holds, not its encoding; types Arrow could not read inside one
        ("1::VARIANT", "1"),
        ("'x'::VARIANT", "x"),
        ("(INTERVAL 1 DAY)::VARIANT", "1 day"),
        ("'12:00:00+05:30'::TIMETZ::VARIANT", "12:00:00+05:30"),
        ("'12:00:00.123456789'::TIME_NS::VARIANT", "12:00:00.123456789"),
        ("'101'::BIT::VARIANT", "101"),
        ("340282366920938463463374607431768211455::UHUGEINT::VARIANT", "340282366920938463463374607431768211455"),
        ("'294247-01-10 04:00:54.775806'::TIMESTAMP", "294247-01-10 04:00:54.775806"),
        ("'0044-03-15 (BC)'::DATE", "0044-03-15 (BC)"),
        ("make_timestamp_ns(9223372036854775806)", "2262-04-11T23:47:16.854775806"),
        ("340282366920938463463374607431768211455::UHUGEINT", 2**128 - 1),
        ("[340282366920938463463374607431768211455::UHUGEINT, 1]", [2**128 - 1, 1]),
        ("{'a': 340282366920938463463374607431768211455::UHUGEINT}", {"a": 2**128 - 1}),
        ("(2::BIGNUM ** 300)::BIGNUM", str(2**300)),
        ("DATE '2024-02-29'", "2024-02-29"),  # ordinary values keep their ordinary form
        # issue 17: values Arrow or Python changed silently; now exact, or DuckDB's text
        ("'12:00:00+05:30'::TIMETZ", "12:00:00+05:30"),  # was "12:00:00"
        ("'24:00:00'::TIME", "24:00:00"),  # was "00:00:00"
        ("'12:34:56.5'::TIME", "12:34:56.5"),
        ("'101010'::BIT", "101010"),  # was "02ea"
        ("to_microseconds(9223372036854775807)", "2562047788:00:54.775807"),  # was [0, 0, -1000]
        ("INTERVAL '1 month 2 days 3 seconds'", "1 month 2 days 00:00:03"),
        ("'12:00:00.123456789'::TIME_NS", "12:00:00.123456789"),  # was cut to µs
        ("MAP {1: 340282366920938463463374607431768211455::UHUGEINT}", [[1, 2**128 - 1]]),  # the query failed
        ("{'a': 340282366920938463463374607431768211455::UHUGEINT, 'b': 2}", {"a": 2**128 - 1, "b": 2}),  # failed
        ("{'t': '24:00:00'::TIME}", "{'t': '24:00:00'}"),  # a nested value holding one: DuckDB's text of it
        ("12345678901234567890.123456789::DECIMAL(38,9)", "12345678901234567890.123456789"),  # a double loses it
        ("0.1::DECIMAL(3,1)", 0.1),  # a JSON number that reads back as the same decimal stays a number
        ("'-inf'::DOUBLE", "-inf"),
    ],
)
def test_values_python_cannot_hold(db, expr, want):
    r = run_sql(db, f"SELECT {expr} AS v")
    assert r.rows == [[want]]
    json.dumps(r.model_dump())


def test_mixed_column_keeps_ordinary_values(db):
    # GIVEN one infinity among ordinary timestamps  THEN only that value becomes DuckDB's text
    r = run_sql(db, "SELECT * FROM (VALUES (TIMESTAMP '2020-01-02 03:04:05'), ('infinity'::TIMESTAMP)) t(v)")
    assert r.rows == [["2020-01-02T03:04:05"], ["infinity"]]


def test_all_types(db):
    # GIVEN DuckDB's every type at its extremes  THEN every row comes back JSON-safe
    r = run_sql(db, "SELECT * FROM test_all_types()")
    assert r.row_count == 3 and not r.truncated and len(r.columns) > 40
    by = dict(zip(r.columns, zip(*r.rows, strict=True), strict=True))
    assert by["uhugeint"][:2] == (0, 2**128 - 1)
    assert by["date"][:2] == ("5877642-06-25 (BC)", "5881580-07-10")
    assert by["timestamp"][1] == "294247-01-10 04:00:54.775806"
    assert "infinity" in json.dumps(by["date_array"])
    json.dumps(r.model_dump())


@pytest.mark.parametrize(
    "q,needle",
    [
        ("EXPLAIN ANALYZE CREATE TEMP TABLE t AS SELECT 1", "EXPLAIN wraps a statement that is refused: CREATE"),
        ("explain analyse insert into meta values ('a', 'b')", "INSERT"),
        ("EXPLAIN (FORMAT json) CREATE TABLE t (a INT)", "CREATE"),
        ("/* x */ EXPLAIN -- y\n ANALYZE COPY meta TO '/tmp/m.csv'", "COPY"),
        ("EXPLAIN EXPLAIN ANALYZE SELECT 1", "does not parse"),
        ("UPDATE EXTENSIONS", "UPDATE EXTENSIONS statements are not allowed"),
        ("EXPLAIN UPDATE EXTENSIONS", "UPDATE EXTENSIONS"),
    ],
)
def test_explain_checked_against_what_it_wraps(db, q, needle):
    with pytest.raises(SqlError) as e:
        run_sql(db, q)
    assert needle in e.value.message and e.value.hint


@pytest.mark.parametrize(
    "q",
    [
        "EXPLAIN SELECT 1",
        "EXPLAIN ANALYZE SELECT count(*) FROM cuda_calls",
        "explain (format json) select 1",
        "EXPLAIN ANALYZE /* /* nested */ */ SELECT 1",
        "EXPLAIN ANALYZE --\r SELECT 1",
    ],
)
def test_explain_of_select_runs(db, q):
    assert run_sql(db, q).row_count >= 1


@pytest.mark.parametrize(
    "q,runs",
    [
        # DuckDB's lexer nests /* */ and ends -- at \r: what runs is rebuilt from DuckDB's own tokens
        ("EXPLAIN ANALYZE /* /* */ SELECT 1 -- */ SELECT 2", "EXPLAIN ANALYZE SELECT 2"),
        ("EXPLAIN ANALYZE --\r SELECT 3", "EXPLAIN ANALYZE SELECT 3"),
        ("EXPLAIN (FORMAT /* x */ json) SELECT 4", "EXPLAIN ( FORMAT json ) SELECT 4"),
        ("/* c */ SELECT 5", "SELECT 5"),  # DuckDB's extraction of the one statement
    ],
)
def test_check_returns_what_runs(q, runs):
    assert check_statement(q) == runs


# -- issue 17: every statement type, in every comment / EXPLAIN form, against the real query worker ------------
VICTIM = "@@DB@@"  # the DB the statement would overwrite
# one statement per duckdb.StatementType member; where no SQL text parses to a member (DuckDB maps it to another
# type, or it exists only in the Python relation API), the nearest statement that would write
STATEMENTS: dict[str, str] = {
    "INVALID": "this is not SQL",
    "SELECT": "SELECT count(*) FROM meta",
    "INSERT": "INSERT INTO meta VALUES ('pwn', 'x')",
    "UPDATE": "UPDATE session SET status = 'pwned'",
    "CREATE": "CREATE TABLE pwn AS SELECT 1 AS a",
    "DELETE": "DELETE FROM meta",
    "PREPARE": "PREPARE pwn AS SELECT 1",
    "EXECUTE": "EXECUTE pwn",
    "ALTER": "ALTER TABLE meta ADD COLUMN pwn INTEGER",
    "TRANSACTION": "COMMIT",
    "COPY": f"COPY (SELECT 'pwned' AS g) TO '{VICTIM}' (HEADER false, USE_TMP_FILE false)",
    "ANALYZE": "ANALYZE meta",
    "VARIABLE_SET": "SET VARIABLE pwn = 1",
    "CREATE_FUNC": "CREATE MACRO pwn(x) AS x",
    "EXPLAIN": f"EXPLAIN ANALYZE COPY (SELECT 'pwned' AS g) TO '{VICTIM}' (HEADER false, USE_TMP_FILE false)",
    "DROP": "DROP TABLE meta",
    "EXPORT": f"EXPORT DATABASE '{VICTIM}.export'",
    "PRAGMA": f"IMPORT DATABASE '{VICTIM}.export'",
    "VACUUM": "VACUUM meta",
    "CALL": "CHECKPOINT",
    "SET": "SET enable_external_access = true",
    "LOAD": "FORCE INSTALL httpfs",
    "RELATION": "INSERT INTO meta SELECT * FROM meta",
    "EXTENSION": "UPDATE EXTENSIONS",
    "LOGICAL_PLAN": "CREATE TEMP TABLE pwn AS SELECT 1 AS a",
    "ATTACH": f"ATTACH '{VICTIM}.new' AS pwn",
    "DETACH": "DETACH pwn",
    "MULTI": "PIVOT session ON status",
    "COPY_DATABASE": "COPY FROM DATABASE memory TO pwn",
    "MERGE_INTO": "MERGE INTO meta USING meta m ON false WHEN NOT MATCHED THEN INSERT",
}
# how the statement is wrapped: plain, explained, hidden behind comments DuckDB ends where a regex did not
FORMS: dict[str, str] = {
    "plain": "{s}",
    "EXPLAIN": "EXPLAIN {s}",
    "EXPLAIN ANALYZE": "EXPLAIN ANALYZE {s}",
    "nested comment": "EXPLAIN ANALYZE /* /* */ SELECT 1 -- */ {s}",
    "-- ended by CR": "EXPLAIN ANALYZE --\r {s}",
    "-- ended by LF": "EXPLAIN ANALYZE -- x\n{s}",
    "comment after a SELECT": "/* /* */ SELECT 1; */ {s}",
    "mixture": "/* a /* b */ c */ EXPLAIN --\r ANALYZE /* -- \n */ {s}",
    "second statement after CR": "SELECT 1 --\r; {s}",
}


def _disk(p: Path) -> tuple[str, list[str]]:
    return hashlib.sha256(p.read_bytes()).hexdigest(), sorted(x.name for x in p.parent.iterdir())


def test_statement_table_covers_every_type():
    # a DuckDB upgrade that adds a statement type fails here until the table has a statement for it
    assert set(STATEMENTS) == set(duckdb.StatementType.__members__)
    exact = {"SELECT", "INSERT", "UPDATE", "CREATE", "DELETE", "PREPARE", "EXECUTE", "ALTER", "TRANSACTION"}
    exact |= {"COPY", "EXPLAIN", "DROP", "EXPORT", "PRAGMA", "VACUUM", "CALL", "SET", "LOAD", "ATTACH", "DETACH"}
    exact |= {"MULTI", "MERGE_INTO"}
    for name in exact:
        assert duckdb.extract_statements(STATEMENTS[name].replace(VICTIM, "/x"))[0].type.name == name, name


@pytest.mark.parametrize("kind", list(STATEMENTS))
def test_every_statement_type_in_every_form(db, tmp_path, kind):
    # GIVEN a trace DB of its own, served by the query workers
    p = tmp_path / "t.duckdb"
    shutil.copy(db, p)
    before = _disk(p)
    stmt = STATEMENTS[kind].replace(VICTIM, str(p))
    for form, template in FORMS.items():
        q = template.replace("{s}", stmt)
        # WHEN the statement is sent in this form  THEN only a lone SELECT (or EXPLAIN of one) runs
        reads = kind == "SELECT" and form != "second statement after CR"
        if reads:
            assert run_sql(p, q).row_count >= 1, (form, q)
        else:
            with pytest.raises(SqlError) as e:
                run_sql(p, q)
            assert e.value.message and e.value.hint, (form, q)
        # AND the DB's bytes and its directory are unchanged, and the workers still answer
        assert _disk(p) == before, (form, q)
    assert run_sql(p, "select 1").rows == [[1]]


# -- issue 17: the server's paths and settings are not the trace's -------------------------------------------
@pytest.mark.parametrize(
    "q",
    [
        "SELECT * FROM duckdb_settings()",
        "SELECT path FROM duckdb_databases()",
        "FROM pragma_database_list",
        "SELECT current_setting('home_directory')",
        'SELECT * FROM system.main."duckdb_settings"()',
        "SHOW secret_directory",
        "SUMMARIZE system.main.duckdb_databases",
        "EXPLAIN ANALYZE SELECT * FROM duckdb_databases()",
        "SELECT list_transform(['x'], lambda s: current_setting('temp_directory'))",
        "SELECT * FROM query('SELECT * FROM duckdb_' || 'settings()')",
        "SELECT * FROM query_table('duckdb_databases')",
    ],
)
def test_server_paths_refused(db, q):
    with pytest.raises(SqlError) as e:
        run_sql(db, q)
    assert "not allowed in run_sql" in e.value.message
    assert str(db.parent) not in e.value.message + e.value.hint


# -- issue 30: what a query calls is decided after DuckDB's macros and views are expanded --------------------------
HIDDEN_CALLS = [
    # table macros whose body runs query_table(source): the served file's path, every setting
    ("SELECT * FROM histogram_values('duckdb_databases', path)", "query_table() is not allowed"),
    ("SELECT * FROM histogram_values('pg_settings', name||'='||coalesce(setting,''), bin_count := 500)", "query_table"),
    ("SELECT * FROM histogram('duckdb_databases', path)", "query_table() is not allowed"),
    ("SELECT * FROM system.main.histogram_values('duckdb_settings', name)", "query_table() is not allowed"),
    # a function named by a string: any SQL, past the interrupt
    (
        "SELECT * FROM destroy_external_resource('query', 'SELECT error(reverse((SELECT path FROM duckdb_databases() "
        "WHERE path IS NOT NULL)))')",
        "destroy_external_resource() is not allowed",
    ),
    ("SELECT * FROM register_external_resource_type('planted', kind:='x', create_function:='query')", "register_"),
    ("SELECT * FROM register_external_resource('planted', 'note', map{'a': 'b'})", "register_external_resource()"),
    ("SELECT * FROM create_external_resource('planted', map{'a': 'b'})", "create_external_resource() is not"),
    ("SELECT * FROM deregister_external_resource('note')", "deregister_external_resource() is not"),
    ("SELECT * FROM duckdb_external_resources()", "duckdb_external_resources() is not"),
    ("SELECT * FROM query_table(['meta', 'duckdb_databases'])", "query_table() is not allowed"),
    ("SELECT * FROM json_execute_serialized_sql(json_serialize_sql('SELECT 1'))", "json_execute_serialized_sql"),
    ("SELECT list_aggr([1], (SELECT 'sum'))", "with a function name that is not a constant"),
    ("SELECT nextval('s')", "nextval() is not allowed"),
    ("SELECT * FROM duckdb_memory()", "shows the server's configuration and paths"),
    ("SELECT * FROM read_duckdb('x.duckdb')", "read_duckdb() is not allowed"),
]


@pytest.mark.parametrize("q,needle", HIDDEN_CALLS)
def test_macros_expanded_before_the_check(db, q, needle):
    with pytest.raises(SqlError) as e:
        run_sql(db, q)
    assert needle in e.value.message and "Table functions allowed: " in e.value.hint
    assert str(db.parent) not in e.value.message + e.value.hint


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    """A trace DB whose own macros and views call what run_sql refuses, and shadow DuckDB's range."""
    p = tmp_path_factory.mktemp("crafted") / "c.duckdb"
    build("healthy", p)
    with duckdb.connect(str(p)) as c:
        c.execute("CREATE MACRO where_am_i() AS (SELECT max(path) FROM duckdb_databases())")
        c.execute("CREATE MACRO range(x) AS TABLE SELECT * FROM query_table('duckdb_databases')")
        c.execute("CREATE VIEW innocent AS SELECT * FROM query('SELECT path FROM duckdb_databases()')")
        c.execute("CREATE VIEW deeper AS SELECT * FROM innocent")
        c.execute("CREATE MACRO fine(x) AS x + 1")
    return p


@pytest.mark.parametrize(
    "q,needle",
    [
        ("SELECT where_am_i()", "duckdb_databases() is not allowed in run_sql (the macro where_am_i calls it)"),
        ("SELECT * FROM range(3)", "query_table() is not allowed in run_sql (the table macro range calls it)"),
        ("SELECT * FROM deeper", "query() is not allowed in run_sql (the view innocent calls it)"),
    ],
)
def test_the_trace_dbs_own_macros_and_views_are_expanded(crafted, q, needle):
    with pytest.raises(SqlError) as e:
        run_sql(crafted, q)
    assert needle in e.value.message


def test_what_a_read_needs_is_allowed(db, crafted):
    # DuckDB's own macros over list_aggr with a constant name, the histogram aggregate, catalog views of the trace
    r = run_sql(db, "SELECT list_sum([1, 2]), list_histogram([1, 1]), pg_typeof(1), list_aggr([3, 4], 'max')")
    assert [r.rows[0][i] for i in (0, 2, 3)] == [3, "integer", 4] and r.rows[0][1]
    assert run_sql(db, "SELECT histogram(op) FROM cuda_calls").row_count == 1
    assert run_sql(db, "SELECT count(*) FROM information_schema.tables").rows[0][0] > 5
    assert run_sql(db, "SELECT count(*) FROM range(3) t(x), unnest([1, 2])").rows == [[6]]
    assert run_sql(crafted, "SELECT fine(1)").rows == [[2]]


def test_ordinary_names_are_not_refused(db):
    # a CTE or a column may be called query: only the table function is refused
    r = run_sql(db, "WITH query AS (SELECT 1 AS setting) SELECT setting AS current_setting FROM query")
    assert r.rows == [[1]]
    assert run_sql(db, "SHOW cuda_calls").row_count > 3  # SHOW of a table describes it


# -- issue 17: errors say what can be done in run_sql ----------------------------------------------------------
@pytest.mark.parametrize(
    "q,says,not_says",
    [
        ("SELECT nope FROM meta", "Check table and column names", "Fix the syntax"),
        ("SELEC 1", "Fix the syntax", "Check table and column names"),
        ("SELECT 'a'::INT", "TRY_CAST", "Check table and column names"),
        ("SELECT " + "1 + " * 2000 + "1", "expression depth", "SET "),
        ("SELECT list_transform([1, 2], x -> x + 1)", "lambda x: x + 1", "SET "),
        ("SELECT * FROM read_text('/etc/hostname')", "Table functions allowed: ", "Check table"),
        ("SELECT * FROM 'https://example.com/x.csv'", "file system operations are disabled", "Check table"),
        # issue 30: a PIVOT whose IN list is a subquery has an IN list; the message says what it has
        ("PIVOT cuda_calls ON op IN (SELECT DISTINCT op FROM cuda_calls) USING count(*)", "IN (subquery)", "without"),
        ("PIVOT cuda_calls ON op IN /* c */ ((FROM cuda_calls SELECT op)) USING count(*)", "IN (subquery)", "without"),
        ("PIVOT cuda_calls ON op USING count(*)", "PIVOT without an IN list", "subquery"),
        ("PIVOT (FROM cuda_calls WHERE op IN (SELECT 1)) ON op USING count(*)", "without an IN list", "subquery"),
    ],
)
def test_errors_advise_what_run_sql_can_do(db, q, says, not_says):
    with pytest.raises(SqlError) as e:
        run_sql(db, q)
    text = f"{e.value.message} {e.value.hint}"
    assert says in text and not_says not in text, text


def test_reply_cap_counts_column_names(db):
    # GIVEN a thousand 2,000-character column names (4 MB against a 1 MiB cap before issue 17)
    q = 'WITH t AS (SELECT 1 AS "' + "n" * 2000 + '") SELECT ' + ", ".join(["t.*"] * 1000) + " FROM t"
    with pytest.raises(SqlError) as e:
        run_sql(db, q)
    assert "column names and types alone take 2,0" in e.value.message and "short names" in e.value.hint
    # AND long names leave less room for rows: the whole result stays within the cap
    names = ", ".join(f'i AS "{c}{"n" * 999}"' for c in "abcdefghij")
    r = run_sql(db, f"SELECT {names} FROM range(10000) t(i)", limit=10_000, reply_bytes=50_000)
    assert r.truncated and len(r.model_dump_json().encode()) <= 50_000


def test_huge_query_not_echoed(db):
    huge = "SELECT '" + "y" * 1_000_000 + "'"
    with pytest.raises(SqlError) as e:
        run_sql(db, huge)
    assert "1,000,009 characters" in e.value.message and len(e.value.message) + len(e.value.hint) < 500
    # a long query DuckDB rejects: its error quotes the query, cut short
    with pytest.raises(SqlError) as e:
        run_sql(db, "SELECT nope_" + "z" * 50_000)
    assert len(e.value.message) < 1_200 and "more characters" in e.value.message


def test_reply_capped_and_values_cut(db):
    # GIVEN 300 rows of 1 MB each (the 3.5 GiB reply)
    r = run_sql(db, "SELECT repeat('x', 1000000) AS s FROM range(300)", limit=300)
    # THEN a capped reply: values cut, fewer rows, truncated, and a note that says both
    size = len(json.dumps(r.rows, ensure_ascii=False, separators=(",", ":")).encode())
    assert r.truncated and 0 < r.row_count < 300 and size <= 1 << 20
    assert r.rows[0][0].startswith("x" * 16_384) and r.rows[0][0].endswith("…[cut: 983,616 more characters]")
    assert "reply cut at 1,048,576 bytes" in r.note and f"{r.row_count} long values were cut" in r.note
    # a blob: cut in its hex form; a short value in the same result: untouched
    r = run_sql(db, "SELECT repeat('\\xAB'::BLOB, 20000) AS b, 'short' AS s")
    assert r.rows[0][0] == "ab" * 8192 + "…[cut: 23,616 more characters]" and r.rows[0][1] == "short"
    assert r.note == "1 long values were cut to 16,384 characters (marked …[cut: N more characters])"


def test_reply_cap_in_bytes(db):
    r = run_sql(db, "SELECT i, repeat('é', 100) AS s FROM range(10000) t(i)", limit=10_000, reply_bytes=50_000)
    size = len(json.dumps(r.rows, ensure_ascii=False, separators=(",", ":")).encode())
    assert r.truncated and size <= 50_000 and r.row_count > 100
    assert r.rows[-1][0] == r.row_count - 1  # a prefix of the rows, in order
    assert "reply cut at 50,000 bytes" in r.note
    # the row limit alone: truncated, and no note (as before issue 11)
    r = run_sql(db, "SELECT i FROM range(10) t(i)", limit=3)
    assert r.truncated and r.row_count == 3 and r.note is None


def test_in_process_connection_path(db):
    # the recorder's live server passes its own connection: same checks and caps, in this process
    from tracer.analysis.db import open_trace

    with open_trace(db) as c:
        assert run_sql(c, "SELECT 'infinity'::DATE").rows == [["infinity"]]
        with pytest.raises(SqlError, match="CREATE"):
            run_sql(c, "EXPLAIN ANALYZE CREATE TEMP TABLE t AS SELECT 1")
        with pytest.raises(QueryTimeout):
            run_sql(c, "SELECT count(*) FROM range(1000000) a, range(1000000) b WHERE a.range + b.range = 7", 1, 0.3)
        assert run_sql(c, "SELECT 42").rows == [[42]]


def test_a_functions_io_error_is_not_a_damaged_file():
    # issue 30: DuckDB reports a table function's failure as an IO Error; that is the query's error, not the file's
    from tracer.analysis.sql.run import _sql_error

    e = duckdb.IOException(
        'IO Error: destroy_external_resource: deleter function "query" failed: Invalid Input Error: boom'
    )
    err = _sql_error(e, fired=False, timeout_s=10)
    assert isinstance(err, SqlError) and "boom" in err.message and "damaged" not in err.hint
    damaged = _sql_error(duckdb.IOException("IO Error: Could not read enough bytes from file"), False, 10)
    assert "cannot be read" in damaged.message
