"""chains.launch_bound: the host is the limit (on CPU issuing work, syncs that find the GPU idle)."""

from __future__ import annotations

from tracedb import MAIN_PID, builder

from tracer.analysis.chains import compute_chains
from tracer.analysis.db import open_trace


def launch_bound(tmp_path, name):
    builder(name).write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        return [x for x in compute_chains(c, limit=100).chains if x.category == "launch_bound"]


def test_tiny_kernels_and_python_between_them(tmp_path):
    (ch,) = launch_bound(tmp_path, "launch_bound")
    ev = ch.evidence
    assert ev.launches == 10_000 and ev.launches_per_s == pytest_approx(1000, 1)
    assert ev.sync_p50_us < 20 and ev.host_share > 0.99 and ch.severity == "HIGH"
    assert (ch.culprit.tid, ch.culprit.code_site) == (MAIN_PID, "train.py:84 train_step")
    assert "CUDA graph" in ch.recommendations[0] and "train.py:84" in ch.recommendations[0]


def test_not_when_the_thread_waits_for_the_gpu_or_for_batches(tmp_path):
    for name in ("healthy", "gpu_bound", "dataloader_starvation", "sync_stall"):
        assert launch_bound(tmp_path, name) == [], name


def pytest_approx(v: float, tol: float):
    import pytest

    return pytest.approx(v, abs=tol)
