"""The overhead budget: what tracing costs the target, duty-cycling the launch probes to stay under it, and
scaling the launch counts they saw back to honest totals.

The cost of a uprobe is the trap, not the BPF program (~16 µs a hit in this VM, 1-2 µs on bare metal), so the
estimate is hits per second x the trap cost measured on this machine (:func:`trap_cost`), as a percent of one CPU.
When it exceeds the budget, the launch probes (the hot path, 10-50 K/s in real training) are attached only part
of the time: :class:`DutyCycler` opens and closes their uprobe_multi links (milliseconds each) in periods of
``PERIOD_S`` and records each live window. Syncs, allocations, copies and lifecycle events are rare and
diagnostic: never duty-cycled, always exact.

Scaling (:func:`launch_scales`) is per process, and by count, not by time: launches seen x (calls of an always-on
op over the whole run / its calls inside the live windows). The reference is the process's steadiest always-on op
(the sync or the copy a training step makes), whose count per step is fixed whatever the probes cost. Scaling by
time instead is biased twice over: a live probe slows a launch-bound loop (16 µs a trap here), so fewer launches
fall in a live second than in a dark one (-17% to -25% measured on train.py); and the idle time before a job
launches, or after it stops, counts as time its launches were missed (+15% to +50% in the first version). Time
scaling over the process's active span remains the fallback for a process with no steady always-on op. The error
bound is twice the standard error of the per-window launches-per-reference ratio plus one reference call per window
(a window's edges may cut a step); when falling back, the spread of the time-based rate, plus, for a span end
marked only by launches, the off-time next to it.
"""

from __future__ import annotations

import ctypes as ct
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from probes.catalog import CATALOG, OP_NAMES
from tracer import procfs
from tracer.recorder import bpfmaps, events
from tracer.recorder.program import ProbeSet

log = logging.getLogger(__name__)

CALIB_CALLS = 4000
# One period: probes live for fraction x PERIOD_S, then off. Opening or closing a uprobe_multi link takes
# milliseconds (closing waits one RCU grace period, ~40 ms, off the job's path), so a short period is cheap and
# gives the estimate many windows to average over.
PERIOD_S = 1.0
MIN_FRACTION = 0.05
OVER_BUDGET = 1.25  # the mean estimate past this x the budget is reported (it hovers around the budget when met)
# by op id: the ops whose probes the duty cycler turns off and on (launches); their counts are scaled, the rest exact
DUTY_CYCLED = np.array([s.duty_cycled for s in CATALOG])
DUTY_CYCLED_IDS = frozenset(int(i) for i in np.nonzero(DUTY_CYCLED)[0])


@dataclass(frozen=True)
class TrapCost:
    entry_ns: float  # one entry uprobe hit, program included
    return_ns: float  # the return probe on top of it


def _libc_labs() -> tuple[str, int]:
    """The libc file mapped in this process and the file offset of its ``labs``."""
    from tracer.recorder.procmaps import read_maps
    from tracer.recorder.targets import exported_offsets

    for m in read_maps(os.getpid()):
        if os.path.basename(m.path).startswith("libc.so") or os.path.basename(m.path).startswith("libc-"):
            offs = exported_offsets(m.host_path)
            if "labs" in offs:
                return m.host_path, offs["labs"]
    raise OSError("no libc with labs mapped in the recorder")


def calibrate(calib_prog: int) -> TrapCost:
    """Time an empty entry probe and an empty return probe on libc ``labs`` in this process only (uprobe_multi
    links filtered on this pid, so nothing else pays for them); return their costs."""
    from tracer.recorder.links import attach_multi

    path, off = _libc_labs()
    libc = ct.CDLL(None)
    labs = libc.labs
    labs.argtypes = [ct.c_long]

    def per_call() -> float:
        t = time.perf_counter_ns()
        for i in range(CALIB_CALLS):
            labs(i)
        return (time.perf_counter_ns() - t) / CALIB_CALLS

    base = min(per_call() for _ in range(3))
    entry_link = attach_multi(calib_prog, path, [off], [0], retprobe=False, pid=os.getpid())
    try:
        entry = min(per_call() for _ in range(3)) - base
        ret_link = attach_multi(calib_prog, path, [off], [0], retprobe=True, pid=os.getpid())
        try:
            both = min(per_call() for _ in range(3)) - base
        finally:
            ret_link.close()
    finally:
        entry_link.close()
    return TrapCost(entry_ns=max(entry, 0.0), return_ns=max(both - entry, 0.0))


def _machine_key() -> str:
    return f"{procfs.boot_id() or '?'}-{os.uname().release}"


