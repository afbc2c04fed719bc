"""tracer.analysis.breakdown.thread_time: an exact breakdown's threads read lazily (LazyThreads) answer as the
stored rows say, thread by thread, process by process and summed, and each thread is one object."""

from __future__ import annotations

import pytest
from tracedb import build

from tracer.analysis.breakdown.load import load_thread_times
from tracer.analysis.breakdown.thread_time import FIELDS, LazyThreads, column_of
from tracer.analysis.db import open_trace


@pytest.mark.parametrize("name", ["process_churn", "fault_storm", "dataloader_starvation"])
def test_lazy_threads_answer_as_the_stored_rows(tmp_path, name):
    # GIVEN a recording with an exact breakdown: many short-lived workers, or a second thread of the main process
    db = tmp_path / "t.duckdb"
    build(name, db)
    with open_trace(db) as c:
        times = load_thread_times(c)
        sums = ", ".join(f"sum(coalesce({column_of(f)}, 0))::BIGINT" for f in FIELDS)
        stored = {
            r[0]: (r[1], r[2:])
            for r in c.execute(f"SELECT tid, any_value(pid), {sums} FROM thread_breakdown GROUP BY tid").fetchall()
        }
        cuda = {t for (t,) in c.execute("SELECT tid FROM threads WHERE cuda_calls > 0").fetchall()}
    lazy = times.threads
    assert isinstance(lazy, LazyThreads) and len(lazy) == len(stored)
    # THEN each thread, asked by tid, has its stored totals, field by field, and is the same object every time
    for tid, (pid, totals) in stored.items():
        t = times.by_tid(tid)
        assert (t.pid, t.tid) == (pid, tid) and tuple(t.total[f] for f in FIELDS) == totals
        assert times.by_tid(tid) is t and t in times.of_pid(pid)
    assert times.by_tid(max(stored) + 1) is None
    # AND a process's threads are the stored ones of that pid, in tid order, and the CUDA threads those with calls
    for pid in {p for p, _ in stored.values()}:
        assert [t.tid for t in times.of_pid(pid)] == sorted(tid for tid, (p, _) in stored.items() if p == pid)
    assert {t.tid for t in times.cuda_threads} == cuda & set(stored)
    # AND a column summed over every thread is the stored sum, without reading the threads one by one
    for f in ("wall", "runq_tracer", "cpu"):
        assert times.total_ns(f) == sum(totals[FIELDS.index(f)] for _, totals in stored.values())
