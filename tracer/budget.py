"""The overhead budget: what tracing costs the target, duty-cycling the launch probes to stay under it, and
scaling the launch counts they saw back to honest totals.

The cost of a uprobe is the trap, not the BPF program (~16 µs a hit in this VM, 1-2 µs on bare metal), so the
estimate is hits per second x the trap cost measured on this machine (:func:`trap_cost`), as a percent of one CPU.
When it exceeds the budget, the launch probes (the hot path, 10-50 K/s in real training) are attached only part
of the time: :class:`DutyCycler` opens and closes their uprobe_multi links (milliseconds each) in periods of
``PERIOD_S`` and records each live window. Syncs, allocations, copies and lifecycle events are rare and
diagnostic: never duty-cycled, always exact.

Scaling (:func:`launch_scales`) is per process: observed launches x (the process's active span / the part of it
the probes were live). The active span runs from the process's first to its last probed call of any kind; the
always-on ops (a sync every step) pin its ends, so the idle time before a job starts launching, after it stops,
or after it exits is not counted as time its launches were missed. That end-of-activity time was the bias of the
first version (+15% to +50% on steady workloads). The error bound comes from how much the launch rate varied
between live windows, and from span ends only launches mark.
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
from dataclasses import asdict, dataclass, field

import numpy as np

from tracer.program import ProbeSet

log = logging.getLogger(__name__)

CALIB_CALLS = 4000
# One period: probes live for fraction x PERIOD_S, then off. Opening or closing a uprobe_multi link takes
# milliseconds (closing waits one RCU grace period, ~40 ms, off the job's path), so a short period is cheap and
# gives the estimate many windows to average over.
PERIOD_S = 1.0
MIN_FRACTION = 0.05


@dataclass(frozen=True)
class TrapCost:
    entry_ns: float  # one entry uprobe hit, program included
    return_ns: float  # the return probe on top of it


def _libc_labs() -> tuple[str, int]:
    """The libc file mapped in this process and the file offset of its ``labs``."""
    from tracer.procmaps import read_maps
    from tracer.targets import exported_offsets

    for m in read_maps(os.getpid()):
        if os.path.basename(m.path).startswith("libc.so") or os.path.basename(m.path).startswith("libc-"):
            offs = exported_offsets(m.host_path)
            if "labs" in offs:
                return m.host_path, offs["labs"]
    raise OSError("no libc with labs mapped in the recorder")


def calibrate(calib_prog: int) -> TrapCost:
    """Time an empty entry probe and an empty return probe on libc ``labs`` in this process only (uprobe_multi
    links filtered on this pid, so nothing else pays for them); return their costs."""
    from tracer.links import attach_multi

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
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{boot}-{os.uname().release}"


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
        return fraction

    @property
    def mean_pct(self) -> float | None:
        return round(float(np.mean(self.samples)), 3) if self.samples else None


@dataclass
class Window:
    """A span the launch probes were live, CLOCK_MONOTONIC ns, and the launches each process made in it."""

    start: int
    end: int
    calls: dict[int, int] = field(default_factory=dict)


class DutyCycler:
    """Opens and closes the launch probes' links in time slices, from a thread of its own.

    ``fraction`` (0..1] is how much of each period they should be live. Each live window is recorded from the end
    of its attach to the start of its detach (a uprobe_multi link's breakpoints are in place when the attach
    returns and gone as soon as the close starts; the grace period after that only delays the close's return).
    ``count_hot``, called at each window's end, returns each process's cumulative launch count, from which the
    per-window counts behind the error bound are taken.
    """

    def __init__(self, count_hot: Callable[[], dict[int, int]] | None = None) -> None:
        self.sets: list[ProbeSet] = []
        self.fraction = 1.0
        self.windows: list[Window] = []
        self.cycled = False
        self._count_hot = count_hot
        self._last_counts: dict[int, int] = {}
        self._open_since: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, ps: ProbeSet) -> None:
        """A new library's launch probes (already live): cycled with the others from now on."""
        with self._lock:
            self.sets.append(ps)
            if self._open_since is None and ps.live:
                self._open_since = time.monotonic_ns()

    def remove(self, ps: ProbeSet) -> None:
        with self._lock:
            if ps in self.sets:
                self.sets.remove(ps)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="duty-cycler", daemon=True)
        self._thread.start()

    def _set_live(self, live: bool) -> None:
        with self._lock:
            sets = list(self.sets)
            if live:
                for ps in sets:
                    self._safe(ps.open)
                self._open_since = time.monotonic_ns()
            else:
                self._close_window(time.monotonic_ns())
                for ps in sets:
                    self._safe(ps.close)

    def _close_window(self, now: int) -> None:
        if self._open_since is None:
            return
        counts = self._count_hot() if self._count_hot else {}
        delta = {pid: n - self._last_counts.get(pid, 0) for pid, n in counts.items()}
        self._last_counts = counts
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
            self._close_window(time.monotonic_ns())

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


def launch_scales(
    windows: Sequence[Window], activity: dict[int, Activity], seen: dict[int, int], cycled: bool
) -> dict[int, tuple[float, float]]:
    """Per process, (fraction of its active span the launch probes were live, error bound in percent) for
    scaling its launch counts: calls = seen / fraction.

    The bound adds (a) twice the standard error of the mean launch rate over the windows inside the span (a
    workload whose rate swings between windows is estimated less surely) and (b) for an end of the span marked
    only by launches, the off-time next to it, during which the process may have gone on launching.
    """
    out: dict[int, tuple[float, float]] = {}
    if not cycled:
        return {pid: (1.0, 0.0) for pid in activity}
    spans = sorted((w.start, w.end, w) for w in windows)
    for pid, act in activity.items():
        a, b = act.first, act.last
        if b <= a or seen.get(pid, 0) == 0:
            out[pid] = (1.0, 0.0)
            continue
        live = sum(max(0, min(e, b) - max(s, a)) for s, e, _ in spans)
        fraction = min(1.0, max(MIN_FRACTION, live / (b - a)))
        rates = [w.calls.get(pid, 0) / (e - s) for s, e, w in spans if s >= a and e <= b and e > s]
        err = 0.0
        if len(rates) >= 2 and np.mean(rates) > 0:
            err += 100.0 * 2 * float(np.std(rates, ddof=1)) / float(np.mean(rates)) / math.sqrt(len(rates))
        elif len(rates) < 2:
            err += 100.0 * (1 - fraction)  # one window or none inside the span: no spread to go by
        off_edge = (1 - fraction) * PERIOD_S * 1e9
        for exact in (act.first_exact, act.last_exact):
            if not exact:
                err += 100.0 * off_edge / (b - a)
        out[pid] = (fraction, round(err, 2))
    return out