def trap_cost(calib_prog: int, cache_dir: str) -> tuple[TrapCost, bool]:
    """This machine's trap cost, measured once per boot and kernel (cached in ``cache_dir``); returns (cost,
    whether it was measured now)."""
    path = os.path.join(cache_dir, "trap-cost.json")
    key = _machine_key()
    try:
        with open(path) as f:
            d = json.load(f)
        if d.get("key") == key:
            return TrapCost(float(d["entry_ns"]), float(d["return_ns"])), False
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cost = calibrate(calib_prog)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"key": key, **asdict(cost)}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("cannot cache the trap cost: %s", e)
    return cost, True


def required_fraction(hot_pct: float, rare_pct: float, budget_pct: float) -> float:
    """Return the share of time the hot probes may stay attached so that hot x fraction + rare <= budget."""
    if hot_pct <= 0 or hot_pct + rare_pct <= budget_pct:
        return 1.0
    return max(MIN_FRACTION, min(1.0, (budget_pct - rare_pct) / hot_pct))


@dataclass
class OverheadEstimator:
    """Turns per-second probe hits into an overhead estimate and the launch probes' duty cycle."""

    trap: TrapCost
    budget_pct: float
    hot_pct: float = 0.0  # what the hot probes would cost if always live (smoothed)
    overhead_pct: float = 0.0  # what the probes cost, as live
    samples: list[float] = field(default_factory=list)
    rare_samples: list[float] = field(default_factory=list)  # of which the probes never cycled

    def update(self, hot_hits: int, rare_hits: int, live_share: float, seconds: float) -> float:
        """Account one interval's hits (hot ones seen while live for ``live_share`` of it); return the fraction
        of time the hot probes may be live from now on."""
        per_hit = self.trap.entry_ns + self.trap.return_ns
        seconds = max(seconds, 1e-3)
        hot = 100.0 * hot_hits * per_hit / 1e9 / seconds / max(live_share, MIN_FRACTION)
        rare = 100.0 * rare_hits * per_hit / 1e9 / seconds
        self.hot_pct = 0.5 * self.hot_pct + 0.5 * hot if self.samples else hot
        fraction = required_fraction(self.hot_pct, rare, self.budget_pct)
        self.overhead_pct = self.hot_pct * fraction + rare
        self.samples.append(self.overhead_pct)
        self.rare_samples.append(rare)
        return fraction

    def over_budget_note(self) -> str | None:
        """What the recording says when the probes cost the job more than the budget on average (None: they did
        not): the probes never cycled (syncs, copies, allocations) cost what they cost, and the launch probes are
        live at least MIN_FRACTION of the time, so a high trap cost (a VM's) can put the two over it. Without
        this the notes said only that the launch probes were cycled "to stay under" the budget."""
        mean = self.mean_pct
        if mean is None or mean <= self.budget_pct * OVER_BUDGET:
            return None
        rare = float(np.mean(self.rare_samples))
        per_hit_us = (self.trap.entry_ns + self.trap.return_ns) / 1e3
        launches = mean - rare
        parts = f"{rare:.1f}% for the probes that are never sampled (syncs, copies, allocations)"
        if launches >= 0.05:
            parts += f", {launches:.1f}% for the launch probes, live at least {MIN_FRACTION:.0%} of the time"
        return (
            f"the probes cost the job an estimated {mean:.1f}% of a core, over --overhead-budget {self.budget_pct:g}%: "
            f"{parts}; a probe hit costs {per_hit_us:.1f} µs on this machine (0.3-2 µs on bare metal; more in a VM)"
        )

    @property
    def mean_pct(self) -> float | None:
        return round(float(np.mean(self.samples)), 3) if self.samples else None


@dataclass
class Window:
    """A span the launch probes were live, CLOCK_MONOTONIC ns, and the calls each (pid, op) made in it: exact, from
    the in-kernel totals read right after the links opened and right before they closed."""

    start: int
    end: int
    calls: dict[tuple[int, int], int] = field(default_factory=dict)


