"""tracer.analysis.stats on hand-built DBs: every number recomputed from the builder's rows."""

from __future__ import annotations

import pytest
from tracedb import MAIN_PID, build, percentile_from_hist

from tracer.analysis.stats import percentile_ns, trace_stats
from tracer.db import open_trace


@pytest.fixture(scope="module")
def contention(tmp_path_factory):
    p = tmp_path_factory.mktemp("db") / "c.duckdb"
    b = build("cpu_contention", p)
    with open_trace(p) as c:
        yield b, trace_stats(c)


def test_percentiles_interpolate_within_bucket():
    buckets = [(0, 10, 10), (10, 20, 10)]
    assert percentile_ns(buckets, 0.5, 0, 20) == 10
    assert percentile_ns(buckets, 0.75, 0, 20) == 15
    assert percentile_ns(buckets, 0.99, 0, 18) == 18  # clamped to max_ns


def test_ops_exact_from_hist(contention):
    b, st = contention
    rows = {r["op"]: r for r in b.op_stats_rows()}
    sync = next(o for o in st.ops if o.op == "cudaStreamSynchronize")
    r = rows["cudaStreamSynchronize"]
    assert sync.calls == r["calls"] == 600
    assert sync.p50_us == pytest.approx(percentile_from_hist(r["hist"], 0.5) / 1e3, abs=0.1)
    assert sync.p99_us == pytest.approx(percentile_from_hist(r["hist"], 0.99) / 1e3, abs=0.1)
    assert sync.max_us == pytest.approx(r["max_ns"] / 1e3, abs=0.1)
    assert sync.tail_ratio == pytest.approx(sync.p99_us / sync.p50_us, rel=0.01)
    # true quantiles from the rows are within a bucket width (3.1 %)
    durs = sorted(x["dur_ns"] for x in b.cuda_calls if x["op"] == "cudaStreamSynchronize")
    assert sync.p50_us * 1e3 == pytest.approx(durs[300], rel=0.04)
    assert st.ops[0].op == "cudaStreamSynchronize"  # worst tail first
    layers = {o.op: o.layer for o in st.ops}
    assert layers["cuLaunchKernel"] == "driver" and layers["cudaLaunchKernel"] == "runtime"
    # launches: every call counted in op_stats, only 2 of 5 stored
    launch = next(o for o in st.ops if o.op == "cudaLaunchKernel")
    assert launch.calls == 3000 and st.events_traced == len(b.cuda_calls) + len(b.unstored)
    assert st.events_stored == len(b.cuda_calls)


def test_processes_and_host(contention):
    b, st = contention
    main = st.processes[0]
    assert (main.pid, main.role, main.comm) == (MAIN_PID, "main", "python3")
    assert {p.role for p in st.processes[1:]} == {"dataloader_worker"}
    mine = [s for s in b.sched if s["pid"] == MAIN_PID]
    assert main.context_switches == len(mine)
    assert main.off_cpu_s == pytest.approx(sum(s["dur_ns"] for s in mine) / 1e9, abs=1e-3)
    assert main.worst_stall_ms == pytest.approx(max(s["dur_ns"] for s in mine) / 1e6, abs=0.01)
    assert main.cuda_calls == len(b.cuda_calls) + len(b.unstored)
    assert st.host.max_load1 == 24.0 and st.host.max_cpu_busy_pct == 100.0
    assert st.chains_by_severity["HIGH"] == 1 and "stress-ng" in st.top_chain


def test_pid_filter_and_sampled(tmp_path):
    b = build("healthy", tmp_path / "h.duckdb")
    b.sampled_fraction = 0.5
    b.write(tmp_path / "s.duckdb")
    with open_trace(tmp_path / "s.duckdb") as c:
        st = trace_stats(c, pid=MAIN_PID + 1)
        assert [p.pid for p in st.processes] == [MAIN_PID + 1] and st.ops == []
        st = trace_stats(c)
        assert all(o.note == "scaled from a sample" for o in st.ops)
    assert st.environment.gpus == "NVIDIA A10" and st.environment.duration_s == 60.0
