"""The overhead budget: what tracing costs the target, and duty-cycling the hot probes to stay under a budget.

The cost of a uprobe is the trap, not the BPF program (~12 µs a hit in a VM, 1-2 µs on bare metal), so the
estimate is hits per second x the trap cost measured on this machine at start (:func:`calibrate`), as a percent
of one CPU: for a launch-bound thread, that is its slowdown. When the estimate exceeds the budget, the launch
probes (the hot path, 10-50 K/s in real training) are detached and re-attached in time slices; their counts are
scaled by the fraction of time they were attached, and marked so. Syncs, allocations, copies and lifecycle
events are rare and diagnostic: never duty-cycled, always exact.
"""

from __future__ import annotations

import ctypes as ct
import logging
import os
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CALIB_CALLS = 4000
# One cycle: probes on for fraction x PERIOD, then off. Detaching a uprobe takes ~0.1 s here (an RCU grace
# period), so the period must be long against it for the on-time (and so the scaling) to be accurate.
PERIOD_S = 5.0
MIN_FRACTION = 0.05


@dataclass(frozen=True)
class TrapCost:
    entry_ns: float  # one entry uprobe hit, program included
    return_ns: float  # the return probe on top of it


def calibrate(bpf) -> TrapCost:
    """Return this machine's cost of an entry uprobe and of a return probe, timed on libc ``labs`` in this process.

    The probes are attached with a pid filter to this process only, so nothing else pays for them.
    """
    libc = ct.CDLL(None)
    labs = libc.labs
    labs.argtypes = [ct.c_long]
    pid = os.getpid()

    def per_call() -> float:
        t = time.perf_counter_ns()
        for i in range(CALIB_CALLS):
            labs(i)
        return (time.perf_counter_ns() - t) / CALIB_CALLS

    base = min(per_call() for _ in range(3))
    bpf.attach_uprobe(name="c", sym="labs", fn_name="calib_probe", pid=pid)
    entry = min(per_call() for _ in range(3)) - base
    bpf.attach_uretprobe(name="c", sym="labs", fn_name="calib_probe", pid=pid)
    both = min(per_call() for _ in range(3)) - base
    return TrapCost(entry_ns=max(entry, 0.0), return_ns=max(both - entry, 0.0))


@dataclass
class Probe:
    path: str
    sym: str
    op: str


@dataclass
class DutyCycler:
    """Attaches and detaches the hot probes in time slices from a thread of its own.

    ``fraction`` (0..1] is how much of the time they should be attached. ``active_s`` accumulates the time they
    were live, measured in BPF from the first to the last hit of each on-window (``duty_span``): attach and
    detach calls take effect only after a grace period, so their own timestamps would misplace the window.
    """

    bpf: object
    probes: list[Probe] = field(default_factory=list)
    fraction: float = 1.0
    active_s: float = 0.0
    windows: int = 0  # on-windows closed by a detach (0: never cycled)
    _attached: bool = True
    _since: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def start(self, started_at: float) -> None:
        self._since = started_at
        self._thread = threading.Thread(target=self._run, name="duty-cycler", daemon=True)
        self._thread.start()

    def add(self, probe: Probe) -> None:
        with self._lock:
            self.probes.append(probe)

    def _detach(self) -> None:
        with self._lock:
            probes = list(self.probes)
        # entry probes first: a return probe removed under a call in flight would leave its entry stale
        for p in probes:
            self._safe(self.bpf.detach_uprobe, name=p.path, sym=p.sym)
        for p in probes:
            self._safe(self.bpf.detach_uretprobe, name=p.path, sym=p.sym)
        self._close_window()
        self._attached = False

    def _close_window(self) -> None:
        """Add the live span of the window just ended, from its first to its last hit plus one mean gap."""
        span = self.bpf["duty_span"]
        first, last, n = (span[ct.c_int(i)].value for i in range(3))
        for i in range(3):
            span[ct.c_int(i)] = ct.c_uint64(0)
        if n >= 2 and last > first:
            self.active_s += (last - first) / 1e9 * n / (n - 1)
            self.windows += 1

    def _attach(self) -> None:
        with self._lock:
            probes = list(self.probes)
        for p in probes:  # return probes first, for the same reason
            self._safe(self.bpf.attach_uretprobe, name=p.path, sym=p.sym, fn_name=f"return_{p.op}")
        for p in probes:
            self._safe(self.bpf.attach_uprobe, name=p.path, sym=p.sym, fn_name=f"entry_{p.op}")
        self._since = time.monotonic()
        self._attached = True

    @staticmethod
    def _safe(fn, **kw) -> None:  # noqa: ANN001
        try:
            fn(**kw)
        except Exception as e:  # a library unmapped meanwhile: nothing to toggle
            log.debug("duty cycle %s %s: %s", fn.__name__, kw.get("sym"), e)

    def _run(self) -> None:
        while not self._stop.is_set():
            f = self.fraction
            if f >= 1.0 or not self.probes:
                if not self._attached:
                    self._attach()
                self._stop.wait(0.25)
                continue
            if not self._attached:
                self._attach()
            if self._stop.wait(f * PERIOD_S):
                break
            self._detach()
            self._stop.wait((1 - f) * PERIOD_S)

    def stop(self) -> float:
        """Stop cycling (leaving the probes as they are); return the fraction of the time since the first hot hit
        that the hot probes were live (1.0 when they were never cycled)."""
        self._stop.set()
        if self._thread:
            self._thread.join()
        if self.windows == 0:
            return 1.0
        now = time.monotonic()
        if self._attached:
            self.active_s += now - self._since
        first_hit = self.bpf["duty_span"][ct.c_int(3)].value / 1e9  # CLOCK_MONOTONIC, as time.monotonic()
        total = now - first_hit if first_hit else 0.0
        return min(1.0, self.active_s / total) if total > 0 else 1.0


def required_fraction(hot_pct: float, rare_pct: float, budget_pct: float) -> float:
    """Return the share of time the hot probes may stay attached so that hot x fraction + rare <= budget."""
    if hot_pct <= 0 or hot_pct + rare_pct <= budget_pct:
        return 1.0
    return max(MIN_FRACTION, min(1.0, (budget_pct - rare_pct) / hot_pct))
