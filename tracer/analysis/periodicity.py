"""Outliers of a series of durations and the period of the slow ones: "every 40th step: +54 ms".

Pure functions over a list of durations, so the rule is tested without a recording:

- *typical* is the median, *spread* the median absolute deviation (scaled to a standard deviation's units, 1.4826):
  both robust to the slow values themselves (a mean and a standard deviation would move with a 54 ms checkpoint
  every 40 steps of 3 ms);
- a value is *slow* above ``typical + margin``, ``margin = max(SPREADS x spread, SLOW_SHARE x typical)``: the
  share floor keeps a loop with almost no jitter from calling every timer tick an outlier;
- a value's *excess* is how far it stands above its neighbours (the median of the NEIGHBOURHOOD values either
  side). Patterns are looked for among the values whose excess is more than SLOW_SHARE of a typical value (the
  *candidates*), not among slow values: on a shared machine a burst of contention makes a hundred steps in a row
  slow, and inside a burst every period looks like a pattern; a checkpoint stands out from its neighbours, burst
  or not. Nor is a candidate held to SPREADS spreads: on a host where most steps lose a few ms to other jobs, the
  spread is a few ms, and a 13 ms checkpoint every 40 steps, plain to the eye, fell under 5 of them half the time
  (the period then came out as "every 120th", the checkpoints that happened to clear it). What a single value
  cannot show, a period does: the chance test below decides;
- a *pattern* is a period P, a phase r and a height h such that at least PATTERN_HIT of the values at r, r + P,
  r + 2P, ... (from its first to its last member) stand out by h or more, MIN_PATTERN of them at least, and
  - it spans at least MIN_SPAN of the series: spikes every few steps for 150 ms in one corner of a run are not
    the loop's period;
  - chance does not explain it: with q the share of the values it spans that stand out by h or more, the binomial
    probability of that many among its positions is below ALPHA over the number of (period, phase, height)
    triples there are to try (inside a burst, where most steps stand out, a "period" is chance). The heights
    tried are the phase's own candidates' (HEIGHTS of them, the lowest included), so one cheap checkpoint (a
    fsync with nothing to flush) lowers neither the bar of the others nor the odds against them.
  Its members are every candidate at its phase from its first member to its last (inside that stretch every
  value at the phase is the periodic work's, the cheap checkpoint included; beyond it a candidate is as likely
  another job's), and its added time is their median excess: what the periodic work adds to a step, less what
  its neighbours had anyway.
- Candidate periods are the differences between candidates' indices, to the next NEIGHBOURS candidates among
  the highest 3, 6, 12, ... MAX_SPIKES (so neither irregular candidates in between nor a dense floor of them from
  other jobs hides the period of the highest), each tried at the phases of the pairs that differ by it.
- The least likely pattern is taken first, not the largest: every 20th step (the checkpoints and, between them,
  spikes of other jobs that fell there) does not win over every 40th. Its values are then set aside and the
  search repeats (a loop can checkpoint every 40 steps and evaluate every 100): a later pattern may hold an
  earlier one's values (step 200 is in both), but its odds are those of its other values, so every 20th is no
  pattern for holding every 40th's checkpoints. The patterns are returned by the time they add in all, most
  first.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

MAD_SCALE = 1.4826  # median absolute deviation -> standard deviation, for normally distributed jitter
SPREADS = 5.0
SLOW_SHARE = 0.20
NEIGHBOURHOOD = 4  # values either side that a value's excess is measured against
MIN_PATTERN = 3
PATTERN_HIT = 0.8
MAX_PATTERNS = 3
MAX_SPIKES = 400  # candidates whose index differences are candidate periods (the highest kept)
NEIGHBOURS = 8  # differences to the next this many candidates: irregular ones between a pattern's members
HEIGHTS = 8  # heights tried per (period, phase): its candidates' excesses, evenly by rank, the lowest included
MIN_SPAN = 1 / 3
ALPHA = 0.01
_HIT = Fraction(PATTERN_HIT).limit_denominator(100)


@dataclass(frozen=True)
class Spread:
    """The usual value of a series and how far it strays."""

    typical: float
    spread: float

    @property
    def margin(self) -> float:
        return max(SPREADS * self.spread, SLOW_SHARE * self.typical)

    @property
    def threshold(self) -> float:
        return self.typical + self.margin


@dataclass(frozen=True)
class Pattern:
    """Values at phase + k x every: ``members`` are their indices (the candidates only), ``added`` their median
    excess over their neighbours."""

    every: int
    phase: int
    members: tuple[int, ...]
    expected: int  # values at that phase from the first member to the last
    added: float

    @property
    def hit(self) -> float:
        return len(self.members) / self.expected if self.expected else 0.0


def spread_of(values: list[float]) -> Spread:
    """Return the median and the scaled median absolute deviation of ``values`` (0, 0 for none)."""
    if not values:
        return Spread(0.0, 0.0)
    med = statistics.median(values)
    return Spread(med, MAD_SCALE * statistics.median(abs(v - med) for v in values))


def slow_indices(values: list[float], spread: Spread) -> list[int]:
    """Return the indices of the values above the spread's threshold, in order."""
    th = spread.threshold
    return [i for i, v in enumerate(values) if v > th]


