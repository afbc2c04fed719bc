"""Steps/s before and after: what a step is on each side, how its steps are counted, and whether the rate changed
beyond noise.

A step ends where the training thread waits for the GPU (the catalog's ``waits_for_gpu`` calls): the marker is
the wait it makes most often, and a step holds as many of its calls as :mod:`tracer.analysis.steps` (the one
definition of a step) counts in one step (a loop that reads the loss and an accuracy with the same op waits twice
a step: its marker's calls are twice its steps). When both sides queue the same number of launches per step of
the marker, a step is one. When one side waits k times less often (a fix that reads the loss every k steps) or not
at all, a step is the launches between two steps of the side that waits most often. Otherwise (launches per step
changed: fused kernels, CUDA graphs) the rates are shown, marked not comparable. ``StepsCompare.method``
says which held.

Issue 20: how the steps are counted once a step is known (:func:`step_clock`). Duty-cycled launch probes see a
launch-heavy loop a fifth of the time, in windows that do not line up with the seconds, so launches counted per
second read 0 in one second and all of them the next: an interval four times wider than a +85% fix. A side that
waits is therefore counted from its waits, which are exact, and a side that never waits from its launches per
second of live probes; ``StepSide.counted_from`` says which."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from tracer.analysis.chains.sync_stall import sync_ops
from tracer.analysis.compare.load import MIN_SECONDS, Loop, S, Side
from tracer.analysis.compare.model import Noise, StepCount, StepsCompare, StepSide
from tracer.analysis.compare.statistics import MIN_REL_DELTA, NoiseTests, judge, relative_change
from tracer.analysis.steps import step_markers

# launches per step on both sides within this (plus the launch counts' error bounds) count as the same step
CADENCE_TOL = 0.05
# a second whose launch probes were live for less than this is left out of a launch-counted step series: its count
# would be mostly the scaling's guess
MIN_LIVE = 0.02


@dataclass
class Cadence:
    """The training thread's waits and launches in one recording: totals, and per whole second of its loop."""

    marker: str | None = None
    waits_per_step: int = 1  # the marker's calls in one step (tracer.analysis.steps.StepMarkers.per_step_of)
    markers: float = 0.0  # steps the marker ended on the training thread in its loop: its calls / waits_per_step
    # markers per whole second: from the periods between consecutive markers when every call of it is stored (a
    # second holding a third of a period counts a third of a marker), else its rows per second, scaled
    marker_series: dict[int, float] = field(default_factory=dict)
    marker_rate: float | None = None  # markers per second over the whole periods from the first to the last
    launches: float = 0.0  # op_stats' count (scaled by the recorder's estimator when duty-cycled)
    # launches per second, by time: the rows seen in a second over the share of it the launch probes were live
    # (seconds live less than MIN_LIVE left out); the level of a duty-cycled series is biased (a live probe slows
    # a launch-bound loop), its shape is what the step clock takes from it
    launch_series: dict[int, float] = field(default_factory=dict)
    launch_error: float = 0.0  # bound on ``launches``' relative error (op_stats.error_pct / 100)
    between: float | None = None  # launches per marker between the first and the last marker

    @property
    def per_marker(self) -> float | None:
        """Return launches per wait: counted between the first and the last wait when there are two (launches
        after the last wait belong to no full period: 1,055 steps waiting every 20 are 52 waits, 21,100 launches),
        else over the loop."""
        if self.between is not None:
            return self.between
        return self.launches / self.markers if self.markers and self.launches else None


