"""tracer.analysis.breakdown on hand-built DBs: every part, holder, waker and fault count equals what the builder
derived from its rows; the estimate of an older recording equals the exact parts where it can; the tracer's cost
is its own line."""

from __future__ import annotations

import os

import duckdb
import pytest
from tracedb import (
    HOG_PID,
    MAIN_PID,
    MS,
    SCENARIOS,
    STORM_TID,
    TRACER_PID,
    S,
    TraceBuilder,
    add_tracer,
    build,
    builder,
    downgrade_to_v1,
    parts_total,
)

from tracer.analysis.breakdown import MAX_BUCKETS, NO_BREAKDOWN, auto_bucket, time_breakdown
from tracer.analysis.db import open_trace
from tracer.analysis.taxonomy import PART_NAMES


def breakdown_of(path, **kw):
    with open_trace(path) as c:
        return time_breakdown(c, **kw)


@pytest.fixture(scope="module")
def dbs(tmp_path_factory):
    d = tmp_path_factory.mktemp("breakdown")
    return {n: (d / f"{n}.duckdb", build(n, d / f"{n}.duckdb")) for n in SCENARIOS}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_parts_equal_the_builder_and_add_up(dbs, name):
    # GIVEN a hand-built scenario; WHEN its breakdown is computed
    path, b = dbs[name]
    res = breakdown_of(path)
    rows = b.breakdown_rows()
    t = res.threads[0]
    # THEN the training thread comes first, and each part is the builder's exact sum (ms, rounded to 1 µs)
    assert (res.basis, res.note, res.training_tid, t.tid, t.role) == ("exact", "", MAIN_PID, MAIN_PID, "training")
    assert [p.part for p in t.parts] == list(PART_NAMES)
    for p in t.parts:
        assert p.ms == pytest.approx(parts_total(rows, MAIN_PID, p.part) / MS, abs=1e-3), p.part
    assert t.wall_ms == pytest.approx(parts_total(rows, MAIN_PID, "wall") / MS, abs=1e-3)
    # the shares add up to 1 (each rounded to 1e-4) and the seconds cover the thread's whole span
    assert sum(p.share for p in t.parts) == pytest.approx(1.0, abs=len(PART_NAMES) * 5e-5)
    assert t.check.gap_ms == 0 and t.check.parts_mismatch_ms == 0 and t.check.span_ms == t.wall_ms


def test_training_thread_is_the_one_feeding_the_gpu(tmp_path):
    # GIVEN a process with a thread making 20,000 cheap pinned-memory copies and one launching and syncing
    b = TraceBuilder(duration_s=10)
    b.process(MAIN_PID, "python3")
    for i in range(20_000):
        b.call(i * 400_000 + 100_000, 2_000, "cudaMemcpyAsync", tid=MAIN_PID + 7, kind="HtoH")
    for i in range(100):
        t = i * 100 * MS + 1 * MS
        b.call(t, 10_000, "cudaLaunchKernel")
        b.call(t + 20 * MS, 60 * MS, "cudaStreamSynchronize")
    b.write(tmp_path / "t.duckdb")
    res = breakdown_of(tmp_path / "t.duckdb")
    # THEN the training thread is the one with the most launch + sync time, not the one with the most calls
    assert res.training_tid == MAIN_PID
    assert [(t.tid, t.role, t.cuda_calls) for t in res.threads] == [
        (MAIN_PID, "training", 200),
        (MAIN_PID + 7, "cuda", 20_000),
    ]
    # only the first thread gets per-bucket rows; auto buckets: 10 s -> 1 s wide
    assert len(res.threads[0].buckets) == 10 and res.threads[1].buckets == [] and res.bucket_s == 1


