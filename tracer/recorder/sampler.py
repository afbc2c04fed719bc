"""The on-CPU sampler: a perf_event software cpu-clock event on every CPU, each tick running probes/profile.bpf.c
``cpu_sample``, which keeps only the target threads' ticks.

cpu-clock is an hrtimer, so it needs no hardware PMU (VMs rarely expose one). A per-CPU event (not one per
thread) covers every thread of the job, those it starts later included, with one event per CPU whatever the
thread count. Its period is fixed in ns (the kernel turns a frequency into a fixed period for cpu-clock anyway),
so each sample stands for exactly ``period_ns`` of CPU time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# 99, not 100: a sampler in step with a 100 Hz (or 1000 Hz) periodic activity sees the same phase of it at every
# tick. At 99 Hz a thread on CPU for 1 s yields 99 samples, a ±10% estimate of a 1% part of its time within
# ~10 s; the probe costs a few µs per target tick (bench/probe_cost.py), ~0.05% of a core at 99 Hz per CPU.
DEFAULT_HZ = 99
MAX_HZ = 999  # past ~1 kHz the per-sample Python walk becomes a cost the job feels


@dataclass
class Sampler:
    """The attached per-CPU cpu-clock events; :meth:`stop` detaches them."""

    bpf: Any
    hz: int
    live: bool = False

    @property
    def period_ns(self) -> int:
        return round(1e9 / self.hz) if self.hz else 0

    def start(self) -> None:
        """Attach the events (one per online CPU).

        Raises:
            Exception: the kernel refused a perf event (bcc's error, with its reason).
        """
        from bcc import PerfSWConfig, PerfType

        self.bpf.attach_perf_event(
            ev_type=PerfType.SOFTWARE,
            ev_config=PerfSWConfig.CPU_CLOCK,
            fn_name="cpu_sample",
            sample_period=self.period_ns,
        )
        self.live = True

    def stop(self) -> None:
        """Detach the events; the samples already counted stay in the map for the last drain."""
        if not self.live:
            return
        from bcc import PerfSWConfig, PerfType

        try:
            self.bpf.detach_perf_event(ev_type=PerfType.SOFTWARE, ev_config=PerfSWConfig.CPU_CLOCK)
        except Exception as e:  # the events close with the process anyway
            log.debug("detaching the sampler failed: %s", e)
        self.live = False
