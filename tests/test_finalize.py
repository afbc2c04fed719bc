"""tracer.recorder.finalize: the end-of-recording rows computed from dumped map contents, without BPF: open segments
split
into the thread_breakdown fields and seconds, and op_stats with duty-cycled launches scaled."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from probes.catalog import CATALOG, OP_IDS, OpClass
from tracer.recorder import columns, events
from tracer.recorder.budget import Window
from tracer.recorder.finalize import RecordSummary, S, Span, by_second, open_spans, scaled_op_stats

T0 = 1_000 * S  # monotonic ns of the session's start


def state(tgid: int, mark: int, in_call: bool = False, off_cpu: bool = False, runnable: int = 0) -> SimpleNamespace:
    """A thread's accounting state as accounting.h keeps it."""
    return SimpleNamespace(tgid=tgid, in_call=int(in_call), off_cpu=int(off_cpu), mark=mark, ts_runnable=runnable)


@pytest.mark.parametrize(
    "a,b,want",
    [
        (T0 + S // 2, T0 + 2 * S + S // 4, [(0, S // 2), (1, S), (2, S // 4)]),
        (T0 - S, T0 + S // 10, [(0, S // 10)]),  # before the session: not counted
        (T0 + 3 * S, T0 + 3 * S, []),
        (T0 + 5 * S, T0 + 6 * S, [(5, S)]),
    ],
)
def test_by_second_splits_at_second_boundaries(a, b, want):
    got = list(by_second(a, b, T0))
    assert got == want and sum(ns for _, ns in got) == max(0, b - max(a, T0))


def test_open_spans_by_what_each_thread_was_doing():
    sync = OP_IDS["cudaStreamSynchronize"]
    end = T0 + 10 * S
    spans = open_spans(
        [
            (11, state(10, T0 + 1 * S, in_call=True)),  # inside a sync since its call began
            (12, state(10, T0 + 2 * S, off_cpu=True, runnable=T0 + 9 * S)),  # blocked, then runnable
            (13, state(10, T0 + 3 * S, off_cpu=True)),  # still blocked
            (14, state(20, T0 + 4 * S)),  # on CPU
        ],
        {11: SimpleNamespace(op=sync, ts_ns=T0 + S // 2)},
        end,
    )
    c = events.C
    assert CATALOG[sync].part == OpClass.SYNC
    assert spans == [
        Span(11, 10, c.TB_CALL + int(OpClass.SYNC), T0 + S // 2, end),
        Span(12, 10, c.TB_BLOCKED, T0 + 2 * S, T0 + 9 * S),
        Span(12, 10, c.TB_RUNQ_OTHER, T0 + 9 * S, end),
        Span(13, 10, c.TB_BLOCKED, T0 + 3 * S, end),
        Span(13, 10, c.TB_RUNQ_OTHER, end, end),
        Span(14, 20, c.TB_CPU, T0 + 4 * S, end),
    ]


def test_a_call_flag_without_its_call_is_on_cpu():
    # the inflight entry was cleared (a launch whose probes were detached mid-call): the segment is CPU time
    (sp,) = open_spans([(11, state(10, T0, in_call=True))], {}, T0 + S)
    assert sp.field == events.C.TB_CPU


def aggregates(calls: dict[tuple[int, str], tuple[int, int, int]]) -> tuple[columns.Aggregates, columns.Aggregates]:
    """op_totals and op_hist contents: (pid, op) -> (calls, first_ns, last_ns), each call 1 µs in one bucket."""
    tk = np.zeros(len(calls), events.OP_KEY_DTYPE)
    tv = np.zeros(len(calls), events.OP_TOTAL_DTYPE)
    hk = np.zeros(len(calls), events.HIST_KEY_DTYPE)
    hv = np.zeros(len(calls), events.COUNT_DTYPE)
    for i, ((pid, op), (n, first, last)) in enumerate(calls.items()):
        tk[i] = (pid, OP_IDS[op])
        tv[i]["calls"], tv[i]["total_ns"], tv[i]["min_ns"], tv[i]["max_ns"] = n, n * 1000, 1000, 1000
        tv[i]["first_ns"], tv[i]["last_ns"] = first, last
        hk[i] = (pid, OP_IDS[op], 0)
        hv[i] = n
    return columns.Aggregates(tk, tv), columns.Aggregates(hk, hv)


def calls_of(cols) -> dict[tuple[int, str], int]:
    return {(p, op): n for p, op, n in zip(cols["pid"], cols["op"], cols["calls"], strict=True)}


def test_op_stats_are_exact_when_nothing_was_duty_cycled():
    totals, hists = aggregates(
        {(10, "cudaLaunchKernel"): (5000, T0, T0 + 9 * S), (10, "cudaStreamSynchronize"): (100, T0, T0 + 9 * S)}
    )
    cols, summary = scaled_op_stats(totals, hists, [], cycled=False)
    assert calls_of(cols) == {(10, "cudaLaunchKernel"): 5000, (10, "cudaStreamSynchronize"): 100}
    assert set(cols["sampled_fraction"]) == {1.0} and {s.op: s.calls for s in summary}["cudaLaunchKernel"] == 5000


def test_duty_cycled_launches_are_scaled_by_the_live_share_of_their_process():
    # GIVEN launch probes live for the first half of pid 10's active span (exact edges from its syncs), and pid 20
    # launching only while they were off
    launch, sync = "cudaLaunchKernel", "cudaStreamSynchronize"
    totals, hists = aggregates(
        {
            (10, launch): (2500, T0 + S, T0 + 5 * S),
            (10, sync): (100, T0, T0 + 10 * S),
            (20, sync): (50, T0, T0 + 10 * S),
        }
    )
    cols, _ = scaled_op_stats(totals, hists, [Window(T0, T0 + 5 * S)], cycled=True)
    got = calls_of(cols)
    frac = dict(zip(zip(cols["pid"], cols["op"], strict=True), cols["sampled_fraction"], strict=True))
    # THEN pid 10's launches are scaled by 1 / 0.5, its syncs (always probed) and pid 20's stay exact
    assert frac[(10, launch)] == pytest.approx(0.5, abs=0.01) and got[(10, launch)] == pytest.approx(5000, rel=0.02)
    assert got[(10, sync)] == 100 and frac[(10, sync)] == 1.0 and got[(20, sync)] == 50


def test_the_cost_per_process_is_said_only_of_a_job_that_churned() -> None:
    def summary(processes: int, pct: float | None = 4.0, span: float | None = 12.0) -> RecordSummary:
        return RecordSummary(
            Path("x.duckdb"), "complete", 13.0, 0, 0, 0, processes, [], [], [], recording_cpu_pct=pct, recording_s=span
        )

    # the demo's churn: 4% of a core over 12 s is 480 ms of CPU, over 300 processes
    assert summary(300).ms_per_process == pytest.approx(1.6)
    # a short job's few workers re-forked faster than one a second still churn
    assert summary(6, span=2.0).ms_per_process == pytest.approx(4.0 * 10 * 2.0 / 6)
    # a trainer and its persistent workers: the whole recording's CPU split three ways says nothing of them
    assert summary(3).ms_per_process is None
    assert summary(10, span=60.0).ms_per_process is None  # fewer than one a second
    assert summary(300, pct=None).ms_per_process is None and summary(300, span=None).ms_per_process is None
