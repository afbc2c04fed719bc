"""The in-kernel latency histogram's bucket layout (probes/cuda.bpf.c ``hist_slot``) and percentiles over it.

Values below 16 ns get one slot each; above, every power of two is split into 16 linear sub-buckets, so a bucket
spans 1/16 of its lower bound and a midpoint estimate is within 3.1% of any value in it.

This is the only histogram implementation: the recorder (``op_stats`` percentiles), the analyses (``stats``,
``chains``, ``compare``: each through :class:`OpHistogram`) and the hand-built test DBs (``tests/tracedb.py``) all
bucket and interpolate through it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

SUB = 16


def slot_bounds(slot: int) -> tuple[int, int]:
    """Return the [lo, hi) latency range in ns of histogram ``slot``."""
    if slot < SUB:
        return slot, slot + 1
    msb, sub = slot // SUB + 3, slot % SUB
    return (SUB + sub) << (msb - 4), (SUB + sub + 1) << (msb - 4)


def slot_of(v: int) -> int:
    """Return the histogram slot of latency ``v`` ns (the same arithmetic as the BPF side)."""
    if v < SUB:
        return v
    msb = v.bit_length() - 1
    return (msb - 3) * SUB + ((v >> (msb - 4)) & 15)


def bucket_of(v: int) -> tuple[int, int]:
    """Return the [lo, hi) bucket in ns that holds latency ``v`` ns."""
    return slot_bounds(slot_of(v))


def quantile(
    buckets: Iterable[tuple[int, int, int]], q: float, lo_clamp: float | None = None, hi_clamp: float | None = None
) -> float:
    """Return the q-quantile (0..1) in ns of (lo_ns, hi_ns, count) buckets, linear inside its bucket.

    The result is clamped to [lo_clamp, hi_clamp] when given (an op's exact min_ns / max_ns: the bucket edges
    can lie outside what was measured). No counts: 0.
    """
    bs = sorted((lo, hi, c) for lo, hi, c in buckets if c > 0)
    total = sum(c for _, _, c in bs)
    if total == 0:
        return 0.0
    rank = q * total
    seen = 0
    value = float(bs[-1][1])
    for lo, hi, c in bs:
        if seen + c >= rank:
            value = lo + (hi - lo) * (rank - seen) / c
            break
        seen += c
    if lo_clamp is not None:
        value = max(value, float(lo_clamp))
    if hi_clamp is not None:
        value = min(value, float(hi_clamp))
    return value


def percentile(buckets: Iterable[tuple[int, int, int]], q: float) -> int:
    """Return the q-quantile (0..1) in whole ns from (lo_ns, hi_ns, count) buckets (see :func:`quantile`)."""
    return int(quantile(buckets, q))


def merge(hists: Iterable[list[dict[str, int]] | None]) -> list[tuple[int, int, int]]:
    """Return one histogram of several stored ones (``op_stats.hist`` lists of {lo_ns, hi_ns, count}, None for
    none), as sorted (lo_ns, hi_ns, count) buckets with the counts of equal buckets added."""
    acc: dict[tuple[int, int], int] = defaultdict(int)
    for h in hists:
        for b in h or []:
            acc[(b["lo_ns"], b["hi_ns"])] += b["count"]
    return sorted((lo, hi, n) for (lo, hi), n in acc.items())


@dataclass(frozen=True)
class OpHistogram:
    """One op's exact latency histogram: its stored ``op_stats`` rows (one per pid) merged, with the fastest and
    slowest call measured, which clamp its quantiles (the bucket edges can lie outside what was measured)."""

    buckets: list[tuple[int, int, int]]  # sorted (lo_ns, hi_ns, count)
    min_ns: int  # 0 when no row has one
    max_ns: int  # 0 when no row has one: quantiles are then 0, as the stored p50_ns/p99_ns would be

    @classmethod
    def of(cls, rows: Iterable[tuple[list[dict[str, int]] | None, int | None, int | None]]) -> OpHistogram:
        """Return the histogram of ``op_stats`` rows given as (hist, min_ns, max_ns)."""
        hists, mins, maxs = [], [], []
        for hist, min_ns, max_ns in rows:
            hists.append(hist)
            if min_ns is not None:
                mins.append(min_ns)
            maxs.append(max_ns or 0)
        return cls(merge(hists), min(mins, default=0), max(maxs, default=0))

    @property
    def calls(self) -> int:
        """Calls the histogram holds: the observed ones (a duty-cycled op's count is scaled, its histogram not)."""
        return sum(c for _, _, c in self.buckets)

    def quantile(self, q: float) -> float:
        """Return the q-quantile (0..1) in ns, linear inside its bucket and clamped to [min_ns, max_ns]."""
        return quantile(self.buckets, q, self.min_ns, self.max_ns)
