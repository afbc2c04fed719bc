"""The in-kernel latency histogram's bucket layout (probes/cuda.bpf.c ``hist_slot``) and percentiles over it.

Values below 16 ns get one slot each; above, every power of two is split into 16 linear sub-buckets, so a bucket
spans 1/16 of its lower bound and a midpoint estimate is within 3.1% of any value in it.
"""

from __future__ import annotations

from collections.abc import Iterable

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


def percentile(buckets: Iterable[tuple[int, int, int]], q: float) -> int:
    """Return the q-quantile (0..1) in ns from (lo_ns, hi_ns, count) buckets, interpolating inside a bucket."""
    bs = sorted((lo, hi, c) for lo, hi, c in buckets if c > 0)
    total = sum(c for _, _, c in bs)
    if total == 0:
        return 0
    rank = q * total
    seen = 0
    for lo, hi, c in bs:
        if seen + c >= rank:
            frac = (rank - seen) / c
            return int(lo + (hi - lo) * frac)
        seen += c
    return bs[-1][1]
