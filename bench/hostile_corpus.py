"""The hostile-query corpus of issues 11 and 17: what an MCP client may send to ``tracer mcp serve --http``, and
what each attack must get back. Shared by ``tests/test_mcp_hostile.py`` (which asserts it) and
``bench/sql_limits.py`` (which records outcome, time and memory per attack).

Every tool-call attack (:data:`ATTACKS`) names its class, the tool and arguments, and the expected answer: a
tool error containing ``needle`` (and not ``absent``), or a result that ``check`` accepts. Arguments may name
the served DB and its directory by the placeholders :data:`DB` and :data:`DIR` (:func:`arguments` fills them
in): the issue-17 writes aimed at the recording itself. After each one the server must still answer a plain
``run_sql("select 1")`` and ``get_trace_stats`` (:func:`liveness`), and the DB's bytes and its directory must
be unchanged. HTTP-level attacks (Host, Origin, token, body size, /healthz) are in the test module, as they do
not go through the SDK client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracer import procfs

DEFAULT_TIMEOUT_S = 10  # the server's run_sql wall clock (mcp_server.state.ToolLimits.sql_timeout_s)
MiB = 1 << 20


@dataclass(frozen=True)
class Attack:
    """One tool call and the answer it must get."""

    name: str
    cls: str  # values | time | memory | reply | statement | file_network | write | arguments | disclosure | state
    tool: str
    args: dict[str, Any]
    needle: str | tuple[str, ...] | None = None  # expected: a tool error whose text contains this (or one of)
    check: Callable[[dict[str, Any]], bool] | None = field(default=None, compare=False)  # expected: a result
    memory: bool = False  # sample the server's RSS during it
    absent: str | None = None  # the error must not say this (advice run_sql cannot follow)


def rows_are(*want: Any) -> Callable[[dict[str, Any]], bool]:
    return lambda sc: sc["rows"] == [list(want)]


def capped(sc: dict[str, Any]) -> bool:
    return sc["truncated"] and "reply cut" in (sc["note"] or "")


def sql(name: str, cls: str, query: str, *, needle: str | None = None, check: Any = None, **kw: Any) -> Attack:
    args = {"query": query, **({"limit": kw.pop("limit")} if "limit" in kw else {})}
    return Attack(name, cls, "run_sql", args, needle, check, **kw)


BIG = "x" * 1_000_000
REFUSED = "not allowed"
NO_FILES = "file system operations are disabled"
SERVER_ONLY = "shows the server's configuration and paths"  # a function or view that reveals the host
DB = "@@DB@@"  # the served DB's absolute path, filled in by arguments()
DIR = "@@DIR@@"  # its directory
T = f"after {DEFAULT_TIMEOUT_S} s"
# A query that allocates as it computes is stopped by whichever limit it reaches first: memory on a fast
# machine, the wall clock on a loaded one. Either way it is stopped, and the memory stays bounded.
OOM = ("out of memory", T)

ATTACKS: tuple[Attack, ...] = (
    # values Python cannot represent: the reply carries DuckDB's text for them (the server died on these)
    sql("infinity date", "values", "SELECT 'infinity'::DATE AS d", check=rows_are("infinity")),
    sql("-infinity date", "values", "SELECT '-infinity'::DATE AS d", check=rows_are("-infinity")),
    sql("infinity timestamp", "values", "SELECT 'infinity'::TIMESTAMP AS t", check=rows_are("infinity")),
    sql("infinity timestamptz", "values", "SELECT 'infinity'::TIMESTAMPTZ AS t", check=rows_are("infinity")),
    sql(
        "max timestamp",
        "values",
        "SELECT '294247-01-10 04:00:54.775806'::TIMESTAMP AS t",
        check=rows_are("294247-01-10 04:00:54.775806"),
    ),
    sql(
        "max timestamp_ns",
        "values",
        "SELECT make_timestamp_ns(9223372036854775806) AS t",
        check=rows_are("2262-04-11T23:47:16.854775806"),
    ),
    sql("BC date", "values", "SELECT '0044-03-15 (BC)'::DATE AS d", check=rows_are("0044-03-15 (BC)")),
    sql(
        "uhugeint max",
        "values",
        "SELECT 340282366920938463463374607431768211455::UHUGEINT AS u",
        check=rows_are(2**128 - 1),
    ),
    sql(
        "test_all_types()",
        "values",
        "SELECT * FROM test_all_types()",
        check=lambda sc: sc["row_count"] == 3 and sc["rows"][1][sc["columns"].index("uhugeint")] == 2**128 - 1,
    ),
    sql(
        "date array with infinity",
        "values",
        "SELECT ['infinity'::DATE, DATE '2020-01-01'] AS a",
        check=rows_are("[infinity, 2020-01-01]"),
    ),
    # time: DuckDB interrupts between vectors only; one scalar call over huge values must still stop
    # 300k, not 100k: a 2026 VM's CPU finished 100k in 9.5 s, inside the 10 s limit (n^2: 300k is 9 times the work)
    sql("levenshtein 300k (n^2)", "time", "SELECT levenshtein(repeat('a', 300000), repeat('b', 300000))", needle=T),
    sql(
        "cross join 10^12",
        "time",
        "SELECT count(*) FROM range(1000000) a, range(1000000) b WHERE a.range + b.range = 7",
        needle=T,
    ),
    sql("regexp on 10 MB", "time", "SELECT regexp_matches(repeat('a', 10000000), '(a|aa)*b')", check=rows_are(False)),
    # memory: lists are not counted by memory_limit; the worker's address-space limit stops them
    sql("len(range(200000000))", "memory", "SELECT len(range(200000000))", needle=OOM, memory=True),
    sql(
        "damerau_levenshtein 16k",
        "memory",
        "SELECT damerau_levenshtein(repeat('a', 16000), repeat('b', 16000))",
        needle=OOM,
        memory=True,
    ),
    sql("list of 100M", "memory", "SELECT list(i) FROM range(100000000) t(i)", needle=OOM, memory=True),
    sql(
        "string_agg of 100M",
        "memory",
        "SELECT string_agg(i::VARCHAR, ',') FROM range(100000000) t(i)",
        needle=OOM,
        memory=True,
    ),
    sql("one 2 GB string", "memory", "SELECT length(repeat('x', 2000000000))", needle=OOM, memory=True),
    # reply size: capped near 1 MiB with truncated and a note; long values cut
    sql(
        "repeat 1 MB x 300 rows",
        "reply",
        "SELECT repeat('x', 1000000) AS s FROM range(300)",
        limit=300,
        check=capped,
        memory=True,
    ),
    sql(
        "10,000 rows x 1 KB",
        "reply",
        "SELECT i, repeat('y', 1000) AS s FROM range(10000) t(i)",
        limit=10000,
        check=capped,
    ),
    sql(
        "quote-heavy text (escaping doubles it)",
        "reply",
        "SELECT repeat('\"', 20000) AS s FROM range(200)",
        limit=200,
        check=capped,
    ),
    sql(
        "one 8 MB list value",
        "reply",
        "SELECT range(1000000) AS r",
        check=lambda sc: sc["truncated"] and sc["row_count"] == 0,
    ),
    sql(
        "blob 1 MB",
        "reply",
        "SELECT repeat('\\xFF'::BLOB, 1000000) AS b",
        check=lambda sc: sc["rows"][0][0].endswith("…[cut: 1,983,616 more characters]"),
    ),
    # statements: one read-only SELECT / EXPLAIN of a SELECT, nothing else
    sql("EXPLAIN ANALYZE CREATE", "statement", "EXPLAIN ANALYZE CREATE TEMP TABLE t AS SELECT 1", needle="CREATE"),
    sql(
        "EXPLAIN (FORMAT json) INSERT",
        "statement",
        "EXPLAIN (FORMAT json) INSERT INTO meta VALUES ('a', 'b')",
        needle="INSERT",
    ),
    sql("EXPLAIN ANALYZE COPY", "statement", "/*c*/ EXPLAIN ANALYZE COPY meta TO '/tmp/meta.csv'", needle="COPY"),
    sql("UPDATE EXTENSIONS", "statement", "UPDATE EXTENSIONS", needle="UPDATE EXTENSIONS statements are not allowed"),
    sql("INSTALL", "statement", "INSTALL httpfs", needle=REFUSED),
    sql("LOAD", "statement", "LOAD httpfs", needle=REFUSED),
    sql("ATTACH", "statement", "ATTACH '/tmp/x.duckdb' AS x", needle=REFUSED),
    sql("DETACH", "statement", "DETACH memory", needle=REFUSED),
    sql("COPY TO", "statement", "COPY meta TO '/tmp/m.csv'", needle=REFUSED),
    sql("COPY FROM", "statement", "COPY meta FROM '/etc/passwd'", needle=REFUSED),
    sql("EXPORT DATABASE", "statement", "EXPORT DATABASE '/tmp/x'", needle=REFUSED),
    sql("SET", "statement", "SET enable_external_access = true", needle=REFUSED),
    sql("RESET", "statement", "RESET lock_configuration", needle=REFUSED),
    sql("PRAGMA", "statement", "PRAGMA version", needle=REFUSED),
    sql("CALL", "statement", "CALL pragma_version()", needle=REFUSED),
    sql("CHECKPOINT", "statement", "CHECKPOINT", needle=REFUSED),
    sql("USE", "statement", "USE memory", needle=REFUSED),
    sql("BEGIN", "statement", "BEGIN TRANSACTION", needle=REFUSED),
    sql("CREATE SECRET", "statement", "CREATE SECRET (TYPE s3, KEY_ID 'a', SECRET 'b')", needle=REFUSED),
    sql("two statements", "statement", "SELECT 1; SELECT 2", needle="exactly one statement"),
    sql("COMMIT then INSERT", "statement", "COMMIT; INSERT INTO meta VALUES ('a', 'b')", needle="exactly one"),
    sql(
        "query() with a write",
        "statement",
        "SELECT * FROM query('INSERT INTO meta VALUES (1, 2)')",
        needle="query() is not allowed",
    ),
    # file and network access from SQL
    sql("read_csv /etc/passwd", "file_network", "SELECT * FROM read_csv('/etc/passwd')", needle=REFUSED),
    sql("read_text", "file_network", "SELECT * FROM read_text('/etc/passwd')", needle=REFUSED),
    sql("read_blob", "file_network", "SELECT * FROM read_blob('/etc/hostname')", needle=REFUSED),
    sql("glob", "file_network", "SELECT * FROM glob('/*')", needle=REFUSED),
    sql("/proc/self/environ", "file_network", "SELECT * FROM read_json_auto('/proc/self/environ')", needle=REFUSED),
    sql("replacement scan of a path", "file_network", "FROM '/etc/passwd'", needle="does not exist"),
    sql("https URL", "file_network", "SELECT * FROM 'https://example.com/x.csv'", needle=NO_FILES),
    sql("s3 parquet", "file_network", "SELECT * FROM read_parquet('s3://bucket/x.parquet')", needle=REFUSED),
    sql("getenv", "file_network", "SELECT getenv('TRACER_MCP_TOKEN')", needle="getenv() is not allowed"),
    sql("stored secrets", "file_network", "SELECT * FROM duckdb_secrets()", needle=SERVER_ONLY),
    # writes
    sql("INSERT", "write", "INSERT INTO meta VALUES ('a', 'b')", needle=REFUSED),
    sql("UPDATE", "write", "UPDATE session SET status = 'x'", needle=REFUSED),
    sql("DELETE", "write", "DELETE FROM meta", needle=REFUSED),
    sql("DROP", "write", "DROP TABLE meta", needle=REFUSED),
    sql("ALTER", "write", "ALTER TABLE meta ADD COLUMN x INT", needle=REFUSED),
    sql("CREATE TEMP", "write", "CREATE TEMP TABLE t AS SELECT 1", needle=REFUSED),
    # arguments: huge or malformed, never echoed back in full
    sql("1 MB query", "arguments", "SELECT '" + BIG + "'", needle="characters long"),
    sql("1 MB identifier", "arguments", "SELECT " + "z" * 99_000, needle="more characters"),
    sql(
        "deep nesting",
        "arguments",
        "SELECT " + "(" * 30000 + "1" + ")" * 30000,
        needle="expression depth",
        absent="SET ",
    ),
    Attack("1 MB op", "arguments", "get_stacks", {"op": BIG}, needle="1,000,000 characters"),
    Attack("1 MB severity", "arguments", "get_causal_chains", {"severity": BIG}, needle="high, medium or low"),
    Attack("huge pid", "arguments", "get_trace_stats", {"pid": 10**40}, needle="not in this trace"),
    Attack("negative limit", "arguments", "run_sql", {"query": "SELECT 1", "limit": -1}, needle="greater than"),
    Attack("limit as text", "arguments", "run_sql", {"query": "SELECT 1", "limit": BIG}, needle="valid integer"),
    Attack("query as a number", "arguments", "run_sql", {"query": 12345}, needle="valid string"),
    Attack("unknown tool", "arguments", "drop_everything", {}, needle="Unknown tool"),
    Attack("2,000 pids", "arguments", "compare_processes", {"pids": [3247] * 2000}, needle="2,000 pids is too many"),
    # issue 30 item 4: compare_traces' errors named the server's absolute paths; every answer names files by their
    # bare names in the served directory (test_attack also checks that no error names the server's directories)
    Attack(
        "compare_traces missing name",
        "disclosure",
        "compare_traces",
        {"before": "missing.duckdb"},
        needle="no recording 'missing.duckdb' here",
    ),
    Attack(
        "compare_traces absolute path of the DB",
        "disclosure",
        "compare_traces",
        {"before": DB},
        needle="is not a recording's file name",
    ),
    Attack(
        "compare_traces ../ name",
        "disclosure",
        "compare_traces",
        {"before": "../x.duckdb"},
        needle="is not a recording's file name",
    ),
    Attack(
        "compare_traces /etc/passwd",
        "disclosure",
        "compare_traces",
        {"after": "/etc/passwd"},
        needle="is not a recording's file name",
    ),
    Attack("compare_traces 1 MB name", "arguments", "compare_traces", {"before": BIG}, needle="1,000,000 characters"),
    *(
        # issue 17: the statement check was a regex comment stripper; DuckDB nests /* */ and ends -- at \r. This
        # COPY replaced the served DB with 6 bytes. Refused by the check, and DuckDB has no file system to do it.
        sql(
            "EXPLAIN ANALYZE nested comment hides COPY over the DB",
            "write",
            f"EXPLAIN ANALYZE /* /* */ SELECT 1 -- */ COPY (SELECT 'pwned' AS g) TO '{DB}' "
            "(HEADER false, USE_TMP_FILE false)",
            needle="COPY statements are not allowed",
        ),
        sql(
            "EXPLAIN ANALYZE --\\r hides COPY over the DB",
            "write",
            f"EXPLAIN ANALYZE --\r COPY (SELECT 'pwned' AS g) TO '{DB}' (HEADER false, USE_TMP_FILE false)",
            needle="COPY statements are not allowed",
        ),
        sql(
            "nested comment hides COPY after a SELECT",
            "write",
            f"/* /* */ SELECT 1; */ COPY (SELECT 'pwned' AS g) TO '{DB}.wal'",
            needle="COPY statements are not allowed",
        ),
        sql("COPY into the DB's directory", "write", f"COPY (SELECT 1 AS a) TO '{DIR}/fill.csv'", needle=REFUSED),
        sql("EXPORT next to the DB", "write", f"EXPORT DATABASE '{DIR}/export'", needle=REFUSED),
        sql("IMPORT DATABASE", "write", f"IMPORT DATABASE '{DIR}'", needle="IMPORT DATABASE statements"),
        sql("COPY FROM DATABASE", "write", "COPY FROM DATABASE memory TO memory", needle="COPY statements"),
        sql("persistent secret", "write", "CREATE PERSISTENT SECRET s (TYPE s3, KEY_ID 'a')", needle="CREATE SECRET"),
        sql("SET VARIABLE", "write", "SET VARIABLE pwn = 'attacker'", needle="SET VARIABLE statements"),
        sql("getvariable in a later call", "write", "SELECT getvariable('pwn') AS v", check=rows_are(None)),
        sql("PREPARE", "write", "PREPARE p AS SELECT 1", needle="PREPARE statements"),
        sql("EXECUTE", "write", "EXECUTE p", needle="EXECUTE statements"),
        sql("DEALLOCATE", "write", "DEALLOCATE p", needle="DEALLOCATE statements"),
        sql("COMMIT", "write", "COMMIT", needle="COMMIT statements"),
        sql("VACUUM", "write", "VACUUM", needle="VACUUM statements"),
        sql("FORCE CHECKPOINT", "write", "FORCE CHECKPOINT", needle="FORCE CHECKPOINT statements"),
        sql("FORCE INSTALL", "write", "FORCE INSTALL httpfs", needle="FORCE INSTALL statements"),
        sql(
            "MERGE INTO", "write", "MERGE INTO meta USING meta m ON false WHEN NOT MATCHED THEN INSERT", needle="MERGE"
        ),
        sql("PIVOT without IN", "statement", "PIVOT session ON status", needle="PIVOT without an IN list"),
        sql(  # issue 30: it was reported as "PIVOT without an IN list"
            "PIVOT IN (subquery)",
            "statement",
            "PIVOT session ON status IN (SELECT DISTINCT status FROM session) USING count(*)",
            needle="PIVOT … IN (subquery) is not allowed",
        ),
        sql(
            "PIVOT with IN runs",
            "statement",
            "PIVOT (SELECT 'a' AS k, 1 AS v) ON k IN ('a') USING sum(v)",
            check=rows_are(1),
        ),
        # the reply cap counts everything sent: a thousand 2,000-character column names were 4 MB
        sql(
            "1,000 columns of 2,000-character names",
            "reply",
            'WITH t AS (SELECT 1 AS "' + "n" * 2000 + '") SELECT ' + ", ".join(["t.*"] * 1000) + " FROM t",
            needle="column names and types alone",
            absent="crashed",
        ),
        # values Arrow or Python would silently change
        sql(
            "TIMETZ keeps its offset",
            "values",
            "SELECT '12:00:00+05:30'::TIMETZ AS t",
            check=rows_are("12:00:00+05:30"),
        ),
        sql("TIME 24:00:00", "values", "SELECT '24:00:00'::TIME AS t", check=rows_are("24:00:00")),
        sql("BIT", "values", "SELECT '101010'::BIT AS b", check=rows_are("101010")),
        sql(
            "INTERVAL past Arrow's nanoseconds",
            "values",
            "SELECT to_microseconds(9223372036854775807) AS i",
            check=rows_are("2562047788:00:54.775807"),
        ),
        sql("TIME_NS", "values", "SELECT '12:00:00.123456789'::TIME_NS AS t", check=rows_are("12:00:00.123456789")),
        sql(
            "UHUGEINT in a MAP",
            "values",
            "SELECT MAP {1: 340282366920938463463374607431768211455::UHUGEINT} AS m",
            check=rows_are([[1, 2**128 - 1]]),
        ),
        sql(
            "UHUGEINT in a two-field struct",
            "values",
            "SELECT {'a': 340282366920938463463374607431768211455::UHUGEINT, 'b': 2} AS s",
            check=rows_are({"a": 2**128 - 1, "b": 2}),
        ),
        sql(
            "DECIMAL(38,9) beyond a double",
            "values",
            "SELECT 12345678901234567890.123456789::DECIMAL(38,9) AS d",
            check=rows_are("12345678901234567890.123456789"),
        ),
        sql(
            "TIMESTAMP_NS infinity",
            "values",
            "SELECT 'infinity'::TIMESTAMP_NS AS a, '-infinity'::TIMESTAMP_MS AS b, 'infinity'::TIMESTAMP_S AS c",
            check=rows_are("infinity", "-infinity", "infinity"),
        ),
        sql(
            "TIMESTAMP_NS infinity in a list and a struct",
            "values",
            "SELECT ['infinity'::TIMESTAMP_NS] AS a, {'t': '-infinity'::TIMESTAMP_NS} AS b",
            check=rows_are("[infinity]", "{'t': -infinity}"),
        ),
        sql("VARIANT", "values", "SELECT 1::VARIANT AS v", check=rows_are("1")),
        sql("VARIANT of an INTERVAL", "values", "SELECT (INTERVAL 1 DAY)::VARIANT AS v", check=rows_are("1 day")),
        sql(
            "NaN and infinities",
            "values",
            "SELECT 'nan'::DOUBLE AS a, 'inf'::DOUBLE AS b, '-inf'::FLOAT AS c",
            check=rows_are("nan", "inf", "-inf"),
        ),
        # the server's paths and home directory: refused by name, wherever they appear
        sql("duckdb_settings()", "disclosure", "SELECT * FROM duckdb_settings()", needle=SERVER_ONLY),
        sql("duckdb_databases()", "disclosure", "SELECT path FROM duckdb_databases()", needle=SERVER_ONLY),
        sql("pragma_database_list", "disclosure", "FROM pragma_database_list", needle=SERVER_ONLY),
        sql("home_directory", "disclosure", "SELECT current_setting('home_directory')", needle=SERVER_ONLY),
        sql("SHOW a setting", "disclosure", "SHOW secret_directory", needle=SERVER_ONLY),
        sql("pg_settings", "disclosure", "SELECT * FROM pg_catalog.pg_settings", needle=SERVER_ONLY),
        sql("duckdb_extensions()", "disclosure", "SELECT install_path FROM duckdb_extensions()", needle=SERVER_ONLY),
        sql("SUMMARIZE a view of paths", "disclosure", "SUMMARIZE system.main.duckdb_databases", needle=SERVER_ONLY),
        sql(
            "EXPLAIN ANALYZE of a lambda over settings",
            "disclosure",
            "EXPLAIN ANALYZE SELECT list_transform(['a'], lambda x: current_setting('temp_directory'))",
            needle=SERVER_ONLY,
        ),
        sql(
            "query_table() of a name built at run time",
            "disclosure",
            "SELECT * FROM query_table('duckdb_' || 'databases')",
            needle="query_table() is not allowed",
        ),
        # issue 30: DuckDB's table macros call query_table(source); functions named by a string run any SQL
        sql(
            "histogram_values over duckdb_databases",
            "disclosure",
            "SELECT * FROM histogram_values('duckdb_databases', path)",
            needle="query_table() is not allowed",
        ),
        sql(
            "histogram_values over pg_settings",
            "disclosure",
            "SELECT * FROM histogram_values('pg_settings', name||'='||coalesce(setting,''), bin_count := 500)",
            needle="query_table() is not allowed",
        ),
        sql(
            "destroy_external_resource runs SQL",
            "disclosure",
            "SELECT * FROM destroy_external_resource('query', 'SELECT error(reverse((SELECT path FROM "
            "duckdb_databases() WHERE path IS NOT NULL)))')",
            needle="destroy_external_resource() is not allowed",
        ),
        sql(
            "register_external_resource_type",
            "state",
            "SELECT * FROM register_external_resource_type('planted', kind:='x', create_function:='query')",
            needle="register_external_resource_type() is not allowed",
        ),
        sql(
            "register_external_resource",
            "state",
            "SELECT * FROM register_external_resource('planted', 'note', map{'k': 'v'})",
            needle="register_external_resource() is not allowed",
        ),
        sql(
            "duckdb_external_resources in a later call",
            "state",
            "SELECT * FROM duckdb_external_resources()",
            needle="duckdb_external_resources() is not allowed",
        ),
        # errors say what can be done in run_sql
        sql("unknown column", "errors", "SELECT nope FROM meta", needle="Check table and column names"),
        sql("syntax error", "errors", "SELEC 1", needle="Fix the syntax", absent="Check table and column names"),
        sql(
            "arrow lambda",
            "errors",
            "SELECT list_transform([1, 2], x -> x + 1)",
            needle="lambda x: x + 1",
            absent="SET ",
        ),
        sql("bad cast", "errors", "SELECT 'a'::INT", needle="TRY_CAST", absent="Check table and column names"),
    ),
)

CLASSES = tuple(dict.fromkeys(a.cls for a in ATTACKS))


@dataclass
class Outcome:
    """What one attack got back."""

    attack: str
    cls: str
    ok: bool  # the answer was the expected one
    is_error: bool
    text: str  # the error text, or the note / first row of a result (cut)
    reply_bytes: int
    seconds: float
    peak_rss_above_idle_bytes: int | None = None


def arguments(attack: Attack, db: str | Path) -> dict[str, Any]:
    """The tool arguments of ``attack`` with :data:`DB` and :data:`DIR` replaced by the served DB's path and its
    directory."""
    path = Path(db).resolve()

    def fill(v: Any) -> Any:
        return v.replace(DB, str(path)).replace(DIR, str(path.parent)) if isinstance(v, str) else v

    return {k: fill(v) for k, v in attack.args.items()}


def evaluate(attack: Attack, result: Any, seconds: float) -> Outcome:
    """Return the :class:`Outcome` of ``attack`` given the SDK's ``CallToolResult``."""
    text = result.content[0].text if result.content else ""
    sc = result.structured_content or {}
    if attack.needle is not None:
        needles = (attack.needle,) if isinstance(attack.needle, str) else attack.needle
        ok = bool(result.is_error) and any(n in text for n in needles) and len(text) < 4_000
        ok = ok and (attack.absent is None or attack.absent not in text)
    else:
        ok = not result.is_error and attack.check is not None and bool(attack.check(sc))
    shown = text if result.is_error else str(sc.get("note") or sc.get("rows", [])[:1])
    return Outcome(
        attack.name,
        attack.cls,
        ok,
        bool(result.is_error),
        shown[:300],
        len(result.model_dump_json(by_alias=True)),
        round(seconds, 3),
    )


