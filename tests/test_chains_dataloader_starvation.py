"""chains.dataloader_starvation: blocked time ended by a data worker's wakeup, the workers' own load deciding
the fix."""

from __future__ import annotations

import pytest
from tracedb import HOG_PID, MAIN_PID, MS, S, builder

from tracer.analysis.chains import compute_chains
from tracer.analysis.db import open_trace


def starvation(tmp_path, b):
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        return [x for x in compute_chains(c, limit=100).chains if x.category == "dataloader_starvation"]


def in_steps(b, rows) -> float:
    """Blocked ns of ``rows`` (sched rows) in the thread's steps (from its first launch to the end of its last
    sync), exactly."""
    a, z = steps(b)
    return sum(max(min(r["ts_ns"] + r["dur_ns"] - r["runq_ns"], z) - max(r["ts_ns"], a), 0) for r in rows)


def about_in_steps(b, rows) -> pytest.approx:
    """:func:`in_steps` in ms, give or take what no estimate can place: the recording keeps blocked time per second,
    so of the steps' first and last second it can only tell the whole, and errs by at most the larger of the
    rows' blocked time there inside the steps and outside them."""
    a, z = steps(b)
    err = 0
    for x0, x1, y0, y1 in ((a // S * S, a, a, a // S * S + S), (z, (z - 1) // S * S + S, (z - 1) // S * S, z)):
        spans = [(r["ts_ns"], r["ts_ns"] + r["dur_ns"] - r["runq_ns"]) for r in rows]
        outside = sum(max(min(hi, x1) - max(lo, x0), 0) for lo, hi in spans)
        inside = sum(max(min(hi, y1, z) - max(lo, y0, a), 0) for lo, hi in spans)
        err += max(outside, inside)
    return pytest.approx(in_steps(b, rows) / MS, abs=err / MS)


def steps(b) -> tuple[int, int]:
    """The main thread's steps: from its first call to the end of its last."""
    calls = [r for r in b.cuda_calls + b.unstored if r["tid"] == MAIN_PID]
    return min(r["ts_ns"] for r in calls), max(r["ts_ns"] + r["dur_ns"] for r in calls)


def queued_share(b, pids) -> float:
    """The workers' run-queue time behind other processes over their time not blocked, within the main thread's
    steps, each second of a worker pro-rated by the part of it (while the worker lived) inside the steps."""
    calls = [r for r in b.cuda_calls + b.unstored if r["tid"] == MAIN_PID]
    a, z = min(r["ts_ns"] for r in calls), max(r["ts_ns"] + r["dur_ns"] for r in calls)
    spans = b.thread_spans()
    queued = working = 0.0
    for pid in pids:
        for sec in range(a // S, (z - 1) // S + 1):
            lo, hi = max(sec * S, spans[pid]["first_ns"]), min((sec + 1) * S, spans[pid]["end_ns"])
            k = (min(z, hi) - max(a, lo)) / (hi - lo)  # the part of the worker's second inside the steps
            rows = [r for r in b.sched if r["pid"] == pid and r["ts_ns"] // S == sec]
            queued += k * sum(r["runq_ns"] for r in rows if r["preempted_by_pid"] not in pids + (MAIN_PID,))
            working += k * (hi - lo - sum(r["dur_ns"] - r["runq_ns"] for r in rows))
    return queued / working


def test_busy_workers(tmp_path):
    b = builder("dataloader_starvation")
    (ch,) = starvation(tmp_path, b)
    ev = ch.evidence
    waits = {w: [r for r in b.sched if r["waker_pid"] == w] for w in (MAIN_PID + 1, MAIN_PID + 2)}
    assert ev.woken_by_workers_ms == about_in_steps(b, waits[MAIN_PID + 1] + waits[MAIN_PID + 2])
    assert (ev.wakeups, ev.worker_count) == (600, 2)
    assert [(w.pid, w.wakeups_of_main, w.woke_blocked_ms) for w in ev.workers] == [
        (p, 300, about_in_steps(b, rows)) for p, rows in waits.items()
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


def test_workers_queued_behind_another_process_move_the_wait_to_cpu_contention(tmp_path):
    # GIVEN the busy workers, but each waiting 600 ms of every second for a CPU held by another tenant's process
    b = builder("dataloader_starvation")
    for w in (MAIN_PID + 1, MAIN_PID + 2):
        for sec in range(1, int(b.duration_s)):
            b.off_cpu(
                sec * S + 350 * MS, 600 * MS, pid=w, comm="pt_data_worker", reason="preempted", runq_ns=600 * MS,
                by_pid=HOG_PID, by_comm="stress-ng",
            )  # fmt: skip
    waits = [r for r in b.sched if r["pid"] == MAIN_PID and r["waker_pid"] in (MAIN_PID + 1, MAIN_PID + 2)]
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        chains = compute_chains(c, limit=100).chains
    (st,) = [x for x in chains if x.category == "dataloader_starvation"]
    (cc,) = [x for x in chains if x.category == "cpu_contention"]
    # THEN the wait splits in the workers' proportion: about 600 ms queued of every 998 ms they were not blocked
    behind = st.evidence.behind_other_processes_ms
    assert behind + st.evidence.woken_by_workers_ms == about_in_steps(b, waits)
    share = queued_share(b, (MAIN_PID + 1, MAIN_PID + 2))
    assert behind / (behind + st.evidence.woken_by_workers_ms) == pytest.approx(share, rel=1e-3)
    # the starvation keeps the rest; the foreign process is charged the part it caused, and ranks first
    assert st.share == pytest.approx(0.4 * (1 - 600 / 998), abs=0.01) and st.severity == "MEDIUM"
    assert cc.evidence.holder_class == "other" and cc.evidence.via_workers_ms == pytest.approx(behind, abs=0.1)
    assert (cc.culprit.pid, cc.culprit.relation) == (HOG_PID, "other_process") and cc.evidence.holders[0].pid == HOG_PID
    assert cc.share == pytest.approx(0.4 * 600 / 998, abs=0.01) and chains[0] is cc
    assert "waited for a CPU" in st.recommendations[0] and "queued behind it" in cc.summary


def test_workers_queued_behind_the_training_thread_stay_starvation(tmp_path):
    # GIVEN the busy workers waiting for a CPU held by the training process itself (its own job, not a tenant)
    b = builder("dataloader_starvation")
    for w in (MAIN_PID + 1, MAIN_PID + 2):
        for sec in range(1, int(b.duration_s)):
            b.off_cpu(
                sec * S + 350 * MS, 300 * MS, pid=w, comm="pt_data_worker", reason="preempted", runq_ns=300 * MS,
                by_pid=MAIN_PID, by_comm="python3",
            )  # fmt: skip
    (ch,) = starvation(tmp_path, b)
    assert ch.evidence.behind_other_processes_ms == 0.0 and ch.share == pytest.approx(0.4, abs=2e-3)