def neighbours(n: int, i: int) -> list[int]:
    """Return the indices of the NEIGHBOURHOOD values either side of ``i`` (fewer at the ends)."""
    return [j for j in range(max(i - NEIGHBOURHOOD, 0), min(i + NEIGHBOURHOOD + 1, n)) if j != i]


def excess(values: list[float]) -> list[float]:
    """Return each value less the median of its neighbours (:func:`neighbours`)."""
    n = len(values)
    return [v - statistics.median(values[j] for j in neighbours(n, i)) if n > 1 else 0.0 for i, v in enumerate(values)]


class _Search:
    """The values that stand out from their neighbours by more than SLOW_SHARE of a typical value (the
    candidates), and which of them an earlier pattern took."""

    def __init__(self, over: list[float], bar: float) -> None:
        self.n = len(over)
        self.over = over
        self.bar = bar
        self.high = np.asarray(over, dtype=float)
        self.at = [i for i, e in enumerate(over) if e > bar]  # in order
        self.left = set(self.at)  # candidates in no earlier pattern
        self.free = np.ones(self.n, dtype=bool)  # values in no earlier pattern

    def take(self, members: tuple[int, ...]) -> None:
        """Set ``members`` aside: a later pattern's odds are those of its other values."""
        self.left.difference_update(members)
        self.free[list(members)] = False

    def share_at_least(self, h: float, first: int, last: int) -> float:
        """The share of the values ``first`` .. ``last`` in no earlier pattern that stand out by ``h`` or more."""
        free = self.free[first : last + 1]
        return int(np.count_nonzero((self.high[first : last + 1] >= h) & free)) / max(int(free.sum()), 1)


def find_patterns(values: list[float], spread: Spread) -> list[Pattern]:
    """Return the periodic patterns among the values that stand out from their neighbours (see the module
    docstring), most added time first."""
    s = _Search(excess(values), SLOW_SHARE * spread.typical)
    out: list[Pattern] = []
    while len(out) < MAX_PATTERNS and len(s.left) >= MIN_PATTERN:
        periods = _periods(s)
        # the chance a pattern must be under: ALPHA over the (period, phase, height) triples there are to try
        limit = math.log(ALPHA) - math.log(max(sum(periods), 1) * HEIGHTS)
        best = _least_likely(s, periods, limit)
        if best is None:
            break
        out.append(best)
        s.take(best.members)
    return sorted(out, key=lambda p: (-p.added * len(p.members), p.every))


def _periods(s: _Search) -> dict[int, set[int]]:
    """The differences between candidates' indices to the next NEIGHBOURS, among the highest 3, 6, 12, ...
    MAX_SPIKES candidates, one of them in no earlier pattern; with, for each, the phases of the pairs that differ
    by it: a pattern's own members are such pairs, so other phases are not searched."""
    ranked = sorted(s.at, key=lambda i: -s.over[i])[:MAX_SPIKES]
    periods: dict[int, set[int]] = {}
    size = MIN_PATTERN
    while True:
        level = sorted(ranked[:size])
        for x, a in enumerate(level):
            for b in level[x + 1 : x + 1 + NEIGHBOURS]:
                if 2 <= b - a <= s.n // MIN_PATTERN and (a in s.left or b in s.left):
                    periods.setdefault(b - a, set()).add(a % (b - a))
        if size >= len(ranked):
            return periods
        size *= 2


def _least_likely(s: _Search, periods: dict[int, set[int]], limit: float) -> Pattern | None:
    """The pattern least likely by chance (its log chance at most ``limit``) with at least MIN_PATTERN candidates
    in no earlier pattern; a step slow for two reasons (a checkpoint every 40 steps and an evaluation every 100:
    step 200) counts in both."""
    best: tuple[float, float, int] | None = None
    found: Pattern | None = None
    for p in sorted(periods):
        for r in sorted(periods[p]):
            fit = _at_phase(s, p, r, min(limit, best[0]) if best else limit)
            if fit is None:
                continue
            chance, pat = fit
            key = (chance, -pat.added * len(pat.members), p)
            if best is None or key < best:
                best, found = key, pat
    return found


