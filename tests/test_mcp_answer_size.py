"""What an assistant reads first stays small: get_trace_stats answers in under 4 KB on every scenario, with
every busy thread named (issue 23), and its structured content equals the analysis' record."""

from __future__ import annotations

import json

import anyio
import pytest
from mcp import Client
from tracedb import SCENARIOS, build

from mcp_server.server import build_server
from tracer.analysis.db import open_trace
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
