"""Which rank is slow, in which phase, who waits for it, and when: read from the ranks' table (:mod:`.table`).

Ranks of a data-parallel job step in lockstep: a collective returns on every rank only once the last one has
arrived, so every rank's step takes as long as the slowest one's, and the time the others spend waiting in the
collective is the straggler's extra time. The straggler is therefore the rank that waits least in collectives (the
fast ones wait for it; it waits for nobody). It is one when the other ranks each wait at least
:data:`MIN_WAIT_SHARE` of the time it was slow in (the window, or its hot range when confined) more than it does.
Its slow phase is the phase (on CPU, asleep, disk I/O, waiting for a CPU, waiting for the GPU, ...) in which it
spends the most time above the median of the other ranks; the excesses of all its phases should add up to about the
others' extra wait, and ``explained`` says how much of it they do.

When: a second of the common window is *hot* when the other ranks' median collective wait exceeds the straggler's by
:data:`HOT_SECOND_FRAC` of the second and the straggler's time in its slow phase exceeds theirs by half that; the
straggler is *persistent* when the hot seconds cover at least
:data:`PERSISTENT_FRAC` of the window, else confined to the range of its hot seconds.

Noise: in a healthy job some rank always waits least, by a little, and on a busy host one rank can get less of the
CPU for a moment. A straggler needs :data:`MIN_HOT_S` hot seconds in a run, one cool second apart at most (a
slowdown that lasts, at the breakdown's one-second grain; a lone hot second elsewhere is left out of its range) and
a window of at least :data:`MIN_WINDOW_NS` (the chains' shortest loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from tracer.analysis.breakdown.thread_time import S
from tracer.analysis.ranks.phases import COLLECTIVE, PHASES
from tracer.analysis.ranks.table import RankTable, RankTime

# The others must each wait >= 5 % of the window more than the straggler: below, ranks differ by jitter (the
# chains' MEDIUM threshold, the smallest share a cause is worth naming at).
MIN_WAIT_SHARE = 0.05
# the straggler's own extra time must explain at least half of what the others wait: else the waits have another
# cause (a slow link, an unequal split of the work the table cannot see)
MIN_EXPLAINED = 0.5
HOT_SECOND_FRAC = 0.10
PERSISTENT_FRAC = 0.8
MIN_WINDOW_NS = 1_000_000_000
MIN_HOT_S = 2


@dataclass(frozen=True)
class RankWait:
    """A rank that waited for the straggler: its collective wait and the part above the straggler's."""

    rank: int
    pid: int
    tid: int
    wait_ns: float
    extra_ns: float


@dataclass(frozen=True)
class Straggler:
    """The slow rank of a job and what it cost the others, over the table's common window."""

    rank: int
    pid: int
    tid: int
    phase: str  # of PHASES, never COLLECTIVE
    excess_ns: dict[str, float]  # its time above the others' median, per phase (positive ones only)
    waits: list[RankWait]
    lost_ns: float  # the median extra wait of the others: time every rank lost per rank in the window
    explained: float  # sum of its excesses / lost_ns
    steps: float | None
    start_ns: int  # the hot range
    end_ns: int
    persistent: bool

    @property
    def phase_excess_ns(self) -> float:
        return self.excess_ns.get(self.phase, 0.0)


def find_straggler(table: RankTable) -> Straggler | None:
    """Return the table's straggler, or None when the ranks wait for each other about equally."""
    window = table.window_ns
    ranks = table.ranks
    if window < MIN_WINDOW_NS or len(ranks) < 2:
        return None
    slow = min(ranks, key=lambda r: (r.total.get(COLLECTIVE, 0.0), r.rank))
    others = [r for r in ranks if r is not slow]
    mine = slow.total.get(COLLECTIVE, 0.0)
    waits = [
        RankWait(r.rank, r.pid, r.tid, r.total.get(COLLECTIVE, 0.0), r.total.get(COLLECTIVE, 0.0) - mine)
        for r in others
    ]
    # the others' extra wait is judged against the time the straggler was slow in: the whole window when it was
    # slow throughout, else its hot range. Against the whole window, a straggler confined to 80 steps (~1.6 s) fell
    # under the 5 % when a loaded machine stretched the window from 11 s to 26 s, and in an hour's recording any
    # confined one would
    excess = {}
    for p in PHASES:
        if p == COLLECTIVE:
            continue
        e = slow.total.get(p, 0.0) - median(r.total.get(p, 0.0) for r in others)
        if e > 0:
            excess[p] = e
    if not excess:
        return None
    phase = max(excess, key=lambda p: (excess[p], p))
    hot = _hot_range(table, slow, others, phase)
    if hot is None:
        return None
    a, b, persistent = hot
    if min(w.extra_ns for w in waits) < MIN_WAIT_SHARE * (window if persistent else b - a):
        return None
    lost = median(w.extra_ns for w in waits)
    explained = sum(excess.values()) / lost if lost > 0 else 0.0
    if explained < MIN_EXPLAINED:
        return None
    return Straggler(
        rank=slow.rank,
        pid=slow.pid,
        tid=slow.tid,
        phase=phase,
        excess_ns=excess,
        waits=waits,
        lost_ns=lost,
        explained=explained,
        steps=table.steps(),
        start_ns=a,
        end_ns=b,
        persistent=persistent,
    )


def _hot_range(table: RankTable, slow: RankTime, others: list[RankTime], phase: str) -> tuple[int, int, bool] | None:
    """The range of the straggler's hot seconds that last (:func:`_lasting`), and whether it is persistent. A hot
    second must also hold the straggler's time in its slow ``phase`` above the others', at least half the
    others' extra wait's bar (MIN_EXPLAINED x HOT_SECOND_FRAC of the second): a second in which it was slow for
    another reason is not this slowdown's (suite run 1 of stop 38, two loads: a rank asleep for 2.2 s read as
    slow for 5 s, the range stretched to a second in which the load had taken its CPU)."""
    hot: dict[int, float] = {}  # hot second -> the straggler's time in the window in it
    all_wall = 0.0
    for sec in sorted(slow.by_sec):
        mine = slow.by_sec[sec]
        wall = sum(mine.values())  # its time in the window in that second (edge seconds: a part)
        all_wall += wall
        present = [r.by_sec[sec] for r in others if sec in r.by_sec]
        if wall <= 0 or not present:
            continue
        extra = median(r[COLLECTIVE] for r in present) - mine[COLLECTIVE]
        own = mine.get(phase, 0.0) - median(r.get(phase, 0.0) for r in present)
        if extra >= HOT_SECOND_FRAC * wall and own >= MIN_EXPLAINED * HOT_SECOND_FRAC * wall:
            hot[sec] = wall
    kept = _lasting(sorted(hot))
    if not kept:
        return None
    a, b = max(kept[0] * S, table.start_ns), min((kept[-1] + 1) * S, table.end_ns)
    return a, b, sum(hot[sec] for sec in kept) >= PERSISTENT_FRAC * all_wall


def _lasting(hot: list[int]) -> list[int]:
    """Return the hot seconds (sorted) that belong to a slowdown that lasts: a run of at least MIN_HOT_S of them,
    one cool second apart at most. A lone hot second is noise wherever it falls (on a busy host a rank that lost
    its CPU for a moment made one a few seconds from a 2 s slowdown, and the straggler read as slow for 6 s)."""
    runs: list[list[int]] = []
    for sec in hot:
        if runs and sec - runs[-1][-1] <= 2:
            runs[-1].append(sec)
        else:
            runs.append([sec])
    return [sec for run in runs if len(run) >= MIN_HOT_S for sec in run]
