"""tracer/recorder/sizecap.py: --max-db-size's parser, and a capped store that thins the oldest detail rows by whole
seconds while the aggregates stay whole, counting what it dropped (no BPF: rows are put as the recorder would)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import duckdb
import numpy as np
import pytest

from tracer.errors import UsageError
from tracer.recorder import sizecap
from tracer.recorder.sizecap import MIN_BYTES, THINNED, disk_bytes, parse_size
from tracer.recorder.store import Store

MiB = 2**20


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500M", 500 * MiB),
        ("2G", 2 * 2**30),
        ("2g", 2 * 2**30),
        ("1.5GiB", int(1.5 * 2**30)),
        ("800MB", 800 * MiB),
        ("8192K", 8 * MiB),
        ("1T", 2**40),
        (str(64 * MiB), 64 * MiB),
        (" 16M ", 16 * MiB),
    ],
)
def test_parse_size_reads_bytes_and_binary_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "foo", "-5M", "12X", "5 M B", "1e9", "0x100000"])
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(UsageError, match="is not a size") as e:
        parse_size(text)
    assert "500M" in e.value.hint


def test_parse_size_refuses_a_cap_no_recording_fits() -> None:
    with pytest.raises(UsageError, match="too small"):
        parse_size("1M")
    assert parse_size(str(MIN_BYTES)) == MIN_BYTES


def test_small_caps_get_small_blocks_and_row_groups() -> None:
    # a thinning frees whole row groups of whole blocks: both must be small beside a small cap
    assert sizecap.block_size(4 * MiB) == 16 * 1024 and sizecap.row_group_size(4 * MiB) == 8192
    assert sizecap.block_size(2**30) == 256 * 1024 and sizecap.row_group_size(2**30) == 122_880


SECONDS = 150
CALLS_PER_S = 4000
THREADS = 4


def _second(rng: np.random.Generator, s: int) -> dict[str, dict[str, object]]:
    """One second of rows as the recorder puts them: random enough that DuckDB cannot compress them away."""
    n = CALLS_PER_S
    ts = np.sort(rng.integers(s * 10**9, (s + 1) * 10**9, n)).astype(np.int64)
    m = n // 4
    sched_ts = np.sort(rng.integers(s * 10**9, (s + 1) * 10**9, m)).astype(np.int64)
    tids = np.arange(100, 100 + THREADS, dtype=np.int32)
    return {
        "cuda_calls": {
            "ts_ns": ts,
            "dur_ns": rng.integers(1_000, 5_000_000, n).astype(np.int64),
            "pid": np.full(n, 100, np.int32),
            "tid": rng.choice(tids, n),
            "op": rng.choice(["cudaLaunchKernel", "cudaStreamSynchronize", "cudaMemcpyAsync"], n).tolist(),
            "layer": ["runtime"] * n,
            "ret": np.zeros(n, np.int32),
            "off_cpu_ns": rng.integers(0, 1_000_000, n).astype(np.int64),
        },
        "sched": {
            "ts_ns": sched_ts,
            "dur_ns": rng.integers(1_000, 10_000_000, m).astype(np.int64),
            "pid": np.full(m, 100, np.int32),
            "tid": rng.choice(tids, m),
            "reason": ["sleep"] * m,
        },
        "cpu_samples": {
            "sec": np.full(THREADS * 8, s, np.int64),
            "pid": np.full(THREADS * 8, 100, np.int32),
            "tid": np.repeat(tids, 8),
            "stack_id": rng.integers(0, 1 << 40, THREADS * 8).astype(np.int64),
            "samples": rng.integers(1, 99, THREADS * 8).astype(np.int64),
        },
        "offcpu_stacks": {
            "sec": np.full(THREADS * 8, s, np.int64),
            "pid": np.full(THREADS * 8, 100, np.int32),
            "tid": np.repeat(tids, 8),
            "stack_id": rng.integers(0, 1 << 40, THREADS * 8).astype(np.int64),
            "blocked_ns": rng.integers(1, 10**9, THREADS * 8).astype(np.int64),
        },
        "thread_breakdown": {
            "sec": np.full(THREADS, s, np.int64),
            "pid": np.full(THREADS, 100, np.int32),
            "tid": tids,
            "wall_ns": np.full(THREADS, 10**9, np.int64),
            "cpu_ns": rng.integers(0, 10**9, THREADS).astype(np.int64),
        },
    }


def test_a_capped_store_thins_the_oldest_detail_and_counts_it(tmp_path: Path) -> None:
    # GIVEN a store capped at 4 MiB, and rows for 150 s that take 9.3 MiB uncapped
    cap = 4 * MiB
    db = tmp_path / "capped.duckdb"
    store = Store(db, max_bytes=cap)
    rng = np.random.default_rng(21)
    written: dict[str, int] = {}
    peak, done = [0], threading.Event()

    def watch() -> None:  # the file and its WAL as they grow, checkpoints included
        while not done.wait(0.002):
            peak[0] = max(peak[0], disk_bytes(db))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # WHEN the rows are put second by second, written every 2 s as the writer does
    try:
        for s in range(SECONDS):
            for table, cols in _second(rng, s).items():
                store.put(table, cols)
                written[table] = written.get(table, 0) + len(next(iter(cols.values())))  # type: ignore[arg-type]
            if s % 2:
                store.sync()
        assert store.thinner is not None
        note = store.thinner.note()
        store.close()
    finally:
        done.set()
        watcher.join()
    peak = max(peak[0], disk_bytes(db))
    # THEN the file and its WAL never passed the cap
    assert peak <= cap, f"peak {peak / MiB:.2f} MiB over the {cap / MiB:.0f} MiB cap"
    assert disk_bytes(db) <= cap
    c = duckdb.connect(str(db), read_only=True)
    dropped = {r[0]: r[1:] for r in c.execute("SELECT * FROM dropped_rows").fetchall()}
    # ...the detail was thinned, oldest first by whole seconds: kept + dropped = written, nothing before the cut
    assert set(dropped) == set(THINNED)
    cuts = {to_ns for _, _, to_ns, _ in dropped.values()}
    assert len(cuts) == 1, "one cut for every detail table"
    cut = cuts.pop()
    assert cut % 10**9 == 0 and 0 < cut < SECONDS * 10**9
    for table, col in THINNED.items():
        rows, from_ns, _, thinnings = dropped[table]
        kept, first = c.execute(f"SELECT count(*), min({col}) FROM {table}").fetchone()
        assert kept + rows == written[table], table
        assert rows > 0 and thinnings >= 1
        assert (first * 10**9 if col == "sec" else first) >= cut, f"{table} keeps a row before the cut"
        assert from_ns < 10**9 if col == "ts_ns" else from_ns == 0
    assert dropped["cuda_calls"][0] > written["cuda_calls"] // 2, "most of the old calls had to go"
    # ...and the aggregate was never thinned
    assert c.execute("SELECT count(*), min(sec) FROM thread_breakdown").fetchone() == (SECONDS * THREADS, 0)
    assert note is not None and f"before {cut / 1e9:.1f} s" in note


def test_an_uncapped_store_thins_nothing(tmp_path: Path) -> None:
    db = tmp_path / "uncapped.duckdb"
    store = Store(db)
    assert store.thinner is None
    rng = np.random.default_rng(1)
    for s in range(3):
        for table, cols in _second(rng, s).items():
            store.put(table, cols)
    store.close()
    c = duckdb.connect(str(db), read_only=True)
    assert c.execute("SELECT count(*) FROM dropped_rows").fetchone() == (0,)
    assert c.execute("SELECT count(*) FROM cuda_calls").fetchone() == (3 * CALLS_PER_S,)
    assert os.path.getsize(db) > 0
