"""Smoke tests for bench/: each benchmark's pure-Python part at tiny sizes, checking the documented JSON keys.

No timing assertions (benchmarks print figures, they do not judge them) and no BPF: the parts that need root
are covered by running the benchmarks themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import common, ingest, overhead, probe_cost, queries, startup, storage


def test_write_result_has_machine_and_timestamp(tmp_path: Path) -> None:
    # GIVEN figures  WHEN written  THEN the file carries them plus bench, timestamp and machine info
    path = common.write_result("demo", {"x": 1}, tmp_path)
    doc = json.loads(path.read_text())
    assert doc["bench"] == "demo" and doc["x"] == 1 and doc["timestamp"]
    assert {"host", "kernel", "cpu_model", "cpu_cores", "python"} <= doc["machine"].keys()


def test_median_spread_ratio() -> None:
    assert common.median([3.0, 1.0, 2.0]) == 2.0
    assert common.median([]) is None
    assert common.spread([1.0, 2.0, 3.0]) == {"min": 1.0, "max": 3.0, "rel": 1.0}
    assert common.ratio(1.0, 0.0) is None


def test_overhead_parse_and_summary() -> None:
    s = overhead.parse_train_summary(
        "noise\ntrain: epochs=2 steps=400 launches=10000 driver_launches=0 workers_forked=4 wall=2.00s\n"
    )
    assert s["steps_per_s"] == 200.0
    with pytest.raises(ValueError):
        overhead.parse_train_summary("nothing here")
    runs = [
        {"variant": "untraced", "steps_per_s": 200.0},
        {"variant": "default", "steps_per_s": 150.0, "recorder_cpu_pct": 6.0},
        {"variant": "budget_1", "steps_per_s": 190.0, "overhead_pct": 1.0},
        {"variant": "no_python", "steps_per_s": 170.0},
        {"variant": "untraced", "steps_per_s": 210.0},
        {"variant": "default", "steps_per_s": 140.0, "recorder_cpu_pct": 8.0},
        {"variant": "budget_1", "steps_per_s": 200.0, "overhead_pct": 1.2},
        {"variant": "no_python", "steps_per_s": 180.0},
    ]
    res = overhead.summarize(runs)
    for key in (
        "untraced_steps_per_s",
        "ratio_default",
        "ratio_budget_1",
        "ratio_no_python",
        "recorder_cpu_pct",
        "estimate_vs_measured",
        "spread",
        "runs",
    ):
        assert key in res
    assert res["ratio_default"] == pytest.approx(145.0 / 205.0)
    assert res["ratio_budget_1"] == pytest.approx(195.0 / 205.0)
    assert res["recorder_cpu_pct"] == pytest.approx(7.0)
    assert res["estimate_vs_measured"][0] == {"estimate_pct": 1.0, "measured_pct": pytest.approx(5.0)}


def test_startup_summary() -> None:
    runs = [
        {
            "program": "true",
            "wall_s": w,
            "startup_s": 2.0,
            "compile_s": 1.0,
            "attach_s": 0.1,
            "first_event_s": None,
            "flush_s": 0.1,
        }
        for w in (3.0, 5.0, 4.0)
    ]
    res = startup.summarize(runs)
    assert res["true"]["wall_s"] == 4.0 and res["true"]["first_event_s"] is None


def test_probe_cost_compute() -> None:
    res = probe_cost.compute({"untraced": [1e-9, 1e-9], "floor": [11e-6], "recorder": [21e-6]})
    assert res["ratio_to_floor"]["floor"] == pytest.approx(1.0)
    assert res["ratio_to_floor"]["recorder"] == pytest.approx(21 / 11, rel=1e-3)
    assert {"untraced_ns_per_call", "added_us_per_call", "ratio_to_floor", "spread"} <= res.keys()


def test_probe_cost_library_builds(tmp_path: Path) -> None:
    import ctypes

    lib = ctypes.CDLL(str(probe_cost.build_lib(tmp_path)))
    lib.bench_loop.argtypes = [ctypes.c_long]
    lib.bench_loop.restype = ctypes.c_long
    assert lib.bench_loop(10) == sum(range(10))


def test_ingest_synthetic_10k(tmp_path: Path) -> None:
    # GIVEN 10k synthetic call events  WHEN pushed through the recorder's real path  THEN all are stored
    res = ingest.ingest(ingest.synth_events(10_000), tmp_path / "i.duckdb", batch=2_500)
    assert res["rows_stored"] == 10_000
    for key in ("events_per_s", "cpu_s_per_100k_events", "stage_s", "stage_us_per_event", "wall_s", "cpu_s"):
        assert key in res


def test_queries_on_10k_rows(tmp_path: Path) -> None:
    db = queries.generate(tmp_path / "q.duckdb", 10_000)
    res = queries.measure(db, runs=1)
    assert res["cuda_calls_rows"] == 10_000
    assert set(res["tools"]) == {"trace_stats", "top_stacks", "compute_chains", "run_sql"}
    for t in res["tools"].values():
        assert {"median_ms", "runs_ms", "target_ms", "within_target", "spread"} <= t.keys()


def test_storage_table_bytes(tmp_path: Path) -> None:
    db = queries.generate(tmp_path / "s.duckdb", 10_000)
    tables = storage.table_bytes(db, tmp_path)
    assert tables["cuda_calls"]["rows"] == 10_000 and tables["cuda_calls"]["bytes"] > 0
    res = storage.summarize(db.stat().st_size, tables, duration_s=2.0)
    for key in ("bytes_per_call", "db_bytes_per_min", "cuda_calls_rows", "tables", "other_tables_bytes"):
        assert key in res
