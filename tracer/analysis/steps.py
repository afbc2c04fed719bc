"""The step-time series of a thread: its loop's steps, detected from the calls that end them, with the slow steps
and their period ("every 40th step: +54.1 ms, 10 steps"), and what the slow steps spent their extra time on.

A step ends where the thread waits for the GPU (the catalog's ``waits_for_gpu`` calls: a synchronize, a
synchronous copy such as ``loss.item()``): every one of those calls is stored (only launches are sampled). A loop
that waits more than once a step (the loss and an accuracy read) repeats the same sequence of wait sites: the
number of waits per step is the shortest period of the sequence of (op, call site) (:func:`markers_per_step`), and
a step runs from the end of one step's last wait to the end of the next's. Outliers and patterns:
:mod:`tracer.analysis.periodicity`.

What the slow steps did with their extra time comes from ``sched`` (every off-CPU interval of 1 ms or more is
stored; shorter ones are a sample): per slow step, the time blocked outside CUDA calls by who woke the thread,
the time waiting for a CPU and the time off CPU inside calls, each less its neighbours' median (as the added time
is measured), averaged over the slow steps; what is left of the added time ran (on CPU, or inside CUDA calls).

A thread that never waits for the GPU has no step boundary: its series is then its seconds (``basis =
"seconds"``), each valued by the time it did not work in it (blocked + waiting for a CPU, from its exact
breakdown).
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass
from typing import Annotated, Literal

import duckdb
import numpy as np
from pydantic import Field

from probes.catalog import CATALOG
from tracer.analysis import Record
from tracer.analysis.breakdown.load import load_thread_times
from tracer.analysis.breakdown.thread_time import MS, S, ThreadTime
from tracer.analysis.code_site import code_site
from tracer.analysis.periodicity import find_patterns, neighbours, slow_indices, spread_of
from tracer.analysis.recording import load_recording
from tracer.analysis.taxonomy import RUNQ_PART_NAMES, part_name, waits_for_gpu
from tracer.steprule import markers_per_step  # the one rule, shared with the recorder's tracer_steps_total
from tracer.vocabulary import waker_name

MAX_IRREGULAR = 20  # slow steps outside any pattern listed
MAX_SERIES = 5000  # per-step durations returned with detail
SYNC_OPS: tuple[str, ...] = tuple(s.op for s in CATALOG if waits_for_gpu(s.op))

Basis = Literal["steps", "seconds", "none"]


class StepPart(Record):
    """Where a slow step's extra time went, per step, beyond a typical step."""

    what: Annotated[
        str,
        Field(
            description="'blocked, woken by W' (outside CUDA calls; W a waker as in get_waits) | 'waiting for a CPU' "
            "| 'off CPU inside CUDA calls' | 'running (on CPU or inside CUDA calls)'"
        ),
    ]
    ms: Annotated[float, Field(description="mean per slow step, less its neighbours' median, ms")]


class StepPattern(Record):
    """Steps that come back with a period, each longer than its neighbours: every ``every``-th step from
    ``first_step``."""

    every: Annotated[int, Field(description="the period, in steps (seconds when basis = seconds)")]
    first_step: Annotated[
        int,
        Field(description="numbered by the wait that ends it: step 2 is the first complete one (a second: its number)"),
    ]
    count: Annotated[
        int,
        Field(
            description="steps in the pattern: those at its period that stand out from their neighbours (on a busy "
            "host some of them by less than slow_above_ms)"
        ),
    ]
    added_ms: Annotated[
        float,
        Field(description="what one adds to a step: the median of their ms less their neighbours' (4 either side)"),
    ]
    first_s: Annotated[float, Field(description="when the first one began, seconds since session start")]
    extra: Annotated[
        list[StepPart], Field(description="what the slow steps spent the added time on, beyond their neighbours")
    ]
    summary: Annotated[str, Field(description="e.g. 'every 40th step: +54.1 ms (10 steps, from step 40 at 1.3 s)'")]


