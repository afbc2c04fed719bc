"""tracer.analysis.chains as a whole: the registry, ranking by the share of the training thread's time, the top
chain of every scenario with its culprit and line, the tracer never blamed, filters, the fallback for older
recordings, and writing chains back."""

from __future__ import annotations

import importlib
import json

import duckdb
import pytest
from tracedb import (
    HOG_PID,
    MAIN_PID,
    MS,
    SCENARIOS,
    STORM_TID,
    TRACER_PID,
    TraceBuilder,
    add_tracer,
    build,
    builder,
    downgrade_to_v1,
)

from tracer.analysis.chains import CATEGORIES, DETECTORS, ChainContext, compute_chains, write_chains
from tracer.analysis.chains.context import HIGH_SHARE, MEDIUM_SHARE, grade
from tracer.analysis.db import open_trace

WORKER = "pt_data_worker"
OP_ITEM = "cudaMemcpy"
# scenario -> (category, severity, culprit (kind, pid, tid, comm), code site, op) of its top chain
TOP = {
    "cpu_contention": ("cpu_contention", "HIGH", ("process", HOG_PID, None, "stress-ng"), None, ""),
    "sync_stall": (
        "sync_stall",
        "HIGH",
        ("code", MAIN_PID, MAIN_PID, "python3"),
        "train.py:92 train_step",
        "cudaMemcpy",
    ),
    "allocation_churn": (
        "allocation_churn",
        "HIGH",
        ("code", MAIN_PID, MAIN_PID, "python3"),
        "alloc_stress.py:74 allocate_batch",
        "cudaMalloc",
    ),
    "process_churn": ("process_churn", "HIGH", ("workers", MAIN_PID, None, WORKER), None, ""),
    "memory_pressure": ("memory_pressure", "HIGH", ("host", None, None, "host memory"), None, ""),
    "fault_storm": ("memory_pressure", "HIGH", ("thread", MAIN_PID, STORM_TID, "cache_fill"), None, ""),
    "dataloader_starvation": (
        "dataloader_starvation",
        "HIGH",
        ("workers", MAIN_PID + 1, None, "pt_data_worker"),
        None,
        "",
    ),
    "launch_bound": (
        "launch_bound",
        "HIGH",
        ("code", MAIN_PID, MAIN_PID, "python3"),
        "train.py:84 train_step",
        "cudaLaunchKernel",
    ),
    "gpu_bound": ("gpu_bound", "LOW", ("host", None, None, "GPU"), None, "cudaStreamSynchronize"),
}


@pytest.fixture(scope="module")
def dbs(tmp_path_factory):
    d = tmp_path_factory.mktemp("chains")
    return {n: build(n, d / f"{n}.duckdb") and d / f"{n}.duckdb" for n in SCENARIOS}


def chains_of(path, **kw):
    with open_trace(path) as c:
        return compute_chains(c, **kw)


def test_registry_has_one_detector_per_category():
    mods = [importlib.import_module(d.__module__) for d in DETECTORS]
    assert sorted(m.CATEGORY for m in mods) == sorted(CATEGORIES)
    assert all(d.__name__ == "detect" for d in DETECTORS)


def _variants(b: TraceBuilder, tmp_path, name: str) -> list:
    paths = [tmp_path / f"{name}.duckdb", tmp_path / f"{name}-empty.duckdb", tmp_path / f"{name}-v1.duckdb"]
    b.write(paths[0])
    b.accounting = False
    b.write(paths[1])
    b.write(paths[2])
    downgrade_to_v1(paths[2])
    return paths


def test_no_detector_fires_high_on_healthy_or_empty(tmp_path):
    # GIVEN the empty and the healthy trace, exact, without the accounting tables and as v1 files
    paths = _variants(TraceBuilder(), tmp_path, "empty") + _variants(builder("healthy"), tmp_path, "healthy")
    for p in paths:
        with open_trace(p) as c:
            ctx = ChainContext.load(c)
            # WHEN every detector runs; THEN none fires HIGH
            for d in DETECTORS:
                assert not [x for x in d(ctx) if x.severity == "HIGH"], (p.name, d.__module__)
    # and the healthy loop, GPU-bound, is only that: one informational chain
    assert [(c.category, c.severity) for c in chains_of(paths[3]).chains] == [("gpu_bound", "LOW")]