def test_buckets(dbs):
    path, b = dbs["fault_storm"]
    res = breakdown_of(path, bucket_s=10)
    bk = res.threads[0].buckets
    assert res.bucket_s == 10 and [x.start_s for x in bk] == [0, 10, 20, 30, 40, 50]
    # t = 10..50 s: 15 ms of every 100 ms step waiting behind its own process, 30 ms blocked on the GIL
    assert [x.share.get("runq_self", 0) for x in bk] == [0, 0.15, 0.15, 0.15, 0.15, 0]
    assert bk[1].ms["runq_self"] == 1500.0 and bk[1].wall_ms == 10_000.0
    assert bk[0].faults == 2_000 and bk[0].page_alloc_bytes == 8 << 20


def test_auto_bucket():
    assert [auto_bucket(s * S) for s in (0, 60, 61, 300, 3600, 10**6)] == [1, 1, 2, 5, 60, 3600]
    assert all(auto_bucket(s * S) * MAX_BUCKETS >= s for s in (59, 119, 1799))


def test_holders_are_per_waiting_thread(dbs):
    path, b = dbs["cpu_contention"]
    t = breakdown_of(path).threads[0]
    hog = [s for s in b.sched if s["preempted_by_pid"] == HOG_PID and s["tid"] == MAIN_PID]
    assert t.holders[0].model_dump() == dict(
        pid=HOG_PID,
        comm="stress-ng",
        holder="other",
        preemptions=len(hog),
        runq_ms=pytest.approx(sum(s["runq_ns"] for s in hog) / MS, abs=1e-3),
    )
    assert [(h.pid, h.holder) for h in t.holders[1:]] == [(MAIN_PID + 1, "tree")] and t.holders_note == ""
    # the hog held the CPU inside syncs too: in-call run-queue time is counted apart from the parts
    assert t.in_call_runq_ms == pytest.approx(sum(r["runq_ns"] for r in b.cuda_calls) / MS, abs=1e-3)


def test_the_wait_for_a_cpu_inside_syncs_is_shown_as_one(dbs):
    # GIVEN the hog holding the CPU in the Python work and at the end of syncs (issue 28: the breakdown showed
    # 0.3% waiting for a CPU, the rest of the wait inside "sync")
    path, b = dbs["cpu_contention"]
    t = breakdown_of(path).threads[0]
    mine = [s for s in b.sched if s["tid"] == MAIN_PID and s["preempted_by_pid"] is not None]
    by = {c: sum(s["runq_ns"] for s in mine if b.holder_class(MAIN_PID, s["preempted_by_pid"]) == c) / MS
          for c in ("other", "tree")}  # fmt: skip
    in_calls = sum(r["runq_ns"] for r in b.cuda_calls) / MS
    # THEN the whole wait is one figure, the part inside calls included, each ms under its holder's class
    w = t.cpu_wait
    assert w.in_calls_ms == pytest.approx(in_calls, abs=1e-3) and in_calls > 0
    assert w.ms == pytest.approx(sum(by.values()), abs=1e-2)
    assert w.by_holder_ms["other"] == pytest.approx(by["other"], abs=1e-2)
    assert w.by_holder_ms["tree"] == pytest.approx(by["tree"], abs=1e-2)
    assert w.share == pytest.approx(w.ms / t.wall_ms, abs=1e-4)


def test_wakers_name_the_workers(dbs):
    path, b = dbs["dataloader_starvation"]
    t = breakdown_of(path).threads[0]
    assert [(w.pid, w.tid, w.comm, w.holder) for w in t.wakers] == [
        (MAIN_PID + 1, MAIN_PID + 1, "pt_data_worker", "tree"),
        (MAIN_PID + 2, MAIN_PID + 2, "pt_data_worker", "tree"),
    ]
    assert [(w.wakeups, w.blocked_ms, w.in_call_ms) for w in t.wakers] == [(300, 12_000.0, 0.0)] * 2


