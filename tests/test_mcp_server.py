"""mcp_server: tools over an in-memory client, then the real transports (streamable HTTP and stdio).

Structured content must equal what the analysis functions return on the same hand-built DB, so MCP and the CLI
cannot disagree.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest
import uvicorn
from mcp import Client, StdioServerParameters
from tracedb import MAIN_PID, SCENARIOS, build, builder

from mcp_server.http import build_app, parse_listen
from mcp_server.server import build_server
from tests.support.serving import TOOLS
from tracer.analysis.breakdown import time_breakdown
from tracer.analysis.chains import compute_chains
from tracer.analysis.db import open_trace
from tracer.analysis.sql.run import run_sql
from tracer.analysis.stacks import top_stacks
from tracer.analysis.stats import trace_stats
from tracer.errors import UsageError


@pytest.fixture(scope="module")
def dbs(tmp_path_factory):
    d = tmp_path_factory.mktemp("mcp")
    return {n: build(n, d / f"{n}.duckdb") and d / f"{n}.duckdb" for n in SCENARIOS}


def call(db, tool, args=None):
    async def go():
        async with Client(build_server(db)) as c:
            return await c.call_tool(tool, args or {})

    return anyio.run(go)


def test_tools_listed_with_annotations_and_schemas(dbs):
    async def go():
        async with Client(build_server(dbs["healthy"])) as c:
            return (
                c.instructions,
                (await c.list_tools()).tools,
                (await c.list_resources()).resources,
                (await c.list_prompts()).prompts,
            )

    instructions, tools, resources, prompts = anyio.run(go)
    assert "get_trace_stats" in instructions and "run_sql" in instructions
    assert {t.name for t in tools} == TOOLS
    for t in tools:
        a = t.annotations
        assert (a.read_only_hint, a.open_world_hint, a.idempotent_hint) == (True, False, True), t.name
        assert t.output_schema and t.output_schema["type"] == "object", t.name
        assert "Next" in t.description or "first" in t.description or "schema" in t.description
    by = {t.name: t for t in tools}
    assert by["get_stacks"].input_schema["required"] == ["op"]
    assert by["run_sql"].input_schema["required"] == ["query"]
    assert "p99_us" in str(by["get_trace_stats"].output_schema)
    # the chains' evidence is typed: every category's record, with its fields, is in the schema
    chains_schema = str(by["get_causal_chains"].output_schema)
    assert "DataloaderStarvationEvidence" in chains_schema and "idle_gap_after_sync_us" in chains_schema
    assert "runq_tracer" in str(by["get_time_breakdown"].output_schema) and "get_time_breakdown" in instructions
    assert [str(r.uri) for r in resources] == ["trace://schema"] and prompts[0].name == "investigate"
    for t in tools:  # the Context the tools read their state through is no argument of theirs
        assert "ctx" not in t.input_schema.get("properties", {}), t.name
        assert "\n    " not in t.description, t.name  # sent without the docstring's indentation


def test_two_servers_in_one_process_each_read_their_own_state(tmp_path: Path):
    # GIVEN two servers in one process, each on a recording in a directory of its own
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        build("healthy", tmp_path / name / f"{name}.duckdb")

    async def go() -> list[str]:
        async with (
            Client(build_server(tmp_path / "a" / "a.duckdb")) as a,
            Client(build_server(tmp_path / "b" / "b.duckdb")) as b,
        ):
            out = []
            for c in (a, b, a):
                r = await c.call_tool("compare_traces", {"before": "nope.duckdb"})
                assert r.is_error
                out.append(r.content[0].text)
            return out

    # THEN each answers from its own directory, whichever was made last
    assert [t.rsplit("recordings here: ", 1)[1] for t in anyio.run(go)] == ["a.duckdb", "b.duckdb", "a.duckdb"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_structured_content_equals_analysis(dbs, name):
    db = dbs[name]
    with open_trace(db) as c:
        want_stats = trace_stats(c).model_dump(mode="json")
        want_chains = compute_chains(c).model_dump(mode="json")
        want_stacks = top_stacks(c, "cudaLaunchKernel").model_dump(mode="json")
        want_breakdown = time_breakdown(c).model_dump(mode="json")
    r = call(db, "get_trace_stats")
    assert not r.is_error and r.structured_content == want_stats
    assert r.content[0].text  # the same object as text for the model
    r = call(db, "get_causal_chains")
    assert r.structured_content == want_chains
    assert (r.structured_content["by_severity"]["HIGH"] == 0) == (name in ("healthy", "gpu_bound"))
    assert call(db, "get_stacks", {"op": "cudaLaunchKernel"}).structured_content == want_stacks
    assert call(db, "get_time_breakdown").structured_content == want_breakdown
    q = "SELECT op, count(*) AS n FROM cuda_calls GROUP BY op ORDER BY op"
    got = call(db, "run_sql", {"query": q}).structured_content
    want = run_sql(db, q).model_dump(mode="json")
    got.pop("elapsed_ms"), want.pop("elapsed_ms")
    assert got == want


def test_numbers_match_builder(dbs, tmp_path):
    b = build("allocation_churn", tmp_path / "a.duckdb")
    r = call(tmp_path / "a.duckdb", "get_stacks", {"op": "cudaMalloc", "limit": 1}).structured_content
    assert r["op_calls_total"] == sum(1 for x in b.cuda_calls if x["op"] == "cudaMalloc")
    assert r["stacks"][0]["frames"][2] == {
        "kind": "python",
        "module": "alloc_stress.py",
        "function": "allocate_batch",
        "file": "alloc_stress.py",
        "line": 74,
    }
    c = call(dbs["cpu_contention"], "get_causal_chains", {"pid": MAIN_PID, "severity": "high"}).structured_content
    assert c["chains"][0]["evidence"]["holders"][0]["comm"] == "stress-ng"
    assert c["chains"][0]["culprit"]["pid"] == 4242 and c["chains"][0]["evidence"]["kind"] == "cpu_contention"
    t = call(dbs["fault_storm"], "get_time_breakdown", {"tid": MAIN_PID + 50, "bucket_s": 10}).structured_content
    assert [(x["tid"], x["role"]) for x in t["threads"]] == [(MAIN_PID + 50, "thread")]
    # the storm thread lives 5..55 s: six 10 s buckets, the first and last half covered
    assert t["bucket_s"] == 10 and [x["wall_ms"] for x in t["threads"][0]["buckets"]] == [5000.0] + [1e4] * 4 + [5e3]
    assert t["threads"][0]["page_alloc_bytes"] == sum(
        m["page_alloc_bytes"] for m in builder("fault_storm").memory if m["tid"] == MAIN_PID + 50
    )


@pytest.mark.parametrize(
    "tool,args,needle",
    [
        ("get_stacks", {"op": "cudaMallocc"}, "cudaMalloc"),
        ("get_causal_chains", {"severity": "urgent"}, "high, medium or low"),
        ("get_trace_stats", {"pid": 999999}, "traced pids"),
        ("get_stacks", {"op": "cudaMalloc", "pid": 7}, "pid 7 is not in this trace; traced pids: 1000"),
        ("get_time_breakdown", {"tid": 77}, "thread 77 is not in this trace"),
        ("get_time_breakdown", {"pid": 900, "tid": 1000}, "thread 1000 belongs to pid 1000, not 900"),
        ("get_time_breakdown", {"bucket_s": -1}, "bucket_s"),
        ("run_sql", {"query": "DELETE FROM meta"}, "not allowed"),
        ("run_sql", {"query": "SELECT 1; SELECT 2"}, "exactly one statement"),
        ("run_sql", {"query": "SELECT * FROM read_csv('/etc/passwd')"}, "not allowed"),
        ("run_sql", {"query": "ATTACH '/tmp/x.duckdb' AS x"}, "not allowed"),
        ("run_sql", {"query": "COPY meta TO '/tmp/m.csv'"}, "not allowed"),
        ("run_sql", {"query": "INSTALL httpfs"}, "not allowed"),
        ("run_sql", {"query": "SET threads = 1"}, "not allowed"),
        ("run_sql", {"query": "PRAGMA version"}, "not allowed"),
    ],
)
def test_bad_arguments_are_tool_errors(dbs, tool, args, needle):
    r = call(dbs["allocation_churn"], tool, args)
    assert r.is_error and needle in r.content[0].text


def test_sql_timeout_then_server_still_answers(dbs):
    from mcp_server.state import ToolLimits

    async def go():
        async with Client(build_server(dbs["healthy"], limits=ToolLimits(sql_timeout_s=0.5))) as c:
            t = time.perf_counter()
            slow = await c.call_tool(
                "run_sql",
                {"query": "SELECT count(*) FROM range(1000000) a, range(1000000) b WHERE a.range + b.range = 7"},
            )
            dt = time.perf_counter() - t
            ok = await c.call_tool("run_sql", {"query": "SELECT 42 AS x"})
            return slow, dt, ok

    slow, dt, ok = anyio.run(go)
    assert slow.is_error and "interrupted" in slow.content[0].text and dt < 5
    assert ok.structured_content["rows"] == [[42]]


@pytest.mark.parametrize(
    "problem,needle",
    [
        ("missing", "no trace DB"),
        ("recording", "still being recorded"),
        ("foreign", "not a cuda-host-tracer"),
        ("fifo", "is a FIFO"),
        ("truncated", "cannot be read"),
    ],
)
@pytest.mark.parametrize("tool", ["get_trace_stats", "run_sql"])
def test_db_problems_are_tool_errors(tmp_path, problem, needle, tool):
    import os

    import duckdb

    from tracer.procfs import boot_id, process_start_ticks

    p = tmp_path / "t.duckdb"
    if problem == "recording":  # a live recorder: this very process, on this boot
        build("healthy", p)
        me = os.getpid()
        duckdb.connect(str(p)).execute(
            "UPDATE session SET status = 'recording', recorder_pid = ?, recorder_start_ticks = ?, boot_id = ?",
            [me, process_start_ticks(me), boot_id()],
        ).close()
    elif problem == "foreign":
        duckdb.connect(str(p)).execute("CREATE TABLE x (a INT)").close()
    elif problem == "fifo":
        os.mkfifo(p)
    elif problem == "truncated":
        build("healthy", p)
        os.truncate(p, p.stat().st_size // 3)
    r = call(p, tool, {"query": "SELECT count(*) FROM cuda_calls"} if tool == "run_sql" else {})
    assert r.is_error and needle in r.content[0].text


def test_file_swapped_while_serving(tmp_path):
    # GIVEN one server over a DB  WHEN the file is damaged, then replaced by a valid one, between calls
    import shutil

    p, good, other = tmp_path / "t.duckdb", tmp_path / "good.duckdb", tmp_path / "other.duckdb"
    build("healthy", good)
    build("allocation_churn", other)
    shutil.copy(good, p)

    async def go():
        async with Client(build_server(p)) as c:
            out = [await c.call_tool("get_trace_stats", {}), await c.call_tool("run_sql", {"query": "SELECT 1"})]
            with open(p, "r+b") as f:
                f.truncate(p.stat().st_size // 3)
            for tool, args in (("get_trace_stats", {}), ("run_sql", {"query": "SELECT count(*) FROM cuda_calls"})):
                out.append(await c.call_tool(tool, args))
            shutil.copy(other, p.with_suffix(".new"))
            p.with_suffix(".new").replace(p)  # swapped in one rename, as a re-recording would
            q = "SELECT count(*) FROM cuda_calls WHERE op = 'cudaMalloc'"
            out += [await c.call_tool("get_trace_stats", {}), await c.call_tool("run_sql", {"query": q})]
            return out

    ok_stats, ok_sql, bad_stats, bad_sql, new_stats, new_sql = anyio.run(go)
    assert not ok_stats.is_error and not ok_sql.is_error
    # THEN the damaged file gets clear tool errors  AND the server answers again, from the new file
    for r in (bad_stats, bad_sql):
        assert r.is_error and "cannot be read" in r.content[0].text and "damaged or truncated" in r.content[0].text
    assert not new_stats.is_error and new_sql.structured_content["rows"][0][0] > 0


def test_huge_arguments_are_not_echoed(dbs):
    big = "x" * 1_000_000
    for tool, args in (
        ("get_stacks", {"op": big}),
        ("get_causal_chains", {"severity": big}),
        ("run_sql", {"query": big}),
        ("run_sql", {"query": f"SELECT {big}"}),
        ("get_trace_stats", {"pid": 10**40}),
        ("get_stacks", {"op": "cudaMalloc", "limit": big}),
    ):
        r = call(dbs["healthy"], tool, args)
        assert r.is_error and len(r.content[0].text) < 2_000, (tool, len(r.content[0].text))


def test_run_sql_limits_are_documented_and_hold(dbs):
    async def go():
        async with Client(build_server(dbs["healthy"])) as c:
            tools = {t.name: t for t in (await c.list_tools()).tools}
            quotes = await c.call_tool("run_sql", {"query": "SELECT repeat('\"', 20000) AS s FROM range(200)"})
            values = await c.call_tool("run_sql", {"query": "SELECT 'infinity'::DATE AS d, 'x' AS s"})
            return tools["run_sql"].description, quotes, values

    desc, quotes, values = anyio.run(go)
    for needle in ("10 s of wall clock", "768 MiB of memory", "KiB of rows per reply", "truncated", "16,384"):
        assert needle in desc
    # text escaping doubles a quote-heavy reply: rows are dropped until the whole result fits the SDK's 1 MiB
    assert quotes.structured_content["truncated"] and "reply cut" in quotes.structured_content["note"]
    assert len(quotes.model_dump_json(by_alias=True).encode()) < 1 << 20
    assert values.structured_content["rows"] == [["infinity", "x"]]
    assert json.loads(values.content[0].text) == values.structured_content  # the text is the same JSON


# -- transports
# -----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(app, port):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(5)


def test_streamable_http(dbs):
    port = free_port()
    with serving(build_app(dbs["cpu_contention"], "127.0.0.1", port), port) as base:
        assert httpx.get(f"{base}/healthz").json() == {"status": "ok", "mcp": "/mcp", "db": "cpu_contention.duckdb"}
        # issue 11: a Host the server would refuse learns it is up, not which file it serves
        evil = httpx.get(f"{base}/healthz", headers={"host": "evil.example"})
        assert evil.status_code == 200 and evil.json() == {"status": "ok", "mcp": "/mcp"}
        evil = httpx.get(f"{base}/healthz", headers={"origin": "http://evil.example"})
        assert "db" not in evil.json()

        async def go():
            async with Client(f"{base}/mcp") as c:
                names = {t.name for t in (await c.list_tools()).tools}
                r = await c.call_tool("get_causal_chains", {"severity": "high"})
                return names, r

        names, r = anyio.run(go)
        assert names == TOOLS and r.structured_content["chains"][0]["category"] == "cpu_contention"
        init = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        hdr = {"accept": "application/json, text/event-stream"}
        bad_host = httpx.post(f"{base}/mcp", json=init, headers={**hdr, "host": "evil.example:80"})
        assert bad_host.status_code == 421
        bad_origin = httpx.post(f"{base}/mcp", json=init, headers={**hdr, "origin": "http://evil.example"})
        assert bad_origin.status_code == 403


def test_non_loopback_needs_token(dbs):
    with pytest.raises(UsageError, match="without a bearer token"):
        build_app(dbs["healthy"], "0.0.0.0", 8090)
    assert parse_listen(":8090") == ("127.0.0.1", 8090)
    assert parse_listen("[::1]:9") == ("::1", 9)
    with pytest.raises(UsageError):
        parse_listen("8090x")


def test_token_required_when_given(dbs):
    port = free_port()
    # bound to loopback for the test, but built as for 0.0.0.0 (token + explicit allow-list)
    app = build_app(dbs["healthy"], "0.0.0.0", port, token="s3cret-token")
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    hdr = {"accept": "application/json, text/event-stream"}
    with serving(app, port) as base:
        assert httpx.get(f"{base}/healthz").json() == {"status": "ok", "mcp": "/mcp"}  # no token: no file name
        named = httpx.get(f"{base}/healthz", headers={"authorization": "Bearer s3cret-token"})
        assert named.json()["db"] == "healthy.duckdb"
        assert httpx.post(f"{base}/mcp", json=init, headers=hdr).status_code == 401
        wrong = httpx.post(f"{base}/mcp", json=init, headers={**hdr, "authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"].startswith("Bearer")
        ok = httpx.post(f"{base}/mcp", json=init, headers={**hdr, "authorization": "Bearer s3cret-token"})
        assert ok.status_code == 200
        evil = httpx.post(
            f"{base}/mcp",
            json=init,
            headers={**hdr, "authorization": "Bearer s3cret-token", "host": "evil.example"},
        )
        assert evil.status_code == 421  # Host validation stays on off loopback


def test_stdio(dbs):
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "tracer.commands.cli", "mcp", "serve", "--db", str(dbs["sync_stall"]), "--stdio"],
        cwd=str(Path(__file__).resolve().parent.parent),
    )

    async def go():
        async with Client(params) as c:
            return await c.call_tool("get_trace_stats", {})

    r = anyio.run(go)
    assert not r.is_error and r.structured_content["chains_by_severity"]["HIGH"] == 1
