"""The training thread's time before and after: the breakdown's parts (:mod:`tracer.analysis.breakdown`) over
the loop's whole seconds (an edge second's row also holds time from before or after the loop), the seconds the
noise tests sample, each part's share tested on its per-second shares."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tracer.analysis.breakdown import PartTime, parts_of
from tracer.analysis.compare.load import MS, Side
from tracer.analysis.compare.model import PartDelta, StepsCompare, TrainingCompare
from tracer.analysis.compare.statistics import MIN_SHARE_DELTA, NoiseTests, judge
from tracer.analysis.taxonomy import PART_NAMES


def loop_parts(side: Side) -> tuple[dict[str, PartTime], int]:
    """Return the training thread's parts over its loop's whole seconds (the per-second tests' samples, so a
    difference and its interval agree), or over its clipped loop when it has too few; and the wall time in ns.

    An edge second of the clipped loop is its breakdown row pro-rated: it holds time from before the loop too."""
    t = side.subject.time  # type: ignore[union-attr]
    row: dict[str, int] = t.total
    if not side.short:
        row = defaultdict(int)
        for sec in side.seconds:
            for k, v in t.by_sec.get(sec, {}).items():
                row[k] += v
    return {p.part: p for p in parts_of(t, row)}, row.get("wall", 0)


def part_series(side: Side, part: str) -> np.ndarray:
    """Return the part's share of the training thread's time in each whole second of its loop."""
    t = side.subject.time  # type: ignore[union-attr]
    rows = {sec: r[part] / r["wall"] for sec, r in t.by_sec.items() if r["wall"] > 0}
    return side.present(rows)


def compare_training(
    before: Side, after: Side, steps: StepsCompare, tests: NoiseTests, launch_error: tuple[float, float]
) -> TrainingCompare | None:
    """Return each part of the training thread's time before and after, largest move first (None when a side has
    no training thread); ``launch_error``: each side's launch-count error bound (fraction)."""
    if before.subject is None or after.subject is None:
        return None
    (parts_before, wall_before), (parts_after, wall_after) = loop_parts(before), loop_parts(after)
    out = []
    for part in PART_NAMES:
        x, y = parts_before[part], parts_after[part]
        if x.ms == 0 and y.ms == 0:
            continue
        delta = y.share - x.share
        matters = abs(delta) >= MIN_SHARE_DELTA
        short = before.short or after.short
        interval = None
        if not short:
            interval = tests.mean_diff(lambda p=part: part_series(before, p), lambda p=part: part_series(after, p))
        # launch time is estimated from the live windows when the launch probes were duty-cycled
        widen = (x.share * launch_error[0] + y.share * launch_error[1]) if part == "launch" else 0.0
        rates = (steps.before.steps_per_s, steps.after.steps_per_s) if steps.comparable else (None, None)
        out.append(
            PartDelta(
                part=part,
                before_ms=x.ms,
                after_ms=y.ms,
                before_share=x.share,
                after_share=y.share,
                delta_points=round(100 * delta, 2),
                before_ms_per_step=round(x.share * 1000 / rates[0], 3) if rates[0] else None,
                after_ms_per_step=round(y.share * 1000 / rates[1], 3) if rates[1] else None,
                noise=judge(matters, interval, short=short, widen=widen, scale=100),
            )
        )
    out.sort(key=lambda p: (-abs(p.delta_points), PART_NAMES.index(p.part)))
    return TrainingCompare(
        before_wall_ms=round(wall_before / MS, 3), after_wall_ms=round(wall_after / MS, 3), parts=out
    )