def periods_per_second(stamps: np.ndarray, seconds: list[int]) -> tuple[dict[int, float], float | None]:
    """Return, from the sorted timestamps (ns) of a call made once per period, the periods in each whole second
    that lies between the first and the last call (a period split between two seconds is shared in proportion),
    and the periods per second from the first call to the last (None under two calls)."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return {}, None
    completed = np.arange(len(stamps), dtype=np.float64)

    def done(x: float) -> float:
        """Periods completed by time ``x``, linear inside each period."""
        return float(np.interp(x, stamps, completed))

    inside = [sec for sec in seconds if sec * S >= stamps[0] and (sec + 1) * S <= stamps[-1]]
    series = {sec: done((sec + 1) * S) - done(sec * S) for sec in inside}
    return series, (len(stamps) - 1) / ((stamps[-1] - stamps[0]) / S)


def _live_shares(side: Side, tid: int) -> dict[int, float]:
    """Return the share of each second the launch probes were live (thread_breakdown.launch_sampled), for the
    seconds that say so; none for a recording made before the column existed."""
    if not side.ctx.info.has("thread_breakdown", "launch_sampled"):
        return {}
    rows = side.conn.execute(
        "SELECT sec, min(launch_sampled) FROM thread_breakdown WHERE tid = ? AND launch_sampled IS NOT NULL "
        "GROUP BY sec",
        [tid],
    ).fetchall()
    return {int(sec): float(share) for sec, share in rows}


def _seen_calls(side: Side, pid: int) -> dict[str, float]:
    """Return the calls per op of ``pid`` its probes saw: op_stats' count unscaled where it was duty-cycled."""
    seen = "calls * coalesce(sampled_fraction, 1)" if side.ctx.info.has("op_stats", "sampled_fraction") else "calls"
    rows = side.conn.execute(f"SELECT op, sum({seen}) FROM op_stats WHERE pid = ? GROUP BY op", [pid]).fetchall()
    return {op: float(n or 0) for op, n in rows}


def cadence(side: Side) -> Cadence:
    """Return the training thread's waits and launches in its loop (nothing when the side has no loop)."""
    subject = side.subject
    out = Cadence()
    if subject is None:
        return out
    start, end = side.span

    def on_thread(ops: list[str]) -> tuple[dict[str, int], dict[str, int], dict[tuple[str, int], int]]:
        """Return per op: rows of the training thread in its loop, rows of its pid, and per (op, sec)."""
        rows = side.conn.execute(
            "SELECT op, ts_ns // 1000000000, count(*) FILTER (WHERE tid = $tid AND ts_ns >= $a AND ts_ns < $b), "
            "count(*) FROM cuda_calls WHERE pid = $pid AND list_contains($ops, op) GROUP BY ALL",
            {"tid": subject.tid, "pid": subject.pid, "ops": ops, "a": start, "b": end},
        ).fetchall()
        mine: dict[str, int] = defaultdict(int)
        pid: dict[str, int] = defaultdict(int)
        secs: dict[tuple[str, int], int] = defaultdict(int)
        for op, sec, n_tid, n_pid in rows:
            mine[op] += n_tid
            pid[op] += n_pid
            secs[(op, int(sec))] += n_tid
        return mine, pid, secs

    def calls_per_row(op: str, stored_pid: int) -> float:
        """Return calls of ``op`` in the pid per stored row (op_stats / cuda_calls): rows may be a sample."""
        o = side.ctx.ops.get((subject.pid, op))
        return o.calls / stored_pid if o and stored_pid else 1.0

    def stamps(op: str) -> np.ndarray:
        rows = side.conn.execute(
            "SELECT ts_ns FROM cuda_calls WHERE tid = $tid AND op = $op AND ts_ns >= $a AND ts_ns < $b ORDER BY 1",
            {"tid": subject.tid, "op": op, "a": start, "b": end},
        ).fetchall()
        return np.array([r[0] for r in rows], dtype=np.float64)

    waits = [o.op for o in sync_ops(side.ctx, subject.pid)]
    marker_scale = 1.0
    if waits:
        mine, pid, secs = on_thread(waits)
        best = max(waits, key=lambda op: (mine.get(op, 0), op))
        if mine.get(best, 0):
            marker_scale = calls_per_row(best, pid[best])
            out.marker = best
            k = out.waits_per_step = step_markers(side.conn, subject.tid).per_step_of(best)
            out.markers = mine[best] * marker_scale / k
            if marker_scale <= 1.0:  # every call stored: time each period between two steps' last waits
                out.marker_series, out.marker_rate = periods_per_second(stamps(best)[k - 1 :: k], side.seconds)
            else:  # a sample of the calls: only their count per second can be scaled
                counts = {sec: n * marker_scale / k for (op, sec), n in secs.items() if op == best}
                out.marker_series = {sec: counts.get(sec, 0.0) for sec in side.seconds}
    launches = side.ctx.ops_of(subject.pid, lambda o: o.part == "launch")
    if launches:
        names = [o.op for o in launches]
        mine, pid, secs = on_thread(names)
        scales = {op: calls_per_row(op, pid.get(op, 0)) for op in names}
        out.launches = sum(mine.get(op, 0) * scales[op] for op in names)
        out.launch_error = max((side.errors.get((o.op, o.layer), 0.0) for o in launches), default=0.0)
        seen = _seen_calls(side, subject.pid)
        live = _live_shares(side, subject.tid)
        per_sec: dict[int, float] = defaultdict(float)
        for (op, sec), n in secs.items():
            per_sec[sec] += n * (seen.get(op, 0.0) / pid[op] if pid.get(op) else 1.0)
        out.launch_series = {
            sec: per_sec.get(sec, 0.0) / live.get(sec, 1.0) for sec in side.seconds if live.get(sec, 1.0) >= MIN_LIVE
        }
        if out.marker:
            first, last, n = side.conn.execute(
                "SELECT min(ts_ns), max(ts_ns), count(*) FROM cuda_calls WHERE tid = $tid AND op = $op "
                "AND ts_ns >= $a AND ts_ns < $b",
                {"tid": subject.tid, "op": out.marker, "a": start, "b": end},
            ).fetchone()
            if n >= 2:
                inside = side.conn.execute(
                    "SELECT op, count(*) FROM cuda_calls WHERE tid = $tid AND list_contains($ops, op) "
                    "AND ts_ns > $first AND ts_ns < $last GROUP BY op",
                    {"tid": subject.tid, "ops": names, "first": first, "last": last},
                ).fetchall()
                out.between = sum(c * scales[op] for op, c in inside) * out.waits_per_step / ((n - 1) * marker_scale)
                if marker_scale <= 1.0 and any(scales[op] > 1.0 for op in names):
                    whole = _whole_period(side, subject.tid, out.marker, out.waits_per_step, names, (first, last))
                    out.between = whole or out.between
    return out


