"""tracer.analysis.arguments.job_pid (issue 32): a node recording's job picked by pid, rank or container (a
container id prefix or a pod name, from process_placement), in one place for the CLI and the MCP tools; a bad
selector is a usage error that names what the recording holds.

Oracle: a built trace (tests/support) where the container's CUDA process is the scenario's main process, with a
worker (no CUDA call) in the same container and a process that made no CUDA call in another."""

from __future__ import annotations

import json

import duckdb
import pytest

from tests.support.builder import MAIN_PID
from tests.support.scenarios import builder
from tracer.analysis.arguments import job_pid
from tracer.analysis.db import open_trace
from tracer.commands.cli import main
from tracer.errors import UsageError

BOX = "3f4d5b1a2c00" + "ab" * 26  # a 64-hex container id
OTHER = "9" * 64
WORKER, LONER = 4242, 5151


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    b = builder("sync_stall")
    b.process(WORKER, "pt_data_worker", ppid=MAIN_PID)
    b.process(LONER, "sh")
    for pid in (MAIN_PID, WORKER, LONER):
        b.placement(pid, "0-1")
    p = tmp_path_factory.mktemp("sel") / "t.duckdb"
    b.write(p)
    with duckdb.connect(str(p)) as c:
        for pid, cid, pod in ((MAIN_PID, BOX, "trainer-1"), (WORKER, BOX, "trainer-1"), (LONER, OTHER, None)):
            c.execute("UPDATE process_placement SET container_id = ?, pod_name = ? WHERE pid = ?", [cid, pod, pid])
    return str(p)


def _pid(db, **kw):
    with open_trace(db) as c:
        return job_pid(c, **kw)


def test_a_container_is_its_cuda_process_by_id_prefix_or_pod_name(db):
    assert _pid(db, container=BOX[:12]) == MAIN_PID  # as docker ps shows it
    assert _pid(db, container=BOX.upper()) == MAIN_PID
    assert _pid(db, container="trainer-1") == MAIN_PID
    assert _pid(db, pid=WORKER) == WORKER and _pid(db) is None


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(container="deadbeef"), "3f4d5b1a2c00 (trainer-1)"),  # not there: the containers it holds
        (dict(container=OTHER[:12]), "holds no process that made a CUDA call"),
        (dict(container=BOX[:2]), "is not in this trace"),  # 2 hex digits match nothing
        (dict(container=BOX[:12], pid=MAIN_PID), "pid and container both select"),
        (dict(rank=3), "rank 3 is not in this trace"),
    ],
)
def test_a_bad_selector_names_what_the_recording_holds(db, kw, needle):
    with pytest.raises(UsageError) as e:
        _pid(db, **kw)
    assert needle in str(e.value)


def test_a_recording_without_container_identity_says_so(tmp_path):
    p = tmp_path / "old.duckdb"
    builder("sync_stall").write(p)  # no process_placement table: as before issue 28
    with pytest.raises(UsageError, match="no container identity"):
        _pid(str(p), container="trainer-1")


def test_the_cli_selects_by_container(db, capsys):
    assert main(["chains", "--db", db, "--container", "trainer-1", "--json"]) == 0
    by_box = json.loads(capsys.readouterr().out)
    assert main(["chains", "--db", db, "--pid", str(MAIN_PID), "--json"]) == 0
    assert by_box == json.loads(capsys.readouterr().out) and by_box["chains"]
    assert main(["stats", "--db", db, "--container", "nope"]) == 2
    assert "not in this trace" in capsys.readouterr().err


def _tool(db, tool, args):
    import anyio
    from mcp import Client

    from mcp_server.server import build_server

    async def go():
        async with Client(build_server(db)) as c:
            return await c.call_tool(tool, args)

    return anyio.run(go)


def test_the_mcp_tools_select_by_container(db):
    by_box = _tool(db, "get_causal_chains", {"container": "trainer-1"})
    by_pid = _tool(db, "get_causal_chains", {"pid": MAIN_PID})
    assert not by_box.is_error and by_box.structured_content == by_pid.structured_content
    bd = _tool(db, "get_time_breakdown", {"container": BOX[:12]})
    assert not bd.is_error and {t["pid"] for t in bd.structured_content["threads"]} == {MAIN_PID}
    bad = _tool(db, "get_trace_stats", {"container": "nope"})
    assert bad.is_error and "not in this trace" in bad.content[0].text


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    p = tmp_path_factory.mktemp("rank") / "t.duckdb"
    builder("sync_stall").write(p)
    with duckdb.connect(str(p)) as c:
        c.execute("UPDATE processes SET rank = 1, world_size = 2, job_id = 'j' WHERE pid = ?", [MAIN_PID])
    return str(p)


def test_a_rank_is_its_process_in_the_resolver_the_cli_and_the_mcp_tools(ranked, capsys):
    # GIVEN a recording whose training process is rank 1
    assert _pid(ranked, rank=1) == MAIN_PID
    # THEN `--rank 1` answers as `--pid` of that process does, on the CLI and in the MCP tools
    assert main(["chains", "--db", ranked, "--rank", "1", "--json"]) == 0
    by_rank = json.loads(capsys.readouterr().out)
    assert main(["chains", "--db", ranked, "--pid", str(MAIN_PID), "--json"]) == 0
    assert by_rank == json.loads(capsys.readouterr().out) and by_rank["chains"]
    tool_rank = _tool(ranked, "get_causal_chains", {"rank": 1})
    assert not tool_rank.is_error
    assert tool_rank.structured_content == _tool(ranked, "get_causal_chains", {"pid": MAIN_PID}).structured_content
    # AND a rank it does not hold is a usage error naming the ones it does
    bad = _tool(ranked, "get_trace_stats", {"rank": 5})
    assert bad.is_error and "rank 5 is not in this trace; its ranks: 1" in bad.content[0].text
    assert main(["breakdown", "--db", ranked, "--rank", "5"]) == 2
