"""The session's start on both clocks: CLOCK_MONOTONIC (which every ts_ns is relative to) and CLOCK_REALTIME (which
lines up recordings made on different hosts, :mod:`tracer.analysis.job`).

The two clocks cannot be read at one instant. Each try reads monotonic, realtime, monotonic: the realtime read lies
between the two monotonic ones, so the realtime of the first monotonic read is within their gap of it. Of
:data:`TRIES` tries the one with the smallest gap is kept (a preemption between the reads makes one try's gap
large, rarely two), and the gap is stored as the read's bound (``session.clock_read_ns``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

TRIES = 2


@dataclass(frozen=True)
class StartClocks:
    """One monotonic and one realtime read taken back to back."""

    mono_ns: int  # CLOCK_MONOTONIC: session.start_mono_ns
    realtime_ns: int  # CLOCK_REALTIME (Unix ns) read right after it: session.realtime_at_start_ns
    read_ns: int  # the monotonic time the pair took to read: the realtime of mono_ns is within this of realtime_ns


def read_start_clocks(tries: int = TRIES) -> StartClocks:
    """Return the pair of reads with the smallest gap of ``tries``."""
    best: StartClocks | None = None
    for _ in range(max(tries, 1)):
        mono = time.monotonic_ns()
        real = time.time_ns()
        gap = time.monotonic_ns() - mono
        if best is None or gap < best.read_ns:
            best = StartClocks(mono, real, gap)
    assert best is not None
    return best
