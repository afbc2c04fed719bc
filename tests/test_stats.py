"""tracer.analysis.stats on hand-built DBs: every number recomputed from the builder's rows."""

from __future__ import annotations

import pytest
from tracedb import MAIN_PID, TRACER_PID, add_tracer, build, builder, parts_total

from tracer.analysis.db import open_trace
from tracer.analysis.stats import main_pid, trace_stats


@pytest.fixture(scope="module")
def contention(tmp_path_factory):
    p = tmp_path_factory.mktemp("db") / "c.duckdb"
    b = builder("cpu_contention")
    add_tracer(b)
    b.write(p)
    with open_trace(p) as c:
        yield b, trace_stats(c, detail=True)


def _hist(row: dict) -> list[tuple[int, int, int]]:
    return [(h["lo_ns"], h["hi_ns"], h["count"]) for h in row["hist"]]


def test_ops_exact_from_hist(contention):
    b, st = contention
    rows = {r["op"]: r for r in b.op_stats_rows()}
    sync = next(o for o in st.ops if o.op == "cudaStreamSynchronize")
    r = rows["cudaStreamSynchronize"]
    assert sync.calls == r["calls"] == 600
    # Expected percentiles worked out by hand from the buckets. A step's sync waits for the GPU (98 ms into the
    # step) from the end of its host work: 77.5 ms in the 400 quiet steps, 17.5 ms in the 200 steps of 20..40 s
    # whose Python work the hog stretched by 60 ms. 16 buckets per power of two: 17.5 ms lies in the first of
    # [2^24, 2^25) (width 2^20), 77.5 ms in the third of [2^26, 2^27) (width 2^22).
    assert _hist(r) == [(16_777_216, 17_825_792, 200), (75_497_472, 79_691_776, 400)]
    # p50: rank 0.5 x 600 = 300 lies 100 calls into the upper bucket's 400: 75,497,472 + 4,194,304 x 100/400
    assert sync.p50_us == 76_546.0  # 76,546,048 ns
    # p95 and p99: ranks 570 and 594 lie 370/400 and 394/400 into it, 79,377,203 and 79,628,861 ns: past the
    # slowest call measured, so clamped to it
    assert sync.p95_us == sync.p99_us == 77_500.0
    assert sync.max_us == pytest.approx(r["max_ns"] / 1e3, abs=0.1)
    # tail_ratio is rounded to 0.1 from the unrounded percentiles: within half that step of their ratio
    assert sync.tail_ratio == pytest.approx(sync.p99_us / sync.p50_us, abs=0.05)
    # true quantiles from the rows are within a bucket width (3.1 %)
    durs = sorted(x["dur_ns"] for x in b.cuda_calls if x["op"] == "cudaStreamSynchronize")
    assert sync.p50_us * 1e3 == pytest.approx(durs[300], rel=0.04)
    layers = {o.op: o.layer for o in st.ops}
    assert layers["cuLaunchKernel"] == "driver" and layers["cudaLaunchKernel"] == "runtime"
    # the part each op's time goes to comes from the catalog
    assert {o.op: o.part for o in st.ops} == {
        "cudaStreamSynchronize": "sync",
        "cudaLaunchKernel": "launch",
        "cuLaunchKernel": "launch",
        "cudaMemcpyAsync": "copy",
    }
    # launches: every call counted in op_stats, only 2 of 5 stored
    launch = next(o for o in st.ops if o.op == "cudaLaunchKernel")
    assert launch.calls == 3000 and st.events_traced == len(b.cuda_calls) + len(b.unstored)
    assert st.events_stored == len(b.cuda_calls)


def test_synchronous_copy_is_a_sync(tmp_path):
    build("sync_stall", tmp_path / "s.duckdb")
    with open_trace(tmp_path / "s.duckdb") as c:
        parts = {o.op: o.part for o in trace_stats(c).ops}
    assert parts["cudaMemcpy"] == "sync" and parts["cuMemcpyDtoH"] == "sync"


def test_processes_host_and_roles(contention):
    b, st = contention
    main = st.processes[0]
    assert (main.pid, main.role, main.comm) == (MAIN_PID, "main", "python3")
    roles = {p.pid: p.role for p in st.processes}
    assert roles[TRACER_PID] == "tracer" and roles[MAIN_PID + 1] == roles[MAIN_PID + 2] == "dataloader_worker"
    mine = [s for s in b.sched if s["pid"] == MAIN_PID]
    assert main.context_switches == len(mine)
    assert main.off_cpu_s == pytest.approx(sum(s["dur_ns"] for s in mine) / 1e9, abs=1e-3)
    assert main.worst_stall_ms == pytest.approx(max(s["dur_ns"] for s in mine) / 1e6, abs=0.01)
    assert main.cuda_calls == len(b.cuda_calls) + len(b.unstored)
    assert st.host.max_load1 == 24.0 and st.host.max_cpu_busy_pct == 100.0
    assert st.chains_by_severity["HIGH"] == 1 and "stress-ng" in st.top_chain


