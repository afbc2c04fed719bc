"""Issue 31: one definition of a step. A 2-rank job whose training loop waits for the GPU with the same op at two
lines each step (the loss, then an accuracy read): the step series, the ranks' table and compare count the same
steps, the ones the job made (built truth), not one per wait."""

from __future__ import annotations

from tests.support.builder import MS, US, S, TraceBuilder
from tracer.analysis.breakdown.load import load_thread_times
from tracer.analysis.compare import compare_traces
from tracer.analysis.db import open_trace
from tracer.analysis.ranks.table import rank_table
from tracer.analysis.recording import load_recording
from tracer.analysis.steps import step_series

RANKS = (4001, 4002)
STEPS = 400
STEP_NS = 10 * MS


def _stack(line: int) -> list[tuple]:
    return [
        ("python", "train.py", "<module>", "train.py", 90),
        ("python", "train.py", "step", "train.py", line),
        ("cuda", "libcudart.so.12", "cudaStreamSynchronize", None, None),
    ]


def two_waits_a_step(path) -> TraceBuilder:
    """Each rank: launch, sync at line 20 (the loss), launch, sync at line 24 (an accuracy), every 10 ms."""
    b = TraceBuilder(duration_s=1 + STEPS * STEP_NS / S + 1, target="torchrun --nproc-per-node 2 train.py")
    b.process(4000, "pt_elastic", ppid=1)
    b.processes[0].update(launcher="torchrun")
    for rank, pid in enumerate(RANKS):
        b.process(pid, "python", ppid=4000, first_ns=100 * MS)
        b.processes[-1].update(rank=rank, local_rank=rank, world_size=2, job_id="j")
    loss, acc = b.stack(_stack(20)), b.stack(_stack(24))
    for i in range(STEPS):
        t = S + i * STEP_NS
        for pid in RANKS:
            b.call(t + 1 * MS, 20 * US, "cudaLaunchKernel", pid=pid)
            b.call(t + 3 * MS, 2 * MS, "cudaStreamSynchronize", pid=pid, stack_id=loss)
            b.call(t + 6 * MS, 20 * US, "cudaLaunchKernel", pid=pid)
            b.call(t + 7 * MS, 2 * MS, "cudaStreamSynchronize", pid=pid, stack_id=acc)
    b.write(path)
    return b


def test_every_tool_counts_the_steps_the_loop_made_when_one_op_waits_twice_a_step(tmp_path):
    two_waits_a_step(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        series = step_series(c, pid=RANKS[0])
        info = load_recording(c)
        table = rank_table(c, info, load_thread_times(c, info))
    # the step series: two waits a step, the steps between the first and the last step's end
    assert series.markers_per_step == 2
    assert series.steps == STEPS - 1
    assert abs(series.typical_ms - STEP_NS / MS) < 0.01
    # the ranks: their steps in the window, at the loop's 100 steps/s (the window is whole seconds of the loop)
    assert table is not None
    for r in table.ranks:
        assert r.waits_per_step == 2
        assert r.steps is not None
        assert abs(r.steps / (table.window_ns / S) - S / STEP_NS) <= 1.0, (r.steps, table.window_ns)
    # compare: the same loop on both sides steps at 100/s, and each side counts its 400 steps, not 800 waits
    with open_trace(tmp_path / "t.duckdb") as b, open_trace(tmp_path / "t.duckdb") as a:
        cmp = compare_traces(b, a, before_name="b", after_name="a")
    for side in (cmp.steps.before, cmp.steps.after):
        assert side.waits_per_step == 2
        assert abs(side.markers - STEPS) <= 1, side
        assert abs(side.steps_per_s - S / STEP_NS) <= 1.0, side
