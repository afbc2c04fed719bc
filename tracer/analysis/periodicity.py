"""Outliers of a series of durations and the period of the slow ones: "every 40th step: +54 ms".

Pure functions over a list of durations, so the rule is tested without a recording:

- *typical* is the median, *spread* the median absolute deviation (scaled to a standard deviation's units, 1.4826):
  both robust to the slow values themselves (a mean and a standard deviation would move with a 54 ms checkpoint
  every 40 steps of 3 ms);
- a value is *slow* above ``typical + margin``, ``margin = max(SPREADS x spread, SLOW_SHARE x typical)``: the
  share floor keeps a loop with almost no jitter from calling every timer tick an outlier;
- a value's *excess* is how far it stands above its neighbours (the median of the NEIGHBOURHOOD values either
  side), and it is a *spike* when that is more than the margin. Patterns are looked for among spikes, not slow
  values: on a shared machine a burst of contention makes a hundred steps in a row slow, and inside a burst every
  period looks like a pattern; a checkpoint stands out from its neighbours, burst or not. A pattern's added time
  is its members' median excess: what the periodic work adds to a step, less what its neighbours had anyway;
- a *pattern* is a period P and a phase r such that at least PATTERN_HIT of the values at r, r + P, r + 2P, ...
  (from its first to its last spike) are spikes, MIN_PATTERN of them at least, and
  - it spans at least MIN_SPAN of the series: spikes every few steps for 150 ms in one corner of a run are not
    the loop's period;
  - chance does not explain it: with q the share of the values it spans that stand out at least as far as its
    least member, the binomial probability of that many hits among its positions is below ALPHA over the number
    of (period, phase) pairs tried (inside a burst, where most steps stand out, a "period" is chance).
  Candidate periods are the differences between spikes' indices, so irregular spikes in between do not hide it;
  of the patterns found, the one that adds most time in all wins, its values are set aside, and the search repeats
  (a loop can checkpoint every 40 steps and evaluate every 100).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

MAD_SCALE = 1.4826  # median absolute deviation -> standard deviation, for normally distributed jitter
SPREADS = 5.0
SLOW_SHARE = 0.20
NEIGHBOURHOOD = 4  # values either side that a value's excess is measured against
MIN_PATTERN = 3
PATTERN_HIT = 0.8
MAX_PATTERNS = 3
MAX_SPIKES = 400  # spikes whose index differences are candidate periods (the largest kept)
NEIGHBOURS = 8  # differences to the next this many spikes: irregular spikes between a pattern's members
MIN_SPAN = 1 / 3
ALPHA = 0.01


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
    """Spikes at phase + k x every: ``members`` are their indices (the spikes only), ``added`` their median
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


def find_patterns(values: list[float], spread: Spread) -> list[Pattern]:
    """Return the periodic patterns among the spikes of ``values`` (see the module docstring), most added time
    first."""
    n = len(values)
    over = excess(values)
    every = [i for i, e in enumerate(over) if e > spread.margin]
    left = list(every)
    out: list[Pattern] = []
    while len(out) < MAX_PATTERNS and len(left) >= MIN_PATTERN:
        best = _best_pattern(n, every, set(left), over)
        if best is None:
            break
        out.append(best)
        taken = set(best.members)
        left = [i for i in left if i not in taken]
    return out


def _best_pattern(n: int, every: list[int], left: set[int], over: list[float]) -> Pattern | None:
    """The pattern adding most time with at least MIN_PATTERN spikes not in an earlier pattern (``left``); a step
    slow for two reasons (a checkpoint every 40 steps and an evaluation every 100: step 200) counts in both."""
    kept = sorted(sorted(every, key=lambda i: -over[i])[:MAX_SPIKES])
    periods = {
        b - a
        for x, a in enumerate(kept)
        for b in kept[x + 1 : x + 1 + NEIGHBOURS]
        if 2 <= b - a <= n // MIN_PATTERN and (a in left or b in left)
    }
    tried = sum(periods)  # (period, phase) pairs
    best: Pattern | None = None
    for p in sorted(periods):
        by_phase: dict[int, list[int]] = {}
        for i in every:
            by_phase.setdefault(i % p, []).append(i)
        for r, members in by_phase.items():
            if sum(i in left for i in members) < MIN_PATTERN:
                continue
            # the longest run of the phase's values that are mostly spikes: from a spike to a spike
            run = _densest_run(members, p)
            if run is None or run[-1] - run[0] < MIN_SPAN * n or sum(i in left for i in run) < MIN_PATTERN:
                continue
            expected = (run[-1] - run[0]) // p + 1
            # chance, from the values the run spans: inside a burst of contention spikes are common
            floor = min(over[i] for i in run)
            q = sum(over[j] >= floor for j in range(run[0], run[-1] + 1)) / (run[-1] - run[0] + 1)
            if _tail(expected, len(run), q) * tried > ALPHA:
                continue
            pat = Pattern(p, r, tuple(run), expected, statistics.median(over[i] for i in run))
            if best is None or (pat.added * len(run), -p) > (best.added * len(best.members), -best.every):
                best = pat
    return best


def _densest_run(members: list[int], every: int) -> list[int] | None:
    """Return the longest stretch of ``members`` (one phase's spikes) in which at least PATTERN_HIT of the phase's
    indices are spikes, MIN_PATTERN at least; None when there is none."""
    best: list[int] | None = None
    for a in range(len(members)):
        for b in range(len(members) - 1, a + MIN_PATTERN - 2, -1):
            run = members[a : b + 1]
            expected = (run[-1] - run[0]) // every + 1
            if len(run) / expected >= PATTERN_HIT:
                if best is None or len(run) > len(best):
                    best = run
                break
        if best is not None and len(best) >= len(members) - a:
            break
    return best


def _tail(trials: int, hits: int, q: float) -> float:
    """P(X >= hits) for X ~ Binomial(trials, q)."""
    return sum(math.comb(trials, k) * q**k * (1 - q) ** (trials - k) for k in range(hits, trials + 1))
