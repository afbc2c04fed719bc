"""tracer.analysis.waitgraph on hand-built recordings: the shared training loop (tests/support/scenarios.py) with a
lock its training thread waits for, held by a thread that is itself blocked reading from a process outside the
job, on CPU, or waiting for its own CPU. Each recording's off-CPU stacks are made from its own sched intervals,
so the breakdown, the wakers and the stacks agree, as the recorder writes them."""

from __future__ import annotations

import duckdb
import pytest
from tracedb import HOG_PID, MAIN_PID, MS, TRACER_PID, S, _base, add_tracer, insert_rows
from tracedb import TraceBuilder as Builder

import tracer.analysis.waitgraph as wg
from tracer.analysis.chains import compute_chains, write_chains
from tracer.analysis.chains.context import ChainContext
from tracer.analysis.db import open_trace
from tracer.analysis.waitgraph import trace, trace_path

HOLDER = MAIN_PID + 60
FEEDER = 7777  # a process outside the traced tree (a storage service, a pipe's writer)
WAIT = ("python", "/w/train.py", "main", "/w/train.py", 50)
READ = ("python", "/w/ckpt.py", "fetch", "/w/ckpt.py", 12)
HOT = ("python", "/w/ckpt.py", "decode", "/w/ckpt.py", 30)


def native(module: str, function: str) -> tuple:
    return ("native", module, function, None, None)


LOCK = [WAIT, native("python3.11", "PyThread_acquire_lock_timed"), native("libc.so.6", "sem_clockwait")]
PIPE_READ = [READ, native("libc.so.6", "read")]


def offcpu_rows(b: Builder, stack_of) -> list[dict]:
    """offcpu_stacks from the builder's blocked intervals, as the recorder counts them: per (second of the
    wakeup, thread, stack, state, in call, waker), the blocked part of each interval."""
    acc: dict[tuple, list[int]] = {}
    for r in b.sched_rows():
        if r["reason"] == "preempted":
            continue
        woke = r["ts_ns"] + r["dur_ns"] - r["runq_ns"]
        k = (woke // S, r["pid"], r["tid"], stack_of(r), "D" if r["reason"] == "io" else "S", r["in_call"],
             r["waker_pid"], r["waker_tid"], r["waker_comm"])  # fmt: skip
        a = acc.setdefault(k, [0, 0])
        a[0] += 1
        a[1] += woke - r["ts_ns"]
    cols = ("sec", "pid", "tid", "stack_id", "state", "in_call", "waker_pid", "waker_tid", "waker_comm")
    return [dict(zip(cols, k, strict=True), intervals=n, blocked_ns=ns) for k, (n, ns) in acc.items()]


