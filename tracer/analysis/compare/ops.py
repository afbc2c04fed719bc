"""Per-op deltas: calls, total time and p50/p99 per (op, layer) over every pid are
:func:`tracer.analysis.stats.op_stats` (exact, from the in-kernel histograms); rates are per second of the
training loop's span. Rates and time per second are tested on the per-second stored rows scaled to the exact
totals; a duty-cycled count (``op_stats.sampled_fraction`` < 1) widens its interval by ``error_pct``; a latency
quantile gets the order-statistic interval of its exact histogram."""

from __future__ import annotations

import numpy as np

from tracer.analysis.compare.load import MS, OpKey, Side
from tracer.analysis.compare.model import Noise, OpDelta
from tracer.analysis.compare.statistics import (
    MIN_CALLS,
    MIN_REL_DELTA,
    NoiseTests,
    judge,
    quantile_interval,
    relative_change,
)


def op_series(side: Side, key: OpKey, time: bool) -> np.ndarray:
    """Return the op's calls (or ms) in each whole second of loop: its stored rows, scaled to op_stats' exact
    totals (rows may be a sample)."""
    o = side.ops.get(key)
    n, dur = side.stored.get(key, (0, 0))
    if o is None or not n:
        return side.series({})
    k = (o.total_ms * MS / dur if dur else 0.0) if time else o.calls / n
    rows = side.by_sec.get(key, {})
    return side.series({sec: (d / MS if time else c) * k for sec, (c, d) in rows.items()})


def _quantile_noise(before: Side, after: Side, key: OpKey, tests: NoiseTests) -> dict[str, Noise]:
    """Return the p50 and p99 verdicts of one op: two quantiles differ when their intervals do not overlap."""
    x, y = before.ops.get(key), after.ops.get(key)
    hist_before, hist_after = before.hists.get(key), after.hists.get(key)
    out = {}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        if x is None or y is None or hist_before is None or hist_after is None:
            out[name] = Noise(verdict="not_tested", ci_lo=None, ci_hi=None, note="only on one side")
            continue
        if min(hist_before.calls, hist_after.calls) < MIN_CALLS:
            out[name] = Noise(verdict="too_short", ci_lo=None, ci_hi=None, note=f"fewer than {MIN_CALLS} calls")
            continue
        pair = tests.run(
            lambda hb=hist_before, ha=hist_after, q=q: (
                quantile_interval(hb, q, tests.z),
                quantile_interval(ha, q, tests.z),
            )
        )
        # after - before: the widest difference the two intervals allow (they overlap iff it holds 0)
        diff = None if pair is None else (pair[1][0] - pair[0][1], pair[1][1] - pair[0][0])
        matters = relative_change(getattr(x, f"{name}_us"), getattr(y, f"{name}_us")) >= MIN_REL_DELTA
        out[name] = judge(matters, diff, scale=1e-3)
    return out


def compare_ops(before: Side, after: Side, tests: NoiseTests) -> list[OpDelta]:
    """Return every op of either side before and after, largest change of time per second first."""
    short = before.short or after.short
    out = []
    for key in sorted(set(before.ops) | set(after.ops)):
        x, y = before.ops.get(key), after.ops.get(key)
        err_before, err_after = before.errors.get(key, 0.0), after.errors.get(key, 0.0)
        calls_before, calls_after = (x.calls if x else 0), (y.calls if y else 0)
        rate_before, rate_after = before.per_s(calls_before), after.per_s(calls_after)
        ms_before, ms_after = (x.total_ms if x else 0.0), (y.total_ms if y else 0.0)
        ms_per_s_before, ms_per_s_after = before.per_s(ms_before), after.per_s(ms_after)
        # a duty-cycled count is known to error_pct: a change inside that bound is not a change
        rate_bound = rate_before * err_before + rate_after * err_after
        time_bound = ms_per_s_before * err_before + ms_per_s_after * err_after
        rate_matters = (
            relative_change(rate_before, rate_after) >= MIN_REL_DELTA and abs(rate_after - rate_before) > rate_bound
        )
        time_matters = (
            relative_change(ms_per_s_before, ms_per_s_after) >= MIN_REL_DELTA
            and abs(ms_per_s_after - ms_per_s_before) > time_bound
        )
        rate_interval = time_interval = None
        if not short:
            rate_interval = tests.mean_diff(
                lambda k=key: op_series(before, k, False), lambda k=key: op_series(after, k, False)
            )
            time_interval = tests.mean_diff(
                lambda k=key: op_series(before, k, True), lambda k=key: op_series(after, k, True)
            )
        quantiles = _quantile_noise(before, after, key, tests)
        presence = "both" if x and y else "before_only" if x else "after_only"
        part = (x or y).part  # type: ignore[union-attr]
        out.append(
            OpDelta(
                op=key[0],
                layer=key[1],
                part=part,
                presence=presence,
                calls_before=calls_before,
                calls_after=calls_after,
                calls_per_s_before=round(rate_before, 3),
                calls_per_s_after=round(rate_after, 3),
                calls_delta_pct=round(100 * (rate_after - rate_before) / rate_before, 1) if rate_before else None,
                total_ms_before=ms_before,
                total_ms_after=ms_after,
                ms_per_s_before=round(ms_per_s_before, 4),
                ms_per_s_after=round(ms_per_s_after, 4),
                p50_us_before=x.p50_us if x else None,
                p50_us_after=y.p50_us if y else None,
                p99_us_before=x.p99_us if x else None,
                p99_us_after=y.p99_us if y else None,
                error_pct_before=round(100 * err_before, 2),
                error_pct_after=round(100 * err_after, 2),
                rate_noise=judge(rate_matters, rate_interval, short=short, widen=rate_bound),
                time_noise=judge(time_matters, time_interval, short=short, widen=time_bound),
                p50_noise=quantiles["p50"],
                p99_noise=quantiles["p99"],
            )
        )
    out.sort(key=lambda o: (-abs(o.ms_per_s_after - o.ms_per_s_before), o.op, o.layer))
    return out
