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
