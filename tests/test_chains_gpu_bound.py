"""chains.gpu_bound: the GPU is the limit; informational, never above LOW."""

from __future__ import annotations

import pytest

from tests.support.builder import MAIN_PID, MS, US, TraceBuilder
from tests.support.scenarios import GPU_BOUND_PYTHON_NS, GPU_NS, STEP_NS, builder
from tracer.analysis.chains import compute_chains
from tracer.analysis.chains.gpu_bound import SYNC_SHARE_MIN
from tracer.analysis.db import open_trace

# Each STEP_NS (100 ms) step of the gpu_bound scenario (tests/support/scenarios.py, _base): 5 launches from 200 µs
# in, 40 µs apart, then the copy, then 100 µs later GPU_BOUND_PYTHON_NS (8 ms) of host work; the sync starts there
# and waits until the GPU is done at GPU_NS (98 ms) into the step. Every step is alike and the thread lives exactly
# its steps, so its sync share is one step's: (98 - 8.5) / 100 = 0.895.
SYNC_START_NS = 200 * US + 5 * 40 * US + 100 * US + GPU_BOUND_PYTHON_NS
SYNC_SHARE = (GPU_NS - SYNC_START_NS) / STEP_NS


def gpu_bound(tmp_path, b):
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        return [x for x in compute_chains(c, limit=100).chains if x.category == "gpu_bound"]


def test_gpu_bound_loop(tmp_path):
    (ch,) = gpu_bound(tmp_path, builder("gpu_bound"))
    assert ch.severity == "LOW" and ch.evidence.sync_share == pytest.approx(SYNC_SHARE, abs=1e-4)
    assert ch.evidence.sync_share >= SYNC_SHARE_MIN
    assert ch.evidence.syncs == 60 * 1_000_000_000 // STEP_NS and ch.op == "cudaStreamSynchronize"  # one a step


def test_never_above_low_even_at_99_percent(tmp_path):
    b = TraceBuilder(duration_s=10)
    b.process(MAIN_PID, "python3")
    for i in range(100):
        b.call(i * 100 * MS, 5 * US, "cudaLaunchKernel")
        b.call(i * 100 * MS + 10 * US, 99_900 * US, "cudaDeviceSynchronize", off_cpu_ns=99_800 * US)
    (ch,) = gpu_bound(tmp_path, b)
    assert ch.severity == "LOW" and ch.share > 0.99


def test_not_below_half(tmp_path):
    assert gpu_bound(tmp_path, builder("sync_stall")) == []  # 50 % waiting, a hair under: the stall is the story


def test_not_when_the_waits_for_the_gpu_were_waits_for_a_cpu(tmp_path):
    # GIVEN the same loop, its syncs runnable for 94% of their time (the GPU done, a hog holding the CPU: issue 28)
    b = TraceBuilder(duration_s=10)
    b.process(MAIN_PID, "python3")
    for i in range(100):
        b.call(i * 100 * MS, 5 * US, "cudaLaunchKernel")
        b.call(i * 100 * MS + 10 * US, 99_900 * US, "cudaDeviceSynchronize", off_cpu_ns=99_800 * US,
               runq_ns=94_000 * US)  # fmt: skip
    # THEN the GPU is not called the limit: nothing says "nothing to fix on the host"
    assert gpu_bound(tmp_path, b) == []
    with open_trace(tmp_path / "t.duckdb") as c:
        cv = compute_chains(c, limit=100).coverage
    sync = next(p for p in cv.parts if p.part == "sync")
    assert "root:gpu" not in sync.explained_by and sync.root == "cpu_capacity"


def test_syncs_waiting_for_a_cpu_are_not_the_gpu(tmp_path):
    # GIVEN 60 ms syncs of which 40 ms is waiting for a CPU after the GPU was done (call_runq): the GPU work is
    # 20 % of each step, the thread's waits for a CPU 40 % (issue 28: a confined job drew "the GPU is the limit")
    b = TraceBuilder(duration_s=10)
    b.process(MAIN_PID, "python3")
    for i in range(100):
        b.call(i * 100 * MS, 5 * US, "cudaLaunchKernel")
        b.call(i * 100 * MS + 10 * US, 60 * MS, "cudaStreamSynchronize", off_cpu_ns=59 * MS, runq_ns=40 * MS)
    # THEN no gpu_bound chain: 20 % waiting for the GPU is under SYNC_SHARE_MIN
    assert gpu_bound(tmp_path, b) == []