def recording(
    tmp_path,
    holder: str = "reads",
    lock_ms: int = 12,
    cycle: bool = False,
    by_tracer: bool = False,
    half_cycle: bool = False,
):
    """The loop, each step's host work holding ``lock_ms`` of a lock wait ended by HOLDER; HOLDER ``reads`` (blocked
    90 ms of each 100 reading from FEEDER), is ``on_cpu`` (its samples at decode), or ``runq`` (waits for a CPU
    held by a hog). ``cycle``: HOLDER's reads are ended by the training thread instead; ``half_cycle``: every other
    one. ``by_tracer``: the tracer's process ends the lock waits instead of HOLDER."""
    b = Builder(duration_s=20.0)
    waker = dict(waker_pid=MAIN_PID, waker_tid=HOLDER, waker_comm="python3")
    if by_tracer:
        add_tracer(b)
        waker = dict(waker_pid=TRACER_PID, waker_tid=TRACER_PID, waker_comm="tracer")
    b.thread(MAIN_PID, HOLDER, "python3")
    lock, read, hot = b.stack(LOCK), b.stack(PIPE_READ), b.stack([HOT])

    def gap(st, a, _end):
        b.off_cpu(a + 2 * MS, lock_ms * MS, **waker)

    _base(b, __import__("random").Random(5), python_gap=gap)
    for i in range(200):
        t0 = i * 100 * MS
        if holder == "reads":
            by_main = cycle or (half_cycle and i % 2 == 0)
            w = (
                dict(waker_pid=MAIN_PID, waker_tid=MAIN_PID)
                if by_main
                else dict(waker_pid=FEEDER, waker_comm="storage")
            )
            b.off_cpu(t0 + 5 * MS, 90 * MS, pid=MAIN_PID, tid=HOLDER, **w)
        elif holder == "runq":
            b.off_cpu(t0 + 5 * MS, 90 * MS, pid=MAIN_PID, tid=HOLDER, reason="preempted", runq_ns=90 * MS,
                      by_pid=HOG_PID, by_comm="stress-ng")  # fmt: skip
    path = b.write(tmp_path / "t.duckdb")
    rows = offcpu_rows(b, lambda r: read if r["tid"] == HOLDER else lock if r["waker_tid"] == HOLDER else None)
    samples = [dict(sec=sec, pid=MAIN_PID, tid=HOLDER, stack_id=hot, in_call=False, kernel=False, samples=95,
                    cpu_ns=95 * S // 99) for sec in range(20)] if holder == "on_cpu" else []  # fmt: skip
    with duckdb.connect(str(path)) as con:
        insert_rows(con, "offcpu_stacks", rows)
        insert_rows(con, "cpu_samples", samples)
    return path


def traced(path, parts, kinds=None):
    with open_trace(path) as c:
        ctx = ChainContext.load(c)
        return trace_path(ctx, ctx.training, parts, kinds)


def test_a_lock_held_over_a_read_from_outside_the_job_is_an_external_wait_two_hops_away(tmp_path):
    # GIVEN the training thread blocked 12 ms of each step on a lock, and 0.5 ms on its batch; the lock's holder
    # blocked 90 ms of every 100 in a read that a process outside the job ends
    path, root = traced(recording(tmp_path), "blocked")
    # THEN the path goes training thread -> holder (woken_by) -> an external wait at the holder's read line
    assert [(h.tid, h.edge) for h in path] == [(MAIN_PID, "start"), (HOLDER, "woken_by")]
    assert path[0].site == "/w/train.py:50 main" and path[0].role == "training" and path[0].share == 1.0
    # the lock waits are 12 of the 12.5 ms blocked a step
    assert path[1].share == pytest.approx(12 / 12.5, abs=0.01) and path[1].role == "job_thread"
    assert path[1].state == "blocked" and path[1].site == "/w/ckpt.py:12 fetch"
    assert root.kind == "external_wait" and root.site == "/w/ckpt.py:12 fetch"
    assert (
        root.detail
        == f"python3 ({HOLDER}) waited in read at /w/ckpt.py:12 fetch for storage (pid 7777), a process outside the job"
    )
    assert root.stack[:2] == ["read", "/w/ckpt.py:12 fetch"]


def test_the_root_found_share_counts_what_reached_a_root(tmp_path):
    # the lock waits (12 of 12.5 ms) reach a root: the holder's reads (an external wait) and its time on CPU
    # meanwhile (its lines); the batch waits (0.5 ms) too, though the path shows the lock's: every waker is
    # followed for the share, the workers on CPU
    p = recording(tmp_path)
    with open_trace(p) as c:
        ctx = ChainContext.load(c)
        t = trace(ctx, ctx.training, "blocked")
    assert t.found == pytest.approx(1.0, abs=0.01) and t.ns == ctx.training.time.ns("blocked")
    # a budget of one thread: the lock's holder alone is visited, the workers' 0.5 ms are not found
    with open_trace(p) as c:
        ctx = ChainContext.load(c)
        before, wg.REACH_NODES = wg.REACH_NODES, 1
        try:
            assert trace(ctx, ctx.training, "blocked").found == pytest.approx(12 / 12.5, abs=0.01)
        finally:
            wg.REACH_NODES = before


def test_waits_the_tracer_ended_are_its_cost_not_the_jobs_lost_time(tmp_path):
    # GIVEN the 12 ms waits of each step ended by the tracer's own process (the recorder releasing the job)
    with open_trace(recording(tmp_path, by_tracer=True)) as c:
        ctx = ChainContext.load(c)
        t = trace(ctx, ctx.training, "blocked")
        cv = compute_chains(c, limit=100).coverage
    # THEN they are the tracer's share of the blocked time, and the lost time the root-found share is of leaves
    # them out, as it does the tracer's CPU: the rest (the workers' 0.5 ms) has its root found
    assert t.tracer == pytest.approx(12 / 12.5, abs=0.01) and t.found == pytest.approx(0.5 / 12.5, abs=0.01)
    assert cv.root_found_share >= 0.99, cv


def test_a_holder_on_cpu_is_the_root_with_its_sampled_line(tmp_path):
    path, root = traced(recording(tmp_path, holder="on_cpu"), "blocked")
    assert [h.tid for h in path] == [MAIN_PID, HOLDER] and path[1].state == "on_cpu"
    assert root.kind == "on_cpu" and root.site == "/w/ckpt.py:30 decode" and path[1].site == root.site


def test_a_holder_waiting_for_a_cpu_ends_at_cpu_capacity(tmp_path):
    path, root = traced(recording(tmp_path, holder="runq"), "blocked")
    assert path[1].state == "runq" and root.kind == "cpu_capacity"


def test_a_wakers_waits_that_the_waiter_ended_alternate_with_the_waiters(tmp_path):
    # GIVEN the holder's reads ended by the training thread itself: A waits on B and B on A, which cannot be at the
    # same time (short of a deadlock): the training thread was running to wake it. So those waits are not where
    # the lock waits went (a persistent DataLoader worker idles until the next batch is asked for): what is left
    # of the holder's seconds, its time on CPU, is the root; and the walk does not loop
    with open_trace(recording(tmp_path, cycle=True)) as c:
        ctx = ChainContext.load(c)
        t = trace(ctx, ctx.training, "blocked")
    assert [h.tid for h in t.path] == [MAIN_PID, HOLDER] and t.path[1].state == "on_cpu"
    assert t.root.kind == "on_cpu" and t.found == pytest.approx(1.0, abs=0.01)


def test_a_wakers_other_waits_take_the_time_its_waits_on_the_waiter_leave(tmp_path):
    # GIVEN the holder's reads ended by the training thread every other step, by the storage service otherwise
    with open_trace(recording(tmp_path, half_cycle=True)) as c:
        ctx = ChainContext.load(c)
        t = trace(ctx, ctx.training, "blocked")
    # THEN the waits on the training thread leave the holder's mix (as above), and the holder's blocked time that
    # is left is its waits for the service: an external wait, all of it found. Given to the training thread's
    # waits too, that part reached a cycle and was counted as not found (a starved torch loop's workers under two
    # loads: root found 0.90)
    assert t.root.kind == "external_wait" and t.found == pytest.approx(1.0, abs=0.01), (t.root, t.found)


def test_waits_of_one_kind_follow_only_those(tmp_path):
    # GIVEN no lock waits: the training thread's blocked time is its batch waits, ended by two data workers in turn
    p = recording(tmp_path, lock_ms=0)
    path, root = traced(p, "blocked")
    # the hop stands for both workers: they deliver the batches in turn, each ending half of the waits
    assert path[1].role == "worker" and path[1].share == pytest.approx(1.0, abs=0.01) and path[1].tid is None
    # THEN a chain about lock waits finds none to follow: no root, rather than the batch waits' root
    path, root = traced(p, "blocked", {"lock"})
    assert [h.edge for h in path] == ["start"] and root is None


def test_sync_waits_end_at_the_gpu_and_runq_at_cpu_capacity(tmp_path):
    path, root = traced(recording(tmp_path), ("sync", "copy"))
    assert [h.edge for h in path] == ["start", "gpu"] and root.kind == "gpu"
    assert path[1].share == pytest.approx(1.0, abs=0.01)


def test_a_sync_spent_waiting_for_a_cpu_ends_at_cpu_capacity(tmp_path):
    p = recording(tmp_path)
    with duckdb.connect(str(p)) as con:
        con.execute("UPDATE cuda_calls SET runq_ns = dur_ns * 9 // 10 WHERE op = 'cudaStreamSynchronize'")
    path, root = traced(p, "sync")
    assert root.kind == "cpu_capacity" and "90% runnable" in root.detail and path[0].state == "runq"


def test_every_chain_carries_its_path_and_the_lock_chain_ends_at_the_read(tmp_path):
    with open_trace(recording(tmp_path)) as c:
        res = compute_chains(c, limit=100)
    ch = next(x for x in res.chains if x.category == "lock_contention")
    assert ch.severity in ("HIGH", "MEDIUM")
    assert [(h.tid, h.edge) for h in ch.path] == [(MAIN_PID, "start"), (HOLDER, "woken_by")]
    assert ch.root.kind == "external_wait" and ch.root.site == "/w/ckpt.py:12 fetch"
    # its path starts at the lock waits alone: 12 of the 12.5 ms the thread is blocked a step
    assert ch.path[0].share == pytest.approx(12 / 12.5, abs=0.01)
    assert all(x.path and x.root for x in res.chains if x.tid == MAIN_PID)
    # and a chain about the waits for the GPU follows those, not the host work they serialize
    assert all(x.root.kind == "gpu" for x in res.chains if x.category in ("gpu_bound", "sync_stall")), res.chains


def test_write_chains_stores_the_path_and_root_in_the_evidence(tmp_path):
    p = recording(tmp_path)
    with open_trace(p) as c:
        chains = compute_chains(c, limit=100).chains
    with duckdb.connect(str(p)) as con:
        write_chains(con, chains)
        kind, hops = con.execute(
            "SELECT evidence->'root'->>'kind', json_array_length(evidence->'path') FROM causal_chains "
            "WHERE category = 'lock_contention'"
        ).fetchone()
    assert (kind, hops) == ("external_wait", 2)


def test_a_fork_carries_its_competing_branches_with_their_shares(tmp_path):
    # GIVEN 4 ms of lock waits a step ended by HOLDER and 0.5 ms of batch waits ended by the two workers in turn
    # (issue 28: a path showed one branch when several competed)
    with open_trace(recording(tmp_path, lock_ms=4)) as c:
        ctx = ChainContext.load(c)
        t = trace(ctx, ctx.training, "blocked")
    # THEN the path follows the lock (4 of 4.5 ms) and the workers are the other branch, as one, with theirs
    assert t.path[1].tid == HOLDER and t.path[1].share == pytest.approx(4 / 4.5, abs=0.01)
    (w,) = t.branches
    assert (w.role, w.edge, w.tid) == ("worker", "woken_by", None) and w.share == pytest.approx(0.5 / 4.5, abs=0.01)
    # as `tracer chains` shows them: one line under the first hop
    from tracer.views.render.chains import path_lines

    lines = [str(x) for x in path_lines(t.path, t.root, t.branches)]
    assert len(lines) == 4 and lines[2].strip().startswith("(also --woken_by 11%--> pt_data_worker")


def test_a_sync_mostly_waiting_for_a_cpu_keeps_the_gpu_as_a_branch(tmp_path):
    p = recording(tmp_path)
    with duckdb.connect(str(p)) as con:
        con.execute("UPDATE cuda_calls SET runq_ns = dur_ns * 8 // 10 WHERE op = 'cudaStreamSynchronize'")
    with open_trace(p) as c:
        ctx = ChainContext.load(c)
        t = trace(ctx, ctx.training, "sync")
    assert t.root.kind == "cpu_capacity"
    assert [(b.role, b.edge) for b in t.branches] == [("gpu", "gpu")]
    assert t.branches[0].share == pytest.approx(0.2, abs=0.01)