def test_every_thread_of_the_process_with_its_faults(dbs):
    # GIVEN a thread of the training process with no CUDA call faulting in memory
    path, b = dbs["fault_storm"]
    res = breakdown_of(path)
    storm = res.process_threads[0]
    mine = [m for m in b.memory if m["tid"] == STORM_TID]
    # THEN it heads the process's threads, with exact faults, page allocation and reclaim
    assert (storm.tid, storm.comm, storm.cuda_calls) == (STORM_TID, "cache_fill", 0)
    assert storm.faults == sum(m["faults"] for m in mine) and storm.page_alloc_bytes == sum(
        m["page_alloc_bytes"] for m in mine
    )
    assert storm.reclaim_ms == pytest.approx(sum(m["reclaim"] for m in mine) / MS)
    assert [t.tid for t in res.process_threads] == [STORM_TID, MAIN_PID]
    # and asked for by tid, it gets the full view although it made no CUDA call
    one = breakdown_of(path, tid=STORM_TID)
    assert one.pid == MAIN_PID and [(t.tid, t.role) for t in one.threads] == [(STORM_TID, "thread")]
    assert one.threads[0].buckets and one.threads[0].page_alloc_bytes == storm.page_alloc_bytes


def test_pid_filter(dbs):
    path, _ = dbs["healthy"]
    res = breakdown_of(path, pid=MAIN_PID + 1)  # a DataLoader worker: no CUDA call
    assert res.threads == [] and [t.tid for t in res.process_threads] == [MAIN_PID + 1]


def test_tracer_is_a_line_of_its_own(tmp_path):
    # GIVEN the recorder preempting the training thread between calls, 2 ms every second
    b = builder("healthy")
    add_tracer(b)
    for sec in range(60):
        b.off_cpu(sec * S + 3 * MS, 2 * MS, reason="preempted", runq_ns=2 * MS, by_pid=TRACER_PID, by_comm="tracer")
    b.write(tmp_path / "t.duckdb")
    res = breakdown_of(tmp_path / "t.duckdb")
    t = res.threads[0]
    # THEN that wait is its own part and the tracer's cost line counts it, with the recorder's CPU
    assert next(p.ms for p in t.parts if p.part == "runq_tracer") == 120.0
    assert next(h for h in t.holders if h.pid == TRACER_PID).holder == "tracer"
    cpu = sum(h["tracer_cpu_ms"] for h in b.host_samples)
    assert res.tracer.runq_caused_ms == 120.0 and res.tracer.cpu_ms == pytest.approx(cpu + 250)
    assert res.tracer.share_of_host_cpu == pytest.approx((cpu + 250) / (60_000 * 16), abs=1e-4)
    assert "traced threads waited 120.0 ms for a CPU it held" in res.tracer.summary


@pytest.mark.parametrize("name", ["cpu_contention", "memory_pressure", "process_churn"])
def test_estimate_of_an_older_recording(dbs, tmp_path, name):
    # GIVEN the same scenario recorded without the time accounting (new tables empty), and as a v1 file
    path, b = dbs[name]
    exact = {p.part: p.ms for p in breakdown_of(path).threads[0].parts}
    b.accounting = False
    b.write(tmp_path / "empty.duckdb")
    b.write(tmp_path / "v1.duckdb")
    downgrade_to_v1(tmp_path / "v1.duckdb")
    b.accounting = True
    for p in (tmp_path / "empty.duckdb", tmp_path / "v1.duckdb"):
        res = breakdown_of(p)
        t = res.threads[0]
        # THEN it says so, and the parts op_stats and sched_stats hold exactly are the exact ones
        assert res.basis == "estimated" and res.note.startswith(NO_BREAKDOWN) and t.check is None
        est = {x.part: x.ms for x in t.parts}
        for part in ("launch", "sync", "copy", "blocked"):
            assert est[part] == pytest.approx(exact[part], abs=1e-3), part
        runq = ("runq_self", "runq_tree", "runq_other", "runq_tracer")
        assert sum(est[x] for x in runq) == pytest.approx(sum(exact[x] for x in runq), abs=1e-3)
        # its span starts at the first CUDA call (0.2 ms in): that much less time on CPU
        assert est["cpu"] == pytest.approx(exact["cpu"] - 0.2, abs=1e-3)
        assert t.faults == 0 and t.wakers == []
    assert "does not say which thread waited" in breakdown_of(tmp_path / "v1.duckdb").threads[0].holders_note
    assert breakdown_of(tmp_path / "v1.duckdb").tracer.cpu_ms is None