async def call(
    url: str, tool: str, args: dict[str, Any], timeout_s: float = 120.0, client: str | None = None
) -> tuple[Any, float]:
    """Call one tool through the real MCP SDK client in a fresh session; return (result, seconds of the call).

    Args:
        client: the client software's name it declares (clientInfo); run_sql's fair queue tells sessionless
            clients apart by it. None: the SDK's default, the same for every call.
    """
    from mcp import Client
    from mcp.types import Implementation

    info = Implementation(name=client, version="1") if client else None
    async with Client(url, read_timeout_seconds=timeout_s, client_info=info) as c:
        t = time.perf_counter()
        r = await c.call_tool(tool, args)
        return r, time.perf_counter() - t


async def liveness(url: str) -> dict[str, float]:
    """Seconds a plain ``run_sql("select 1")`` and ``get_trace_stats`` take; raises unless both answer right."""
    out = {}
    r, out["run_sql"] = await call(url, "run_sql", {"query": "select 1"}, timeout_s=30)
    if r.is_error or r.structured_content["rows"] != [[1]]:
        raise AssertionError(f"run_sql('select 1') after the attack: {r.content[0].text[:300]}")
    r, out["get_trace_stats"] = await call(url, "get_trace_stats", {}, timeout_s=30)
    if r.is_error:
        raise AssertionError(f"get_trace_stats after the attack: {r.content[0].text[:300]}")
    return out


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants (the server and its query workers)."""
    children: dict[int, list[int]] = {}
    for p, st in procfs.processes().items():
        children.setdefault(st.ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_rss_bytes(pid: int) -> int:
    """RSS of ``pid`` plus all its descendants, from /proc."""
    return sum(procfs.resident_bytes(p) or 0 for p in tree_pids(pid))


def cpu_wait_s(pids: list[int]) -> float:
    """Seconds the threads of ``pids`` have spent runnable but waiting for a CPU, summed (procfs.cpu_wait_ns)."""
    return sum(procfs.cpu_wait_ns(p) or 0 for p in pids) / 1e9


class RssSampler:
    """Samples :func:`tree_rss_bytes` every 20 ms in a thread while in a ``with`` block; ``peak`` is the highest."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            self._stop.wait(0.02)

    def __enter__(self) -> RssSampler:
        self._t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._t.join()
