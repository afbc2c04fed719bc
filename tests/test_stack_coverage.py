"""tracer.analysis.stack_coverage (get_stacks' coverage, tracer stacks): how many calls of an op have a stack, and
why the others have none.

Ground truth, set here: 1,000 launches of which the launch probes saw half (sampled_fraction 0.5: op_stats counts
them scaled to 1,000); of the 500 seen, 400 stored; of those, 100 walked (a stack), 290 not (the 1-in-64 stack
budget) and 10 slow ones (>= 200 µs, which the policy always walks) without a stack: lost walks. Syncs are walked
1 in 1, so a stored sync without a stack lost its walk.
"""

from __future__ import annotations

import duckdb
import pytest
from tracedb import MAIN_PID, MS, US, TraceBuilder

from probes.catalog import STACK_EVERY, OpClass
from tracer.analysis.db import open_trace
from tracer.analysis.stacks import top_stacks
from tracer.commands.cli import main

STACK = [
    ("python", "t.py", "step", "t.py", 12),
    ("cuda", "libcudart.so.12", "cudaLaunchKernel", None, None),
]


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    b = TraceBuilder(duration_s=10.0)
    b.sampled_fraction = 0.5
    b.process(MAIN_PID, "python3")
    sid = b.stack(STACK)
    sync = b.stack(
        [("python", "t.py", "step", "t.py", 14), ("cuda", "libcudart.so.12", "cudaDeviceSynchronize", None, None)]
    )
    # 500 seen: op_stats doubles what the builder counts (calls / sampled_fraction), as the recorder scales
    for i in range(500):
        t = i * 10 * MS
        slow = i < 10
        b.call(
            t,
            300 * US if slow else 10 * US,
            "cudaLaunchKernel",
            stack_id=sid if 10 <= i < 110 else None,
            stored=i < 400,
        )
        b.call(t + 1 * MS, 2 * MS, "cudaDeviceSynchronize", stack_id=sync if i % 100 else None)
    p = tmp_path_factory.mktemp("cov") / "c.duckdb"
    b.write(p)
    with duckdb.connect(str(p)) as c:  # the recorder's scaling of a duty-cycled op: counted calls / live share
        c.execute("UPDATE op_stats SET calls = calls * 2 WHERE op = 'cudaLaunchKernel'")
        c.execute("UPDATE op_stats SET sampled_fraction = 1.0 WHERE op <> 'cudaLaunchKernel'")
    return p


def test_launch_coverage_by_reason(db):
    with open_trace(db) as c:
        cov = top_stacks(c, "cudaLaunchKernel").coverage
    assert (cov.calls, cov.with_stack, cov.share) == (1000, 100, 0.1)
    by = {m.reason: m.calls for m in cov.missing}
    assert by == {"duty_cycle": 500, "row_budget": 100, "stack_budget": 290, "lost_walk": 10}
    assert sum(by.values()) + cov.with_stack == cov.calls
    assert [m.reason for m in cov.missing] == ["duty_cycle", "stack_budget", "row_budget", "lost_walk"]
    every = STACK_EVERY[OpClass.LAUNCH]  # the rate the recorder walks at: the reason names it
    assert f"1 stored call in {every} " in next(m.why for m in cov.missing if m.reason == "stack_budget")
    assert cov.summary.startswith("cudaLaunchKernel: 100 of 1,000 calls have a stack (10.0%); without: 500 duty cycle")


def test_a_sync_without_a_stack_lost_its_walk(db):
    with open_trace(db) as c:
        cov = top_stacks(c, "cudaDeviceSynchronize").coverage
    assert (cov.calls, cov.with_stack) == (500, 495)
    assert [(m.reason, m.calls) for m in cov.missing] == [("lost_walk", 5)]


def test_the_cli_says_why(db, capsys):
    assert main(["stacks", "--db", str(db), "--op", "cudaLaunchKernel"]) == 0
    out = capsys.readouterr().out
    assert "100 of 1,000 calls have a stack" in out and "290 stack budget" in out and "500 duty cycle" in out
