"""chains.dataloader_starvation: blocked time ended by a data worker's wakeup, the workers' own load deciding
the fix."""

from __future__ import annotations

import pytest
from tracedb import MAIN_PID, MS, S, builder

from tracer.analysis.chains import compute_chains
from tracer.db import open_trace


def starvation(tmp_path, b):
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        return [x for x in compute_chains(c, limit=100).chains if x.category == "dataloader_starvation"]


def in_steps(b, rows) -> float:
    """Blocked ns of ``rows`` (sched rows) counted in the thread's steps: per second, weighted by the part of
    the second between its first launch and the end of its last sync (per-second data is pro-rated at the edges)."""
    calls = [r for r in b.cuda_calls + b.unstored if r["tid"] == MAIN_PID]
    a, z = min(r["ts_ns"] for r in calls), max(r["ts_ns"] + r["dur_ns"] for r in calls)
    total = 0.0
    for r in rows:
        sec = (r["ts_ns"] + r["dur_ns"]) // S
        total += (r["dur_ns"] - r["runq_ns"]) * max(min(z, (sec + 1) * S) - max(a, sec * S), 0) / S
    return total


def test_busy_workers(tmp_path):
    b = builder("dataloader_starvation")
    (ch,) = starvation(tmp_path, b)
    ev = ch.evidence
    waits = {w: [r for r in b.sched if r["waker_pid"] == w] for w in (MAIN_PID + 1, MAIN_PID + 2)}
    assert ev.woken_by_workers_ms == pytest.approx(in_steps(b, waits[MAIN_PID + 1] + waits[MAIN_PID + 2]) / MS, abs=0.1)
    assert (ev.wakeups, ev.worker_count) == (600, 2)
    assert [(w.pid, w.wakeups_of_main, w.woke_blocked_ms) for w in ev.workers] == [
        (p, 300, pytest.approx(in_steps(b, rows) / MS, abs=0.1)) for p, rows in waits.items()
    ]
    # the workers are on CPU nearly all the time: more of them is the fix, on this 16-CPU host
    assert ev.workers_cpu_share > 0.99 and "raise num_workers to 4" in ch.recommendations[0]
    assert ch.severity == "HIGH" and ch.share == pytest.approx(0.4, abs=2e-3)
    assert (ch.culprit.kind, ch.culprit.pid, ch.culprit.relation) == ("workers", MAIN_PID + 1, "own_workers")


def test_idle_workers_point_at_the_hand_off(tmp_path):
    # GIVEN the same waits, but workers that are themselves blocked most of the time (slow storage / IPC)
    b = builder("dataloader_starvation")
    for w in (MAIN_PID + 1, MAIN_PID + 2):
        for sec in range(1, 60):
            b.off_cpu(sec * S + 400 * MS, 500 * MS, pid=w, comm="pt_data_worker", reason="io")
    (ch,) = starvation(tmp_path, b)
    assert ch.evidence.workers_cpu_share < 0.6 and "prefetch_factor" in ch.recommendations[0]


def test_a_short_wait_per_step_is_not_starvation(tmp_path):
    assert starvation(tmp_path, builder("healthy")) == []  # 0.5 ms a step