def test_empty_recording(tmp_path):
    TraceBuilder().write(tmp_path / "e.duckdb")
    res = breakdown_of(tmp_path / "e.duckdb")
    assert (res.basis, res.threads, res.training_tid) == ("none", [], None) and NO_BREAKDOWN in res.note
    assert res.tracer.summary == "the tracer used 250 ms of CPU on this host (0.0% of its 16 CPUs over the recording)"


def test_a_second_split_over_two_rows_is_summed(tmp_path):
    # GIVEN a recording whose every second of the training thread is stored as two rows (the recorder writes a
    # second row for a (tid, sec) when a long interval that began in it is closed late)
    path, b = tmp_path / "t.duckdb", builder("cpu_contention")
    b.write(path)
    whole = breakdown_of(path).threads[0]
    with duckdb.connect(str(path)) as c:
        cols = [r[0] for r in c.execute("DESCRIBE thread_breakdown").fetchall()]
        parts = [x for x in cols if x not in ("sec", "pid", "tid")]
        c.execute("CREATE TEMP TABLE t AS SELECT * FROM thread_breakdown")
        c.execute("DELETE FROM thread_breakdown")
        c.execute(f"INSERT INTO thread_breakdown SELECT sec, pid, tid, {', '.join(f'{x} // 2' for x in parts)} FROM t")
        c.execute(
            f"INSERT INTO thread_breakdown SELECT sec, pid, tid, {', '.join(f'{x} - {x} // 2' for x in parts)} FROM t"
        )
    # THEN the thread's parts and seconds are the same as from one row a second
    split = breakdown_of(path).threads[0]
    assert [(p.part, p.ms) for p in split.parts] == [(p.part, p.ms) for p in whole.parts]
    assert split.wall_ms == whole.wall_ms and split.check == whole.check
    assert [r.model_dump() for r in split.buckets] == [r.model_dump() for r in whole.buckets] and whole.buckets


@pytest.mark.parametrize("order", [("swapper/1", "swapper/0"), ("swapper/0", "swapper/1")])
def test_a_holder_seen_under_several_names_gets_one(tmp_path, order):
    # GIVEN the idle task (pid 0, named per CPU) taking the CPU from the thread on two CPUs, in either order
    b = builder("healthy")
    for i, comm in enumerate(order):
        b.off_cpu((2 + i) * S + 3 * MS, 2 * MS, reason="preempted", runq_ns=2 * MS, by_pid=0, by_comm=comm, cpu=i)
    b.write(tmp_path / "t.duckdb")
    (h,) = [h for h in breakdown_of(tmp_path / "t.duckdb").threads[0].holders if h.pid == 0]
    # THEN it has one name, the same whatever order the rows come in (an MCP answer must equal the CLI's)
    assert h.comm == "swapper/0" and h.runq_ms == pytest.approx(4.0)


# -- thread names ---------------------------------------------------------------------------------------------------

METRICS_TID, WORKER_TID, PIN_TID, IDLE_TID = MAIN_PID + 50, MAIN_PID + 51, MAIN_PID + 52, MAIN_PID + 53
TRAIN = ("python", "/w/train.py", "main", "/w/train.py", 76)
HOT = ("python", "/w/metrics.py", "aggregate_metrics", "/w/metrics.py", 15)
TORCH = ("python", "/usr/lib/python3/dist-packages/torch/nn/modules/module.py", "_call_impl", None, 1520)
MEMCPY = ("native", "/lib/x86_64-linux-gnu/libc.so.6", "memcpy", None, None)


