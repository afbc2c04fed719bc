"""Did the fix work? Two recordings of one workload compared (BEFORE, AFTER): steps/s, where the training
thread's time went, per-op rates and latency, and the causal chains that appeared, went away or changed, each
difference judged against the recordings' own variance.

What is compared, and from where:
- **The training loop.** Each recording's training thread and its *steps* (first launch or sync to the end of
  the last) come from the chains' context (:class:`tracer.analysis.chains.ChainContext`), so set-up (imports,
  attaching, forking the loader) counts on neither side. Its parts are the breakdown's
  (:mod:`tracer.analysis.breakdown`) over the loop's whole seconds (an edge second's row also holds time from
  before or after the loop), the seconds the noise tests sample.
- **Steps.** A step ends where the training thread waits for the GPU (the catalog's ``waits_for_gpu`` calls):
  the marker is the wait it makes most often. When both sides queue the same number of launches per marker,
  steps/s is the markers' rate. When one side waits k times less often (a fix that reads the loss every k steps)
  or not at all, a step is the launches between two waits of the side that waits most often, and both sides'
  steps/s are their launches/s over that. Otherwise (launches per step changed: fused kernels, CUDA graphs) the
  rates are shown, marked not comparable. ``steps.method`` says which held.
- **Ops.** Calls, total time and p50/p99 per (op, layer) over every pid are :func:`tracer.analysis.stats.op_stats`
  (exact, from the in-kernel histograms); rates are per second of the training loop's span.
- **Chains.** Recomputed on both sides by the chains package (as ``tracer chains`` does; a stored
  ``causal_chains`` row may come from an older tracer), then paired by (category, culprit kind, relation, name):
  pids and Python lines change between two runs and between two versions of the code.

Noise. Every per-second quantity (steps, each part's share, each op's calls and time) is a sample of the
recording's own seconds: the difference of the two means gets a percentile bootstrap interval (seconds merged
into at most MAX_BLOCKS consecutive blocks, whose means absorb short-range correlation; RESAMPLES resamples,
seeded, so a comparison always gives the same answer), at a Bonferroni level over every test the comparison makes
(family-wise ALPHA). A latency quantile gets the distribution-free order-statistic interval of its exact
histogram, widened to bucket edges; two quantiles differ when their intervals do not overlap. Duty-cycled counts
(``op_stats.sampled_fraction`` < 1) widen their intervals by ``error_pct``. A difference is *beyond noise* when
its interval excludes zero and it is large enough to matter (MIN_SHARE_DELTA of the thread's time,
MIN_REL_DELTA of a rate or latency); *too_short* when a side has fewer than MIN_SECONDS whole seconds of loop.
"""

from __future__ import annotations

import math
import shlex
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from statistics import NormalDist
from typing import Annotated, Literal, TypeVar

import duckdb
import numpy as np
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.breakdown import PartTime, parts_of
from tracer.analysis.chains import CausalChain, ChainContext, Subject, detect_all
from tracer.analysis.chains.model import SEVERITIES
from tracer.analysis.chains.sync_stall import sync_ops
from tracer.analysis.stats import OpStat, environment, op_stats
from tracer.analysis.taxonomy import PART_NAMES
from tracer.db import recording_state
from tracer.hist import merge

S = 1_000_000_000
MS = 1_000_000
ALPHA = 0.05  # family-wise error rate over all the tests of one comparison (Bonferroni)
MIN_SECONDS = 5  # whole seconds of loop per side below which a per-second test cannot tell noise from change
MAX_BLOCKS = 40  # per-second values are merged into at most this many consecutive blocks before resampling
RESAMPLES = 20_000  # enough for ~10 resamples beyond the Bonferroni tail of 50 tests
SEED = 13  # issue 13: fixed, so the CLI and the MCP tool give the same answer on the same files
# Below these a difference does not change what to fix: a part moving by less than one point of the thread's
# time, a rate or latency by less than 2% (chains.context.LOW_SHARE: 2% of a step is a training loop's jitter).
MIN_SHARE_DELTA = 0.01
MIN_REL_DELTA = 0.02
MIN_CALLS = 20  # a latency quantile of fewer calls is not compared
# launches per step on both sides within this (plus the launch counts' error bounds) count as the same step
CADENCE_TOL = 0.05
# shared kernel names (or ops) below this Jaccard index: probably two different workloads
SAME_WORKLOAD_MIN = 0.5
TOP_OPS = 12  # ops shown in the summary lines
NOISE_TEST = (
    "per-second values (steps, each part's share of the training thread, each op's calls and time): percentile "
    f"bootstrap of the difference of means ({RESAMPLES:,} resamples of up to {MAX_BLOCKS} blocks of consecutive "
    "seconds); latency p50/p99: order-statistic interval of the exact histogram, bucket-widened; duty-cycled counts "
    f"widened by error_pct; Bonferroni over all tests, family-wise alpha {ALPHA}"
)

_T = TypeVar("_T")
Verdict = Literal["beyond_noise", "within_noise", "too_short", "not_tested"]
Presence = Literal["both", "before_only", "after_only"]
ChainStatus = Literal["appeared", "gone", "worse", "better", "unchanged"]


# ---------------------------------------------------------------------------------------------- records
class Noise(Record):
    """Whether a difference is beyond the recordings' own variance, and its interval."""

    verdict: Annotated[
        Verdict,
        Field(
            description="beyond_noise (interval excludes 0 and the change is large enough to matter) | "
            "within_noise | too_short (a side has too few seconds or calls to tell) | not_tested"
        ),
    ]
    ci_lo: Annotated[float | None, Field(description="lower end of the difference's interval (the delta's unit)")]
    ci_hi: Annotated[float | None, Field(description="upper end")]
    note: str = ""


