"""chains.gil_contention / lock_contention / blocking_io on hand-built recordings: the healthy loop of
tests/support/scenarios.py with off-CPU stacks and samples added to its training thread and to threads beside it.
Each chain's cost is exactly the blocked time of its kind in the thread's steps (the GIL's less the sync waits it
displaced); its culprit is the thread and the line the stacks name; a recording without those tables yields none
of them."""

from __future__ import annotations

import duckdb
import pytest
from tracedb import MAIN_PID, MS, S, builder, insert_rows

from tracer.analysis.chains import compute_chains
from tracer.analysis.db import open_trace

TRAIN = ("python", "/w/train.py", "main", "/w/train.py", 76)
METRICS_TID, LOGGER_TID = MAIN_PID + 50, MAIN_PID + 51
HOT = ("python", "/w/metrics.py", "aggregate_metrics", "/w/metrics.py", 15)
EMIT = ("python", "/w/log.py", "emit", "/w/log.py", 40)


def native(module: str, function: str) -> tuple:
    return ("native", module, function, None, None)


GIL = [TRAIN, native("python3.11", "PyEval_RestoreThread"), native("python3.11", "?"),
       native("libc.so.6", "pthread_cond_timedwait")]  # fmt: skip
LOCK = [TRAIN, native("python3.11", "PyThread_acquire_lock_timed"), native("libc.so.6", "sem_clockwait")]
FSYNC = [TRAIN, native("libc.so.6", "fsync")]
SLEEP_IN_EMIT = [EMIT, native("libc.so.6", "clock_nanosleep")]