def named(tmp_path, samples: bool = True):
    """The healthy loop with threads beside the training thread: one with the interpreter's name, one with the
    name PyTorch gives its main thread, one named by its code (pin_memory), one never sampled; the training
    thread sampled most in native code, then in its own line (under a library frame), then in another."""
    b = builder("healthy")
    for tid, comm in ((METRICS_TID, "python3"), (WORKER_TID, "pt_main_thread"), (PIN_TID, "pin_memory"),
                      (IDLE_TID, "python3.11")):  # fmt: skip
        b.thread(MAIN_PID, tid, comm)
    native, train, hot = b.stack([MEMCPY]), b.stack([TRAIN, TORCH]), b.stack([TRAIN, HOT])
    for sec in range(10, 20):
        b.samples(sec, native, 60)
        b.samples(sec, train, 30, in_call=True)
        b.samples(sec, hot, 20)
        b.samples(sec, hot, 90, tid=METRICS_TID)
        b.samples(sec, train, 5, tid=METRICS_TID)
        b.samples(sec, train, 50, tid=WORKER_TID)
        b.samples(sec, hot, 50, tid=PIN_TID)
    path = b.write(tmp_path / "named.duckdb")
    if not samples:
        with duckdb.connect(str(path)) as c:
            c.execute("DROP TABLE cpu_samples")
    return path


def test_threads_are_named_by_what_they_run(tmp_path):
    # GIVEN threads whose OS names say nothing (python3, pt_main_thread, python3.11, their process's own name)
    res = breakdown_of(named(tmp_path))
    names = {t.tid: t.name for t in res.process_threads}
    # THEN each is named by the Python function it was sampled in most (the training thread: its own line,
    # not the native stack it was sampled in more, nor the library frame under it); a thread that names itself
    # keeps its name; one never sampled is its tid
    assert res.threads[0].name == f"thread {MAIN_PID} (main, train.py:76)" == names[MAIN_PID]
    assert names == {
        MAIN_PID: f"thread {MAIN_PID} (main, train.py:76)",
        METRICS_TID: f"thread {METRICS_TID} (aggregate_metrics, metrics.py:15)",
        WORKER_TID: f"thread {WORKER_TID} (main, train.py:76)",
        PIN_TID: f"pin_memory ({PIN_TID})",
        IDLE_TID: f"thread {IDLE_TID}",
    }
    # and the OS name stays what it is
    assert {t.tid: t.comm for t in res.process_threads}[WORKER_TID] == "pt_main_thread"


def test_without_samples_threads_are_named_by_their_tid(tmp_path):
    res = breakdown_of(named(tmp_path, samples=False))
    assert res.threads[0].name == f"thread {MAIN_PID}"
    assert {t.tid: t.name for t in res.process_threads}[PIN_TID] == f"pin_memory ({PIN_TID})"
    text = rendered(res)
    assert f"thread {MAIN_PID} python3" in text and "(main, train.py" not in text


