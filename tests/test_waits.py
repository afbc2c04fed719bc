"""tracer.analysis.waits (get_waits / tracer waits): a thread's waits by waker, exact counts from thread_wakers and
the lengths of the stored waits from sched.

Ground truth: tests/support/checkpoint.py: 421 in-call waits of 1.1 ms ended by [irq], 42 sleeps of 1 ms ended
by [timer], 10 fsync waits of 50 ms ended by [block].
"""

from __future__ import annotations

import json

import pytest
from tracedb import MAIN_PID, TraceBuilder

from tests.support.checkpoint import checkpoint_loop
from tracer.analysis.db import open_trace
from tracer.analysis.waits import waits
from tracer.commands.cli import main


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    b = TraceBuilder()
    checkpoint_loop(b)
    p = tmp_path_factory.mktemp("waits") / "ckpt.duckdb"
    b.write(p)
    return p


def test_waits_by_waker(db):
    with open_trace(db) as c:
        w = waits(c)
    assert (w.pid, w.tid) == (MAIN_PID, MAIN_PID)
    by = {x.waker: x for x in w.wakers}
    assert list(by) == ["[block]", "[irq]", "[timer]"]  # most blocked time first
    # THEN each waker's exact count and time, and how long its waits were
    blk, irq, tmr = by["[block]"], by["[irq]"], by["[timer]"]
    assert (blk.wakeups, blk.blocked_ms, blk.in_call_ms, blk.typical_ms, blk.histogram) == (
        10,
        500.0,
        0.0,
        50.0,
        {"10-100ms": 10},
    )
    assert (irq.wakeups, irq.in_call_ms, irq.typical_ms, irq.histogram) == (421, irq.blocked_ms, 1.1, {"1-5ms": 421})
    assert (tmr.wakeups, tmr.blocked_ms, tmr.typical_ms, tmr.histogram) == (42, 42.0, 1.0, {"1-5ms": 42})
    assert all(x.holder == "interrupt" and x.pid == 0 for x in w.wakers)
    # AND the thread's totals are its breakdown's: 500 + 42 ms blocked outside calls, [irq]'s inside them
    assert w.blocked_ms == 542.0 and w.in_call_off_cpu_ms == pytest.approx(irq.in_call_ms)
    assert w.headline.startswith("thread 1000 (python3) blocked 542.0 ms outside CUDA calls: [block] 10x, 500.0 ms")


def test_the_cli_returns_the_function(db, capsys):
    assert main(["waits", "--db", str(db), "--json"]) == 0
    with open_trace(db) as c:
        assert json.loads(capsys.readouterr().out) == json.loads(waits(c).model_dump_json())
    assert main(["waits", "--db", str(db), "--tid", str(MAIN_PID)]) == 0
    out = capsys.readouterr().out
    assert "[block]" in out and "10-100ms" in out


def test_an_unknown_thread_is_refused(db, capsys):
    assert main(["waits", "--db", str(db), "--tid", "4"]) == 2
    assert "thread 4 is not in this trace" in capsys.readouterr().err


def test_a_process_without_cuda_calls_answers_for_its_main_thread(tmp_path):
    # GIVEN a data worker (no CUDA call) blocked 15 ms at a time in recv, woken by a storage process (issue 28:
    # get_waits(pid=<a worker>) answered "the recording has no CUDA thread")
    from tracedb import MS, S, builder

    b = builder("dataloader_starvation")
    worker = MAIN_PID + 1
    for k in range(20):
        b.off_cpu(2 * S + k * 40 * MS, 15 * MS, pid=worker, comm="pt_data_worker", waker_pid=4242,
                  waker_comm="storage_proxy")  # fmt: skip
    db = b.write(tmp_path / "w.duckdb")
    # WHEN its waits are asked for by pid
    with open_trace(db) as c:
        w = waits(c, pid=worker)
    # THEN they are its main thread's, the storage process first with its 20 waits of 15 ms
    assert (w.pid, w.tid) == (worker, worker)
    top = w.wakers[0]
    assert (top.waker, top.pid, top.wakeups, top.blocked_ms, top.typical_ms) == ("storage_proxy", 4242, 20, 300.0, 15.0)
    # AND a pid with no thread at all says so, naming the pid
    with open_trace(db) as c:
        assert "pid 31337" in waits(c, pid=31337).headline
