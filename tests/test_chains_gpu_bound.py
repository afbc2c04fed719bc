"""chains.gpu_bound: the GPU is the limit; informational, never above LOW."""

from __future__ import annotations

import pytest
from tracedb import MAIN_PID, MS, US, TraceBuilder, builder

from tracer.analysis.chains import compute_chains
from tracer.analysis.chains.gpu_bound import SYNC_SHARE_MIN
from tracer.db import open_trace


def gpu_bound(tmp_path, b):
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        return [x for x in compute_chains(c, limit=100).chains if x.category == "gpu_bound"]


def test_gpu_bound_loop(tmp_path):
    (ch,) = gpu_bound(tmp_path, builder("gpu_bound"))
    assert ch.severity == "LOW" and ch.evidence.sync_share == pytest.approx(0.895, abs=1e-3)
    assert ch.evidence.sync_share >= SYNC_SHARE_MIN
    assert ch.evidence.syncs == 600 and ch.op == "cudaStreamSynchronize"


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
