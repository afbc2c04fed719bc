"""tracer.analysis.chains: each scenario yields its chain, with evidence and trace-specific fixes; healthy none."""  # noqa: E501

from __future__ import annotations

import duckdb
import pytest
from tracedb import MAIN_PID, SCENARIOS, build

from tracer.analysis.chains import DETECTORS, ChainContext, compute_chains, write_chains
from tracer.db import open_trace


@pytest.fixture(scope="module")
def dbs(tmp_path_factory):
    d = tmp_path_factory.mktemp("chains")
    return {n: build(n, d / f"{n}.duckdb") and d / f"{n}.duckdb" for n in SCENARIOS}


def chains_of(path, **kw):
    with open_trace(path) as c:
        return compute_chains(c, **kw)


def test_registry_on_healthy_and_empty(dbs, tmp_path):
    from tracedb import TraceBuilder

    TraceBuilder().write(tmp_path / "empty.duckdb")
    for p in (dbs["healthy"], tmp_path / "empty.duckdb"):
        with open_trace(p) as c:
            ctx = ChainContext.load(c)
            for d in DETECTORS:
                assert not [x for x in d(ctx) if x.severity == "HIGH"], d.__name__
    assert chains_of(dbs["healthy"]).total == 0


@pytest.mark.parametrize(
    "name,category,op",
    [
        ("cpu_contention", "cpu_contention", "cudaStreamSynchronize"),
        ("process_churn", "process_churn", "cudaStreamSynchronize"),
        ("memory_pressure", "memory_pressure", "cudaMemcpy"),
        ("allocation_churn", "allocation_churn", "cudaMalloc"),
        ("sync_stall", "sync_stall", "cudaStreamSynchronize"),
    ],
)
def test_scenario_top_chain(dbs, name, category, op):
    res = chains_of(dbs[name])
    top = res.chains[0]
    assert (top.category, top.severity, top.op) == (category, "HIGH", op)
    assert MAIN_PID in top.pids and top.recommendations and top.evidence
    assert top.op_p99_us > top.op_p50_us > 0 and top.end_ns > top.start_ns
    assert {c.category for c in res.chains} == {category}, "no other category fires"


def test_cpu_contention_names_the_preemptor(dbs):
    top = chains_of(dbs["cpu_contention"]).chains[0]
    ev = top.evidence
    assert ev["slow_calls"] == 200 and ev["runq_share"] > 0.9
    assert ev["preemptors"][0] == dict(
        pid=4242, comm="stress-ng", own=False, preemptions=200, runq_ms=ev["runq_ms"]
    )
    assert "stress-ng (pid 4242)" in top.summary and "renice -n 19 -p 4242" in top.recommendations[0]
    assert any("train.py:88 train_step" in r for r in top.recommendations)


def test_churn_and_alloc_fixes_are_specific(dbs):
    churn = chains_of(dbs["process_churn"]).chains[0]
    assert churn.evidence["workers_per_wave"] == 4 and churn.evidence["respawn_waves"] == 5
    assert "num_workers=4, persistent_workers=True" in churn.recommendations[0]
    alloc = chains_of(dbs["allocation_churn"]).chains[0]
    assert "alloc_stress.py:74 allocate_batch" in alloc.recommendations[0]
    assert alloc.evidence["calls"] == 10000 and alloc.evidence["empty_cache_in_free_stacks"]
    assert any("empty_cache" in r for r in alloc.recommendations)
    sync = chains_of(dbs["sync_stall"]).chains[0]
    assert sync.evidence["calls_per_s"] == 400 and "train.py:88" in sync.recommendations[0]


def test_filters(dbs):
    assert chains_of(dbs["cpu_contention"], severity="low").chains == []
    assert chains_of(dbs["cpu_contention"], pid=MAIN_PID + 1).total == 0
    assert chains_of(dbs["cpu_contention"], limit=0).chains == []
    with pytest.raises(ValueError):
        chains_of(dbs["cpu_contention"], severity="urgent")


def test_unexplained_tail_not_blamed_on_cpu(tmp_path):
    from tracedb import S, TraceBuilder

    b = TraceBuilder()
    b.process(MAIN_PID, "python3")
    for i in range(600):  # slow syncs, thread on CPU the whole time: no runq, no off-CPU
        b.call(i * S // 10, 30_000_000 if i % 10 == 0 else 1_000_000, "cudaStreamSynchronize")
    b.write(tmp_path / "t.duckdb")
    assert not [c for c in chains_of(tmp_path / "t.duckdb").chains if c.category == "cpu_contention"]


def test_write_chains_appends(dbs, tmp_path):
    import shutil

    p = tmp_path / "rw.duckdb"
    shutil.copy(dbs["allocation_churn"], p)
    res = chains_of(p)
    c = duckdb.connect(str(p))
    assert write_chains(c, res.chains) == 1
    write_chains(c, res.chains)
    rows = c.execute(
        "SELECT id, severity, evidence->>'calls', recommendations->>0 FROM causal_chains"
    ).fetchall()
    c.close()
    assert (
        len(rows) == 2
        and rows[0][1] == "HIGH"
        and rows[0][2] == "10000"
        and "alloc_stress.py:74" in rows[0][3]
    )
