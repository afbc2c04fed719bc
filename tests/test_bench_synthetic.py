"""bench/synthetic.py: the benchmark recording's time accounting is the generated calls' own, worked out here by hand
from the generator's duration formula, never by the analyses that the benchmark times."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from bench.synthetic import PID, generate_large
from tracer.analysis.breakdown import load_thread_times

S = 1_000_000_000
MS = 1_000_000
SHORT = 5000  # launches and copies last 5000 + (i * 7919) % 10000 ns; short syncs 900000 + (i * 7919) % 300000


def _breakdown(db: Path) -> dict[int, dict[str, int]]:
    with duckdb.connect(str(db), read_only=True) as con:
        cur = con.execute(
            "SELECT sec, wall_ns, cpu_ns, launch_ns, copy_ns, sync_ns, call_off_cpu_ns, call_runq_ns, blocked_ns "
            "FROM thread_breakdown WHERE tid = ? ORDER BY sec",
            [PID],
        )
        names = [d[0] for d in cur.description]
        return {r[0]: dict(zip(names[1:], r[1:], strict=True)) for r in cur.fetchall()}


def test_each_second_holds_its_calls_time(tmp_path: Path) -> None:
    # GIVEN 8 calls over 4 s: one every 0.5 s, launch / driver launch / copy / sync in turn, the first sync long
    db = generate_large(tmp_path / "s.duckdb", n_calls=8, duration_s=4)
    rows = _breakdown(db)
    # THEN per second (durations by hand: 5000 + (i * 7919) % 10000, the long sync 20 ms + (3 * 7919) % 15 ms)
    want = {
        0: dict(launch_ns=5000 + 12919, copy_ns=0, sync_ns=0, call_off_cpu_ns=0, call_runq_ns=0),  # calls 0, 1
        1: dict(launch_ns=0, copy_ns=10838, sync_ns=20_023_757, call_off_cpu_ns=19 * MS, call_runq_ns=18 * MS),
        2: dict(launch_ns=6676 + 14595, copy_ns=0, sync_ns=0, call_off_cpu_ns=0, call_runq_ns=0),  # calls 4, 5
        3: dict(launch_ns=0, copy_ns=12514, sync_ns=900_000 + 55_433, call_off_cpu_ns=0, call_runq_ns=0),
    }
    assert sorted(rows) == [0, 1, 2, 3]
    for sec, parts in want.items():
        got = rows[sec]
        assert {k: got[k] for k in parts} == parts, sec
        # the rest of the second is on CPU: nothing is off CPU outside a call
        assert got["wall_ns"] == S and got["blocked_ns"] == 0
        assert got["cpu_ns"] == S - parts["launch_ns"] - parts["copy_ns"] - parts["sync_ns"]


def test_calls_that_start_inside_a_call_are_its_time(tmp_path: Path) -> None:
    # GIVEN 200 calls in 1 s, one every 5 ms: call 3 is the long sync (15 ms to 35.023757 ms); calls 4-6 (20, 25,
    # 30 ms) start inside it, and call 7, a short sync at 35 ms, too, running it on to 35.955433 ms
    db = generate_large(tmp_path / "n.duckdb", n_calls=200, duration_s=1)
    (row,) = _breakdown(db).values()
    with duckdb.connect(str(db), read_only=True) as con:
        # every other call is alone: its own duration
        alone = dict(
            con.execute(
                "SELECT op, sum(dur_ns) FROM cuda_calls WHERE ts_ns NOT BETWEEN 15 * 1000000 AND 35 * 1000000 "
                "GROUP BY op"
            ).fetchall()
        )
    # THEN the run of calls 3-7 is one sync, from call 3's start to call 7's end; launches 4, 5 and copy 6 vanish
    assert row["sync_ns"] == alone["cudaStreamSynchronize"] + (35_955_433 - 15 * MS)
    assert row["launch_ns"] == alone["cudaLaunchKernel"] + alone["cuLaunchKernel"]
    assert row["copy_ns"] == alone["cudaMemcpyAsync"]
    assert row["cpu_ns"] == S - row["sync_ns"] - row["launch_ns"] - row["copy_ns"]


def test_dense_calls_agree_with_a_sweep_over_the_rows(tmp_path: Path) -> None:
    # GIVEN 4000 calls in 1 s, one every 250 µs: each sync (~1 ms) swallows the next calls, and the last one
    # runs past the end of the recording
    db = generate_large(tmp_path / "d.duckdb", n_calls=4000, duration_s=1)
    (row,) = _breakdown(db).values()
    with duckdb.connect(str(db), read_only=True) as con:
        calls = con.execute("SELECT ts_ns, ts_ns + dur_ns, op FROM cuda_calls ORDER BY ts_ns").fetchall()
    # THEN the parts are those of a sweep: a call that starts before the run so far has ended joins it
    part = {"cudaLaunchKernel": "launch", "cuLaunchKernel": "launch", "cudaMemcpyAsync": "copy"}
    want = {"launch": 0, "copy": 0, "sync": 0}
    run: list = []  # [start, end, part] of the open run
    for a, b, op in [*calls, (None, None, None)]:
        if run and (a is None or a >= run[1]):
            want[run[2]] += min(run[1], S) - run[0]
            run = []
        if a is None:
            break
        run = [run[0], max(run[1], b), run[2]] if run else [a, b, part.get(op, "sync")]
    assert calls[-1][1] > S  # the cut is exercised
    assert {k: row[f"{k}_ns"] for k in want} == want
    assert row["cpu_ns"] == S - sum(want.values()) > 0


@pytest.mark.parametrize("accounting", [True, False])
def test_the_analyses_read_it_as_exact_or_estimate_it(tmp_path: Path, accounting: bool) -> None:
    db = generate_large(tmp_path / "a.duckdb", n_calls=4000, duration_s=4, accounting=accounting)
    with duckdb.connect(str(db), read_only=True) as con:
        times = load_thread_times(con)
    assert times.basis == ("exact" if accounting else "estimated")
    assert times.training is not None and times.training.tid == PID
