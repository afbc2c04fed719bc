"""What an assistant reads first stays small: get_trace_stats answers in under 4 KB on every scenario, with
every busy thread named (issue 23), and its structured content equals the analysis' record."""

from __future__ import annotations

import json

import anyio
import pytest
from mcp import Client
from tracedb import SCENARIOS, build

from mcp_server.server import build_server
from tests.test_ranks import COMM_TID, RANK_PIDS, job
from tracer.analysis.db import open_trace
from tracer.analysis.processes import TOP_BUSY_THREADS
from tracer.analysis.stats import trace_stats

ANSWER_BYTES = 4096


@pytest.fixture(scope="module")
def dbs(tmp_path_factory):
    d = tmp_path_factory.mktemp("answers")
    out = {}
    for name in SCENARIOS:
        build(name, d / f"{name}.duckdb")
        out[name] = d / f"{name}.duckdb"
    return out


def _call(db, tool, args=None):
    async def go():
        async with Client(build_server(db)) as c:
            return await c.call_tool(tool, args or {})

    return anyio.run(go)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_trace_stats_answer_is_small_and_names_the_busy_threads(dbs, name):
    r = _call(dbs[name], "get_trace_stats")
    assert not r.is_error
    text = r.content[0].text
    assert len(text.encode()) < ANSWER_BYTES, f"{name}: {len(text.encode())} bytes"
    with open_trace(dbs[name]) as c:
        want = trace_stats(c)
    # the text is the structured content, compact; both are the analysis' record
    assert json.loads(text) == r.structured_content == json.loads(want.model_dump_json())
    assert [(b["pid"], b["tid"]) for b in r.structured_content["busy_threads"]] == [
        (b.pid, b.tid) for b in want.busy_threads
    ]


def test_detail_gives_every_process(dbs):
    r = _call(dbs["process_churn"], "get_trace_stats", {"detail": True})
    sc = r.structured_content
    assert len(sc["processes"]) == sum(g["processes"] for g in sc["process_groups"]) > 20


def test_trace_stats_of_a_ranked_job_is_small_and_names_every_rank(tmp_path):
    # GIVEN the 3-rank torchrun job of tests/test_ranks.py: each rank's gloo thread is busier than its main thread,
    # rank 2's main thread (the straggler, asleep the longest) the least busy
    db = tmp_path / "ranks.duckdb"
    job().write(db)
    r = _call(db, "get_trace_stats")
    assert not r.is_error
    text = r.content[0].text
    # THEN the answer fits
    assert len(text.encode()) < ANSWER_BYTES, f"{len(text.encode())} bytes"
    sc = r.structured_content
    busy = [(b["pid"], b["tid"]) for b in sc["busy_threads"]]
    # AND names every rank's main thread, fills the cap with the busiest others and counts the one left out
    assert {(p, p) for p in RANK_PIDS} <= set(busy) and len(busy) == TOP_BUSY_THREADS
    assert sc["more_busy_threads"] == 2 * len(RANK_PIDS) - TOP_BUSY_THREADS
    # AND detail lists every busy thread: each rank's main and gloo threads
    full = _call(db, "get_trace_stats", {"detail": True}).structured_content
    assert {(b["pid"], b["tid"]) for b in full["busy_threads"]} == {
        (p, t) for p in RANK_PIDS for t in (p, p + COMM_TID)
    } and full["more_busy_threads"] == 0
