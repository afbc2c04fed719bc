"""tracer.analysis.side_by_side (compare_processes / tracer compare-processes): processes or threads, one column
each, one row per measure.

Ground truth: two copies of tests/support/checkpoint.py's loop, pid 1000 checkpointing every 40 steps (10 slow
steps, each 54 ms longer, 50 ms of it blocked) and pid 2000 never; fault_storm's process has the training thread
and the cache_fill thread (on CPU 80 % of its span while it faults memory in).
"""

from __future__ import annotations

import json

import pytest
from tracedb import MAIN_PID, STORM_TID, TraceBuilder, builder

from tests.support.checkpoint import CKPT_IO_NS, STEPS, checkpoint_loop
from tracer.analysis.db import open_trace
from tracer.analysis.side_by_side import compare_processes
from tracer.commands.cli import main
from tracer.errors import UsageError

QUIET = 2000


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    b = TraceBuilder()
    checkpoint_loop(b)
    checkpoint_loop(b, pid=QUIET, every=0)
    p = tmp_path_factory.mktemp("sbs") / "two.duckdb"
    b.write(p)
    return p


def _row(res, measure):
    return next(r.values for r in res.rows if r.measure == measure)


def test_two_processes_side_by_side(two):
    with open_trace(two) as c:
        res = compare_processes(c)
    assert res.by == "process" and [c.pid for c in res.columns] == [MAIN_PID, QUIET]
    assert {c.thread_role for c in res.columns} == {"training", "driver"}
    # THEN the checkpointing one has the 10 slow steps and the 500 ms of blocked time more
    assert _row(res, "slow steps") == [10.0, 0.0]
    assert _row(res, "steps") == [STEPS - 1, STEPS - 1]
    wall = _row(res, "wall")
    blocked = _row(res, "blocked share")
    assert blocked[0] * wall[0] - blocked[1] * wall[1] == pytest.approx(10 * CKPT_IO_NS / 1e6, abs=0.5)
    assert res.columns[0].top_waker.startswith("[block] (interrupt) 500.0 ms")
    # AND the headline names the share that differs most between them
    shares = [r for r in res.rows if r.unit == "share"]
    widest = max(shares, key=lambda r: max(r.values) - min(r.values))
    assert res.headline.startswith(f"{widest.measure} differs most")


def test_named_pids_in_the_order_given(two):
    with open_trace(two) as c:
        res = compare_processes(c, pids=[QUIET, MAIN_PID])
        assert [c.pid for c in res.columns] == [QUIET, MAIN_PID]
        with pytest.raises(UsageError):
            compare_processes(c, pids=[4])


def test_the_threads_of_a_process(tmp_path):
    p = tmp_path / "f.duckdb"
    builder("fault_storm").write(p)
    with open_trace(p) as c:
        res = compare_processes(c, threads_of=MAIN_PID)
    assert res.by == "thread" and [c.tid for c in res.columns] == [MAIN_PID, STORM_TID]
    cpu = _row(res, "cpu share")
    assert cpu[1] > cpu[0] and res.headline.startswith("cpu share differs most: tid 1050 cache_fill")
    assert _row(res, "faults")[1] > 0 and _row(res, "cuda calls")[1] == 0


def test_the_cli_returns_the_function(two, capsys):
    assert main(["compare-processes", "--db", str(two), "--json"]) == 0
    with open_trace(two) as c:
        assert json.loads(capsys.readouterr().out) == json.loads(compare_processes(c).model_dump_json())
    assert main(["compare-processes", "--db", str(two), "--pid", str(QUIET), "--pid", str(MAIN_PID)]) == 0
    assert "slow steps" in capsys.readouterr().out