class RecordingRef(Record):
    """One side of the comparison."""

    name: Annotated[str, Field(description="the recording's file, as named")]
    target: Annotated[str, Field(description="session.target: the command, or pid N")]
    started_at: str
    duration_s: float
    status: str
    basis: Annotated[str, Field(description="exact (thread_breakdown) | estimated (older recording) | none")]
    training_pid: int | None
    training_tid: int | None
    training_comm: str
    loop_start_s: Annotated[float, Field(description="the training loop's first launch or sync, s since start")]
    loop_s: Annotated[float, Field(description="length of the training loop (its steps), s: the rates' denominator")]
    seconds: Annotated[int, Field(description="whole seconds of loop: the samples of the per-second noise tests")]


class StepSide(Record):
    """Steps of one recording."""

    steps: Annotated[float | None, Field(description="steps in the loop (exact count, or launches / step size)")]
    steps_per_s: float | None
    marker: Annotated[str | None, Field(description="the training thread's most frequent wait for the GPU")]
    markers: Annotated[float, Field(description="calls of the marker on the training thread")]
    launches: Annotated[float, Field(description="kernel launches of the training thread (scaled when duty-cycled)")]
    launches_per_marker: float | None
    launch_error_pct: Annotated[float, Field(description="bound on the launch count's error, % (0: exact)")]


class StepsCompare(Record):
    """Steps/s before and after, when a step can be seen."""

    detected: bool
    comparable: Annotated[bool, Field(description="both sides count the same unit of work as a step")]
    method: Annotated[str, Field(description="how a step was detected, in words (or why none could be)")]
    launches_per_step: Annotated[float | None, Field(description="launches in one step, when steps are counted so")]
    before: StepSide
    after: StepSide
    delta_per_s: float | None
    delta_pct: float | None
    noise: Noise


class PartDelta(Record):
    """One part of the training thread's time, before and after, over its loop's whole seconds."""

    part: Annotated[str, Field(description=" | ".join(PART_NAMES))]
    before_ms: float
    after_ms: float
    before_share: Annotated[float, Field(description="share of the thread's steps' time, 0..1")]
    after_share: float
    delta_points: Annotated[float, Field(description="after - before share, in percentage points")]
    before_ms_per_step: Annotated[float | None, Field(description="share x step time (when steps are comparable)")]
    after_ms_per_step: float | None
    noise: Annotated[Noise, Field(description="on the per-second shares; ci in percentage points")]


class TrainingCompare(Record):
    """The training thread's time breakdown before and after, parts that changed most first: over the whole
    seconds of its loop (an edge second also holds time from before or after the loop), or over the whole loop
    when it is too short to test."""

    before_wall_ms: Annotated[float, Field(description="the thread's time the parts split, ms")]
    after_wall_ms: float
    parts: list[PartDelta]


class OpDelta(Record):
    """One CUDA op (per layer, every pid) before and after: exact counts and latency from op_stats."""

    op: str
    layer: str
    part: Annotated[str, Field(description="launch | sync | alloc | free | copy | other (probe catalog)")]
    presence: Annotated[Presence, Field(description="both | before_only | after_only")]
    calls_before: int
    calls_after: int
    calls_per_s_before: Annotated[float, Field(description="calls per second of the training loop")]
    calls_per_s_after: float
    calls_delta_pct: Annotated[float | None, Field(description="change of calls/s, % (null when it had none)")]
    total_ms_before: float
    total_ms_after: float
    ms_per_s_before: Annotated[float, Field(description="time in the op per second of loop, ms/s")]
    ms_per_s_after: float
    p50_us_before: float | None
    p50_us_after: float | None
    p99_us_before: float | None
    p99_us_after: float | None
    error_pct_before: Annotated[float, Field(description="count error bound when duty-cycled, % (0: exact)")]
    error_pct_after: float
    rate_noise: Annotated[Noise, Field(description="calls/s; ci in calls/s")]
    time_noise: Annotated[Noise, Field(description="ms/s; ci in ms/s")]
    p50_noise: Annotated[Noise, Field(description="ci of after - before, µs")]
    p99_noise: Noise


class ChainChange(Record):
    """A causal chain that appeared, went away, or changed (paired by category and culprit)."""

    category: str
    status: Annotated[ChainStatus, Field(description="appeared | gone | worse | better | unchanged")]
    severity_before: str | None
    severity_after: str | None
    share_before: Annotated[float | None, Field(description="share of the training thread's steps it cost, 0..1")]
    share_after: float | None
    culprit: Annotated[str, Field(description="who or what it blames: comm, relation, code site")]
    op: str
    summary: Annotated[str, Field(description="the chain's summary, from the side that has it (after when both)")]
    note: str = ""


class CompareWarning(Record):
    """Something that makes the comparison less trustworthy, or worth knowing."""

    level: Annotated[Literal["warning", "info"], Field(description="warning | info")]
    kind: Annotated[
        str,
        Field(
            description="different_program | different_workload | different_host | different_options | "
            "different_basis | unfinished | too_short | steps | same_file | arguments | tracer_version"
        ),
    ]
    message: str


class Comparison(Record):
    """Two recordings of one workload compared: the headline, steps/s, the training thread's time, per-op
    deltas and chains, each difference judged against the recordings' own variance."""

    before: RecordingRef
    after: RecordingRef
    headline: Annotated[list[str], Field(description="the differences beyond noise, most important first")]
    noise_test: Annotated[str, Field(description="how noise is judged (the tests, their level)")]
    alpha: Annotated[float, Field(description="family-wise error rate over all the tests")]
    tests: Annotated[int, Field(description="tests made (the Bonferroni divisor)")]
    steps: StepsCompare
    training: Annotated[TrainingCompare | None, Field(description="null when a side has no CUDA thread")]
    ops: Annotated[list[OpDelta], Field(description="every op, largest change of time per second first")]
    chains: Annotated[list[ChainChange], Field(description="changed chains first, worst first")]
    warnings: list[CompareWarning]


