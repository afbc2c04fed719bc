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
