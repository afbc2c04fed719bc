"""tracer.analysis.processes: processes grouped by (comm, parent, role, rank) with totals, and the busy threads."""

from __future__ import annotations

import pytest
from tracedb import MAIN_PID, SCENARIOS, S, add_tracer, build, builder

from tracer.analysis.db import open_trace
from tracer.analysis.processes import (
    BUSY_CORE_SHARE,
    TOP_BUSY_THREADS,
    BusyThread,
    group_processes,
    grouped_processes,
    top_busy_threads,
)
from tracer.analysis.recording import load_recording
from tracer.analysis.stats import ProcessStat, process_rows, trace_stats


def proc(pid, comm, role, ppid=1, calls=0, off=0.1, worst=1.0, exit_s=None, code=None, rank=None):
    return ProcessStat(
        pid=pid, ppid=ppid, comm=comm, role=role, rank=rank, cuda_calls=calls, context_switches=10, preemptions=3,
        off_cpu_s=off, runq_s=off / 2, worst_stall_ms=worst, first_s=0.0, exit_s=exit_s, exit_code=code,
    )  # fmt: skip


def test_groups_by_comm_parent_role_and_rank_with_totals():
    # GIVEN a main process, 184 workers it re-forked (one failed), the same name under another parent, two ranks
    procs = (
        [proc(100, "python3", "main", calls=22_825, off=17.2, worst=5831.0, exit_s=25.5, code=0)]
        + [
            proc(200 + i, "pt_data_worker", "dataloader_worker", ppid=100, off=0.25, worst=100.0 + i, exit_s=14.0,
                 code=256 * (i == 7))
            for i in range(184)
        ]
        + [proc(500, "pt_data_worker", "dataloader_worker", ppid=101)]
        + [proc(600 + r, "python3", "rank", ppid=50, rank=r) for r in range(2)]
    )  # fmt: skip
    groups = group_processes(procs)
    # THEN one row per (comm, parent, role, rank), in the order of their first process
    assert [(g.comm, g.ppid, g.rank, g.processes) for g in groups] == [
        ("python3", 1, None, 1),
        ("pt_data_worker", 100, None, 184),
        ("pt_data_worker", 101, None, 1),
        ("python3", 50, 0, 1),
        ("python3", 50, 1, 1),
    ]
    w = groups[1]
    # AND the totals are the members' sums, the worst stall their max, exits and failures counted
    assert w.context_switches == 184 * 10 and w.off_cpu_s == pytest.approx(184 * 0.25)
    assert w.worst_stall_ms == 100.0 + 183 and (w.exited, w.failed) == (184, 1) and w.exit_s is None
    assert (groups[0].exit_s, groups[0].exit_code) == (25.5, 0)


def test_the_children_of_a_group_are_one_group():
    # GIVEN twelve start-up `sh -c` helpers of the main process, each running one `uname`, and a worker that two
    # different mains forked (two jobs side by side)
    procs = (
        [proc(100, "python3", "main"), proc(900, "python3", "main", ppid=2)]
        + [proc(200 + i, "sh", "child", ppid=100, exit_s=1.0, code=0) for i in range(12)]
        + [proc(300 + i, "uname", "child", ppid=200 + i, exit_s=1.0, code=0) for i in range(12)]
        + [proc(400, "worker", "child", ppid=100), proc(401, "worker", "child", ppid=900)]
    )
    # THEN the unames are one row under the first sh, as the sh are one row under main: the parent stands for its
    # group, and the children of different parents stay apart
    assert [(g.comm, g.ppid, g.processes) for g in group_processes(procs)] == [
        ("python3", 1, 1),
        ("python3", 2, 1),
        ("sh", 100, 12),
        ("uname", 200, 12),
        ("worker", 100, 1),
        ("worker", 900, 1),
    ]


def test_the_overview_lists_top_groups_and_busy_threads(tmp_path):
    # GIVEN the process-churn scenario: a main process re-forking 4 workers 6 times
    db = tmp_path / "t.duckdb"
    build("process_churn", db)
    with open_trace(db) as c:
        info = load_recording(c)
        short = trace_stats(c)
        full = trace_stats(c, detail=True)
        cpu = dict(
            ((p, t), ns)
            for p, t, ns in c.execute("SELECT pid, tid, sum(cpu_ns) FROM thread_breakdown GROUP BY pid, tid").fetchall()
        )
    # THEN the workers are one group of 24 and the per-process rows come only with detail
    assert [(g.comm, g.processes) for g in short.process_groups if g.comm == "pt_data_worker"] == [
        ("pt_data_worker", 24)
    ]
    assert short.processes == [] and len(full.processes) == sum(g.processes for g in full.process_groups)
    # AND the threads on CPU for >= 5% of the recording are listed, busiest first: by default the main thread and
    # the busiest others up to the cap, with the count of those left out; with detail every one, none other
    busy = sorted(
        ((ns, t, p) for (p, t), ns in cpu.items() if ns >= BUSY_CORE_SHARE * info.duration_ns),
        key=lambda x: (-x[0], x[1]),
    )
    assert len(busy) > TOP_BUSY_THREADS  # the cap applies here: 24 workers and the main thread are busy
    every = [(p, t) for _, t, p in busy]
    assert [(b.pid, b.tid) for b in full.busy_threads] == every and full.more_busy_threads == 0
    top = [x for x in every if x == (MAIN_PID, MAIN_PID)]
    top += [x for x in every if x != (MAIN_PID, MAIN_PID)][: TOP_BUSY_THREADS - len(top)]
    assert [(b.pid, b.tid) for b in short.busy_threads] == [x for x in every if x in top]
    assert short.more_busy_threads == len(busy) - TOP_BUSY_THREADS
    assert all(b.role == "dataloader_worker" or b.pid == MAIN_PID for b in short.busy_threads)