# a period count is taken as a step's whole launches when this many periods between two waits show it
MIN_WHOLE_PERIODS = 3


def _whole_period(
    side: Side, tid: int, marker: str, per_step: int, launches: list[str], span: tuple[int, int]
) -> float | None:
    """Return the launches of one step (``per_step`` consecutive waits of the marker), counted where the probes saw
    it whole.

    When some launch rows are missing (duty-cycled probes, a full ring buffer) the launches between the first and
    the last wait are a scaled estimate, and the estimator's few percent of error decide the k of a side that waits
    every k steps: 190 launches per wait read as 19 steps of 10 when the truth is 20. Rows are only ever missing,
    never added, so a period the probes saw whole shows the largest count, and every whole period shows the same
    one: the most common count of the periods is taken when at least MIN_WHOLE_PERIODS show it and it is within
    CADENCE_TOL of the largest (a period the probes cut shows fewer). None when no such count exists (probes live
    for shorter than a period, a loop whose steps differ), and the scaled estimate stands."""
    counts = side.conn.execute(
        "WITH m AS (SELECT ts_ns, (row_number() OVER (ORDER BY ts_ns) - 1) // $k AS i FROM cuda_calls "
        "  WHERE tid = $tid AND op = $marker AND ts_ns >= $first AND ts_ns <= $last), "
        "l AS (SELECT ts_ns FROM cuda_calls WHERE tid = $tid AND list_contains($ops, op) "
        "  AND ts_ns > $first AND ts_ns < $last) "
        "SELECT n, count(*) AS periods FROM (SELECT m.i, count(*) AS n FROM l ASOF JOIN m ON l.ts_ns >= m.ts_ns "
        "GROUP BY m.i) GROUP BY n ORDER BY periods DESC, n DESC",
        {"tid": tid, "marker": marker, "k": per_step, "ops": launches, "first": span[0], "last": span[1]},
    ).fetchall()
    if not counts:
        return None
    (n, periods), largest = counts[0], max(c for c, _ in counts)
    return float(n) if periods >= MIN_WHOLE_PERIODS and n >= (1 - CADENCE_TOL) * largest else None