# ---------------------------------------------------------------------------------------------- one side
@dataclass
class _OpHist:
    buckets: list[tuple[int, int, int]]
    min_ns: int
    max_ns: int
    error: float  # fraction

    @property
    def calls(self) -> int:
        """Calls the histogram holds (the observed ones: a duty-cycled op's count is scaled, its histogram not)."""
        return sum(c for _, _, c in self.buckets)


@dataclass
class _Side:
    """What one recording contributes, loaded once."""

    name: str
    conn: duckdb.DuckDBPyConnection
    ctx: ChainContext
    subject: Subject | None
    span: tuple[int, int]
    seconds: list[int]  # the whole seconds of the loop: the samples of the per-second tests
    ops: dict[tuple[str, str], OpStat]
    hists: dict[tuple[str, str], _OpHist]
    chains: list[CausalChain]
    stored: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (op, layer) -> (rows, dur)
    by_sec: dict[tuple[str, str], dict[int, tuple[int, int]]] = field(default_factory=dict)

    @property
    def loop_s(self) -> float:
        return max(self.span[1] - self.span[0], 0) / S

    @property
    def short(self) -> bool:
        return len(self.seconds) < MIN_SECONDS

    def per_s(self, count: float) -> float:
        return count / self.loop_s if self.loop_s > 0 else 0.0

    def series(self, rows: dict[int, float]) -> np.ndarray:
        """Return the per-second values ``rows`` (sec -> value in that second) over the loop's whole seconds."""
        return np.array([rows.get(sec, 0.0) for sec in self.seconds], dtype=np.float64)


