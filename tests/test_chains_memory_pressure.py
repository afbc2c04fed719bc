"""chains.memory_pressure: a fault storm by a named thread of the job, host memory pressure, OOM kills."""

from __future__ import annotations

import duckdb
import pytest
from tracedb import MAIN_PID, MS, STORM_TID, S, builder, insert_rows

from tracer.analysis.chains import ChainContext, compute_chains
from tracer.analysis.chains.memory_pressure import CATEGORY, _gil_waits_behind
from tracer.analysis.db import open_trace


def memory(tmp_path, b):
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        res = compute_chains(c, limit=100).chains
    return [x for x in res if x.category == CATEGORY], res


def test_fault_storm_names_the_thread(tmp_path):
    b = builder("fault_storm")
    (ch,), all_chains = memory(tmp_path, b)
    ev = ch.evidence
    # the culprit is the thread faulting in memory, a thread with no CUDA call, not the training thread
    assert (ev.trigger, ch.culprit.kind, ch.culprit.pid, ch.culprit.tid, ch.culprit.comm) == (
        "fault_storm",
        "thread",
        MAIN_PID,
        STORM_TID,
        "cache_fill",
    )
    storm = ev.storm_threads[0]
    mine = [m for m in b.memory if m["tid"] == STORM_TID]
    assert storm.page_alloc_bytes == sum(m["page_alloc_bytes"] for m in mine) and storm.faults == sum(
        m["faults"] for m in mine
    )
    assert storm.page_alloc_bytes_per_s == pytest.approx(storm.page_alloc_bytes / 50, rel=1e-6)
    # what it cost the training thread: 30 ms blocked on the GIL it held and 15 ms waiting for its CPU, per step
    assert (ev.woken_by_culprit_ms, ev.runq_behind_culprit_ms, ev.pressure_seconds) == (12_000.0, 6_000.0, 40)
    assert ev.lock_waits_ms == 12_000.0  # the batch waits (0.5 ms a step, ended by a worker) are not lock waits
    assert ch.severity == "HIGH" and ch.share == pytest.approx(18_000 / 59_998.3, abs=1e-3)
    assert (ch.start_ns, ch.end_ns) == (10 * S, 50 * S) and "1050" in ch.recommendations[0]
    # the CPU it held is its chain's, not a second cpu_contention chain
    assert "cpu_contention" not in {c.category for c in all_chains}


def test_host_pressure(tmp_path):
    (ch,), _ = memory(tmp_path, builder("memory_pressure"))
    ev = ch.evidence
    assert (ev.trigger, ch.culprit.relation, ev.min_mem_available_bytes) == ("host_pressure", "host", 1536 << 20)
    assert ev.max_swap_used_bytes == 3 * (1 << 30) + 19 * 64 * (1 << 20)
    # 70 ms of page-fault I/O in each of 200 steps, above the usual 0.5 ms blocked a step (0.5 % of a second)
    assert ev.io_ms == 14_000.0 and ev.excess_off_cpu_ms == 14_000.0
    assert ch.severity == "HIGH" and (ch.start_ns, ch.end_ns) == (29 * S, 50 * S)


def test_oom_kill_is_high_whatever_the_share(tmp_path):
    b = builder("healthy")
    b.event(30 * S, "oom_kill", MAIN_PID + 2, "pt_data_worker")
    (ch,), _ = memory(tmp_path, b)
    assert (ch.severity, ch.evidence.trigger, ch.evidence.oom_kills) == ("HIGH", "oom_kill", [MAIN_PID + 2])
    assert ch.start_ns == 30 * S and "pt_data_worker (pid 1002)" in ch.summary


def test_a_quiet_host_has_no_memory_chain(tmp_path):
    b = builder("healthy")
    b.faults(10 * S, MAIN_PID + 50, faults=10, page_alloc_bytes=200 << 20)  # one burst: not a storm rate
    b.thread(MAIN_PID, MAIN_PID + 50, "reader", first_ns=5 * S, end_ns=55 * S)
    assert memory(tmp_path, b)[0] == []
    assert MS  # units used above


def test_the_training_thread_faulting_memory_in_itself(tmp_path):
    # GIVEN a loop whose own thread faults in 400 MiB/s in t = 10..30 s, its Python work 30 ms longer a step
    import random

    from tracedb import PYTHON_NS, Step, TraceBuilder, _base

    b = TraceBuilder()
    hot = range(10 * S, 30 * S)

    def shape(st: Step) -> None:
        if st.t0 in hot:
            st.python_ns = PYTHON_NS + 30 * MS

    _base(b, random.Random(12), shape=shape)
    for sec in range(10, 30):
        b.faults(sec * S, MAIN_PID, faults=102_400, page_alloc_bytes=400 << 20)
    (ch,), _ = memory(tmp_path, b)
    # THEN the culprit is the training thread itself, and the cost its CPU above its usual rate in those seconds
    assert (ch.culprit.tid, ch.evidence.trigger, ch.evidence.woken_by_culprit_ms) == (MAIN_PID, "fault_storm", 0.0)
    assert ch.evidence.faulting_cpu_ms == pytest.approx(200 * 30, abs=1.0) and ch.severity == "MEDIUM"


def test_lock_waits_ended_by_a_timer_count(tmp_path):
    # GIVEN the fault storm, but every other GIL wait of the training thread ends by its 5 ms timeout (a timer
    # interrupt: waker pid 0) instead of the storm thread's hand-over
    b = builder("fault_storm")
    gil = [r for r in b.sched if r.get("waker_tid") == STORM_TID]
    for r in gil[::2]:
        r.update(waker_pid=0, waker_tid=0, waker_comm="swapper/1")
    (ch,), _ = memory(tmp_path, b)
    # THEN the storm thread woke it half as often, and its lock waits are the same: the cost does not move
    assert ch.evidence.woken_by_culprit_ms == 6_000.0 and ch.evidence.lock_waits_ms == 12_000.0
    assert ch.share == pytest.approx(18_000 / 59_998.3, abs=1e-3)


