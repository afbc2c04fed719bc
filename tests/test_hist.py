"""tracer/hist.py: the log-linear slot layout round-trips, and percentiles over it stay within 5% of exact."""

from __future__ import annotations

import random

import numpy as np

from tracer.hist import SUB, bucket_of, merge, percentile, quantile, slot_bounds, slot_of


def _values() -> list[int]:
    rng = random.Random(7)
    return (
        list(range(0, 70_000))
        + [rng.randrange(1, 1 << 42) for _ in range(20_000)]
        + [(1 << e) + d for e in range(4, 43) for d in (-1, 0, 1)]
    )


def test_every_value_falls_in_its_slot() -> None:
    # GIVEN values from 0 ns to ~1.2 hours; WHEN each is mapped to a slot and back
    for v in _values():
        s = slot_of(v)
        lo, hi = slot_bounds(s)
        # THEN it lies in [lo, hi), and above 16 ns the bucket is at most 1/16 of its lower bound wide
        assert lo <= v < hi, (v, s, lo, hi)
        if v >= SUB:
            assert (hi - lo) * 16 <= lo, (v, lo, hi)
        else:
            assert (lo, hi) == (v, v + 1)


def test_slots_tile_the_line_without_gaps() -> None:
    # GIVEN consecutive slots; THEN each starts where the previous ended (no gap, no overlap)
    for s in range(1, 44 * SUB):
        assert slot_bounds(s)[0] == slot_bounds(s - 1)[1], s


def test_percentiles_within_5_percent_of_numpy() -> None:
    # GIVEN lognormal latencies (median ~50 us, long tail) bucketed like the BPF histogram
    rng = np.random.default_rng(3)
    data = rng.lognormal(mean=np.log(50_000), sigma=1.2, size=200_000).astype(np.int64) + 1
    counts: dict[int, int] = {}
    for v in data.tolist():
        counts[slot_of(v)] = counts.get(slot_of(v), 0) + 1
    buckets = [(*slot_bounds(s), c) for s, c in counts.items()]
    # WHEN percentiles are taken from the buckets; THEN each is within 5% of the exact one
    for q in (0.01, 0.1, 0.5, 0.9, 0.95, 0.99, 0.999):
        exact = float(np.percentile(data, q * 100))
        got = percentile(buckets, q)
        assert abs(got - exact) <= 0.05 * exact, (q, got, exact)


def test_percentile_of_nothing_is_zero() -> None:
    assert percentile([], 0.5) == 0
    assert percentile([(10, 11, 0)], 0.99) == 0


def test_bucket_of_is_the_slot_bounds() -> None:
    # GIVEN values around powers of two; THEN bucket_of(v) is the bucket of v's slot, 1/16 of an octave wide
    for v in (0, 15, 16, 17, 31, 32, 1023, 1024, 1025, 1_000_000, (1 << 40) + 12345):
        lo, hi = bucket_of(v)
        assert (lo, hi) == slot_bounds(slot_of(v)) and lo <= v < hi
    assert bucket_of(1024) == (1024, 1088) and bucket_of(1087) == (1024, 1088) and bucket_of(1088) == (1088, 1152)


def test_quantile_interpolates_and_clamps() -> None:
    buckets = [(0, 10, 10), (10, 20, 10)]
    assert quantile(buckets, 0.5) == 10.0 and quantile(buckets, 0.75) == 15.0
    # clamped to what was measured: the bucket edge 20 lies above the slowest call
    assert quantile(buckets, 0.99, 0, 18) == 18.0 and quantile(buckets, 0.0, 3, 18) == 3.0
    # empty buckets are skipped, unsorted input is sorted
    assert quantile([(10, 20, 10), (5, 6, 0), (0, 10, 10)], 0.25) == 5.0
    # the whole-ns view the recorder stores is the same number, truncated
    assert percentile(buckets, 0.75) == 15 and percentile([(100, 116, 3)], 0.5) == int(quantile([(100, 116, 3)], 0.5))


def test_merge_adds_equal_buckets_and_skips_missing_histograms():
    a = [{"lo_ns": 16, "hi_ns": 17, "count": 2}, {"lo_ns": 64, "hi_ns": 68, "count": 1}]
    b = [{"lo_ns": 64, "hi_ns": 68, "count": 5}, {"lo_ns": 32, "hi_ns": 34, "count": 3}]
    assert merge([a, None, b, []]) == [(16, 17, 2), (32, 34, 3), (64, 68, 6)]
    assert merge([]) == []