class DutyCycler:
    """Opens and closes the launch probes' links in time slices, from a thread of its own.

    ``fraction`` (0..1] is how much of each period they should be live. Each live window is recorded from the end
    of its attach to the start of its detach (a uprobe_multi link's breakpoints are in place when the attach
    returns and gone as soon as the close starts; the grace period after that only delays the close's return).
    ``count_calls`` returns the cumulative calls per (pid, op), read at each window's open and close: the exact
    counts behind the scaling. ``on_closed(t, sets)`` runs after the links are closed, with the time they were:
    a launch still in flight then (blocked longer than the close's grace period) never sees its return probe, and
    its thread's next probe clears it (cuda.bpf.c ``missed_return``).
    """

    def __init__(
        self,
        count_calls: Callable[[], dict[tuple[int, int], int]] | None = None,
        on_closed: Callable[[int, list[ProbeSet]], None] | None = None,
    ) -> None:
        self.sets: list[ProbeSet] = []
        self._on_closed = on_closed
        self.fraction = 1.0
        self.windows: list[Window] = []
        self.cycled = False
        self._count_calls = count_calls
        self._open_counts: dict[tuple[int, int], int] = {}
        self._open_since: int | None = None
        self._outer: set[int] = set()  # id() of the sets opened last and closed first
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="duty-close")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, ps: ProbeSet, outer: bool = False) -> None:
        """A new library's launch probes (already live): cycled with the others from now on. ``outer``: a runtime's,
        which calls the driver's: opened after the driver's and closed before them, so that whenever a runtime
        launch is seen its nested driver launch is seen too."""
        with self._lock:
            self.sets.append(ps)
            if outer:
                self._outer.add(id(ps))
            if self._open_since is None and ps.live:
                self._open_window()

    def _open_window(self) -> None:
        self._open_counts = self._count_calls() if self._count_calls else {}
        self._open_since = time.monotonic_ns()

    def remove(self, ps: ProbeSet) -> None:
        with self._lock:
            if ps in self.sets:
                self.sets.remove(ps)
                self._outer.discard(id(ps))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="duty-cycler", daemon=True)
        self._thread.start()

    def _set_live(self, live: bool) -> None:
        with self._lock:
            inner = [ps for ps in self.sets if id(ps) not in self._outer]
            outer = [ps for ps in self.sets if id(ps) in self._outer]
            if live:
                for ps in self.sets:
                    self._safe(ps.open_returns)
                for ps in inner + outer:
                    self._safe(ps.open_entries)
                self._open_window()
            else:
                self._close_window()
                # each close waits a grace period: run them side by side, outer entries before inner ones
                for group in (outer, inner):
                    list(self._pool.map(lambda ps: self._safe(ps.close_entries), group))
                list(self._pool.map(lambda ps: self._safe(ps.close_returns), self.sets))
                if self._on_closed is not None:
                    # taken once the returns are gone: a hot call that entered before this never returns through
                    # a probe (the entries closed first, so none entered after)
                    self._on_closed(time.monotonic_ns(), list(self.sets))

    def _close_window(self) -> None:
        if self._open_since is None:
            return
        counts = self._count_calls() if self._count_calls else {}
        now = time.monotonic_ns()
        delta = {k: n - self._open_counts.get(k, 0) for k, n in counts.items() if n > self._open_counts.get(k, 0)}
        self.windows.append(Window(self._open_since, now, delta))
        self._open_since = None

    @staticmethod
    def _safe(fn: Callable[[], None]) -> None:
        try:
            fn()
        except OSError as e:  # a library unmapped meanwhile: nothing to toggle
            log.debug("duty cycle: %s", e)

    def _run(self) -> None:
        while not self._stop.is_set():
            f = self.fraction
            if f >= 1.0:
                if self._open_since is None:
                    self._set_live(True)
                self._stop.wait(0.25)
                continue
            self.cycled = True
            if self._open_since is None:
                self._set_live(True)
            if self._stop.wait(f * PERIOD_S):
                break
            self._set_live(False)
            self._stop.wait((1 - f) * PERIOD_S)

    def stop(self) -> None:
        """Stop cycling and close the current window (the probes stay as they are)."""
        self._stop.set()
        if self._thread:
            self._thread.join()
        with self._lock:
            self._close_window()

    def live_share(self, t0: int, t1: int) -> float:
        """Share of [t0, t1) (monotonic ns) the launch probes were live; 1.0 when they were never cycled."""
        if not self.cycled or t1 <= t0:
            return 1.0
        with self._lock:
            spans = [(w.start, w.end) for w in self.windows]
            if self._open_since is not None:
                spans.append((self._open_since, time.monotonic_ns()))
        covered = sum(max(0, min(b, t1) - max(a, t0)) for a, b in spans)
        return min(1.0, covered / (t1 - t0))


@dataclass(frozen=True)
class Activity:
    """A process's active span (monotonic ns), and whether each end was marked by an always-on probe (exact) or
    only by a launch (the true end may lie in the off-time next to it)."""

    first: int
    last: int
    first_exact: bool
    last_exact: bool