def step_unit(before: Cadence, after: Cadence) -> tuple[str, float | None, bool, str]:
    """Return (kind, launches per step, comparable, method in words): kind 'markers' counts each side's marker,
    'launches' counts L launches as a step on both sides, '' detects no step."""
    tol = CADENCE_TOL + before.launch_error + after.launch_error
    per_before, per_after = before.per_marker, after.per_marker
    if before.marker and after.marker and per_before is None and per_after is None:
        # no launches seen: markers are all there is
        return "markers", None, True, f"one step = one {before.marker} / {after.marker} of the training thread"
    if per_before is not None and per_after is not None:
        if abs(per_after / per_before - 1) <= tol:
            same = (
                before.marker if before.marker == after.marker else f"{before.marker} (before) / {after.marker} (after)"
            )
            return (
                "markers",
                None,
                True,
                f"one step = one {same} of the training thread: its wait for the GPU, after "
                f"{per_before:,.1f} / {per_after:,.1f} launches",
            )
        k = max(per_after, per_before) / min(per_after, per_before)
        if round(k) >= 2 and abs(k - round(k)) <= tol * k:
            unit = min(per_after, per_before)
            finer = "before" if per_before <= per_after else "after"
            return (
                "launches",
                unit,
                True,
                f"one step = {unit:,.1f} launches, the launches between two waits for the GPU in {finer}; the other "
                f"side waits once every {round(k)} steps ({max(per_after, per_before):,.1f} launches)",
            )
        return (
            "markers",
            None,
            False,
            f"each side's own wait for the GPU: {per_before:,.1f} launches per wait before, {per_after:,.1f} after, "
            "not a whole multiple, so a step may not be the same work on both sides (fused kernels, CUDA graphs?)",
        )
    one, other, which = (before, after, "before") if per_before is not None else (after, before, "after")
    if one.per_marker is not None and other.launches and not other.marker:
        unit = one.per_marker
        return (
            "launches",
            unit,
            True,
            f"one step = {unit:,.1f} launches, the launches between two waits for the GPU in {which}; the other "
            "side never waits for the GPU on its training thread",
        )
    if not before.marker and not after.marker:
        return "", None, False, "none could be detected: no call waits for the GPU on either training thread"
    return "", None, False, "none could be detected: the two sides' waits for the GPU and launches do not line up"


@dataclass(frozen=True)
class StepClock:
    """How one side's steps are counted: the level (steps/s), the steps in each measured whole second of its
    loop (the noise test's samples), and the bound on the level's error the launch sampler contributes."""

    counted_from: StepCount
    steps: float | None
    per_s: float | None
    series: np.ndarray
    error: float = 0.0  # fraction of per_s; 0 when counted from exact calls
    per_wait: int | None = None


NO_CLOCK = StepClock("none", None, None, np.zeros(0))


def step_clock(c: Cadence, loop: Loop, kind: str, unit: float | None) -> StepClock:
    """Return how the side's steps are counted once the step is known (``kind``/``unit``: :func:`step_unit`).

    From its waits whenever it has them: their calls are exact (the wait probes are never duty-cycled) and a wait
    closes a whole number of steps (1, or the k of a side that waits every k steps), so steps/s carries no launch
    sampler error. From its launches only when it never waits: launches / launches per step, the level from
    op_stats' count (the recorder's estimator when duty-cycled, known to ``launch_error``) and the per-second
    shape from the launches seen in each second over the share of it the probes were live, so a second the
    probes were dark does not read as a second the loop stood still.
    """
    if kind == "markers" or (kind == "launches" and unit and c.marker and c.per_marker):
        per_wait = 1 if kind == "markers" else max(1, round(c.per_marker / unit))  # type: ignore[operator]
        series = loop.present(c.marker_series) * per_wait
        if kind == "markers" or len(series) >= MIN_SECONDS:
            rate = c.marker_rate if c.marker_rate is not None else loop.per_s(c.markers)
            return StepClock("waits", c.markers * per_wait, rate * per_wait, series, 0.0, per_wait)
    if kind == "launches" and unit:
        steps = c.launches / unit
        per_s = loop.per_s(steps)
        shape = loop.present(c.launch_series)
        series = shape * (per_s / shape.mean()) if len(shape) and shape.mean() > 0 else shape
        return StepClock("launches", steps, per_s, series, c.launch_error)
    return NO_CLOCK