class SlowStep(Record):
    """One slow step outside any pattern."""

    step: int
    start_s: float
    ms: float


class StepSeries(Record):
    """A thread's steps: the typical step, the slow ones, their period and what they spent it on."""

    pid: int | None
    tid: int | None
    comm: str
    basis: Annotated[
        str, Field(description="steps (ended by waits for the GPU) | seconds (no wait: per second) | none")
    ]
    marker: Annotated[str, Field(description="what ends a step: the wait op(s) and their code site")]
    markers_per_step: Annotated[int, Field(description="waits for the GPU per step (the loop's period)")]
    steps: Annotated[int, Field(description="complete steps in the series")]
    steps_per_s: Annotated[float, Field(description="steps over the time they span")]
    typical_ms: Annotated[float, Field(description="median step")]
    spread_ms: Annotated[float, Field(description="the steps' jitter: median absolute deviation x 1.4826, ms")]
    slow_above_ms: Annotated[float, Field(description="a step above this is slow (see tracer/analysis/periodicity)")]
    mean_ms: float
    p90_ms: float
    max_ms: float
    slow_steps: Annotated[int, Field(description="steps above slow_above_ms")]
    patterns: Annotated[
        list[StepPattern], Field(description="periodic slow steps, most added time (added_ms x count) first")
    ]
    irregular: Annotated[list[SlowStep], Field(description="slow steps in no pattern, slowest first (at most 20)")]
    series_ms: Annotated[list[float], Field(description="every step's ms, in order (detail=True; at most 5000)")]
    headline: Annotated[str, Field(description="one line: the typical step, and the slow steps' pattern")]
    note: Annotated[str, Field(description="caveats: basis, stored calls, sampled intervals")]


def step_series(
    conn: duckdb.DuckDBPyConnection, pid: int | None = None, tid: int | None = None, detail: bool = False
) -> StepSeries:
    """Return the step series of thread ``tid`` (default: the driver thread of ``pid``, or the training thread)."""
    info = load_recording(conn)
    times = load_thread_times(conn, info, pid)
    t = times.pick(pid, tid)
    if t is None:
        return _empty(
            pid, tid, "no thread to follow: the recording has no CUDA thread" + (f" in pid {pid}" if pid else "")
        )
    return series_of(conn, t, detail)


@dataclass(frozen=True)
class StepMarkers:
    """The one definition of a thread's steps (issue 31), read by the step series, the ranks and compare alike:
    the thread's stored waits for the GPU (runtime ones only when it has them: a runtime wait and the driver call
    inside it are one wait) and how many of them end one step (:func:`markers_per_step`).

    Columns, not rows: a long recording's training thread has millions of waits, and the chains read its steps
    (the 200 K-process bench's 1.25 M waits took 3.8 s as Python tuples, 0.3 s as arrays)."""

    ts_ns: np.ndarray  # each wait's start, in time order (int64)
    dur_ns: np.ndarray  # its duration (int64)
    op_index: np.ndarray  # its op, as an index into SYNC_OPS
    stack_id: np.ndarray  # its stack_id, 0 when it has none (int64)
    per_step: int  # waits per step

    def __len__(self) -> int:
        return len(self.ts_ns)

    def ops(self, n: int) -> list[str]:
        """The ops of the first ``n`` waits."""
        return [SYNC_OPS[i] for i in self.op_index[:n].tolist()]

    @property
    def ends(self) -> np.ndarray:
        """Each step's end: the end of its last wait (int64, in time order)."""
        k = self.per_step
        return self.ts_ns[k - 1 :: k] + self.dur_ns[k - 1 :: k]

    def per_step_of(self, op: str) -> int:
        """Return how many of one step's waits are ``op`` (at least 1: an op outside the step's sequence, such as
        the driver twin of a runtime wait, is counted as one a step)."""
        return max(1, self.ops(self.per_step).count(op))


# the calls whose span is a training loop's steps: from its first launch or wait for the GPU to the end of its last
SPAN_PARTS = ("launch", "sync")