def test_a_file_writes_page_cache_is_not_a_fault_storm(tmp_path):
    # GIVEN the fault storm's thread, except that its pages went to the page cache: a checkpoint's write() (issue 18:
    # 3.7 GiB of a synchronous checkpoint's page cache read as HIGH memory_pressure)
    b = builder("fault_storm")
    b.write(tmp_path / "t.duckdb")
    import duckdb

    with duckdb.connect(str(tmp_path / "t.duckdb")) as con:
        con.execute("UPDATE thread_breakdown SET page_cache_bytes = page_alloc_bytes WHERE tid = ?", [STORM_TID])
    # WHEN chains are computed; THEN no fault storm (its allocations are the file's)
    with open_trace(tmp_path / "t.duckdb") as c:
        chains = compute_chains(c, limit=100).chains
    assert not [x for x in chains if x.category == CATEGORY and x.evidence.trigger == "fault_storm"]
    # and with a third of them page cache, the storm is still one, of the other two thirds
    with duckdb.connect(str(tmp_path / "t.duckdb")) as con:
        con.execute("UPDATE thread_breakdown SET page_cache_bytes = page_alloc_bytes // 3 WHERE tid = ?", [STORM_TID])
    with open_trace(tmp_path / "t.duckdb") as c:
        (ch,) = [x for x in compute_chains(c, limit=100).chains if x.category == CATEGORY]
    mine = sum(m["page_alloc_bytes"] for m in b.memory if m["tid"] == STORM_TID)
    assert ch.evidence.trigger == "fault_storm"
    assert ch.evidence.storm_threads[0].page_alloc_bytes == pytest.approx(mine - mine // 3, rel=1e-3)


GIL = [
    ("python", "/w/train.py", "main", "/w/train.py", 76),
    ("native", "python3.11", "PyEval_RestoreThread", None, None),
    ("native", "libc.so.6", "pthread_cond_timedwait", None, None),
]
OTHER_TID = MAIN_PID + 60  # a second busy thread of the process, on CPU all of t = 10..50 s


def test_gil_waits_behind_the_storm_are_its_cost_and_the_gil_chain_is_explained(tmp_path):
    # GIVEN the fault storm, the training thread's GIL waits as its off-CPU stacks show them (300 ms a second in
    # t = 10..50 s, ended by the lock's 5 ms timer), and another thread of the process on CPU beside the storm's
    b = builder("fault_storm")
    b.thread(MAIN_PID, OTHER_TID, "python3", first_ns=10 * S, end_ns=50 * S)
    gil = b.stack(GIL)
    hot = b.stack([("python", "/w/cache.py", "fill_cache", "/w/cache.py", 51)])
    b.write(tmp_path / "t.duckdb")
    with duckdb.connect(str(tmp_path / "t.duckdb")) as con:
        insert_rows(
            con,
            "offcpu_stacks",
            [
                dict(
                    sec=sec,
                    pid=MAIN_PID,
                    tid=MAIN_PID,
                    stack_id=gil,
                    state="S",
                    in_call=False,
                    intervals=60,
                    blocked_ns=300 * MS,
                    waker_pid=0,
                    waker_comm="[timer]",
                )  # fmt: skip
                for sec in range(10, 50)
            ],
        )
        # the storm thread's on-CPU samples, in the kernel at its faulting line (the other thread has none)
        insert_rows(
            con,
            "cpu_samples",
            [
                dict(
                    sec=sec,
                    pid=MAIN_PID,
                    tid=STORM_TID,
                    stack_id=hot,
                    in_call=False,
                    kernel=True,
                    samples=95,
                    cpu_ns=95 * S // 99,
                )
                for sec in range(10, 50)
            ],
        )
        cpu = dict(
            con.execute(
                "SELECT tid, sum(cpu_ns) FROM thread_breakdown WHERE sec BETWEEN 10 AND 49 AND tid IN (?, ?) "
                "GROUP BY tid",
                [STORM_TID, OTHER_TID],
            ).fetchall()
        )
    with open_trace(tmp_path / "t.duckdb") as c:
        ctx = ChainContext.load(c)
        s = next(x for x in ctx.subjects if x.tid == MAIN_PID)
        storm = ctx.times.by_tid(STORM_TID)
        others = [t for t in ctx.threads_of(MAIN_PID) if t.tid != MAIN_PID]
        behind = _gil_waits_behind(ctx, s, [storm], others, set(range(10, 50)))
        weight = ctx.in_steps(s, "blocked")
        chains = compute_chains(c, limit=100).chains
    # THEN the GIL waits behind the storm are its share of the CPU the other threads had, second by second
    share = cpu[STORM_TID] / (cpu[STORM_TID] + cpu[OTHER_TID])
    assert 0.3 < share < 0.7
    assert behind == pytest.approx(sum(300 * MS * weight(sec) for sec in range(10, 50)) * share, rel=1e-3)
    # AND a gil_contention chain naming the storm thread is explained by the storm's chain, which comes first
    mem = next(x for x in chains if x.category == CATEGORY)
    gils = [x for x in chains if x.category == "gil_contention"]
    (g,) = gils
    assert g.culprit.tid == STORM_TID and g.explained_by == mem.id and chains.index(mem) < chains.index(g)