def recording(tmp_path, per_sec_ms: dict[str, float], seconds=range(10, 50)):
    """The healthy loop plus, in each of ``seconds``, per_sec_ms[kind] ms of the training thread blocked there."""
    b = builder("healthy")
    b.thread(MAIN_PID, METRICS_TID, "python3")
    b.thread(MAIN_PID, LOGGER_TID, "python3")
    ids = {k: b.stack(v) for k, v in (("gil", GIL), ("lock", LOCK), ("io", FSYNC), ("emit", SLEEP_IN_EMIT))}
    hot = b.stack([HOT])
    path = b.write(tmp_path / "t.duckdb")
    waker = {
        "gil": dict(waker_pid=0, waker_comm="[timer]"),
        "lock": dict(waker_pid=MAIN_PID, waker_tid=LOGGER_TID, waker_comm="python3"),
        "io": dict(waker_pid=0, waker_comm="[block]"),
    }
    rows, samples = [], []
    for sec in seconds:
        for kind, ms in per_sec_ms.items():
            state = "D" if kind == "io" else "S"
            rows.append(dict(sec=sec, pid=MAIN_PID, tid=MAIN_PID, stack_id=ids[kind], state=state, in_call=False,
                             intervals=10, blocked_ns=int(ms * MS), **waker[kind]))  # fmt: skip
        rows.append(dict(sec=sec, pid=MAIN_PID, tid=LOGGER_TID, stack_id=ids["emit"], state="S", in_call=False,
                         waker_pid=0, waker_comm="[timer]", intervals=100, blocked_ns=900 * MS))  # fmt: skip
        samples.append(dict(sec=sec, pid=MAIN_PID, tid=METRICS_TID, stack_id=hot, in_call=False, kernel=False,
                            samples=95, cpu_ns=95 * S // 99))  # fmt: skip
    with duckdb.connect(str(path)) as con:
        insert_rows(con, "offcpu_stacks", rows)
        insert_rows(con, "cpu_samples", samples)
    with open_trace(path) as c:
        return {ch.category: ch for ch in compute_chains(c, limit=100).chains}


def gil_chain(path):
    """The gil_contention chain of the recording at ``path`` (after a test changed its rows)."""
    with open_trace(path) as c:
        return {x.category: x for x in compute_chains(c, limit=100).chains}["gil_contention"]


def test_gil_waits_name_the_thread_on_cpu_and_its_line(tmp_path):
    chains = recording(tmp_path, {"gil": 300})
    ch = chains["gil_contention"]
    assert ch.evidence.gil_wait_ms == pytest.approx(40 * 300, rel=1e-6) and ch.severity == "HIGH"
    # every sync waited as long as an undisturbed one: no GPU work overlapped the waits
    assert ch.evidence.gpu_overlap_ms == 0
    assert ch.share == pytest.approx(12_000 / 59_998.3, abs=2e-3)
    assert (ch.culprit.tid, ch.culprit.code_site) == (METRICS_TID, "/w/metrics.py:15 aggregate_metrics")
    assert ch.culprit.comm == f"thread {METRICS_TID} (aggregate_metrics, metrics.py:15)"
    assert ch.evidence.waited_at[0].site == "/w/train.py:76 main" and ch.evidence.woken_by == {"[timer]": 12_000.0}
    assert "lock_contention" not in chains and "blocking_io" not in chains


def test_gil_waits_while_the_gpu_ran_the_queued_work_are_not_lost(tmp_path):
    # GIVEN the same GIL waits, but in seconds 10-29 the thread's syncs wait 20 ms less than an undisturbed
    # step's 77.5 ms: the GPU ran 20 ms of the step's work while the thread waited for the lock
    recording(tmp_path, {"gil": 300})
    with duckdb.connect(str(tmp_path / "t.duckdb")) as con:
        (shortened,) = con.execute(
            "UPDATE cuda_calls SET dur_ns = dur_ns - 20000000 WHERE tid = ? AND op = 'cudaStreamSynchronize' "
            "AND ts_ns >= 10000000000 AND ts_ns < 30000000000",
            [MAIN_PID],
        ).fetchone()
        # the thread's time outside its waits for the GPU: its own work, its waits for a CPU, every block
        (held_up,) = con.execute(
            "SELECT sum(cpu_ns + launch_ns + alloc_ns + free_ns + copy_ns + other_ns + runq_self_ns + runq_tree_ns "
            "+ runq_other_ns + runq_tracer_ns + blocked_ns) / 1e6 FROM thread_breakdown WHERE tid = ?",
            [MAIN_PID],
        ).fetchone()
    ch = gil_chain(tmp_path / "t.duckdb")
    # THEN the waits are all still counted, and the GIL waits' part of the overlapped 4,000 ms (their share of
    # the time the thread was held up while the GPU ran) is taken out of the cost
    overlap = 200 * 20 * 12_000 / held_up
    assert shortened == 200 and ch.evidence.gil_wait_ms == pytest.approx(12_000, rel=1e-6)
    assert ch.evidence.gpu_overlap_ms == pytest.approx(overlap, rel=1e-3)
    assert ch.share == pytest.approx((12_000 - overlap) / 59_998.3, abs=2e-3)


def test_a_sync_that_waited_for_a_cpu_is_no_longer_gpu_work(tmp_path):
    # GIVEN the GIL waits, and one sync in 8 woken 30 ms late by a busy host (it waited for a CPU: runq_ns)
    recording(tmp_path, {"gil": 300})
    with duckdb.connect(str(tmp_path / "t.duckdb")) as con:
        (late,) = con.execute(
            "UPDATE cuda_calls SET dur_ns = dur_ns + 30000000, runq_ns = coalesce(runq_ns, 0) + 30000000 "
            "WHERE tid = ? AND op = 'cudaStreamSynchronize' AND ts_ns // 1000000 % 8 = 0",
            [MAIN_PID],
        ).fetchone()
    ch = gil_chain(tmp_path / "t.duckdb")
    # THEN an undisturbed step's sync is still the GPU's 77.5 ms, not 107.5: no sync waited less, nothing overlapped
    assert late >= 40 and ch.evidence.gpu_overlap_ms == 0
    assert ch.share == pytest.approx(12_000 / 59_998.3, abs=2e-3)


def test_lock_waits_name_the_releasing_thread_and_where_it_was(tmp_path):
    ch = recording(tmp_path, {"lock": 100})["lock_contention"]
    assert ch.evidence.lock_wait_ms == pytest.approx(4_000, rel=1e-6) and ch.severity == "MEDIUM"
    holder = ch.evidence.holders[0]
    assert (holder.tid, holder.woke_ms, holder.hot_lines[0].site) == (LOGGER_TID, 4_000.0, "/w/log.py:40 emit")
    assert ch.culprit.tid == LOGGER_TID and ch.culprit.comm == f"thread {LOGGER_TID} (emit, log.py:40)"


def test_disk_waits_are_blocking_io_at_the_sync_line(tmp_path):
    ch = recording(tmp_path, {"io": 150})["blocking_io"]
    assert ch.evidence.io_wait_ms == pytest.approx(6_000, rel=1e-6) and ch.evidence.d_state_ms == ch.evidence.io_wait_ms
    assert ch.evidence.sites[0].call == "fsync" and ch.evidence.sites[0].site == "/w/train.py:76 main"


def test_small_waits_and_old_recordings_make_no_chain(tmp_path):
    # 10 ms a second of GIL waits is 1%: under LOW_SHARE, noise
    assert "gil_contention" not in recording(tmp_path, {"gil": 10})
    b = builder("healthy")
    path = b.write(tmp_path / "old.duckdb")
    with duckdb.connect(str(path)) as con:
        con.execute("DROP TABLE offcpu_stacks")
        con.execute("DROP TABLE cpu_samples")
    with open_trace(path) as c:
        cats = {ch.category for ch in compute_chains(c, limit=100).chains}
    assert not cats & {"gil_contention", "lock_contention", "blocking_io", "host_python"}