def _load(conn: duckdb.DuckDBPyConnection, name: str) -> _Side:
    ctx = ChainContext.load(conn)
    s = ctx.training
    span = (s.start_ns, s.end_ns) if s is not None else (0, ctx.info.duration_ns)
    a, b = span
    # only whole seconds of loop: an edge second's breakdown row holds time before or after the loop too
    seconds = list(range(-(-a // S), b // S))
    hists: dict[tuple[str, str], _OpHist] = {}
    err = "coalesce(max(error_pct), 0)" if ctx.info.has("op_stats", "error_pct") else "0"
    for op, layer, e, hs, mn, mx in conn.execute(
        f"SELECT op, coalesce(layer, ''), {err}, list(hist), min(min_ns), max(max_ns) FROM op_stats GROUP BY ALL"
    ).fetchall():
        hists[(op, layer)] = _OpHist(merge(hs or []), mn or 0, mx or 0, e / 100)
    side = _Side(
        name=name,
        conn=conn,
        ctx=ctx,
        subject=s,
        span=span,
        seconds=seconds,
        ops={(o.op, o.layer): o for o in op_stats(conn)},
        hists=hists,
        chains=detect_all(ctx),
    )
    for op, layer, n, dur in conn.execute(
        "SELECT op, coalesce(layer, ''), count(*), sum(dur_ns) FROM cuda_calls GROUP BY ALL"
    ).fetchall():
        side.stored[(op, layer)] = (int(n), int(dur or 0))
    for op, layer, sec, n, dur in conn.execute(
        "SELECT op, coalesce(layer, ''), ts_ns // 1000000000, count(*), sum(dur_ns) FROM cuda_calls "
        "WHERE ts_ns >= $a AND ts_ns < $b GROUP BY ALL",
        {"a": a, "b": b},
    ).fetchall():
        side.by_sec.setdefault((op, layer), {})[int(sec)] = (int(n), int(dur or 0))
    return side


# ---------------------------------------------------------------------------------------------- noise
@dataclass
class _Tests:
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


def quantile_interval(h: _OpHist, q: float, z: float) -> tuple[float, float] | None:
    """Return the distribution-free interval in ns of the q-quantile of histogram ``h``: the values of ranks
    n*q -+ z*sqrt(n*q*(1-q)) (binomial order statistics), widened to the edges of their buckets; None under
    MIN_CALLS calls."""
    n = h.calls
    if n < MIN_CALLS:
        return None
    sd = math.sqrt(n * q * (1 - q))
    r_lo, r_hi = max(n * q - z * sd, 0.0), min(n * q + z * sd, float(n))
    lo = hi = None
    seen = 0
    for b_lo, b_hi, c in h.buckets:
        if lo is None and seen + c >= max(r_lo, 1e-9):
            lo = b_lo
        if seen + c >= r_hi:
            hi = b_hi
            break
        seen += c
    lo = h.buckets[0][0] if lo is None else lo
    hi = h.buckets[-1][1] if hi is None else hi
    if h.max_ns:  # the bucket edges can lie outside what was measured
        lo, hi = max(lo, h.min_ns), min(hi, h.max_ns)
    return float(lo), float(max(hi, lo))


def _noise(
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
    return Noise(verdict="beyond_noise" if real and matters else "within_noise", ci_lo=_r(lo), ci_hi=_r(hi), note=note)


def _r(v: float) -> float:
    """Round for display: 4 significant digits past the point, whatever the magnitude."""
    return round(v, max(0, 3 - int(math.floor(math.log10(abs(v))))) if v else 0) if math.isfinite(v) else v


def _rel(a: float, b: float) -> float:
    top = max(abs(a), abs(b))
    return abs(b - a) / top if top else 0.0


# ---------------------------------------------------------------------------------------------- steps
@dataclass
class _Cadence:
    """The training thread's waits and launches in one recording, exact counts estimated from its stored rows."""

    marker: str | None = None
    markers: float = 0.0
    marker_series: dict[int, float] = field(default_factory=dict)
    launches: float = 0.0
    launch_series: dict[int, float] = field(default_factory=dict)
    launch_error: float = 0.0
    between: float | None = None  # launches per marker between the first and the last marker

    @property
    def per_marker(self) -> float | None:
        """Return launches per wait: counted between the first and the last wait when there are two (launches
        after the last wait belong to no full period: 1,055 steps waiting every 20 are 52 waits, 21,100 launches),
        else over the loop."""
        if self.between is not None:
            return self.between
        return self.launches / self.markers if self.markers and self.launches else None


def _cadence(side: _Side) -> _Cadence:
    s = side.subject
    out = _Cadence()
    if s is None:
        return out
    a, b = side.span

    def on_thread(ops: list[str]) -> tuple[dict[str, int], dict[str, int], dict[tuple[str, int], int]]:
        """Return per op: rows of the training thread in its loop, rows of its pid, and per (op, sec)."""
        rows = side.conn.execute(
            "SELECT op, ts_ns // 1000000000, count(*) FILTER (WHERE tid = $tid AND ts_ns >= $a AND ts_ns < $b), "
            "count(*) FROM cuda_calls WHERE pid = $pid AND list_contains($ops, op) GROUP BY ALL",
            {"tid": s.tid, "pid": s.pid, "ops": ops, "a": a, "b": b},
        ).fetchall()
        mine: dict[str, int] = defaultdict(int)
        pid: dict[str, int] = defaultdict(int)
        secs: dict[tuple[str, int], int] = defaultdict(int)
        for op, sec, n_tid, n_pid in rows:
            mine[op] += n_tid
            pid[op] += n_pid
            secs[(op, int(sec))] += n_tid
        return mine, pid, secs

    def exact(op: str, stored_pid: int) -> float:
        """Return calls of ``op`` in the pid per stored row (op_stats / cuda_calls): rows may be a sample."""
        o = side.ctx.ops.get((s.pid, op))
        return o.calls / stored_pid if o and stored_pid else 1.0

    waits = [o.op for o in sync_ops(side.ctx, s.pid)]
    k_marker = 1.0
    if waits:
        mine, pid, secs = on_thread(waits)
        best = max(waits, key=lambda op: (mine.get(op, 0), op))
        if mine.get(best, 0):
            k_marker = exact(best, pid[best])
            out.marker = best
            out.markers = mine[best] * k_marker
            out.marker_series = {sec: n * k_marker for (op, sec), n in secs.items() if op == best}
    launches = side.ctx.ops_of(s.pid, lambda o: o.part == "launch")
    if launches:
        names = [o.op for o in launches]
        mine, pid, secs = on_thread(names)
        ks = {op: exact(op, pid.get(op, 0)) for op in names}
        out.launches = sum(mine.get(op, 0) * ks[op] for op in names)
        for (op, sec), n in secs.items():
            out.launch_series[sec] = out.launch_series.get(sec, 0.0) + n * ks[op]
        out.launch_error = max((h.error for o in launches if (h := side.hists.get((o.op, o.layer)))), default=0.0)
        if out.marker:
            first, last, n = side.conn.execute(
                "SELECT min(ts_ns), max(ts_ns), count(*) FROM cuda_calls WHERE tid = $tid AND op = $op "
                "AND ts_ns >= $a AND ts_ns < $b",
                {"tid": s.tid, "op": out.marker, "a": a, "b": b},
            ).fetchone()
            if n >= 2:
                inside = side.conn.execute(
                    "SELECT op, count(*) FROM cuda_calls WHERE tid = $tid AND list_contains($ops, op) "
                    "AND ts_ns > $first AND ts_ns < $last GROUP BY op",
                    {"tid": s.tid, "ops": names, "first": first, "last": last},
                ).fetchall()
                out.between = sum(c * ks[op] for op, c in inside) / ((n - 1) * k_marker)
    return out


def _step_unit(cb: _Cadence, ca: _Cadence) -> tuple[str, float | None, bool, str]:
    """Return (kind, launches per step, comparable, method in words): kind 'markers' counts each side's marker,
    'launches' counts L launches as a step on both sides, '' detects no step."""
    tol = CADENCE_TOL + cb.launch_error + ca.launch_error
    pb, pa = cb.per_marker, ca.per_marker
    if cb.marker and ca.marker and pb is None and pa is None:  # no launches seen: markers are all there is
        return "markers", None, True, f"one step = one {cb.marker} / {ca.marker} of the training thread"
    if pb is not None and pa is not None:
        if abs(pa / pb - 1) <= tol:
            same = cb.marker if cb.marker == ca.marker else f"{cb.marker} (before) / {ca.marker} (after)"
            return (
                "markers",
                None,
                True,
                f"one step = one {same} of the training thread: its wait for the GPU, after "
                f"{pb:,.1f} / {pa:,.1f} launches",
            )
        k = max(pa, pb) / min(pa, pb)
        if round(k) >= 2 and abs(k - round(k)) <= tol * k:
            unit = min(pa, pb)
            finer = "before" if pb <= pa else "after"
            return (
                "launches",
                unit,
                True,
                f"one step = {unit:,.1f} launches, the launches between two waits for the GPU in {finer}; the other "
                f"side waits once every {round(k)} steps ({max(pa, pb):,.1f} launches)",
            )
        return (
            "markers",
            None,
            False,
            f"each side's own wait for the GPU: {pb:,.1f} launches per wait before, {pa:,.1f} after, not a whole "
            "multiple, so a step may not be the same work on both sides (fused kernels, CUDA graphs?)",
        )
    one, other, which = (cb, ca, "before") if pb is not None else (ca, cb, "after")
    if one.per_marker is not None and other.launches and not other.marker:
        unit = one.per_marker
        return (
            "launches",
            unit,
            True,
            f"one step = {unit:,.1f} launches, the launches between two waits for the GPU in {which}; the other "
            "side never waits for the GPU on its training thread",
        )
    if not cb.marker and not ca.marker:
        return "", None, False, "none could be detected: no call waits for the GPU on either training thread"
    return "", None, False, "none could be detected: the two sides' waits for the GPU and launches do not line up"


def _steps(sb: _Side, sa: _Side, cb: _Cadence, ca: _Cadence, tests: _Tests) -> StepsCompare:
    kind, unit, comparable, method = _step_unit(cb, ca)

    def side(c: _Cadence, s: _Side) -> tuple[StepSide, dict[int, float]]:
        if kind == "launches" and unit:
            steps: float | None = c.launches / unit
            series = {sec: n / unit for sec, n in c.launch_series.items()}
        elif kind == "markers":
            steps, series = c.markers, c.marker_series
        else:
            steps, series = None, {}
        return (
            StepSide(
                steps=None if steps is None else round(steps, 1),
                steps_per_s=None if steps is None or not s.loop_s else round(s.per_s(steps), 3),
                marker=c.marker,
                markers=round(c.markers, 1),
                launches=round(c.launches, 1),
                launches_per_marker=None if c.per_marker is None else round(c.per_marker, 2),
                launch_error_pct=round(100 * c.launch_error, 2),
            ),
            series,
        )

    (b, ser_b), (a, ser_a) = side(cb, sb), side(ca, sa)
    delta = pct = None
    noise = Noise(verdict="not_tested", ci_lo=None, ci_hi=None, note="no step detected")
    if a.steps_per_s is not None and b.steps_per_s is not None:
        delta = a.steps_per_s - b.steps_per_s
        pct = 100 * delta / b.steps_per_s if b.steps_per_s else None
        matters = _rel(b.steps_per_s, a.steps_per_s) >= MIN_REL_DELTA
        short = sb.short or sa.short
        if not comparable:
            noise = Noise(verdict="not_tested", ci_lo=None, ci_hi=None, note="steps not comparable")
        else:
            interval = None
            if not short:
                interval = tests.mean_diff(lambda: sb.series(ser_b), lambda: sa.series(ser_a))
            widen = (b.steps_per_s * cb.launch_error + a.steps_per_s * ca.launch_error) if kind == "launches" else 0
            noise = _noise(matters, interval, short=short, widen=widen)
    return StepsCompare(
        detected=kind != "",
        comparable=comparable,
        method=method,
        launches_per_step=None if unit is None else round(unit, 2),
        before=b,
        after=a,
        delta_per_s=None if delta is None else round(delta, 3),
        delta_pct=None if pct is None else round(pct, 1),
        noise=noise,
    )


# ---------------------------------------------------------------------------------------------- training
def _loop_parts(side: _Side) -> tuple[dict[str, PartTime], int]:
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


def _part_series(side: _Side, part: str) -> np.ndarray:
    """Return the part's share of the training thread's time in each whole second of its loop."""
    t = side.subject.time  # type: ignore[union-attr]
    rows = {sec: r[part] / r["wall"] for sec, r in t.by_sec.items() if r["wall"] > 0}
    return np.array([rows[sec] for sec in side.seconds if sec in rows], dtype=np.float64)


def _training(
    sb: _Side, sa: _Side, steps: StepsCompare, tests: _Tests, launch_err: tuple[float, float]
) -> TrainingCompare | None:
    if sb.subject is None or sa.subject is None:
        return None
    (pb, wall_b), (pa, wall_a) = _loop_parts(sb), _loop_parts(sa)
    out = []
    for part in PART_NAMES:
        x, y = pb[part], pa[part]
        if x.ms == 0 and y.ms == 0:
            continue
        delta = y.share - x.share
        matters = abs(delta) >= MIN_SHARE_DELTA
        short = sb.short or sa.short
        interval = None
        if not short:
            interval = tests.mean_diff(lambda p=part: _part_series(sb, p), lambda p=part: _part_series(sa, p))
        # launch time is estimated from the live windows when the launch probes were duty-cycled
        widen = (x.share * launch_err[0] + y.share * launch_err[1]) if part == "launch" else 0.0
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
                noise=_noise(matters, interval, short=short, widen=widen, scale=100),
            )
        )
    out.sort(key=lambda p: (-abs(p.delta_points), PART_NAMES.index(p.part)))
    return TrainingCompare(before_wall_ms=round(wall_b / MS, 3), after_wall_ms=round(wall_a / MS, 3), parts=out)


# ---------------------------------------------------------------------------------------------- ops
def _op_series(side: _Side, key: tuple[str, str], time: bool) -> np.ndarray:
    """Return the op's calls (or ms) in each whole second of loop: its stored rows, scaled to op_stats' exact
    totals (rows may be a sample)."""
    o = side.ops.get(key)
    n, dur = side.stored.get(key, (0, 0))
    if o is None or not n:
        return side.series({})
    k = (o.total_ms * MS / dur if dur else 0.0) if time else o.calls / n
    rows = side.by_sec.get(key, {})
    return side.series({sec: (d / MS if time else c) * k for sec, (c, d) in rows.items()})


def _ops(sb: _Side, sa: _Side, tests: _Tests) -> list[OpDelta]:
    keys = sorted(set(sb.ops) | set(sa.ops))
    short = sb.short or sa.short
    out = []
    for key in keys:
        x, y = sb.ops.get(key), sa.ops.get(key)
        hx, hy = sb.hists.get(key), sa.hists.get(key)
        ex, ey = (hx.error if hx else 0.0), (hy.error if hy else 0.0)
        cx, cy = (x.calls if x else 0), (y.calls if y else 0)
        rx, ry = sb.per_s(cx), sa.per_s(cy)
        tx, ty = (x.total_ms if x else 0.0), (y.total_ms if y else 0.0)
        msx, msy = sb.per_s(tx), sa.per_s(ty)
        # a duty-cycled count is known to error_pct: a change inside that bound is not a change
        rate_bound, time_bound = rx * ex + ry * ey, msx * ex + msy * ey
        rate_matters = _rel(rx, ry) >= MIN_REL_DELTA and abs(ry - rx) > rate_bound
        time_matters = _rel(msx, msy) >= MIN_REL_DELTA and abs(msy - msx) > time_bound
        rate_i = time_i = None
        if not short:
            rate_i = tests.mean_diff(lambda k=key: _op_series(sb, k, False), lambda k=key: _op_series(sa, k, False))
            time_i = tests.mean_diff(lambda k=key: _op_series(sb, k, True), lambda k=key: _op_series(sa, k, True))
        qn = {}
        for q, qq in (("p50", 0.5), ("p99", 0.99)):
            if x is None or y is None or hx is None or hy is None:
                qn[q] = Noise(verdict="not_tested", ci_lo=None, ci_hi=None, note="only on one side")
                continue
            if min(hx.calls, hy.calls) < MIN_CALLS:
                qn[q] = Noise(verdict="too_short", ci_lo=None, ci_hi=None, note=f"fewer than {MIN_CALLS} calls")
                continue
            pair = tests.run(
                lambda hx=hx, hy=hy, qq=qq: (quantile_interval(hx, qq, tests.z), quantile_interval(hy, qq, tests.z))
            )
            # after - before: the widest difference the two intervals allow (they overlap iff it holds 0)
            diff = None if pair is None else (pair[1][0] - pair[0][1], pair[1][1] - pair[0][0])
            matters = _rel(getattr(x, f"{q}_us"), getattr(y, f"{q}_us")) >= MIN_REL_DELTA
            qn[q] = _noise(matters, diff, scale=1e-3)
        presence = "both" if x and y else "before_only" if x else "after_only"
        part = (x or y).part  # type: ignore[union-attr]
        out.append(
            OpDelta(
                op=key[0],
                layer=key[1],
                part=part,
                presence=presence,
                calls_before=cx,
                calls_after=cy,
                calls_per_s_before=round(rx, 3),
                calls_per_s_after=round(ry, 3),
                calls_delta_pct=round(100 * (ry - rx) / rx, 1) if rx else None,
                total_ms_before=tx,
                total_ms_after=ty,
                ms_per_s_before=round(msx, 4),
                ms_per_s_after=round(msy, 4),
                p50_us_before=x.p50_us if x else None,
                p50_us_after=y.p50_us if y else None,
                p99_us_before=x.p99_us if x else None,
                p99_us_after=y.p99_us if y else None,
                error_pct_before=round(100 * ex, 2),
                error_pct_after=round(100 * ey, 2),
                rate_noise=_noise(rate_matters, rate_i, short=short, widen=rate_bound),
                time_noise=_noise(time_matters, time_i, short=short, widen=time_bound),
                p50_noise=qn["p50"],
                p99_noise=qn["p99"],
            )
        )
    out.sort(key=lambda o: (-abs(o.ms_per_s_after - o.ms_per_s_before), o.op, o.layer))
    return out


# ---------------------------------------------------------------------------------------------- chains
def _chain_key(c: CausalChain) -> tuple[str, str, str, str]:
    u = c.culprit
    return (c.category, u.kind if u else "", u.relation if u else "", u.comm if u else "")


def _culprit(c: CausalChain) -> str:
    u = c.culprit
    if u is None:
        return ""
    return " ".join(x for x in (u.comm, f"[{u.relation}]", f"at {u.code_site}" if u.code_site else "") if x)


def _chains(sb: _Side, sa: _Side) -> list[ChainChange]:
    """Pair the two sides' chains by :func:`_chain_key` (within a key, by share) and say what changed."""
    groups: dict[tuple[str, str, str, str], tuple[list[CausalChain], list[CausalChain]]] = defaultdict(lambda: ([], []))
    for i, side in enumerate((sb, sa)):
        for c in side.chains:
            groups[_chain_key(c)][i].append(c)
    out = []
    for bs, as_ in groups.values():
        bs.sort(key=lambda c: -c.share)
        as_.sort(key=lambda c: -c.share)
        for i in range(max(len(bs), len(as_))):
            x = bs[i] if i < len(bs) else None
            y = as_[i] if i < len(as_) else None
            ref = y or x
            assert ref is not None
            note = ""
            if x and y:
                rank = SEVERITIES.index(y.severity) - SEVERITIES.index(x.severity)
                status = "better" if rank > 0 else "worse" if rank < 0 else "unchanged"
                if rank and abs(y.share - x.share) < MIN_SHARE_DELTA:
                    note = "a threshold crossing: its share moved less than one point"
            else:
                status = "appeared" if y else "gone"
            if ref.culprit is not None and ref.culprit.relation == "other_process":
                note = (note + "; " if note else "") + "caused by another process on the host, not by the job"
            out.append(
                ChainChange(
                    category=ref.category,
                    status=status,
                    severity_before=x.severity if x else None,
                    severity_after=y.severity if y else None,
                    share_before=x.share if x else None,
                    share_after=y.share if y else None,
                    culprit=_culprit(ref),
                    op=ref.op,
                    summary=ref.summary,
                    note=note,
                )
            )
    order = {"appeared": 0, "worse": 1, "gone": 2, "better": 3, "unchanged": 4}

    def worst(c: ChainChange) -> int:
        return min(SEVERITIES.index(s) for s in (c.severity_before, c.severity_after) if s)

    out.sort(key=lambda c: (order[c.status], worst(c), -(c.share_before or 0) - (c.share_after or 0), c.category))
    return out


# ---------------------------------------------------------------------------------------------- warnings
def _program(cmd: str) -> str:
    """Return the program a command line runs: its script (``x.py``, ``-m module``) or its executable's name."""
    try:
        argv = shlex.split(cmd)
    except ValueError:
        argv = cmd.split()
    if not argv:
        return ""
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv):
            return f"-m {argv[i + 1]}"
        if arg.endswith(".py"):
            return PurePath(arg).name
    return PurePath(argv[0]).name


def _command(side: _Side) -> str:
    p = side.ctx.info.procs.get(side.ctx.info.main_pid) if side.ctx.info.main_pid is not None else None
    if p is not None:
        r = side.conn.execute("SELECT cmdline FROM processes WHERE pid = ?", [p.pid]).fetchone()
        if r and r[0]:
            return str(r[0])
    return side.ctx.info.target


def _fingerprint(side: _Side) -> tuple[str, set[str]]:
    """Return what identifies the workload: the kernel names it launched, else the ops it called."""
    names = {
        r[0] for r in side.conn.execute("SELECT DISTINCT kernel FROM cuda_calls WHERE kernel IS NOT NULL").fetchall()
    }
    if names:
        return "kernels", names
    return "ops", {op for (op, _), o in side.ops.items() if o.calls}


def _session(conn: duckdb.DuckDBPyConnection) -> dict[str, object]:
    cols = ("host", "cpu_model", "cpu_cores", "gpus", "driver", "kernel", "tracer_version", "events_lost", "notes")
    row = conn.execute(f"SELECT {', '.join(cols)} FROM session ORDER BY session_id DESC LIMIT 1").fetchone()
    return dict(zip(cols, row or (None,) * len(cols), strict=True))


def _python_frames(side: _Side) -> tuple[int, int]:
    r = side.conn.execute("SELECT count(*) FILTER (WHERE kind = 'python'), count(*) FROM stacks").fetchone()
    return (int(r[0]), int(r[1])) if r else (0, 0)


def _warnings(sb: _Side, sa: _Side, same_file: bool, cb: _Cadence, ca: _Cadence) -> list[CompareWarning]:
    out: list[CompareWarning] = []

    def add(level: str, kind: str, message: str) -> None:
        out.append(CompareWarning(level=level, kind=kind, message=message))

    if same_file:
        add("warning", "same_file", "BEFORE and AFTER are the same file: every difference is zero")
    cmd_b, cmd_a = _command(sb), _command(sa)
    prog_b, prog_a = _program(cmd_b), _program(cmd_a)
    if prog_b and prog_a and prog_b != prog_a:
        add("warning", "different_program", f"different programs: {prog_b} before, {prog_a} after")
    elif cmd_b != cmd_a:
        add("info", "arguments", f"the commands differ: {cmd_b!r} before, {cmd_a!r} after")
    (kind_b, fb), (kind_a, fa) = _fingerprint(sb), _fingerprint(sa)
    if kind_b == kind_a and fb and fa:
        jac = len(fb & fa) / len(fb | fa)
        if jac < SAME_WORKLOAD_MIN:
            add(
                "warning",
                "different_workload",
                f"the {kind_b} launched differ ({len(fb & fa)} shared of {len(fb | fa)}): these look like two "
                "different workloads, so their differences are not only a fix's",
            )
    env_b, env_a = _session(sb.conn), _session(sa.conn)
    machine = [k for k in ("host", "cpu_model", "cpu_cores", "gpus", "driver", "kernel") if env_b[k] != env_a[k]]
    if machine:
        add(
            "warning",
            "different_host",
            "recorded on different machines or set-ups ("
            + ", ".join(f"{k}: {env_b[k]} / {env_a[k]}" for k in machine)
            + "): timings may differ for that alone",
        )
    if env_b["tracer_version"] != env_a["tracer_version"]:
        add("info", "tracer_version", f"tracer {env_b['tracer_version']} before, {env_a['tracer_version']} after")
    for side, env, c in ((sb, env_b, cb), (sa, env_a, ca)):
        if c.launch_error > 0:
            add(
                "info",
                "different_options",
                f"{side.name}: launch probes were duty-cycled (--overhead-budget): launch counts are scaled, within "
                f"{100 * c.launch_error:.1f}%; the noise judgment includes that bound",
            )
        if env["events_lost"]:
            add("info", "different_options", f"{side.name}: {env['events_lost']:,} call events were lost (rows only)")
    pyb, pya = _python_frames(sb), _python_frames(sa)
    for side, (py, total), (other_py, _) in ((sb, pyb, pya), (sa, pya, pyb)):
        if total and not py and other_py:
            add(
                "warning",
                "different_options",
                f"{side.name} has no Python frames in its stacks (recorded with --no-python-stacks?): chains there "
                "name no Python line, so a chain may seem to change only because its code site is unknown",
            )
    bb, ba = sb.ctx.times.basis, sa.ctx.times.basis
    if bb != ba:
        add(
            "warning",
            "different_basis",
            f"the time breakdown is {bb} before and {ba} after: an estimate (an older recording) and an exact "
            "breakdown differ by the estimate's error",
        )
    elif bb == "estimated":
        add("info", "different_basis", "both breakdowns are estimated (recordings made before the time accounting)")
    for side in (sb, sa):
        st = recording_state(side.conn)
        if not st.finished:
            add("warning", "unfinished", f"{side.name}: {st.ended}")
        if side.subject is not None and side.short:
            add(
                "warning",
                "too_short",
                f"{side.name}: its training loop spans {side.loop_s:.1f} s, {len(side.seconds)} whole seconds (at "
                f"least {MIN_SECONDS} are needed): too short to tell noise from change; record 10 s or more",
            )
        if side.subject is None:
            add("warning", "steps", f"{side.name}: no thread made CUDA calls, so there is no training loop")
    return out


# ---------------------------------------------------------------------------------------------- headline
def _headline(c: Comparison) -> list[str]:
    """Return steps/s (whatever its verdict: it is the question), then every other difference beyond noise."""
    head, out = [], []
    st = c.steps
    if st.comparable and st.before.steps_per_s is not None and st.after.steps_per_s is not None:
        pct = f" ({st.delta_pct:+.1f}%)" if st.delta_pct is not None else ""
        head.append(
            f"steps/s {st.before.steps_per_s:,.2f} -> {st.after.steps_per_s:,.2f}{pct}: "
            + st.noise.verdict.replace("_", " ")
        )
    for p in c.training.parts if c.training else []:
        if p.noise.verdict == "beyond_noise":
            per_step = (
                f", {p.before_ms_per_step:,.2f} -> {p.after_ms_per_step:,.2f} ms per step"
                if p.before_ms_per_step is not None and p.after_ms_per_step is not None
                else ""
            )
            out.append(
                f"{p.part}: {p.before_share:.1%} -> {p.after_share:.1%} of the training thread's time "
                f"({p.delta_points:+.1f} points){per_step}: beyond noise"
            )
    for ch in c.chains:
        if ch.status != "unchanged" and "another process" not in ch.note:  # the job's own changes
            sev = f"{ch.severity_before or '-'} -> {ch.severity_after or 'gone'}"
            out.append(f"chain {ch.category} ({ch.culprit}): {ch.status}, {sev}")
    for o in c.ops[:TOP_OPS]:
        if o.presence != "both" and (o.calls_before + o.calls_after) >= MIN_CALLS:
            where = "before" if o.presence == "before_only" else "after"
            out.append(f"{o.op} ({o.layer}) only {where}: {max(o.calls_before, o.calls_after):,} calls")
        elif o.rate_noise.verdict == "beyond_noise" or o.time_noise.verdict == "beyond_noise":
            out.append(
                f"{o.op} ({o.layer}): {o.calls_per_s_before:,.1f} -> {o.calls_per_s_after:,.1f} calls/s, "
                f"{o.ms_per_s_before:,.1f} -> {o.ms_per_s_after:,.1f} ms per second of loop: beyond noise"
            )
    if not out and st.noise.verdict != "beyond_noise":
        out.append("no difference beyond noise")
    return head + out


# ---------------------------------------------------------------------------------------------- entry point
def compare_traces(
    before: duckdb.DuckDBPyConnection,
    after: duckdb.DuckDBPyConnection,
    *,
    before_name: str = "before",
    after_name: str = "after",
    same_file: bool = False,
) -> Comparison:
    """Return BEFORE and AFTER compared: steps/s, the training thread's parts, per-op deltas, chains gained,
    lost or changed, and for each difference whether it is beyond the recordings' own noise.

    Args:
        before_name, after_name: how the sides are named in the result (their files).
        same_file: the two connections read one file (the result says so).
    """
    sb, sa = _load(before, before_name), _load(after, after_name)
    cb, ca = _cadence(sb), _cadence(sa)
    errs = (cb.launch_error, ca.launch_error)
    tests = _Tests()
    for counting in (True, False):  # count the tests (the Bonferroni divisor), then make them
        tests.counting = counting
        steps = _steps(sb, sa, cb, ca, tests)
        training = _training(sb, sa, steps, tests, launch_err=errs)
        ops = _ops(sb, sa, tests)
    warnings = _warnings(sb, sa, same_file, cb, ca)
    if steps.detected and not steps.comparable:
        warnings.append(CompareWarning(level="warning", kind="steps", message=f"steps: {steps.method}"))

    def ref(side: _Side) -> RecordingRef:
        env = environment(side.conn)
        s = side.subject
        return RecordingRef(
            name=side.name,
            target=env.target,
            started_at=env.started_at,
            duration_s=env.duration_s,
            status=env.status,
            basis=side.ctx.times.basis,
            training_pid=s.pid if s else None,
            training_tid=s.tid if s else None,
            training_comm=s.time.comm if s else "",
            loop_start_s=round(side.span[0] / S, 3),
            loop_s=round(side.loop_s, 3),
            seconds=len(side.seconds),
        )

    c = Comparison(
        before=ref(sb),
        after=ref(sa),
        headline=[],
        noise_test=NOISE_TEST,
        alpha=ALPHA,
        tests=tests.count,
        steps=steps,
        training=training,
        ops=ops,
        chains=_chains(sb, sa),
        warnings=warnings,
    )
    return c.model_copy(update={"headline": _headline(c)})


def names_of(paths: Sequence[str]) -> tuple[str, str]:
    """Return how two recording paths are named in a comparison: their file names, or the paths when the names
    are equal."""
    a, b = (PurePath(p).name for p in paths)
    return (a, b) if a != b else (str(paths[0]), str(paths[1]))