@pytest.mark.parametrize("name", list(TOP))
def test_scenario_top_chain(dbs, name):
    res = chains_of(dbs[name])
    top = res.chains[0]
    category, severity, culprit, site, op = TOP[name]
    assert (top.category, top.severity, top.op) == (category, severity, op)
    assert (top.culprit.kind, top.culprit.pid, top.culprit.tid, top.culprit.comm) == culprit
    assert top.culprit.code_site == site
    assert top.evidence.kind == category and top.recommendations and top.basis == "exact"
    assert top.tid == res.training_tid == MAIN_PID and MAIN_PID in top.pids
    assert top.end_ns > top.start_ns and top.impact_ms > 0
    # ranking: severity first, then the share of the thread's time
    keys = [(("HIGH", "MEDIUM", "LOW").index(c.severity), -c.share) for c in res.chains]
    assert keys == sorted(keys)


def test_severity_is_the_share_of_the_threads_time(dbs):
    # GIVEN cpu_contention: 60 ms of each 100 ms step in t = 20..40 s behind the hog, plus 8-12 ms in the syncs
    b = builder("cpu_contention")
    top = chains_of(dbs["cpu_contention"]).chains[0]
    rows = [r for r in b.breakdown_rows() if r["tid"] == MAIN_PID]
    outside = sum(r["runq_other_ns"] for r in rows)
    in_call = sum(r["runq_ns"] for r in b.cuda_calls)
    steps = [r for r in b.cuda_calls + b.unstored if r["tid"] == MAIN_PID]
    window = max(r["ts_ns"] + r["dur_ns"] for r in steps) - min(r["ts_ns"] for r in steps)
    # the worker held the CPU only outside calls: every in-call wait is the hog's (not split by the holders' shares)
    cost = outside + in_call
    # THEN the chain's share is that cost over the thread's steps (first launch to last sync), HIGH at >= 20 %
    assert top.share == pytest.approx(cost / window, abs=1e-4) and top.share >= HIGH_SHARE
    assert top.impact_ms == pytest.approx(cost / MS, abs=0.1)
    assert (top.start_ns, top.end_ns) == (20 * 10**9, 40 * 10**9)


def test_grade():
    assert [grade(x) for x in (0.5, HIGH_SHARE, 0.19, MEDIUM_SHARE, 0.03, 0.01)] == [
        "HIGH",
        "HIGH",
        "MEDIUM",
        "MEDIUM",
        "LOW",
        None,
    ]


def test_the_tracer_is_never_a_culprit(tmp_path):
    # GIVEN the recorder holding the training thread's CPU 30 % of the time (and the job's worker a little)
    b = builder("healthy")
    add_tracer(b)
    for i in range(600):
        b.off_cpu(
            i * 100 * MS + 2 * MS, 15 * MS, reason="preempted", runq_ns=15 * MS, by_pid=TRACER_PID, by_comm="tracer"
        )
    b.write(tmp_path / "t.duckdb")
    res = chains_of(tmp_path / "t.duckdb", limit=100)
    # THEN no chain blames it and no fix touches it: it is the tracer's cost, reported by the breakdown
    assert all(c.culprit is None or c.culprit.pid != TRACER_PID for c in res.chains)
    assert not [c for c in res.chains if c.category == "cpu_contention"]
    text = json.dumps([c.model_dump() for c in res.chains])
    assert str(TRACER_PID) not in text and "tracer" not in " ".join(r for c in res.chains for r in c.recommendations)


def test_filters(dbs):
    assert chains_of(dbs["cpu_contention"], severity="medium").chains == []
    assert [c.category for c in chains_of(dbs["cpu_contention"], severity="low").chains] == ["gpu_bound"]
    assert chains_of(dbs["cpu_contention"], pid=MAIN_PID + 1).total == 0  # a worker: no CUDA thread
    assert chains_of(dbs["cpu_contention"], limit=0).chains == []
    res = chains_of(dbs["cpu_contention"], limit=1)
    assert res.total == 2 and res.by_severity == {"HIGH": 1, "MEDIUM": 0, "LOW": 1}
    with pytest.raises(ValueError):
        chains_of(dbs["cpu_contention"], severity="urgent")