REF_MIN_CALLS = 20  # a reference op needs this many calls inside the live windows


def launch_scales(
    windows: Sequence[Window],
    activity: dict[int, Activity],
    totals: dict[tuple[int, int], int],
    hot_ops: frozenset[int],
    cycled: bool,
) -> dict[int, tuple[float, float]]:
    """Per process, (the fraction of its launches the probes saw, an error bound in percent): its launch counts
    are scaled by 1 / fraction. ``totals``: every (pid, op)'s exact calls over the run; ``hot_ops``: the launch ops.

    By count when the process has a steady always-on op (see the module docstring), else by time over its active
    span.
    """
    if not cycled:
        return {pid: (1.0, 0.0) for pid in activity}
    out: dict[int, tuple[float, float]] = {}
    for pid, act in activity.items():
        seen = sum(n for (p, op), n in totals.items() if p == pid and op in hot_ops)
        if seen == 0 or act.last <= act.first:
            out[pid] = (1.0, 0.0)
            continue
        in_windows = {}
        for w in windows:
            for (p, op), n in w.calls.items():
                if p == pid and op not in hot_ops:
                    in_windows[op] = in_windows.get(op, 0) + n
        ref = max(in_windows, key=lambda op: in_windows[op], default=None)
        if ref is not None and in_windows[ref] >= REF_MIN_CALLS and totals.get((pid, ref), 0) > 0:
            # launches per reference call inside the windows (both counted over exactly the live spans), times
            # the reference's total: launches seen during transitions do not enter
            refs = [w.calls.get((pid, ref), 0) for w in windows]
            hot = [sum(n for (p, op), n in w.calls.items() if p == pid and op in hot_ops) for w in windows]
            estimate = sum(hot) / sum(refs) * totals[(pid, ref)]
            fraction = min(1.0, seen / estimate) if estimate > 0 else 1.0
            q = [h / r for h, r in zip(hot, refs, strict=True) if r > 0]
            # each window's two edges may cut a step: one reference call's worth of launches per window, at most
            err = 100.0 * len(q) / sum(refs)
            if len(q) >= 2 and np.mean(q) > 0:
                err += 100.0 * 2 * float(np.std(q, ddof=1)) / float(np.mean(q)) / math.sqrt(len(q))
            how = f"by {sum(refs)} of {totals[(pid, ref)]} calls of {OP_NAMES[ref] if ref < len(OP_NAMES) else ref}"
        else:
            fraction, err = _by_time(windows, act, pid, hot_ops)
            how = "by time"
        fraction = max(MIN_FRACTION, fraction)
        out[pid] = (fraction, round(err, 2))
        for w in windows:
            log.debug(
                "  window %.3f s: %s", (w.end - w.start) / 1e9, {op: n for (p, op), n in w.calls.items() if p == pid}
            )
        log.info("launch scale pid %d: %d seen, %s -> x%.3f +-%.1f%%", pid, seen, how, 1 / fraction, err)
    return out


def _by_time(windows: Sequence[Window], act: Activity, pid: int, hot_ops: frozenset[int]) -> tuple[float, float]:
    """(live share of the process's active span, error bound): the fallback with no steady always-on op."""
    a, b = act.first, act.last
    live = sum(max(0, min(w.end, b) - max(w.start, a)) for w in windows)
    fraction = min(1.0, live / (b - a))
    rates = [
        sum(n for (p, op), n in w.calls.items() if p == pid and op in hot_ops) / (w.end - w.start)
        for w in windows
        if w.start >= a and w.end <= b and w.end > w.start
    ]
    err = 100.0 * (1 - fraction) if len(rates) < 2 else 0.0
    if len(rates) >= 2 and np.mean(rates) > 0:
        err = 100.0 * 2 * float(np.std(rates, ddof=1)) / float(np.mean(rates)) / math.sqrt(len(rates))
    off_edge = (1 - fraction) * PERIOD_S * 1e9
    for exact in (act.first_exact, act.last_exact):
        if not exact:
            err += 100.0 * off_edge / (b - a)
    return fraction, err


def calls_by_pid_op(bpf: Any) -> dict[tuple[int, int], int]:
    """Return the cumulative calls per (pid, op) from the in-kernel totals (the duty cycler's window counts)."""
    keys, vals = bpfmaps.dump(bpf["op_totals"], events.OP_KEY_DTYPE, events.OP_TOTAL_DTYPE)
    return {
        (pid, op): int(n)
        for pid, op, n in zip(keys["pid"].tolist(), keys["op"].tolist(), vals["calls"].tolist(), strict=True)
    }
