"""tracer.analysis.stacks and timeline on hand-built DBs."""

from __future__ import annotations

import pytest
from tracedb import MAIN_PID, S, build

from tracer.analysis.stacks import NO_STACK, UnknownOp, top_stacks
from tracer.analysis.timeline import around, buckets
from tracer.db import open_trace


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
    res = top_stacks(c, "cudaMemcpyAsync")
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
        assert hot.sync_p99_us > 20_000 > 2_000 > cold.sync_p99_us
        assert hot.preemptions > 100 > cold.preemptions and hot.max_load1 == 24.0
        assert hot.calls["sync"] == 100
        slow = next(r for r in b.cuda_calls if r["runq_ns"])
        a = around(c, slow["ts_ns"], window_ms=1)
        kinds = [(e.source, e.what) for e in a.events]
        assert ("cuda", "cudaStreamSynchronize") in kinds and ("sched", "off_cpu:preempted") in kinds
        pre = next(e for e in a.events if e.what == "off_cpu:preempted")
        assert "stress-ng(4242)" in pre.detail and pre.offset_us == 10.0
        assert [e.ts_ns for e in a.events] == sorted(e.ts_ns for e in a.events)
    p2 = tmp_path / "p.duckdb"
    build("process_churn", p2)
    with open_trace(p2) as c:
        a = around(c, 10 * S, window_ms=5)
        assert sum(e.what == "fork" for e in a.events) == 4