def test_ids_are_stable(dbs):
    assert [c.id for c in chains_of(dbs["fault_storm"]).chains] == [c.id for c in chains_of(dbs["fault_storm"]).chains]


@pytest.mark.parametrize("name", ["cpu_contention", "sync_stall", "allocation_churn", "process_churn", "launch_bound"])
def test_older_recordings_get_the_same_diagnosis(tmp_path, name):
    # GIVEN the scenario recorded without the time accounting, and as a v1 file
    b = builder(name)
    exact, *older = _variants(b, tmp_path, name)
    want = chains_of(exact).chains[0]
    for p in older:
        res = chains_of(p)
        top = res.chains[0]
        # THEN the estimate finds the same cause and culprit, and says it is an estimate
        assert (top.category, top.severity, top.culprit.pid, top.culprit.code_site) == (
            want.category,
            want.severity,
            want.culprit.pid,
            want.culprit.code_site,
        )
        assert res.basis == top.basis == "estimated" and "no breakdown in this recording" in res.note


def test_starvation_needs_wakers(tmp_path):
    b = builder("dataloader_starvation")
    _, empty, _ = _variants(b, tmp_path, "dl")
    res = chains_of(empty)
    assert "dataloader_starvation" not in {c.category for c in res.chains} and "wakers" in res.note


def test_write_chains_appends(dbs, tmp_path):
    import shutil

    p = tmp_path / "rw.duckdb"
    shutil.copy(dbs["allocation_churn"], p)
    res = chains_of(p)
    c = duckdb.connect(str(p))
    assert write_chains(c, res.chains) == 1
    write_chains(c, res.chains)
    rows = c.execute(
        "SELECT id, severity, category, evidence->>'calls', evidence->>'share', evidence->'culprit'->>'code_site', "
        "recommendations->>0 FROM causal_chains"
    ).fetchall()
    c.close()
    assert len(rows) == 2 and rows[0] == rows[1]
    # every runtime allocation and free, async ones included (the driver's cuMemAlloc inside is the same call)
    b = builder("allocation_churn")
    calls = sum(r["op"] in ("cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync") for r in b.cuda_calls)
    assert rows[0][1:6] == (
        "HIGH",
        "allocation_churn",
        str(calls),
        str(res.chains[0].share),
        "alloc_stress.py:74 allocate_batch",
    )
    assert "alloc_stress.py:74" in rows[0][6]


def test_a_fork_heavy_job_judges_the_training_thread_and_a_bounded_number_of_others(tmp_path):
    from tracer.analysis.chains.context import MAX_OTHER_SUBJECTS

    # GIVEN the sync-stall loop, and 200 short-lived children (a monitoring loop's helpers) each making CUDA calls
    b = builder("sync_stall")
    for i in range(200):
        pid = 20_000 + i
        b.process(pid, "helper", ppid=MAIN_PID, first_ns=1_000 * MS + i * 10 * MS, exit_ns=1_005 * MS + i * 10 * MS)
        b.call(1_001 * MS + i * 10 * MS, 2 * MS, "cudaStreamSynchronize", pid=pid, tid=pid, stream=7)
    db = b.write(tmp_path / "churn.duckdb")
    with open_trace(db) as c:
        ctx = ChainContext.load(c)
        res = compute_chains(c, limit=100)
    # THEN the chains judge the training thread and at most MAX_OTHER_SUBJECTS other processes' threads, the
    # children with the most GPU work first, so the work stays linear in the children
    assert ctx.training is not None and ctx.training.pid == MAIN_PID
    assert len(ctx.subjects) <= 1 + MAX_OTHER_SUBJECTS < 200
    # AND the training thread's diagnosis is the one the scenario has
    assert res.chains[0].category == "sync_stall" and res.chains[0].tid == MAIN_PID
