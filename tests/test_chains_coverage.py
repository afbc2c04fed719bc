"""tracer/analysis/chains/coverage.py: which parts of the training thread's time the chains explain, on the
hand-built scenarios (tests/support/scenarios.py); the recorded fixtures' coverage is checked in
tests/integration/test_stack_chains_real.py and test_diagnosis_real.py."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from mcp import Client
from tracedb import MAIN_PID, build

from mcp_server.server import build_server
from tests.support.builder import TraceBuilder
from tests.support.scenarios import ALLOC_STACK, allocation_churn
from tracer.analysis.chains import compute_chains
from tracer.analysis.chains.coverage import AT_SITE, MIN_PART
from tracer.analysis.db import open_trace
from tracer.commands.cli import main


@pytest.fixture(scope="module")
def dbs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("coverage")
    names = ("sync_stall", "fault_storm", "allocation_churn", "healthy", "process_churn")
    return {n: (build(n, d / f"{n}.duckdb"), d / f"{n}.duckdb")[1] for n in names}


def covered(db: Path, **kw):
    with open_trace(db) as c:
        return compute_chains(c, **kw)


def parts(res) -> dict[str, tuple[float, list[str], list[str]]]:
    return {p.part: (p.share, p.explained_by, p.top_sites) for p in res.coverage.parts}


def test_a_stall_explains_the_wait_and_the_host_work_it_serializes(dbs):
    # GIVEN a loop that reads the loss every step (half its steps on CPU, half waiting for the GPU)
    res = covered(dbs["sync_stall"])
    p = parts(res)
    # THEN both parts are the sync_stall chain's, and nothing is left unexplained
    assert set(p) == {"cpu", "sync"} and p["cpu"][1] == ["sync_stall"] and p["sync"][1] == ["sync_stall"]
    assert res.coverage.unexplained_share == 0 and res.coverage.tid == MAIN_PID


def test_a_part_no_chain_explains_is_listed_with_where_its_time_went(dbs):
    # GIVEN a fault storm: a thread of the training process faults in memory, and takes the CPU from the loop
    res = covered(dbs["fault_storm"])
    p = parts(res)
    # THEN the faults are memory_pressure's, the waits for the GPU the GPU being the limit
    assert p["blocked"][1] == ["memory_pressure"] and p["sync"][1] == ["root:gpu"]
    # AND the run-queue wait behind the storm thread, which no chain claims, is listed with its holder
    share, by, sites = p["runq_self"]
    assert by == [] and share >= MIN_PART and sites and sites[0].startswith(f"cache_fill {MAIN_PID} [self]")
    assert res.coverage.unexplained_share == pytest.approx(share)


def test_host_work_of_a_loop_that_barely_waits_is_not_the_gpus(dbs):
    # GIVEN a host-bound loop of allocations (it waits for the GPU under 5% of its steps), recorded without samples
    res = covered(dbs["allocation_churn"])
    p = parts(res)
    # THEN its allocations are allocation_churn's, and its CPU time is unexplained, not put on the GPU
    assert p["alloc"][1] == ["allocation_churn"] and p["cpu"][1] == []
    assert res.coverage.unexplained_share == pytest.approx(p["cpu"][0]) and p["cpu"][0] > 0.5


def test_every_part_of_at_least_five_percent_is_reported_and_only_those(dbs):
    for db in dbs.values():
        res = covered(db)
        with open_trace(db) as c:
            wall = c.execute("SELECT sum(wall_ns) FROM thread_breakdown WHERE tid = ?", [res.training_tid]).fetchone()
        assert res.coverage is not None and wall[0] > 0
        assert all(p.share >= MIN_PART for p in res.coverage.parts)
        assert sum(p.share for p in res.coverage.parts) > 0.85  # the small parts left out are small
        assert res.coverage.unexplained_share == pytest.approx(
            sum(p.share for p in res.coverage.parts if not p.explained_by), abs=1e-3
        )
        assert all(p.unexplained_share == (0 if p.explained_by else p.share) for p in res.coverage.parts)


def test_a_filter_does_not_change_what_the_chains_explain(dbs):
    # GIVEN the process-churn scenario, whose HIGH chain explains the blocked part
    whole = covered(dbs["process_churn"])
    # WHEN only the LOW chains are asked for
    low = covered(dbs["process_churn"], severity="low", limit=1)
    # THEN the coverage is still that of every chain found
    assert low.coverage == whole.coverage and parts(whole)["blocked"][1] == ["process_churn"]


def test_the_cli_and_mcp_report_the_same_coverage(dbs, capsys):
    db = dbs["fault_storm"]
    assert main(["chains", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "10% unexplained" in out and "runq_self" in out and "cache_fill" in out

    async def go():
        async with Client(build_server(db)) as client:
            return await client.call_tool("get_causal_chains", {"severity": "high"})

    r = anyio.run(go)
    assert not r.is_error, r.content
    assert r.structured_content["coverage"] == covered(db).coverage.model_dump(mode="json")


def test_the_lost_time_of_each_scenario_has_its_root_found(dbs):
    # GIVEN the healthy loop: its lost time is its waits for the GPU (the GPU's root) and its batch waits (a worker
    # on CPU meanwhile: its lines); THEN every part has a root and the root-found share is nearly all of it
    cv = covered(dbs["healthy"]).coverage
    assert 0 < cv.lost_share < 1 and cv.root_found_share >= 0.9
    assert {p.part: p.root for p in cv.parts if p.part == "sync"} == {"sync": "gpu"}
    assert not any(x == "gpu_limit" for p in cv.parts for x in p.explained_by)


@pytest.mark.parametrize("under", [40, 60])
def test_cpu_partly_under_the_churns_code_is_the_churns_share_only(tmp_path, under):
    # GIVEN the allocation loop with its CPU outside calls sampled: ``under`` of every 100 samples in the function
    # that makes the allocations, the rest in the loop's other code
    b = TraceBuilder()
    allocation_churn(b)
    at_site, elsewhere = b.stack(ALLOC_STACK[:3]), b.stack(ALLOC_STACK[:2])
    for sec in range(5, 55):
        b.samples(sec, at_site, under)
        b.samples(sec, elsewhere, 100 - under)
    b.write(tmp_path / "t.duckdb")
    (cpu,) = [p for p in covered(tmp_path / "t.duckdb").coverage.parts if p.part == "cpu"]
    if under >= AT_SITE * 100:
        # THEN mostly under it: the part is the churn's
        assert cpu.explained_by == ["allocation_churn"] and cpu.unexplained_share == 0
    else:
        # THEN short of that: the share under it is the churn's, the rest unexplained and listed
        assert cpu.explained_by == [] and cpu.top_sites
        assert cpu.unexplained_share == pytest.approx(cpu.share * (100 - under) / 100, abs=2e-4)
