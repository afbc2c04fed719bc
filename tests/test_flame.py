"""tracer flame and analysis/thread_stacks.py: the stacks outside calls of a hand-built recording, ranked, and
written in speedscope's file format (validated against speedscope's own schema, tests/data/speedscope) and as
folded stacks."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import jsonschema
import pytest
from typer.testing import CliRunner

from tests.tracedb import MAIN_PID, MS, S, TraceBuilder, insert_rows
from tracer.analysis.thread_stacks import NoStacks, thread_stacks
from tracer.commands.cli import app
from tracer.errors import UsageError
from tracer.views.flame import folded, speedscope

SCHEMA = json.loads((Path(__file__).parent / "data" / "speedscope" / "file-format-schema.json").read_text())
MAIN, METRICS = MAIN_PID, MAIN_PID + 1
TRAIN = ("python", "/w/train.py", "<module>", "/w/train.py", 90)
LOOP = ("python", "/w/train.py", "main", "/w/train.py", 76)
HOT = ("python", "/w/metrics.py", "aggregate_metrics", "/w/metrics.py", 15)


def native(module: str, function: str) -> tuple:
    return ("native", module, function, None, None)


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    b = TraceBuilder()
    b.process(MAIN, "python3")
    b.thread(MAIN, MAIN, "python3")
    b.thread(MAIN, METRICS, "python3")
    gil = b.stack(
        [
            TRAIN,
            LOOP,
            native("python3.11", "PyEval_RestoreThread"),
            native("python3.11", "?"),
            native("libc.so.6", "pthread_cond_timedwait"),
        ]
    )
    fsync = b.stack([TRAIN, LOOP, native("libc.so.6", "fsync")])
    hot = b.stack([HOT])
    loop = b.stack([TRAIN, LOOP])
    path = b.write(tmp_path / "t.duckdb")
    with duckdb.connect(str(path)) as con:
        con.execute("UPDATE session SET sample_hz = 99, offcpu_stacks = true")
        insert_rows(
            con,
            "offcpu_stacks",
            [
                dict(
                    sec=1,
                    pid=MAIN,
                    tid=MAIN,
                    stack_id=gil,
                    state="S",
                    in_call=False,
                    waker_pid=0,
                    waker_comm="[timer]",
                    intervals=100,
                    blocked_ns=500 * MS,
                ),
                dict(
                    sec=2,
                    pid=MAIN,
                    tid=MAIN,
                    stack_id=gil,
                    state="S",
                    in_call=False,
                    waker_pid=MAIN,
                    waker_tid=METRICS,
                    waker_comm="python3",
                    intervals=10,
                    blocked_ns=50 * MS,
                ),
                dict(
                    sec=2,
                    pid=MAIN,
                    tid=MAIN,
                    stack_id=fsync,
                    state="D",
                    in_call=False,
                    waker_pid=0,
                    waker_comm="[block]",
                    intervals=2,
                    blocked_ns=200 * MS,
                ),
                dict(
                    sec=2,
                    pid=MAIN,
                    tid=MAIN,
                    stack_id=None,
                    state="S",
                    in_call=False,
                    waker_pid=0,
                    waker_comm="[timer]",
                    intervals=1,
                    blocked_ns=1 * MS,
                ),
            ],
        )
        insert_rows(
            con,
            "cpu_samples",
            [
                dict(
                    sec=1,
                    pid=MAIN,
                    tid=METRICS,
                    stack_id=hot,
                    in_call=False,
                    kernel=False,
                    samples=90,
                    cpu_ns=90 * S // 99,
                ),
                dict(
                    sec=1, pid=MAIN, tid=MAIN, stack_id=loop, in_call=False, kernel=False, samples=9, cpu_ns=9 * S // 99
                ),
            ],
        )
    return path


def test_off_cpu_stacks_rank_exact_blocked_time(db: Path):
    with duckdb.connect(str(db), read_only=True) as con:
        r = thread_stacks(con, "off-cpu", tid=MAIN)
    assert [(s.wait, s.state, s.ms) for s in r.stacks] == [("gil", "S", 550.0), ("io", "D", 200.0), ("other", "S", 1.0)]
    assert r.total_ms == 751.0 and r.stacks[0].site == "/w/train.py:76 main" and r.stacks[2].frames == []


def test_on_cpu_names_threads_by_hottest_function(db: Path):
    with duckdb.connect(str(db), read_only=True) as con:
        r = thread_stacks(con, "on-cpu")
    assert r.sample_hz == 99 and r.stacks[0].tid == METRICS
    assert r.stacks[0].thread == f"thread {METRICS} (aggregate_metrics, metrics.py:15)"
    assert r.stacks[0].share == 1.0 and r.stacks[0].samples == 90


def test_speedscope_file_validates_against_speedscope_schema(db: Path):
    with duckdb.connect(str(db), read_only=True) as con:
        doc = speedscope(thread_stacks(con, "off-cpu", limit=None), "t off-cpu")
    jsonschema.validate(doc, SCHEMA)
    # what speedscope's importer relies on beyond the schema: indices into shared.frames, one weight per sample
    frames = doc["shared"]["frames"]
    for p in doc["profiles"]:
        assert len(p["samples"]) == len(p["weights"]) and p["endValue"] == sum(p["weights"])
        assert all(0 <= i < len(frames) for s in p["samples"] for i in s)
    leafs = {frames[s[-1]]["name"] for p in doc["profiles"] for s in p["samples"]}
    assert leafs == {"[off-cpu gil]", "[off-cpu io D]", "[off-cpu other]"}
    assert any(frames[s[0]]["name"] == "(no stack captured)" for p in doc["profiles"] for s in p["samples"])
    py = next(f for f in frames if f["name"] == "main")
    assert (py["file"], py["line"]) == ("/w/train.py", 76)


def test_folded_lines(db: Path):
    with duckdb.connect(str(db), read_only=True) as con:
        lines = folded(thread_stacks(con, "on-cpu", limit=None))
    assert f"thread {METRICS} (aggregate_metrics, metrics.py:15);aggregate_metrics (metrics.py:15) 909091000" in lines
    for line in lines:
        stack, ns = line.rsplit(" ", 1)
        assert int(ns) > 0 and stack


def test_cli_writes_a_file_and_refuses_bad_options(db: Path, tmp_path: Path):
    out = tmp_path / "f.json"
    r = CliRunner().invoke(app, ["flame", "--db", str(db), "--off-cpu", "--thread", str(MAIN), "-o", str(out)])
    assert r.exit_code == 0, r.output
    jsonschema.validate(json.loads(out.read_text()), SCHEMA)
    r = CliRunner().invoke(app, ["flame", "--db", str(db), "--off-cpu", "--on-cpu", "-o", str(tmp_path / "g")])
    assert isinstance(r.exception, UsageError) and "exclude" in str(r.exception)


def test_a_recording_without_stacks_says_so(tmp_path: Path):
    path = TraceBuilder().write(tmp_path / "old.duckdb")
    with duckdb.connect(str(path)) as con:
        con.execute("DROP TABLE cpu_samples")
    with duckdb.connect(str(path), read_only=True) as con, pytest.raises(NoStacks):
        thread_stacks(con, "on-cpu")


def test_mcp_tool_returns_the_same_records(db: Path):
    import anyio
    from mcp import Client

    from mcp_server.server import build_server

    async def go():
        async with Client(build_server(db)) as client:
            ok = await client.call_tool("get_thread_stacks", {"mode": "off-cpu", "tid": MAIN})
            bad = await client.call_tool("get_thread_stacks", {"mode": "sideways"})
            return ok, bad

    ok, bad = anyio.run(go)
    with duckdb.connect(str(db), read_only=True) as con:
        want = thread_stacks(con, "off-cpu", tid=MAIN, limit=10).model_dump(mode="json")
    assert not ok.is_error and ok.structured_content == want
    assert bad.is_error and "on-cpu, off-cpu" in bad.content[0].text