def step_spans(
    conn: duckdb.DuckDBPyConnection, tids: list[int], ops: list[str] | None = None
) -> dict[int, tuple[int, int]]:
    """Return {tid: (start, end) ns of its steps}: the first stored call of ``ops`` (default: the recording's ops of
    the SPAN_PARTS) to the end of the last, for each of ``tids`` that made one. The one step span the chains'
    subjects and the ranks' table clip to (a thread's start-up and teardown are not its steps)."""
    if ops is None:
        ops = [o for (o,) in conn.execute("SELECT DISTINCT op FROM op_stats").fetchall() if part_name(o) in SPAN_PARTS]
    if not ops or not tids:
        return {}
    rows = conn.execute(
        "SELECT tid, min(ts_ns), max(ts_ns + dur_ns) FROM cuda_calls WHERE list_contains($tids, tid) "
        "AND list_contains($ops, op) GROUP BY tid",
        {"tids": tids, "ops": ops},
    ).fetchall()
    return {int(t): (int(a), int(b)) for t, a, b in rows if a is not None}


def step_markers(conn: duckdb.DuckDBPyConnection, tid: int) -> StepMarkers:
    """Return thread ``tid``'s step markers (see :class:`StepMarkers`); ``per_step`` is 1 under 3 waits."""
    c = conn.execute(
        # the op as its index in SYNC_OPS (list_position is 1-based): the period search compares integers. Sorted
        # here, not by DuckDB: the rows are stored about in time order, and its ORDER BY was half of this read
        "SELECT ts_ns, dur_ns, list_position($ops, op) - 1 AS op_index, coalesce(stack_id, 0) AS stack_id, "
        "layer = 'runtime' AS rt FROM cuda_calls WHERE tid = $tid AND list_contains($ops, op)",
        {"tid": tid, "ops": list(SYNC_OPS)},
    ).fetchnumpy()
    cols = {k: np.asarray(c[k], dtype=np.int64) for k in ("ts_ns", "dur_ns", "op_index", "stack_id")}
    rt = np.asarray(c["rt"], dtype=bool)
    if rt.any() and not rt.all():
        cols = {k: v[rt] for k, v in cols.items()}
    if len(cols["ts_ns"]) > 1 and (np.diff(cols["ts_ns"]) < 0).any():
        order = np.argsort(cols["ts_ns"], kind="stable")
        cols = {k: v[order] for k, v in cols.items()}
    n = len(cols["ts_ns"])
    # one integer per (op, call site): stack ids are far below 2**48
    keys = (cols["op_index"] << 48) | cols["stack_id"]
    k = markers_per_step(keys) if n >= 3 else 1
    return StepMarkers(cols["ts_ns"], cols["dur_ns"], cols["op_index"], cols["stack_id"], k)


def series_of(conn: duckdb.DuckDBPyConnection, t: ThreadTime, detail: bool = False) -> StepSeries:
    """Return the step series of thread ``t`` (see the module docstring)."""
    sm = step_markers(conn, t.tid)
    k = sm.per_step
    if len(sm) < 3:
        return _seconds(conn, t)
    ends = sm.ends.tolist()
    durations = [(b - a) / MS for a, b in zip(ends, ends[1:], strict=False)]
    note = _stored_note(conn, t, len(sm))
    site = _site(conn, sm.stack_id[:k].tolist())
    marker = " + ".join(dict.fromkeys(sm.ops(k))) + (f" at {site}" if site else "")
    return _series(conn, t, "steps", marker, k, ends, durations, detail, note)


