"""tracer/recorder/budget.py: the duty cycle's arithmetic and the launch scaling, on hand-built windows (no BPF)."""

from __future__ import annotations

import pytest

from tracer.recorder.budget import (
    MIN_FRACTION,
    Activity,
    DutyCycler,
    OverheadEstimator,
    TrapCost,
    Window,
    launch_scales,
    required_fraction,
)

LAUNCH, SYNC, COPY = 6, 10, 8
HOT = frozenset({LAUNCH})
S = 1_000_000_000


def test_required_fraction_keeps_the_total_under_budget() -> None:
    assert required_fraction(1.0, 0.5, 2.0) == 1.0  # already under
    assert required_fraction(20.0, 0.0, 2.0) == pytest.approx(0.1)
    assert required_fraction(20.0, 1.0, 2.0) == pytest.approx(0.05)
    assert required_fraction(1000.0, 0.0, 2.0) == MIN_FRACTION  # never below the floor


def test_estimator_scales_hot_hits_seen_while_live_back_to_full_rate() -> None:
    # GIVEN a 16 us trap pair; 10k hot hits seen in 1 s while live 10% of it (100k/s in truth)
    est = OverheadEstimator(TrapCost(15_000, 1_000), budget_pct=2.0)
    fraction = est.update(hot_hits=10_000, rare_hits=0, live_share=0.1, seconds=1.0)
    # THEN the hot probes would cost 160% of a CPU if always live: the fraction that fits 2% is 1/80
    assert est.hot_pct == pytest.approx(160.0)
    assert fraction == pytest.approx(MIN_FRACTION)  # 1/80 is below the floor
    assert est.overhead_pct == pytest.approx(160.0 * MIN_FRACTION)


def test_live_share_counts_only_the_windows() -> None:
    c = DutyCycler()
    c.cycled = True
    c.windows = [Window(0, 2 * S), Window(5 * S, 6 * S)]
    assert c.live_share(0, 10 * S) == pytest.approx(0.3)
    assert c.live_share(2 * S, 5 * S) == 0.0
    assert DutyCycler().live_share(0, S) == 1.0  # never cycled: everything seen


def _windows(ratios: list[tuple[int, int]]) -> list[Window]:
    return [Window(i * S, i * S + S // 10, {(1, LAUNCH): h, (1, SYNC): r}) for i, (h, r) in enumerate(ratios)]


def test_scaling_by_an_always_on_op_ignores_how_long_the_windows_were() -> None:
    # GIVEN 100 launches per sync in every live window, 5 windows seeing 50 of the 1000 syncs
    windows = _windows([(1000, 10)] * 5)
    totals = {(1, LAUNCH): 5000, (1, SYNC): 1000}
    act = {1: Activity(0, 100 * S, True, True)}
    ((fraction, err),) = launch_scales(windows, act, totals, HOT, cycled=True).values()
    # THEN the 5000 launches seen are 5% of 100 x 1000: the time the windows lasted does not enter
    assert 5000 / fraction == pytest.approx(100_000)
    assert 0 < err < 20  # one sync's worth per window, no spread


def test_a_swinging_ratio_widens_the_bound() -> None:
    steady = launch_scales(
        _windows([(1000, 10)] * 6),
        {1: Activity(0, 100 * S, True, True)},
        {(1, LAUNCH): 6000, (1, SYNC): 600},
        HOT,
        cycled=True,
    )[1][1]
    swinging = launch_scales(
        _windows([(500, 10), (1500, 10)] * 3),
        {1: Activity(0, 100 * S, True, True)},
        {(1, LAUNCH): 6000, (1, SYNC): 600},
        HOT,
        cycled=True,
    )[1][1]
    assert swinging > steady + 10


def test_without_a_steady_op_time_over_the_active_span_is_used() -> None:
    # GIVEN launches only (no always-on op) in windows covering 20% of the process's active span
    windows = [Window(i * S, i * S + S // 5, {(1, LAUNCH): 200}) for i in range(10)]
    act = {1: Activity(0, 10 * S, True, True)}
    ((fraction, _),) = launch_scales(windows, act, {(1, LAUNCH): 2000}, HOT, cycled=True).values()
    assert fraction == pytest.approx(0.2)


def test_not_cycled_means_exact() -> None:
    act = {1: Activity(0, S, True, True)}
    assert launch_scales([], act, {(1, LAUNCH): 7}, HOT, cycled=False) == {1: (1.0, 0.0)}


def test_a_cost_over_the_budget_says_what_it_is_made_of() -> None:
    # GIVEN a VM's 12 us trap pair, a budget of 2%, and per second 2,000 hits of never-cycled probes (2.4% of a core
    # alone) beside 15,000 launches/s seen while the launch probes were live 5% of the time
    est = OverheadEstimator(TrapCost(10_000, 2_000), budget_pct=2.0)
    for _ in range(3):
        est.update(hot_hits=750, rare_hits=2_000, live_share=0.05, seconds=1.0)
    # THEN the note says the estimate, the budget, the two parts and the machine's trap cost
    note = est.over_budget_note()
    assert note is not None
    assert "estimated 3.3% of a core, over --overhead-budget 2%" in note  # 2.4 + 18% x 5% = 3.3
    assert "2.4% for the probes that are never sampled" in note and "0.9% for the launch probes" in note
    assert "12.0 µs" in note
    # AND a recording whose probes stayed within the budget (or has no estimate yet) says nothing of it
    under = OverheadEstimator(TrapCost(10_000, 2_000), budget_pct=2.0)
    assert under.over_budget_note() is None
    under.update(hot_hits=1_000, rare_hits=100, live_share=1.0, seconds=1.0)
    assert under.over_budget_note() is None