def _at_phase(s: _Search, every: int, phase: int, limit: float) -> tuple[float, Pattern] | None:
    """The log chance and the pattern of the candidates at ``phase`` of period ``every``, if it is at most
    ``limit``, with MIN_PATTERN of them in no earlier pattern."""
    fewest = _fewest(s.n, every)
    members = [i for i in range(phase, s.n, every) if s.over[i] > s.bar]
    if len(members) < fewest or sum(i in s.left for i in members) < MIN_PATTERN:
        return None
    fit = _best_height(s, members, every, fewest, limit)
    return (fit[0], _grown(s, members, every, phase, fit[1])) if fit else None


def _best_height(
    s: _Search, members: list[int], every: int, fewest: int, limit: float
) -> tuple[float, list[int]] | None:
    """The log chance and the run of the height at which one phase's candidates (``members``) are least likely
    by chance, if that is at most ``limit``: the longest stretch in which PATTERN_HIT of the phase's values stand
    out that far, spanning MIN_SPAN of the series with MIN_PATTERN candidates in no earlier pattern."""
    levels = sorted({s.over[i] for i in members})
    heights = sorted({levels[k * (len(levels) - 1) // max(HEIGHTS - 1, 1)] for k in range(HEIGHTS)})
    best: tuple[float, list[int]] | None = None
    for h in heights:
        at = [i for i in members if s.over[i] >= h]
        if len(at) < fewest or sum(i in s.left for i in at) < MIN_PATTERN:
            break  # higher heights keep fewer
        run = _densest_run(at, every)
        if run is None or run[-1] - run[0] < MIN_SPAN * s.n:
            continue
        # the odds are those of its values in no earlier pattern: every 20th step is no pattern for holding
        # every 40th's checkpoints and, between them, a few steps other jobs slowed
        hits = sum(i in s.left for i in run)
        trials = (run[-1] - run[0]) // every + 1 - (len(run) - hits)
        if hits < MIN_PATTERN:
            continue
        # its own values stand out that far: the least q can be, and the most likely it is not by chance
        if _log_tail(trials, hits, hits / (run[-1] - run[0] + 1)) > min(limit, best[0] if best else limit):
            continue
        chance = _log_tail(trials, hits, s.share_at_least(h, run[0], run[-1]))
        if chance <= limit and (best is None or chance < best[0]):
            best = (chance, run)
    return best


def _fewest(n: int, every: int) -> int:
    """The fewest members a pattern of period ``every`` in ``n`` values has: it spans MIN_SPAN of them, and
    PATTERN_HIT of the phase's values in its span are members."""
    return max(MIN_PATTERN, math.ceil(_HIT * (math.ceil(MIN_SPAN * n) // every + 1)))


def _grown(s: _Search, members: list[int], every: int, phase: int, run: list[int]) -> Pattern:
    """The pattern of ``run``, with every candidate at its phase from its first member to its last: inside the run
    every value at the phase is the periodic work's, however little it added (not beyond it: there a candidate
    is as likely another job's)."""
    kept = tuple(i for i in members if run[0] <= i <= run[-1])
    return Pattern(every, phase, kept, (run[-1] - run[0]) // every + 1, statistics.median(s.over[i] for i in kept))


def _densest_run(members: list[int], every: int) -> list[int] | None:
    """Return the longest stretch of ``members`` (one phase's values, in order) in which at least PATTERN_HIT of
    the phase's indices are members, MIN_PATTERN at least (the earliest of the longest); None when there is none.

    With k_j = members[j] // every, the stretch j..l holds l - j + 1 of k_l - k_j + 1 indices: with PATTERN_HIT
    = a/b it is dense enough when a k_l - b l <= a k_j - b j + (b - a), so for each l the stretch starts at the
    first j whose key reaches a k_l - b l - (b - a): a binary search in the keys' running maximum."""
    a, b = _HIT.numerator, _HIT.denominator
    key = [a * (m // every) - b * j for j, m in enumerate(members)]
    top: list[int] = []  # running maximum of key
    best: tuple[int, int] | None = None
    for j, k in enumerate(key):
        top.append(max(k, top[-1]) if top else k)
        start = bisect.bisect_left(top, k - (b - a))
        if j - start + 1 >= MIN_PATTERN and (best is None or j - start > best[1] - best[0]):
            best = (start, j)
    return members[best[0] : best[1] + 1] if best else None


def _log_tail(trials: int, hits: int, q: float) -> float:
    """log P(X >= hits) for X ~ Binomial(trials, q), in logs: a pattern of hundreds of steps is less likely than
    a float can hold."""
    if q >= 1.0:
        return 0.0
    terms = [
        math.lgamma(trials + 1)
        - math.lgamma(k + 1)
        - math.lgamma(trials - k + 1)
        + k * math.log(q)
        + (trials - k) * math.log1p(-q)
        for k in range(hits, trials + 1)
    ]
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms))