def _series(
    conn: duckdb.DuckDBPyConnection,
    t: ThreadTime,
    basis: Basis,
    marker: str,
    k: int,
    bounds: list[int],
    durations: list[float],
    detail: bool,
    note: str,
) -> StepSeries:
    spread = spread_of(durations)
    slow = slow_indices(durations, spread)
    patterns = find_patterns(durations, spread)
    in_pattern = {i for p in patterns for i in p.members}
    extra = _Extra(conn, t, bounds) if basis == "steps" else None
    unit = "step" if basis == "steps" else "second"

    def number(i: int) -> int:
        """A step is numbered by the wait that ends it: step 1 ends with the thread's first wait, whose start the
        recording cannot tell, so the first complete step is step 2. A second is numbered from the session start."""
        return i + 2 if basis == "steps" else bounds[i] // S

    out = []
    for p in patterns:
        added = p.added
        shown = round(added, 2)  # the summary says what added_ms says (67.748 read +67.7 ms beside 67.75)
        first = p.members[0]
        out.append(
            StepPattern(
                every=p.every,
                first_step=number(first),
                count=len(p.members),
                added_ms=shown,
                first_s=round(bounds[first] / S, 3),
                extra=extra.parts(p.members, len(durations), added) if extra else [],
                summary=f"every {_nth(p.every)} {unit}: +{shown:,.1f} ms ({len(p.members)} {unit}s, from {unit} "
                f"{number(first)} at {bounds[first] / S:.1f} s)",
            )
        )
    irregular = sorted((i for i in slow if i not in in_pattern), key=lambda i: -durations[i])
    span = (bounds[-1] - bounds[0]) / S if len(bounds) > 1 else 0.0
    srt = sorted(durations)
    headline = (
        f"thread {t.tid} ({t.comm}): {len(durations):,} {unit}s, typically {spread.typical:,.2f} ms"
        + (f" ({len(durations) / span:,.1f}/s)" if span and basis == "steps" else "")
        + "".join(f"; {p.summary}" for p in out)
        + (f"; {len(irregular)} other slow {unit}s" if irregular else "")
    )
    return StepSeries(
        pid=t.pid,
        tid=t.tid,
        comm=t.comm,
        basis=basis,
        marker=marker,
        markers_per_step=k,
        steps=len(durations),
        steps_per_s=round(len(durations) / span, 2) if span else 0.0,
        typical_ms=round(spread.typical, 3),
        spread_ms=round(spread.spread, 3),
        slow_above_ms=round(spread.threshold, 3),
        mean_ms=round(statistics.fmean(durations), 3) if durations else 0.0,
        p90_ms=round(srt[int(0.9 * (len(srt) - 1))], 3) if srt else 0.0,
        max_ms=round(srt[-1], 3) if srt else 0.0,
        slow_steps=len(slow),
        patterns=out,
        irregular=[
            SlowStep(step=number(i), start_s=round(bounds[i] / S, 3), ms=round(durations[i], 3))
            for i in irregular[:MAX_IRREGULAR]
        ],
        series_ms=[round(d, 3) for d in durations[:MAX_SERIES]] if detail else [],
        headline=headline,
        note=note,
    )


class _Extra:
    """The thread's off-CPU intervals by step, to say what the slow steps spent their extra time on."""

    def __init__(self, conn: duckdb.DuckDBPyConnection, t: ThreadTime, bounds: list[int]) -> None:
        self.by_step: dict[int, dict[str, float]] = {}
        rows = conn.execute(
            "SELECT ts_ns, dur_ns, coalesce(runq_ns, 0), waker_pid, waker_comm, coalesce(in_call, false) FROM sched "
            "WHERE tid = ? AND ts_ns >= ? AND ts_ns < ?",
            [t.tid, bounds[0], bounds[-1]],
        ).fetchall()
        for ts, dur, runq, wp, wc, in_call in rows:
            i = bisect.bisect_right(bounds, ts) - 1
            acc = self.by_step.setdefault(i, {})
            if in_call:
                acc["off CPU inside CUDA calls"] = acc.get("off CPU inside CUDA calls", 0.0) + dur / MS
                continue
            if runq:
                acc["waiting for a CPU"] = acc.get("waiting for a CPU", 0.0) + runq / MS
            if dur > runq:
                who = f"blocked, woken by {waker_name(wp, wc)}" if wp is not None else "blocked, waker not seen"
                acc[who] = acc.get(who, 0.0) + (dur - runq) / MS

    def parts(self, slow: tuple[int, ...], n: int, added: float) -> list[StepPart]:
        """Per kind of off-CPU time, its mean excess in the slow steps over their neighbours (as the added time
        is measured); what is left of the added time ran."""

        def of(i: int, what: str) -> float:
            return self.by_step.get(i, {}).get(what, 0.0)

        def over(i: int, what: str) -> float:
            return of(i, what) - statistics.median(of(j, what) for j in neighbours(n, i))

        whats = {w for i in slow for w in self.by_step.get(i, {})}
        parts = {w: statistics.fmean(over(i, w) for i in slow) for w in whats}
        parts = {w: v for w, v in parts.items() if abs(v) >= 0.05}
        parts["running (on CPU or inside CUDA calls)"] = added - sum(parts.values())
        return sorted(
            (StepPart(what=w, ms=round(v, 2)) for w, v in parts.items() if abs(v) >= 0.05), key=lambda p: -p.ms
        )