def test_training_thread_and_tracer_cost(contention):
    b, st = contention
    rows = b.breakdown_rows()
    tr = st.training_thread
    assert (tr.pid, tr.tid, tr.basis) == (MAIN_PID, MAIN_PID, "exact")
    assert tr.wall_ms == pytest.approx(parts_total(rows, MAIN_PID, "wall") / 1e6, abs=1e-3)
    by = {p.part: p for p in tr.parts}
    assert by["runq_other"].ms == pytest.approx(parts_total(rows, MAIN_PID, "runq_other") / 1e6, abs=1e-3)
    assert [p.ms for p in tr.parts] == sorted((p.ms for p in tr.parts), reverse=True)
    assert all(p.ms > 0 for p in tr.parts)
    want = sum(h["tracer_cpu_ms"] for h in b.host_samples)
    assert st.tracer.sampled_cpu_ms == pytest.approx(want, abs=0.1)
    assert st.tracer.cpu_ms == pytest.approx(want + 250, abs=0.1)  # session.recorder_cpu_s (builder: + 0.25 s)
    assert st.tracer.summary.startswith(f"the tracer used {want + 250:,.0f} ms of CPU on this host")


def test_the_overview_says_the_whole_wait_for_a_cpu(contention):
    # the hog also held the CPU at the end of syncs: that wait is in "sync", and the overview adds it to the runq
    # parts in one figure (issue 28: 0.3% shown waiting for a CPU, the rest inside "sync")
    b, st = contention
    rows = b.breakdown_rows()
    runq = sum(parts_total(rows, MAIN_PID, f"runq_{c}") for c in ("self", "tree", "other", "tracer"))
    in_calls = sum(r["runq_ns"] for r in b.cuda_calls if r["tid"] == MAIN_PID)
    tr = st.training_thread
    assert in_calls > 0
    assert tr.cpu_wait_share == pytest.approx((runq + in_calls) / parts_total(rows, MAIN_PID, "wall"), abs=1e-4)


def test_main_pid_is_never_the_tracer(tmp_path):
    from tracedb import TraceBuilder

    b = TraceBuilder(target="python train.py")
    b.process(TRACER_PID, "tracer", ppid=1, role="tracer")
    b.process(MAIN_PID, "python3", ppid=TRACER_PID, first_ns=5)  # launched by the recorder
    b.process(MAIN_PID + 1, "pt_data_worker", ppid=MAIN_PID, first_ns=10)
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        assert main_pid(c) == MAIN_PID


def test_pid_filter_and_sampled(tmp_path):
    b = build("healthy", tmp_path / "h.duckdb")
    b.sampled_fraction = 0.5
    b.write(tmp_path / "s.duckdb")
    with open_trace(tmp_path / "s.duckdb") as c:
        st = trace_stats(c, pid=MAIN_PID + 1)
        assert [p.pid for p in st.processes] == [MAIN_PID + 1] and st.ops == [] and st.training_thread is None
        st = trace_stats(c)
        assert all(o.sampled_fraction < 1 for o in st.ops)
    assert st.environment.gpus == "NVIDIA A10" and st.environment.duration_s == 60.0


@pytest.mark.parametrize(
    "status,pid,needle",
    [
        ("complete", None, None),
        ("snapshot", None, "snapshot"),
        ("recording", 2**22 + 12345, "last flush"),  # a recorder pid that is not alive: the recording was cut off
    ],
)
def test_stats_say_whether_the_recording_finished(tmp_path, status, pid, needle):
    import duckdb

    p = tmp_path / "t.duckdb"
    build("healthy", p)
    with duckdb.connect(str(p)) as c:
        c.execute(
            "UPDATE session SET status = ?, recorder_pid = ?, recorder_start_ticks = 1, flushed_ns = 7000000000",
            [status, pid],
        )
    with open_trace(p) as c:
        st = trace_stats(c)
    assert st.recording.status == status
    assert st.recording.finished is (needle is None)
    if needle:
        assert needle in st.recording.ended and not st.recording.live
