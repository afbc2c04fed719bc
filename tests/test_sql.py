"""tracer.analysis.sql: one read-only statement, JSON-safe values, honest truncation, refusals, timeout."""

from __future__ import annotations

import json
import time

import pytest
from tracedb import build

from tracer.analysis.sql import QueryTimeout, SqlError, run_sql


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
    assert row[0] == "2026-05-04T12:00:00+00:00" and row[1] is None and row[2] == "aabb"
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
        ("'294247-01-10 04:00:54.775806'::TIMESTAMP", "294247-01-10 04:00:54.775806"),
        ("'0044-03-15 (BC)'::DATE", "0044-03-15 (BC)"),
        ("make_timestamp_ns(9223372036854775806)", "2262-04-11T23:47:16.854775806"),
        ("340282366920938463463374607431768211455::UHUGEINT", 2**128 - 1),
        ("[340282366920938463463374607431768211455::UHUGEINT, 1]", [2**128 - 1, 1]),
        ("{'a': 340282366920938463463374607431768211455::UHUGEINT}", {"a": 2**128 - 1}),
        ("(2::BIGNUM ** 300)::BIGNUM", str(2**300)),
        ("DATE '2024-02-29'", "2024-02-29"),  # ordinary values keep their ordinary form
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
    "q", ["EXPLAIN SELECT 1", "EXPLAIN ANALYZE SELECT count(*) FROM cuda_calls", "explain (format json) select 1"]
)
def test_explain_of_select_runs(db, q):
    assert run_sql(db, q).row_count >= 1


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
    from tracer.db import open_trace

    with open_trace(db) as c:
        assert run_sql(c, "SELECT 'infinity'::DATE").rows == [["infinity"]]
        with pytest.raises(SqlError, match="CREATE"):
            run_sql(c, "EXPLAIN ANALYZE CREATE TEMP TABLE t AS SELECT 1")
        with pytest.raises(QueryTimeout):
            run_sql(c, "SELECT count(*) FROM range(1000000) a, range(1000000) b WHERE a.range + b.range = 7", 1, 0.3)
        assert run_sql(c, "SELECT 42").rows == [[42]]
