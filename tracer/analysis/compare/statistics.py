"""The noise tests: whether a difference between BEFORE and AFTER is beyond the recordings' own variance.

Per-second quantities get a percentile bootstrap interval of the difference of the two series' means (seconds
merged into at most MAX_BLOCKS consecutive blocks, whose means absorb short-range correlation; RESAMPLES resamples,
seeded, so a comparison always gives the same answer); a latency quantile gets the distribution-free
order-statistic interval of its exact histogram. Every test runs at a Bonferroni level over all the tests one
comparison makes (family-wise ALPHA), counted by :class:`NoiseTests`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import TypeVar

import numpy as np

from tracer.analysis.compare.model import Noise
from tracer.hist import OpHistogram

ALPHA = 0.05  # family-wise error rate over all the tests of one comparison (Bonferroni)
MAX_BLOCKS = 40  # per-second values are merged into at most this many consecutive blocks before resampling
RESAMPLES = 20_000  # enough for ~10 resamples beyond the Bonferroni tail of 50 tests
SEED = 13  # issue 13: fixed, so the CLI and the MCP tool give the same answer on the same files
# Below these a difference does not change what to fix: a part moving by less than one point of the thread's
# time, a rate or latency by less than 2% (chains.context.LOW_SHARE: 2% of a step is a training loop's jitter).
MIN_SHARE_DELTA = 0.01
MIN_REL_DELTA = 0.02
MIN_CALLS = 20  # a latency quantile of fewer calls is not compared
NOISE_TEST = (
    "per-second values (steps, each part's share of the training thread, each op's calls and time): percentile "
    f"bootstrap of the difference of means ({RESAMPLES:,} resamples of up to {MAX_BLOCKS} blocks of consecutive "
    "seconds); steps counted from exact waits where the loop waits, else from launches (a duty-cycled count's "
    "error_pct added in quadrature); latency p50/p99: order-statistic interval of the exact histogram, "
    f"bucket-widened; duty-cycled op counts widened by error_pct; Bonferroni over all tests, family-wise alpha {ALPHA}"
)

_T = TypeVar("_T")


@dataclass
class NoiseTests:
    """The comparison's tests. The analysis runs twice: first counting the tests it would make (the Bonferroni
    divisor), then making them at the shared level; one code path decides which tests there are."""

    count: int = 0
    counting: bool = True

    def run(self, test: Callable[[], _T]) -> _T | None:
        """Return ``test()``, or None while counting."""
        if self.counting:
            self.count += 1
            return None
        return test()

    def mean_diff(
        self, before: Callable[[], np.ndarray], after: Callable[[], np.ndarray]
    ) -> tuple[float, float] | None:
        """Return the interval of the difference of the two per-second series' means (None while counting, or
        when a side has no value)."""

        def test() -> tuple[float, float] | None:
            b, a = before(), after()
            return mean_diff_interval(b, a, self.level) if len(b) and len(a) else None

        return self.run(test)

    @property
    def level(self) -> float:
        return 1 - ALPHA / max(self.count, 1)

    @property
    def z(self) -> float:
        return NormalDist().inv_cdf(1 - ALPHA / max(self.count, 1) / 2)


def _blocks(x: np.ndarray) -> np.ndarray:
    """Return ``x`` as the means of at most MAX_BLOCKS runs of consecutive values."""
    if len(x) <= MAX_BLOCKS:
        return x
    return np.array([c.mean() for c in np.array_split(x, MAX_BLOCKS)])


def mean_diff_interval(before: np.ndarray, after: np.ndarray, level: float) -> tuple[float, float]:
    """Return the percentile bootstrap interval at ``level`` of mean(after) - mean(before) (see the module
    docstring); a fixed seed makes it reproducible."""
    a, b = _blocks(before), _blocks(after)
    rng = np.random.default_rng(SEED)
    ma = a[rng.integers(0, len(a), (RESAMPLES, len(a)))].mean(axis=1)
    mb = b[rng.integers(0, len(b), (RESAMPLES, len(b)))].mean(axis=1)
    q = (1 - level) / 2
    lo, hi = np.quantile(mb - ma, [q, 1 - q])
    return float(lo), float(hi)


def quantile_interval(h: OpHistogram, q: float, z: float) -> tuple[float, float] | None:
    """Return the distribution-free interval in ns of the q-quantile of histogram ``h``: the values of ranks
    n*q -+ z*sqrt(n*q*(1-q)) (binomial order statistics), widened to the edges of their buckets; None under
    MIN_CALLS calls."""
    n = h.calls
    if n < MIN_CALLS:
        return None
    sd = math.sqrt(n * q * (1 - q))
    rank_lo, rank_hi = max(n * q - z * sd, 0.0), min(n * q + z * sd, float(n))
    lo = hi = None
    seen = 0
    for bucket_lo, bucket_hi, c in h.buckets:
        if lo is None and seen + c >= max(rank_lo, 1e-9):
            lo = bucket_lo
        if seen + c >= rank_hi:
            hi = bucket_hi
            break
        seen += c
    lo = h.buckets[0][0] if lo is None else lo
    hi = h.buckets[-1][1] if hi is None else hi
    if h.max_ns:  # the bucket edges can lie outside what was measured
        lo, hi = max(lo, h.min_ns), min(hi, h.max_ns)
    return float(lo), float(max(hi, lo))


def judge(
    matters: bool,
    interval: tuple[float, float] | None,
    *,
    short: bool = False,
    widen: float = 0.0,
    note: str = "",
    scale: float = 1.0,
) -> Noise:
    """Return the verdict on a difference given its interval (widened by ``widen`` on each side), whether it is
    large enough to matter, and whether a side was too short; ``scale`` converts the interval to the
    difference's unit."""
    if interval is None:
        if short:
            return Noise(verdict="too_short", ci_lo=None, ci_hi=None, note=note or "too few seconds of loop")
        return Noise(verdict="not_tested", ci_lo=None, ci_hi=None, note=note)
    lo, hi = (interval[0] - widen) * scale, (interval[1] + widen) * scale
    real = lo > 0 or hi < 0
    if real and not matters:
        note = note or "a real difference, but too small to matter"
    verdict = "beyond_noise" if real and matters else "within_noise"
    return Noise(verdict=verdict, ci_lo=for_display(lo), ci_hi=for_display(hi), note=note)


def for_display(v: float) -> float:
    """Round for display: 4 significant digits past the point, whatever the magnitude."""
    return round(v, max(0, 3 - int(math.floor(math.log10(abs(v))))) if v else 0) if math.isfinite(v) else v


def relative_change(before: float, after: float) -> float:
    """Return |after - before| over the larger of the two magnitudes (0 when both are 0)."""
    top = max(abs(before), abs(after))
    return abs(after - before) / top if top else 0.0