def _seconds(conn: duckdb.DuckDBPyConnection, t: ThreadTime) -> StepSeries:
    """The series of a thread with no wait for the GPU: its seconds, each valued by the time it did not work."""
    secs = sorted(t.by_sec)
    if len(secs) < 3:
        return _empty(t.pid, t.tid, f"thread {t.tid} has no wait for the GPU and under 3 s of accounted time")
    values = [(t.by_sec[s]["blocked"] + sum(t.by_sec[s][p] for p in RUNQ_PART_NAMES)) / MS for s in secs]
    note = (
        f"thread {t.tid} never waits for the GPU, so its steps cannot be told apart: the series is its seconds, "
        "each valued by the ms it was blocked or waiting for a CPU (its exact breakdown)"
    )
    bounds = [s * S for s in secs] + [(secs[-1] + 1) * S]
    return _series(conn, t, "seconds", "seconds (no wait for the GPU)", 1, bounds, values, False, note)


def _stored_note(conn: duckdb.DuckDBPyConnection, t: ThreadTime, stored: int) -> str:
    """Say when the process counted more waits than were stored: steps with a missing wait are merged."""
    r = conn.execute(
        "SELECT coalesce(sum(calls), 0) FROM op_stats WHERE pid = ? AND list_contains(?, op) AND layer = "
        "(SELECT CASE WHEN count(*) FILTER (WHERE layer = 'runtime') > 0 THEN 'runtime' ELSE 'driver' END "
        "FROM op_stats WHERE pid = ? AND list_contains(?, op))",
        [t.pid, list(SYNC_OPS), t.pid, list(SYNC_OPS)],
    ).fetchone()
    counted = int(r[0]) if r else 0
    if counted > stored:
        return (
            f"pid {t.pid} made {counted:,} waits for the GPU and {stored:,} of this thread's were stored: other "
            "threads' waits, or waits the row budget left out (a step with a missing wait is merged with the next)"
        )
    return ""


def _site(conn: duckdb.DuckDBPyConnection, stack_ids: list[int]) -> str:
    """Return the user's code site ('file:line function') of the step's last wait, '' when it has no stack."""
    ids = [i for i in stack_ids if i]
    return (code_site(conn, ids[-1]) or "") if ids else ""


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _empty(pid: int | None, tid: int | None, note: str) -> StepSeries:
    return StepSeries(
        pid=pid,
        tid=tid,
        comm="",
        basis="none",
        marker="",
        markers_per_step=0,
        steps=0,
        steps_per_s=0.0,
        typical_ms=0.0,
        spread_ms=0.0,
        slow_above_ms=0.0,
        mean_ms=0.0,
        p90_ms=0.0,
        max_ms=0.0,
        slow_steps=0,
        patterns=[],
        irregular=[],
        series_ms=[],
        headline=note,
        note=note,
    )


__all__ = [
    "SlowStep",
    "StepMarkers",
    "StepPart",
    "StepPattern",
    "StepSeries",
    "markers_per_step",
    "series_of",
    "step_markers",
    "step_series",
]
