"""Smoke tests for bench/: each benchmark's pure-Python part at tiny sizes, checking the documented JSON keys.

No timing assertions (benchmarks print figures, they do not judge them) and no BPF: the parts that need root
are covered by running the benchmarks themselves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import duckdb
import pytest

from bench import (
    churn_memory,
    common,
    elf_cache,
    fork_heavy,
    ingest,
    overhead,
    probe_cost,
    queries,
    scaling,
    size_cap,
    startup,
    storage,
)
from tracer.analysis.stats import trace_stats


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
        {"variant": "untraced", "steps_per_s": 200.0, "job_cpu_s": 10.0},
        {
            "variant": "default",
            "steps_per_s": 150.0,
            "recorder_cpu_pct": 6.0,
            "job_cpu_s": 10.5,
            "recording_cpu_pct": 5.0,
            "duration_s": 11.0,
            "startup_s": 3.0,  # from another origin than duration_s: the span is recording_s, never their difference
            "recording_s": 10.0,
        },
        {"variant": "budget_1", "steps_per_s": 190.0, "overhead_pct": 1.0},
        {"variant": "no_python", "steps_per_s": 170.0},
        {"variant": "untraced", "steps_per_s": 210.0, "job_cpu_s": 8.0},
        {
            "variant": "default",
            "steps_per_s": 140.0,
            "recorder_cpu_pct": 8.0,
            "job_cpu_s": 8.0,
            "recording_cpu_pct": 10.0,
            "duration_s": 11.0,
            "startup_s": 3.0,  # from another origin than duration_s: the span is recording_s, never their difference
            "recording_s": 10.0,
        },
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
    # the CPU tracing added, per pair: (10.5 + 5% of 10 s) / 10 and (8 + 10% of 10 s) / 8, less one (the recorder's
    # share over recording_s); the job's own
    assert res["cpu_cost_pct_default"] == pytest.approx((10.0 + 12.5) / 2)
    assert res["job_cpu_ratio_default"] == pytest.approx(1.025)


def test_startup_summary() -> None:
    runs = [
        {
            "program": "true",
            "mode": mode,
            "wall_s": w + (2.0 if mode == "cold" else 0.0),
            "startup_s": 2.0,
            "compile_s": 1.0,
            "attach_s": 0.1,
            "first_event_s": None,
            "flush_s": 0.1,
        }
        for w in (3.0, 5.0, 4.0)
        for mode in ("cold", "warm")
    ]
    compiles = {"cold": [{"wall_s": 3.0, "cpu_s": 2.5}, {"wall_s": 2.0, "cpu_s": 2.0}], "warm": []}
    res = startup.summarize(runs, compiles)
    assert res["warm"]["true"]["wall_s"] == 4.0 and res["cold"]["true"]["wall_s"] == 6.0
    assert res["warm"]["true"]["first_event_s"] is None
    assert "pid_train" not in res["warm"]  # no runs: no row
    assert res["cold"]["compile_alone"] == {"wall_s": 2.5, "cpu_s": 2.25}
    assert res["warm"]["compile_alone"] == {"wall_s": None, "cpu_s": None}


def test_churn_memory_summary() -> None:
    # GIVEN RSS that saws by 20 MiB around a flat line over 1,000 processes, then one that climbs 1 MiB a sample
    mib = churn_memory.MIB
    flat = [churn_memory.Sample(i, i * 10, (300 + 20 * (i % 2)) * mib, 15 * mib) for i in range(101)]
    climb = [churn_memory.Sample(i, i * 10, (300 + i) * mib, 0) for i in range(101)]
    # THEN the flat one grows by nothing (medians of the stretches, not two points of the saw) and the climbing one
    # by the 80.5 samples between the stretches' medians; the fit says the same per 100 K processes
    f, c = churn_memory.summarize(flat, 1000), churn_memory.summarize(climb, 1000)
    assert abs(f["growth_mib"]) <= 10 and abs(f["slope_per_100k_mib"]) < 100
    assert c["growth_mib"] == 80.5 and c["slope_per_100k_mib"] == 10_000
    assert {"warmup", "end", "growth_with_children_mib", "peak_mib"} <= f.keys()
    assert churn_memory.summarize([], 1000)["growth_mib"] is None
    notes = "12 lifecycle events lost to a full buffer (a burst)\n3 file mappings lost to a full buffer"
    assert churn_memory.lost_events(notes, "lifecycle events") == 12 and churn_memory.lost_events(None, "x") == 0


def test_size_cap_replays_a_recording_under_a_cap(tmp_path: Path) -> None:
    # GIVEN an uncapped recording of 30 s of detail rows (tests/test_sizecap.py's seconds, ~4 MiB)
    import numpy as np
    from test_sizecap import _second

    from tracer.recorder.store import Store

    src = tmp_path / "source.duckdb"
    store, rng = Store(src), np.random.default_rng(5)
    for sec in range(30):
        for table, cols in _second(rng, sec).items():
            store.put(table, cols)
    store.close()
    # WHEN it is replayed twice over under a 4 MiB cap
    res = size_cap.replay(src, tmp_path / "capped.duckdb", 4 * 2**20, passes=2)
    # THEN the sizes, the share and the rows thinned are reported, and the replay covered both passes
    assert {"cap_bytes", "peak_bytes", "peak_share", "final_bytes", "rows_dropped", "cpu_s", "note"} <= res.keys()
    assert res["peak_share"] == round(res["peak_bytes"] / res["cap_bytes"], 3)
    assert res["peak_bytes"] >= res["final_bytes"]
    assert res["rows_dropped"]["cuda_calls"] > 0 and res["replayed_s"] >= 60
    kept = duckdb.connect(str(tmp_path / "capped.duckdb"), read_only=True).execute("SELECT count(*) FROM cuda_calls")
    assert kept.fetchone()[0] + res["rows_dropped"]["cuda_calls"] == 2 * 30 * 4000


def test_probe_cost_compute() -> None:
    res = probe_cost.compute({"untraced": [1e-9, 1e-9], "floor": [11e-6], "recorder": [21e-6]})
    assert res["ratio_to_floor"]["floor"] == pytest.approx(1.0)
    assert res["ratio_to_floor"]["recorder"] == pytest.approx(21 / 11, rel=1e-3)
    assert {"untraced_ns_per_call", "added_us_per_call", "ratio_to_floor", "spread"} <= res.keys()


def test_probe_cost_sched_derivation() -> None:
    # GIVEN the micro's phases (sched_switch / sched_waking (ns, hits) and blocking switches) and a recorder run's
    # programs  WHEN summarized  THEN the added µs per blocking switch and per sample come out under their keys
    phases = {
        "no_target": {"switch": [(1000, 10)], "waking": [(500, 5)], "blocking": [0]},
        "target": {"switch": [(3000, 10)], "waking": [(1500, 5)], "blocking": [2]},
        "target_capture": {"switch": [(7000, 10)], "waking": [(1500, 5)], "blocking": [2]},
        "target_capture_deep": {"switch": [(9000, 10)], "waking": [(1500, 5)], "blocking": [2]},
    }
    micro = probe_cost.summarize_micro(phases, rounds=10, reps=1, lost=None)
    assert micro["phases"]["target"]["added_us_per_blocking_switch"] == pytest.approx(1.5)  # (2,000 + 1,000) ns / 2
    assert micro["capture_us_per_blocking_switch"] == pytest.approx(2.0)
    assert micro["capture_deep_us_per_blocking_switch"] == pytest.approx(3.0)
    last = {
        1: {"id": 1, "type": 5, "name": probe_cost.SCHED_SWITCH, "run_cnt": 100, "run_time_ns": 50_000},
        2: {"id": 2, "type": 5, "name": probe_cost.SCHED_WAKING, "run_cnt": 10, "run_time_ns": 5_000},
        3: {"id": 3, "type": 7, "name": "cpu_sample", "run_cnt": 40, "run_time_ns": 80_000},
        4: {"id": 4, "type": 5, "name": "offcpu_stack", "run_cnt": 0, "run_time_ns": 0},
        5: {"id": 5, "type": 5, "name": "sched__sched_pr", "run_cnt": 1, "run_time_ns": 1},
        6: {"id": 6, "type": 5, "name": "sched__sched_pr", "run_cnt": 2, "run_time_ns": 2},
    }
    progs = probe_cost.by_name(last)
    assert progs["sched__sched_pr"]["programs"] == 2 and progs["sched__sched_pr"]["run_cnt"] == 3
    assert progs["offcpu_stack"]["ns_per_hit"] is None and progs["cpu_sample"]["ns_per_hit"] == 2000
    rec = {"programs": progs, "job": {"target_blocking_switches": 10, "target_samples": 20}}
    d = probe_cost.derive(rec, micro)
    # (50,000 + 5,000 - 100 x 100 - 10 x 100) ns / 10 blocking switches = 4.4 µs; 80,000 ns / 20 samples = 4 µs
    assert d["added_us_per_blocking_switch"] == pytest.approx(4.4)
    assert d["added_us_per_sample"] == pytest.approx(4.0)
    assert d["tail_called_run_cnt"] == {"offcpu_stack": 0}
    for key in ("micro_added_us_per_blocking_switch", "micro_capture_us_per_blocking_switch", "excludes"):
        assert key in d


def test_probe_cost_steady_window() -> None:
    # GIVEN polls every 0.5 s and the job's per-second counts (seconds 0..3 of the session)  WHEN the steady
    # window is taken  THEN it spans seconds 1..2, with the programs' stats interpolated at its edges
    sec = 1_000_000_000
    names = (probe_cost.SCHED_SWITCH, probe_cost.SCHED_WAKING, "cpu_sample")
    series = [(t * sec // 2, {n: (t * 100, t * 1000) for n in names}) for t in range(9)]
    job = {"start_mono_ns": 0, "per_sec": {0: [5, 1], 1: [10, 2], 2: [20, 4], 3: [1, 0]}}
    st = probe_cost.steady(series, job)
    assert st is not None and st["secs"] == [1, 2]
    assert st["target_blocking_switches"] == 30 and st["target_samples"] == 6
    assert st["programs"]["cpu_sample"] == {"run_cnt": 400, "run_time_ns": 4000}
    assert probe_cost.steady(series, {"start_mono_ns": 0, "per_sec": {0: [1, 1], 1: [1, 1]}}) is None


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


def test_scaling_recording_is_a_sample_of_exact_counts(tmp_path: Path) -> None:
    # the size-2 recording at a tiny scale: helpers, workers, and op_stats counting SAMPLED calls per stored row
    db = scaling.generate(tmp_path / "s.duckdb", 2, procs=300, rows=20_000, duration_s=60)
    with duckdb.connect(str(db), read_only=True) as c:
        (helpers,) = c.execute("SELECT count(*) FROM processes WHERE comm = 'true'").fetchone()
        counts = c.execute(
            "SELECT o.calls, s.n, list_sum(list_transform(o.hist, lambda b: b.count)) FROM op_stats o "
            "JOIN (SELECT pid, op, layer, count(*) AS n FROM cuda_calls GROUP BY ALL) s USING (pid, op, layer)"
        ).fetchall()
        stats = trace_stats(c)
    assert helpers == 600
    assert counts and all(calls == scaling.SAMPLED * n == hist for calls, n, hist in counts)
    # and the analyses read it as a recording: the helpers one group under their shell
    assert any(g.comm == "true" and g.processes == 600 for g in stats.process_groups)


def test_fork_heavy_job_ends_with_its_mark() -> None:
    cmd = fork_heavy.job(1000)
    assert "fork_churn.py --procs 1000" in cmd and "step_loop.py --duration 5" in cmd
    assert cmd.endswith(f"echo {fork_heavy.END_MARK}$(date +%s.%N) >&2")


def test_overhead_cpu_per_1k_events_is_the_recording_cpu_over_the_traced_calls() -> None:
    # 5% of a core for 20 s of recording = 1 s of CPU over 100,000 calls (the session's own span: duration_s and
    # startup_s count from different origins, so their difference is not it)
    r = {"recording_cpu_pct": 5.0, "recording_s": 20.0, "duration_s": 25.0, "startup_s": 8.0, "events_traced": 100_000}
    assert overhead.ms_per_1k_events(r) == pytest.approx(10.0)
    # an older session row without the figure, or a run that traced nothing: no figure, not a division by zero
    assert overhead.ms_per_1k_events({**r, "recording_cpu_pct": None}) is None
    assert overhead.ms_per_1k_events({**r, "recording_s": None}) is None
    assert overhead.ms_per_1k_events({**r, "events_traced": 0}) is None


def test_elf_cache_bench_parses_this_process_files() -> None:
    files = [f for f in elf_cache.mapped_files(os.getpid()) if "python" in f or "libc" in f][:3]
    assert files
    parse_ms, save_ms = elf_cache.parse_all(files, None)
    assert parse_ms > 0 and save_ms == 0


def test_stability_names_tests_that_exist_and_reads_pytest_outcomes() -> None:
    from bench import stability

    # every test the bench repeats exists (a renamed test would silently drop out of it)
    for t in stability.TESTS:
        path, _, name = t.partition("::")
        text = (Path(__file__).resolve().parents[1] / path).read_text()
        assert not name or f"def {name}(" in text, t
    out = (
        "tests/integration/test_two_hop_real.py::test_x PASSED [ 50%]\n"
        "tests/integration/test_diagnosis_real.py::test_top_cause[respawn] FAILED [100%]\n"
    )
    found = {m.group(1): m.group(2) for m in stability.RESULT.finditer(out)}
    assert found == {
        "tests/integration/test_two_hop_real.py::test_x": "PASSED",
        "tests/integration/test_diagnosis_real.py::test_top_cause[respawn]": "FAILED",
    }
