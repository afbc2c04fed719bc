"""tracer.analysis.stacks and timeline on hand-built DBs."""

from __future__ import annotations

import pytest
from tracedb import HOG_PID, MAIN_PID, S, build

from tracer.analysis.db import open_trace
from tracer.analysis.stacks import NO_STACK, UnknownOp, top_stacks
from tracer.analysis.timeline import around, buckets


@pytest.fixture(scope="module")
def alloc(tmp_path_factory):
    p = tmp_path_factory.mktemp("s") / "a.duckdb"
    b = build("allocation_churn", p)
    with open_trace(p) as c:
        yield b, c


def test_stacks_ranked_with_frames(alloc):
    b, c = alloc
    res = top_stacks(c, "cudaMalloc")
    assert res.op_calls_total == 5000 and res.stored_calls == 5000 and res.distinct_stacks == 2
    s = res.stacks[0]
    assert (s.label, s.calls, s.pids) == ("alloc_stress.py:74 allocate_batch", 4900, [MAIN_PID])
    mine = [r for r in b.cuda_calls if r["op"] == "cudaMalloc" and r["stack_id"] == s.stack_id]
    assert s.total_bytes == sum(r["bytes"] for r in mine)
    assert s.max_us == pytest.approx(max(r["dur_ns"] for r in mine) / 1e3, abs=0.1)
    assert [f.kind for f in s.frames] == ["python", "python", "python", "native", "cuda"]
    assert (s.frames[2].file, s.frames[2].line) == ("alloc_stress.py", 74)
    assert top_stacks(c, "cudaMalloc", limit=1).stacks == [s]


def test_no_stack_group_and_unknown(alloc):
    _, c = alloc
    res = top_stacks(c, "cudaFreeAsync")
    assert res.stacks[0].label == NO_STACK and res.stacks[0].frames == [] and res.stacks[0].stack_id is None
    with pytest.raises(UnknownOp) as e:
        top_stacks(c, "cudaMallocc")
    assert "cudaMalloc" in e.value.known
    assert top_stacks(c, "cudaMalloc", pid=4242).stacks == []


def test_buckets_and_around(tmp_path):
    p = tmp_path / "c.duckdb"
    b = build("cpu_contention", p)
    with open_trace(p) as c:
        t = buckets(c, seconds=10)
        assert [x.start_s for x in t.buckets] == [0, 10, 20, 30, 40, 50]
        hot, cold = t.buckets[2], t.buckets[0]
        # in 20..40 s the hog takes the CPU: more preemptions, shorter syncs (the Python work took the time)
        assert hot.preemptions == 100 + 2 and cold.preemptions == 2 and hot.max_load1 == 24.0
        assert hot.sync_p99_us_sampled < 20_000 < cold.sync_p99_us_sampled
        # stored calls per catalog part: 2 of 5 launches (+ their driver twins), one copy and one sync a step
        assert hot.calls == {"launch": 400, "copy": 100, "sync": 100}
        pre = next(r for r in b.sched if r["reason"] == "preempted" and r["preempted_by_pid"] == HOG_PID)
        a = around(c, pre["ts_ns"], window_ms=6)
        kinds = [(e.source, e.what) for e in a.events]
        assert ("cuda", "cudaMemcpyAsync") in kinds and ("sched", "off_cpu:preempted") in kinds
        ev = next(e for e in a.events if e.what == "off_cpu:preempted" and e.ts_ns == pre["ts_ns"])
        assert "stress-ng(4242)" in ev.detail and ev.offset_us == 0.0 and ev.dur_us == 60_000.0
        assert [e.ts_ns for e in a.events] == sorted(e.ts_ns for e in a.events)
    p2 = tmp_path / "p.duckdb"
    build("process_churn", p2)
    with open_trace(p2) as c:
        a = around(c, 10 * S, window_ms=5)
        assert sum(e.what == "fork" for e in a.events) == 4


def test_buckets_count_synchronous_copies_as_syncs(tmp_path):
    # GIVEN loss.item() every step: a cudaMemcpy DtoH (and the driver copy inside it), no *Synchronize call
    p = tmp_path / "s.duckdb"
    b = build("sync_stall", p)
    with open_trace(p) as c:
        first = buckets(c, seconds=10).buckets[0]
    # THEN the timeline counts them as syncs (the catalog's part), with their p99 and bytes nowhere else
    copies = [r for r in b.cuda_calls if r["op"] in ("cudaMemcpy", "cuMemcpyDtoH") and r["ts_ns"] < 10 * S]
    assert first.calls["sync"] == len(copies) == 200 and "copy" not in first.calls
    assert first.sync_max_us == round(max(r["dur_ns"] for r in copies) / 1e3, 1)