def rendered(res) -> str:
    from rich.console import Console

    from tracer.views.render.breakdown import render_breakdown

    con = Console(width=220, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    con.print(render_breakdown(res))
    return con.export_text()


def test_breakdown_renders_the_names(tmp_path):
    text = rendered(breakdown_of(named(tmp_path)))
    # the training thread's heading, and each thread of the process with what it ran beside its OS name
    assert f"thread {MAIN_PID} (main, train.py:76)" in text.splitlines()[1]
    for tid, cell in (
        (METRICS_TID, "python3 (aggregate_metrics, metrics.py:15)"),
        (WORKER_TID, "pt_main_thread (main, train.py:76)"),
        (PIN_TID, "pin_memory "),
        (IDLE_TID, "python3.11 "),
    ):
        row = next(line for line in text.splitlines() if line.strip().startswith(str(tid)))
        assert cell in row, row


def test_mcp_breakdown_carries_the_names(tmp_path):
    import anyio
    from mcp import Client

    from mcp_server.server import build_server

    path = named(tmp_path)

    async def go():
        async with Client(build_server(path)) as c:
            return await c.call_tool("get_time_breakdown", {})

    sc = anyio.run(go).structured_content
    assert sc["threads"][0]["name"] == f"thread {MAIN_PID} (main, train.py:76)"
    assert {t["tid"]: t["name"] for t in sc["process_threads"]} == {
        t.tid: t.name for t in breakdown_of(path).process_threads
    }


def test_a_tid_reused_by_another_process_keeps_each_thread_s_own_row(tmp_path):
    # GIVEN a recording where a later process's thread got the training thread's tid (pid_max wraps on a
    # fork-heavy host), with a name and CUDA call count of its own
    from tracer.analysis.breakdown.load import load_thread_times

    path = tmp_path / "t.duckdb"
    builder("cpu_contention").write(path)
    with duckdb.connect(str(path)) as c:
        tid, pid, comm, calls = c.execute(
            "SELECT tid, pid, comm, cuda_calls FROM threads WHERE cuda_calls > 0 ORDER BY cuda_calls DESC LIMIT 1"
        ).fetchone()
        c.execute("CREATE TEMP TABLE t AS SELECT * FROM threads WHERE tid = ? AND pid = ?", [tid, pid])
        c.execute("UPDATE t SET pid = 999, comm = 'reuser', cuda_calls = 0")
        c.execute("INSERT INTO threads SELECT * FROM t")
        c.execute("CREATE TEMP TABLE b AS SELECT * FROM thread_breakdown WHERE tid = ? AND pid = ?", [tid, pid])
        c.execute("UPDATE b SET pid = 999")
        c.execute("INSERT INTO thread_breakdown SELECT * FROM b")
    # WHEN the threads' times are loaded
    with open_trace(path) as c:
        times = load_thread_times(c)
        got = {(t.pid, t.tid): (t.comm, t.cuda_calls) for t in times.threads if t.tid == tid}
    # THEN each (process, thread) has its own name and count
    assert got == {(pid, tid): (comm, calls), (999, tid): ("reuser", 0)}


def test_a_mostly_blocked_thread_is_named_by_where_it_waits(tmp_path):
    # GIVEN a thread blocked 900 ms of every second in recv (fetch_sample's line), sampled on CPU the rest in a
    # decode function (issue 28: a thread blocked in recv 94% of its time was labelled by its CPU function)
    from tests.support.builder import insert_rows

    b = builder("healthy")
    fetch = ("python", "/w/fetch.py", "fetch_sample", "/w/fetch.py", 42)
    decode = ("python", "/w/fetch.py", "decode", "/w/fetch.py", 50)
    b.thread(MAIN_PID, METRICS_TID, "python3")
    recv = b.stack([TRAIN, fetch, ("native", "/lib/x86_64-linux-gnu/libc.so.6", "recv", None, None)])
    cpu = b.stack([TRAIN, decode])
    rows = []
    for sec in range(1, 59):
        b.off_cpu(sec * S, 900 * MS, tid=METRICS_TID, waker_pid=600, waker_comm="storage_proxy")
        b.samples(sec, cpu, 9, tid=METRICS_TID)
        rows.append(dict(sec=sec + 1, pid=MAIN_PID, tid=METRICS_TID, stack_id=recv, state="S", in_call=False,
                         waker_pid=600, waker_comm="storage_proxy", intervals=1, blocked_ns=900 * MS))  # fmt: skip
    path = b.write(tmp_path / "blocked.duckdb")
    with duckdb.connect(str(path)) as c:
        insert_rows(c, "offcpu_stacks", rows)
    names = {t.tid: t.name for t in breakdown_of(path).process_threads}
    # THEN it is named by the call and the line it waits at, not by its CPU function
    assert names[METRICS_TID] == f"thread {METRICS_TID} (blocked in recv: fetch_sample, fetch.py:42)"
    # AND the training thread, on CPU more than blocked, keeps its CPU name
    assert "blocked" not in names[MAIN_PID]
