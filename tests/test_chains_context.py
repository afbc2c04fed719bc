"""chains.context.clip: a thread's time restricted to its steps, an edge second losing its start-up, not a slice."""

from __future__ import annotations

import pytest

from tracer.analysis.breakdown.thread_time import FIELDS, ThreadTime
from tracer.analysis.chains.context import clip

S = 1_000_000_000
MS = 1_000_000


def thread(rows: dict[int, dict[str, int]]) -> ThreadTime:
    """A thread alive from second 1 to the end of second 2, with these per-second rows (ms, wall derived)."""
    by_sec = {}
    for sec, r in rows.items():
        row = dict.fromkeys(FIELDS, 0)
        row.update({f: v * MS for f, v in r.items()})
        row["wall"] = sum(row[f] for f in ("cpu", "launch", "alloc", "blocked", "runq_other"))
        by_sec[sec] = row
    total = {f: sum(r[f] for r in by_sec.values()) for f in FIELDS}
    return ThreadTime(1, 1, "python", 1 * S, 3 * S, True, 100, total, by_sec)


def test_an_edge_seconds_start_up_leaves_the_parts_outside_calls_not_its_calls():
    # GIVEN a second whose first 200 ms are start-up (imports: 150 ms CPU, a 50 ms hold) before the first launch,
    # then 800 ms of steps: 600 ms in calls, 150 ms CPU, 50 ms blocked
    t = thread({1: {"cpu": 300, "alloc": 600, "blocked": 100}, 2: {"cpu": 100, "alloc": 900}})
    # WHEN it is clipped to the steps, from 200 ms into second 1
    c = clip(t, 1 * S + 200 * MS, 3 * S)
    # THEN the 200 ms leave CPU and blocked in their proportion (3:1), and every call stays: the mix of the
    # second is not the mix of its steps (a slice would keep 480 ms of calls and 240 ms of CPU)
    r = c.by_sec[1]
    assert (r["wall"], r["alloc"], r["cpu"], r["blocked"]) == (800 * MS, 600 * MS, 150 * MS, 50 * MS)
    assert c.by_sec[2] == t.by_sec[2] and c.total["alloc"] == 1500 * MS


def test_calls_outside_the_steps_leave_their_part():
    # GIVEN the same second, 40 ms of which were set-up calls (cudaMalloc of the weights) before the first launch
    t = thread({1: {"cpu": 300, "alloc": 600, "blocked": 100}, 2: {"cpu": 100, "alloc": 900}})
    # WHEN it is clipped with those calls known
    c = clip(t, 1 * S + 200 * MS, 3 * S, {1: {"alloc": 40 * MS}})
    # THEN they leave alloc, and the 160 ms left leave CPU and blocked
    r = c.by_sec[1]
    assert (r["alloc"], r["cpu"], r["blocked"]) == (560 * MS, 180 * MS, 60 * MS)


def test_time_the_parts_outside_calls_cannot_give_leaves_the_calls():
    # GIVEN a second that is nearly all calls, 300 ms of it before the steps (the stored call rows missing)
    t = thread({1: {"cpu": 100, "launch": 900}, 2: {"cpu": 100, "launch": 900}})
    # WHEN it is clipped from 300 ms in
    c = clip(t, 1 * S + 300 * MS, 3 * S)
    # THEN the CPU goes first, then the rest from the calls; the parts still add up to the wall
    r = c.by_sec[1]
    assert (r["cpu"], r["launch"], r["wall"]) == (0, 700 * MS, 700 * MS)


def test_extras_follow_their_parts():
    t = thread({1: {"cpu": 300, "alloc": 600, "blocked": 100, "io": 80}, 2: {"cpu": 100, "alloc": 900}})
    c = clip(t, 1 * S + 200 * MS, 3 * S)
    # io is blocked time on a disk: it leaves with blocked (half of it)
    assert c.by_sec[1]["io"] == pytest.approx(40 * MS, abs=1)


def _loaded(t: ThreadTime) -> ThreadTime:
    """``t`` as the exact loader gives it: its seconds a read-only SecondRows over shared columns."""
    import numpy as np

    from tracer.analysis.breakdown.thread_time import SecondRows

    secs = np.array(sorted(t.by_sec), dtype=np.int64)
    values = np.array([[t.by_sec[s][f] for f in FIELDS] for s in secs.tolist()], dtype=np.int64)
    return ThreadTime(
        t.pid, t.tid, t.comm, t.first_ns, t.end_ns, t.exited, t.cuda_calls, dict(t.total), SecondRows(secs, values)
    )


@pytest.mark.parametrize("window", [(0, 5 * S), (1 * S, 3 * S), (1 * S + 200 * MS, 3 * S), (0, 2 * S + 1)])
def test_a_loaded_thread_clips_as_its_rows_do(window):
    # GIVEN a thread with two seconds, as a dict of rows and as the loader's SecondRows
    t = thread({1: {"cpu": 300, "alloc": 600, "blocked": 100}, 2: {"cpu": 100, "alloc": 900}})
    # WHEN each is clipped to a window holding both seconds, or cutting one
    a, b = clip(t, *window), clip(_loaded(t), *window)
    # THEN they agree: the whole-seconds case's shortcut keeps the rows as they are
    assert (a.first_ns, a.end_ns, a.total) == (b.first_ns, b.end_ns, b.total)
    assert {s: dict(r) for s, r in a.by_sec.items()} == {s: dict(r) for s, r in b.by_sec.items()}
