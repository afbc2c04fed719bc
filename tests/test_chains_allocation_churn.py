"""chains.allocation_churn: allocation and free time from the catalog's classes (async ones included), the
culprit line, empty_cache spotted, the stream-ordered fix offered."""

from __future__ import annotations

import pytest
from tracedb import ALLOC_STACK, MAIN_PID, MS, US, TraceBuilder, builder

from tracer.analysis.chains import compute_chains
from tracer.analysis.chains.allocation_churn import CATEGORY, MIN_CALLS
from tracer.analysis.db import open_trace


def churn(tmp_path, b):
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        return [x for x in compute_chains(c, limit=100).chains if x.category == CATEGORY]


def test_alloc_stress(tmp_path):
    b = builder("allocation_churn")
    (ch,) = churn(tmp_path, b)
    ev = ch.evidence
    allocs = [r for r in b.cuda_calls if r["op"] in ("cudaMalloc", "cudaMallocAsync")]
    frees = [r for r in b.cuda_calls if r["op"] in ("cudaFree", "cudaFreeAsync")]
    assert ev.calls == len(allocs) + len(frees) and ev.async_calls == 1000
    assert ev.alloc_ms == pytest.approx(sum(r["dur_ns"] for r in allocs) / MS, abs=0.1)
    assert ev.free_ms == pytest.approx(sum(r["dur_ns"] for r in frees) / MS, abs=0.1)
    assert ev.bytes == sum(r["bytes"] for r in allocs)
    assert [s.site for s in ev.top_sites] == ["alloc_stress.py:74 allocate_batch", "alloc_stress.py:46 direct_alloc"]
    assert ev.empty_cache_in_free_stacks and any("empty_cache" in r for r in ch.recommendations)
    assert any("cudaMemPoolAttrReleaseThreshold" in r for r in ch.recommendations)
    assert (ch.severity, ch.culprit.code_site) == ("HIGH", "alloc_stress.py:74 allocate_batch")


def test_stream_ordered_allocations_alone_count(tmp_path):
    # GIVEN only cudaMallocAsync / cudaFreeAsync, 30 % of each 10 ms step
    b = TraceBuilder(duration_s=10)
    b.process(MAIN_PID, "python3")
    sid = b.stack(ALLOC_STACK)
    for i in range(1000):
        t = i * 10 * MS
        b.call(t + 1 * MS, 2 * MS, "cudaMallocAsync", bytes=1 << 20, stack_id=sid, stream=7)
        b.call(t + 4 * MS, 10 * US, "cudaLaunchKernel", stream=7)
        b.call(t + 5 * MS, 1 * MS, "cudaFreeAsync", stream=7)
    (ch,) = churn(tmp_path, b)
    assert ch.op == "cudaMallocAsync" and ch.evidence.async_calls == 2000 and ch.severity == "HIGH"


def test_a_few_allocations_at_start_up_are_not_churn(tmp_path):
    b = builder("healthy")
    for i in range(MIN_CALLS - 1):  # in the first step's Python work
        b.call(1 * MS + i * 100 * US, 10 * US, "cudaMalloc", bytes=1 << 20)
    assert churn(tmp_path, b) == []