def _side(c: Cadence, clock: StepClock) -> StepSide:
    return StepSide(
        steps=None if clock.steps is None else round(clock.steps, 1),
        steps_per_s=None if clock.per_s is None else round(clock.per_s, 3),
        counted_from=clock.counted_from,
        steps_per_wait=clock.per_wait,
        steps_error_pct=round(100 * clock.error, 2),
        marker=c.marker,
        waits_per_step=c.waits_per_step,
        markers=round(c.markers, 1),
        launches=round(c.launches, 1),
        launches_per_marker=None if c.per_marker is None else round(c.per_marker, 2),
        launch_error_pct=round(100 * c.launch_error, 2),
    )


def _counted(clock: StepClock, marker: str | None) -> str:
    if clock.counted_from == "waits":
        return (
            f"from the exact {marker} calls ({'one step' if clock.per_wait == 1 else f'{clock.per_wait} steps'} each)"
        )
    if clock.error:
        return f"from the duty-cycled launches (scaled per second; within {100 * clock.error:.1f}%)"
    return "from the launches"


def compare_steps(
    before: Loop, after: Loop, cadence_before: Cadence, cadence_after: Cadence, tests: NoiseTests
) -> StepsCompare:
    """Return steps/s before and after and whether it changed beyond noise: the per-second steps of the two
    clocks bootstrapped, widened by what the launch sampler contributes to a side counted from launches."""
    kind, unit, comparable, method = step_unit(cadence_before, cadence_after)
    clock_before = step_clock(cadence_before, before, kind, unit)
    clock_after = step_clock(cadence_after, after, kind, unit)
    if kind:
        how = _counted(clock_before, cadence_before.marker), _counted(clock_after, cadence_after.marker)
        method += (
            f"; steps counted {how[0]} on both sides"
            if how[0] == how[1]
            else f"; steps counted {how[0]} before, {how[1]} after"
        )
    rate_before, rate_after = clock_before.per_s, clock_after.per_s
    delta = pct = None
    noise = Noise(verdict="not_tested", ci_lo=None, ci_hi=None, note="no step detected")
    if rate_before is not None and rate_after is not None and before.loop_s and after.loop_s:
        delta = rate_after - rate_before
        pct = 100 * delta / rate_before if rate_before else None
        matters = relative_change(rate_before, rate_after) >= MIN_REL_DELTA
        short = before.short or after.short
        sampled = min(len(clock_before.series), len(clock_after.series))
        if not comparable:
            noise = Noise(verdict="not_tested", ci_lo=None, ci_hi=None, note="steps not comparable")
        elif not short and sampled < MIN_SECONDS:  # a long loop that waits too rarely to be timed per second
            note = f"fewer than {MIN_SECONDS} whole seconds between a side's first and last wait"
            noise = Noise(verdict="not_tested", ci_lo=None, ci_hi=None, note=note)
        else:
            interval = None
            if not short:
                interval = tests.mean_diff(lambda: clock_before.series, lambda: clock_after.series)
            note = ""
            # A duty-cycled level's error moves a launch-counted side's whole series, which no resampling of its
            # seconds shows. Its bound is about two standard errors (tracer/recorder/budget.py): scaled to the
            # test's level and added in quadrature to each half of the interval, as an independent error.
            sampler = math.hypot(rate_before * clock_before.error, rate_after * clock_after.error) * tests.z / 2
            if interval is not None and sampler > 0:
                centre = float(clock_after.series.mean() - clock_before.series.mean())
                below, above = centre - interval[0], interval[1] - centre
                if sampler > max(below, above):
                    note = f"mostly the launch sampler's error (+-{sampler:,.1f} steps/s): the launch counts are scaled"
                interval = (centre - math.hypot(below, sampler), centre + math.hypot(above, sampler))
            noise = judge(matters, interval, short=short, note=note)
    return StepsCompare(
        detected=kind != "",
        comparable=comparable,
        method=method,
        launches_per_step=None if unit is None else round(unit, 2),
        before=_side(cadence_before, clock_before),
        after=_side(cadence_after, clock_after),
        delta_per_s=None if delta is None else round(delta, 3),
        delta_pct=None if pct is None else round(pct, 1),
        noise=noise,
    )