def _busy(pid: int, tid: int, role: str, core: float) -> BusyThread:
    return BusyThread(
        pid=pid, tid=tid, comm="t", process_comm="python", role=role, core_share=core, cuda_calls=0, headline="cpu"
    )


def test_the_overview_never_drops_a_rank_main_thread_for_another():
    # GIVEN 3 ranks' gloo threads busier than any rank's main thread, rank 2's (the straggler) the least busy of
    # all, and a busy launcher thread
    threads = [_busy(3001 + r, 3101 + r, "rank", 0.99) for r in range(3)]
    threads += [_busy(3000, 3000, "launcher", 0.6)]
    threads += [_busy(3001 + r, 3001 + r, "rank", 0.35 - 0.1 * r) for r in range(3)]
    # WHEN the overview caps them at 5
    shown, more = top_busy_threads(threads, limit=5)
    # THEN every rank's main thread is listed, the busiest others fill the cap, in the busiest-first order
    assert [(b.pid, b.tid) for b in shown] == [(3001, 3101), (3002, 3102), (3001, 3001), (3002, 3002), (3003, 3003)]
    assert more == 2
    # AND with more ranks than the cap, every rank's main thread still is, and nothing else
    shown, more = top_busy_threads(threads, limit=2)
    assert {b.tid for b in shown} == {3001, 3002, 3003} and more == 4
    # AND under the cap nothing is left out
    assert top_busy_threads(threads, limit=10) == (threads, 0)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_groups_summed_in_duckdb_are_the_groups_of_the_rows(tmp_path, name):
    # GIVEN a scenario with, on top of its own processes, the recorder, a shell whose helpers each run a command
    # (parents that stand for their group), failed and living helpers, and a chain of forks deeper than one level
    b = builder(name)
    add_tracer(b)
    b.process(700, "sh", ppid=MAIN_PID, first_ns=S, exit_ns=2 * S, exit_code=0)
    for i in range(30):
        b.process(710 + i, "sh", ppid=700, first_ns=S + i, exit_ns=S + i + 10, exit_code=256 * (i % 7 == 0))
        b.process(750 + i, "git", ppid=710 + i, first_ns=S + i + 1, exit_ns=None if i == 3 else S + i + 5)
    b.process(800, "python3", ppid=750, first_ns=S + 5)
    db = b.write(tmp_path / "t.duckdb")
    # WHEN the overview sums them by group in DuckDB
    with open_trace(db) as c:
        info = load_recording(c)
        fast = grouped_processes(c, info)
        rows = group_processes(process_rows(c, info=info))
    # THEN it has exactly the groups of the process rows, in their order, with the same figures
    assert [g.model_dump(exclude={"off_cpu_s", "runq_s"}) for g in fast] == [
        g.model_dump(exclude={"off_cpu_s", "runq_s"}) for g in rows
    ]
    secs = [x for g in fast for x in (g.off_cpu_s, g.runq_s)]
    assert secs == pytest.approx([x for g in rows for x in (g.off_cpu_s, g.runq_s)], abs=1e-3)
    assert any(g.comm == "git" and g.processes == 30 and g.exited == 29 for g in fast)


def test_workers_killed_as_their_parent_shut_down_did_not_fail(tmp_path):
    # GIVEN a main process that exits at 30 s and three kinds of worker exit (issue 28: workers that exited with
    # their parent showed failed: 2): two terminated (SIGTERM, status 15) 0.1 s before it, as torch's DataLoader
    # ends its workers; one killed (SIGKILL, 9) at 10 s, mid-run (the OOM killer); one exiting with status 1 at
    # the teardown
    b = builder("healthy")
    b.process(MAIN_PID, "python3", exit_ns=30 * S, exit_code=0)
    b.processes = [p for p in b.processes if p["pid"] != MAIN_PID or p["exit_ns"] is not None]
    for i, (code, at) in enumerate([(15, 29.9), (15, 29.9), (9, 10.0), (256, 29.9)]):
        b.process(900 + i, "decode_worker", ppid=MAIN_PID, first_ns=S, exit_ns=int(at * S), exit_code=code)
    db = b.write(tmp_path / "t.duckdb")
    with open_trace(db) as c:
        info = load_recording(c)
        fast = grouped_processes(c, info)
        rows = group_processes(process_rows(c, info=info))
    # WHEN grouped, in DuckDB and from the rows; THEN the four exited, and only the mid-run kill and the exit
    # status 1 failed
    for groups in (fast, rows):
        (w,) = [g for g in groups if g.comm == "decode_worker"]
        assert (w.processes, w.exited, w.failed) == (4, 4, 2)
