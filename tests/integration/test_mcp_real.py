"""Real eBPF, MCP surface: the in-memory MCP client against a real recording of train.py with DataLoader
workers: four tools, stats that equal SQL over the DB, stacks down to train.py's lines, and run_sql."""

from __future__ import annotations

import anyio
import pytest
from _helpers import WORKLOADS, scenario
from mcp import Client

from mcp_server.server import build_server
from tests.support.serving import TOOLS

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    return scenario("train_workers", tmp_path_factory)


def _session(db, fn):
    async def go():
        async with Client(build_server(db)) as c:
            return await fn(c)

    return anyio.run(go)


def _call(db, tool, args=None):
    return _session(db, lambda c: c.call_tool(tool, args or {}))


def test_four_tools_are_listed(train):
    async def tools(c):
        return (await c.list_tools()).tools

    assert {t.name for t in _session(train.db, tools)} == TOOLS


def test_trace_stats_numbers_equal_sql(train):
    # GIVEN a real recording of train.py --workers 2 --epochs 3, WHEN get_trace_stats is called over MCP
    r = _call(train.db, "get_trace_stats", {"detail": True})
    assert not r.is_error, r.content
    st = r.structured_content
    # THEN per-op calls equal the exact op_stats sums
    want_calls = dict(train.q("SELECT op, sum(calls) FROM op_stats GROUP BY op"))
    got_calls: dict[str, int] = {}
    for o in st["ops"]:
        got_calls[o["op"]] = got_calls.get(o["op"], 0) + o["calls"]
    assert got_calls == want_calls
    assert want_calls["cudaLaunchKernel"] == 3 * 10 * 20  # epochs x steps x launches per step
    assert st["events_traced"] == train.one("SELECT events_traced FROM session")
    # AND the processes are the tree in the DB: the main process and the 6 workers as dataloader_worker
    procs = {p["pid"]: p for p in st["processes"]}
    assert set(procs) == {r[0] for r in train.q("SELECT pid FROM processes")}
    workers = {r[0] for r in train.q("SELECT pid FROM processes WHERE comm = 'pt_data_worker'")}
    assert len(workers) == 6
    assert {p for p, v in procs.items() if v["role"] == "dataloader_worker"} == workers
    assert procs[train.pid]["role"] == "main"
    # AND by default (no detail) the workers are one group of 6 under the main process, and no per-process rows
    brief = _call(train.db, "get_trace_stats").structured_content
    assert brief["processes"] == [] and len(r.content[0].text) > len(_call(train.db, "get_trace_stats").content[0].text)
    assert [(g["processes"], g["ppid"]) for g in brief["process_groups"] if g["comm"] == "pt_data_worker"] == [
        (6, train.pid)
    ]
    # and their scheduling numbers are the sched_stats sums
    for pid, sw, off in train.q("SELECT pid, sum(switches), sum(off_cpu_ns) FROM sched_stats GROUP BY pid"):
        assert procs[pid]["context_switches"] == sw
        assert procs[pid]["off_cpu_s"] == pytest.approx(off / 1e9, abs=1e-3)


def test_get_stacks_reaches_train_py_lines(train):
    r = _call(train.db, "get_stacks", {"op": "cudaLaunchKernel"})
    assert not r.is_error, r.content
    st = r.structured_content
    assert st["stacks"], st
    lines = (WORKLOADS / "train.py").read_text().splitlines()
    py = [
        f for s in st["stacks"] for f in s["frames"] if f["kind"] == "python" and (f["file"] or "").endswith("train.py")
    ]
    assert py, st["stacks"][0]["frames"]
    for f in py:
        assert f["line"] and 1 <= f["line"] <= len(lines)
    # the innermost train.py frame sits on the line that launches the kernel
    inner = [
        [f for f in s["frames"] if f["kind"] == "python" and (f["file"] or "").endswith("train.py")]
        for s in st["stacks"]
    ]
    inner = [fs[-1] for fs in inner if fs]
    assert any("cudaLaunchKernel" in lines[f["line"] - 1] for f in inner), [
        (f["line"], lines[f["line"] - 1]) for f in inner
    ]
    # and the frames end in the CUDA call itself
    assert any(s["frames"] and s["frames"][-1]["kind"] == "cuda" for s in st["stacks"])


def test_run_sql_works(train):
    q = "SELECT count(*) AS n FROM process_events WHERE kind = 'exit'"
    r = _call(train.db, "run_sql", {"query": q})
    assert not r.is_error, r.content
    assert r.structured_content["columns"] == ["n"]
    assert r.structured_content["rows"] == [[train.one(q)]]
    bad = _call(train.db, "run_sql", {"query": "DELETE FROM meta"})
    assert bad.is_error
