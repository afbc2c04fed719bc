"""``--max-db-size``: keep a recording's file (with its .wal) under a size the user sets, however long it runs.

What grows with time (bench/storage.py, train.py's defaults: ~10 MiB a minute) is mostly the detail: individual
calls (``cuda_calls``), off-CPU intervals (``sched``) and the per-stack profiles (``offcpu_stacks``,
``cpu_samples``). Each has its exact totals elsewhere, never thinned: calls in ``op_stats``/``threads``, intervals
in ``sched_stats``/``thread_wakers``/``preemptors``, blocked and on-CPU time in ``thread_breakdown``. So when the
file nears the cap the detail is thinned, **oldest first, by whole time ranges**: every detail row before a cut T
goes, in every detail table at once. One T for all tables keeps the story simple for a reader ("no detail before
T; the aggregates cover it all"), and a time prefix frees whole row groups, which is what frees space in DuckDB
(below). The budget's 1-in-N sampling would keep a thinner sample of old times instead, but deleting scattered
rows frees no block at all: a row group keeps its blocks until every row in it is gone. ``stacks`` is not thinned
(a stack is sent once and later rows may point at it; it grows with distinct stacks, not with time), nor are
``process_events`` (lifecycle: never sampled) and ``host_samples`` (1 Hz, ~2 MB a day).

What bounds the file (measured with DuckDB 2.0; the figures are in bench/README.md):
- DELETE frees nothing by itself; the next CHECKPOINT frees the blocks of row groups left with no live row, and
  later writes reuse them (the file even shrinks when its tail blocks are free).
- That checkpoint's *vacuum* merges the row group the cut leaves part-full with every row group after it, by
  rewriting them all: the file grew from 43 to 62 blocks on a thinning that freed 15. So it runs with
  ``max_vacuum_tasks = 0``; only that one: vacuum off for good leaves the small row group each auto-checkpoint
  appends unmerged, and a 90 s recording under a 12 MiB cap grew to 79 MB, 279 of its 304 blocks free. The
  part-full row group at the cut is freed by the next cut.
- The WAL grows to ``checkpoint_threshold`` (16 MiB by default) before DuckDB checkpoints it into the file; under a
  cap it is WAL_SHARE of the cap.
- A table with a row holds at least one block, and a thinning frees only whole row groups: under a cap the file
  gets blocks and row groups scaled to it (block_size(), row_group_size()), else a 5 MiB cap thinned once and
  ended at 6.2 MB.
- Auto-checkpoints rewrite a table's last, part-full row group, so the file holds free blocks besides the used
  ones: the trigger is on used blocks + WAL, and HIGH_WATER leaves room for them.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracer.errors import UsageError

log = logging.getLogger(__name__)

# The detail tables thinned, with the column that places a row in time (ts_ns, or the second of a per-second
# profile row). Every other table is an exact aggregate or lifecycle record and is never thinned.
THINNED: dict[str, str] = {"cuda_calls": "ts_ns", "sched": "ts_ns", "offcpu_stacks": "sec", "cpu_samples": "sec"}
# Thin when used blocks + WAL pass this share of the cap, down to LOW_WATER: the rest is headroom for the free
# blocks auto-checkpoints leave in the file, one flush's rows, and what the end writes (op_stats, processes,
# threads, the causal chains). Measured: file + WAL peaked at 0.82 of a 5 MiB cap on a real recording and 0.89 of
# 12 MiB in a replay (bench/README.md).
HIGH_WATER = 0.6
LOW_WATER = 0.4
WAL_SHARE = 0.05  # checkpoint_threshold: this share of the cap, within [WAL_MIN, WAL_MAX]
WAL_MIN = 256 * 1024
WAL_MAX = 16 * 2**20  # DuckDB's default
BLOCK_MIN, BLOCK_MAX = 16 * 1024, 256 * 1024  # DuckDB's smallest block size, and its default
ROWS_MIN, ROWS_MAX = 8192, 122_880  # rows per row group: a few vectors of 2,048, and DuckDB's default
KEEP_LAST_S = 2  # never cut into the last seconds: per-second rows of them may still be on their way
# Each table takes at least one block once it has a row (~20 tables; block_size()), which must fit under LOW_WATER
# with room for some detail.
MIN_BYTES = 4 * 2**20

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Return the bytes in ``text``: plain bytes (``524288000``) or a number with a binary unit (``500M``,
    ``2G``, ``1.5GiB``, ``800MB``; K/M/G/T are powers of 1024, as in ``ls -h``).

    Raises:
        UsageError: not a size, or smaller than MIN_BYTES.
    """
    m = _SIZE.match(text or "")
    if not m:
        raise UsageError(
            f"--max-db-size {text!r} is not a size", "Give bytes or a number with K, M, G or T, e.g. 500M or 2G."
        )
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < MIN_BYTES:
        raise UsageError(
            f"--max-db-size {text} is too small: a recording needs at least {MIN_BYTES // 2**20} MiB",
            "Each table takes at least one block of the file; e.g. --max-db-size 500M.",
        )
    return n


def wal_limit(max_bytes: int) -> int:
    """The checkpoint_threshold under a cap of ``max_bytes``."""
    return int(min(WAL_MAX, max(WAL_MIN, max_bytes * WAL_SHARE)))


def block_size(max_bytes: int) -> int:
    """The file's block size under a cap: a 1/1024th of it as a power of two, within DuckDB's 16-256 KiB."""
    return max(BLOCK_MIN, min(BLOCK_MAX, 1 << (max_bytes // 1024).bit_length() - 1))


def row_group_size(max_bytes: int) -> int:
    """Rows per row group under a cap: a thinning frees only whole row groups (one of cuda_calls' is ~25 bytes a
    row), so each must be a small part of the (HIGH_WATER - LOW_WATER) share a thinning frees."""
    return max(ROWS_MIN, min(ROWS_MAX, 1 << (max_bytes // 512).bit_length() - 1))


def connect(path: Path, max_bytes: int) -> Any:
    """A new trace DB at ``path`` with the block and row group sizes for ``max_bytes``, as the connection's
    default database (readers open it as any other: both are in the file), its WAL checkpointed at
    :func:`wal_limit` (see the module docstring for why each)."""
    import duckdb  # the recorder's store imports it anyway; kept here so parse_size stays light for the CLI

    conn = duckdb.connect(":memory:")
    try:
        conn.execute(
            f"ATTACH '{_quote(path)}' AS recording (BLOCK_SIZE {block_size(max_bytes)}, "
            f"ROW_GROUP_SIZE {row_group_size(max_bytes)})"
        )
        conn.execute("USE recording")
        conn.execute(f"SET checkpoint_threshold = '{wal_limit(max_bytes)}B'")
    except BaseException:
        conn.close()
        raise
    return conn


def _quote(path: Path) -> str:
    return str(path).replace("'", "''")


@dataclass
class Dropped:
    """What thinning dropped from one table: rows, and the time range they covered (ns since session start)."""

    rows: int = 0
    from_ns: int | None = None  # the oldest dropped row's time
    to_ns: int = 0  # the cut: every row of the table before it was dropped
    thinnings: int = 0


@dataclass
class Thinner:
    """Runs on the store's writer thread after each write: thins the detail when the file nears ``max_bytes``."""

    path: Path
    max_bytes: int
    dropped: dict[str, Dropped] = field(default_factory=dict)
    cut_ns: int = 0  # no detail row before this is left (0: nothing thinned)
    over_cap_bytes: int = 0  # used bytes after a thinning that left the aggregates alone above LOW_WATER
    _next_at: int = 0

    def __post_init__(self) -> None:
        self._next_at = int(HIGH_WATER * self.max_bytes)

    def file_bytes(self) -> tuple[int, int]:
        """(the file's size, its WAL's size)."""
        wal = self.path.with_name(self.path.name + ".wal")
        return _size(self.path), _size(wal)

    def after_write(self, conn: Any) -> bool:
        """Thin if the file nears the cap; return True when it did. Cheap when it does not: two stat calls while
        the file is small, one pragma once it has grown (the file keeps its size after a thinning)."""
        file, wal = self.file_bytes()
        if file + wal <= self._next_at:  # the file is at least its used blocks: no need to look inside
            return False
        used = _used_bytes(conn) + wal
        if used <= self._next_at:
            return False
        self.thin(conn, used - int(LOW_WATER * self.max_bytes))
        after = _used_bytes(conn) + self.file_bytes()[1]
        # When the aggregates alone are near the cap, thinning the little detail left at every write would cost
        # CPU for nothing: wait for another (HIGH - LOW) share of growth, and say so at the end.
        self._next_at = max(int(HIGH_WATER * self.max_bytes), after + int((HIGH_WATER - LOW_WATER) * self.max_bytes))
        if after > LOW_WATER * self.max_bytes:
            self.over_cap_bytes = after
        log.info("thinned the detail before %.1f s: %d -> %d bytes used", self.cut_ns / 1e9, used, after)
        return True

    def thin(self, conn: Any, need_bytes: int) -> None:
        """Drop the oldest detail rows worth about ``need_bytes``, record what went, and checkpoint."""
        cut = _cut_ns(conn, need_bytes)
        if cut is None or cut <= self.cut_ns:
            return
        conn.begin()
        try:
            for table, col in THINNED.items():
                pos = f"{col} * 1000000000" if col == "sec" else col
                q = f"SELECT count(*), min({pos}) FROM {table} WHERE {pos} < ?"
                n, first = conn.execute(q, [cut]).fetchall()[0]
                if n:
                    conn.execute(f"DELETE FROM {table} WHERE {pos} < ?", [cut])
                d = self.dropped.setdefault(table, Dropped())
                d.rows += int(n)
                if first is not None:
                    d.from_ns = int(first) if d.from_ns is None else min(d.from_ns, int(first))
                d.to_ns, d.thinnings = cut, d.thinnings + 1
            self._write_dropped(conn)
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        self.cut_ns = cut
        conn.execute("SET max_vacuum_tasks = 0")
        try:
            conn.execute("CHECKPOINT")  # frees the deleted row groups' blocks for the next writes
        finally:
            conn.execute("RESET max_vacuum_tasks")

    def _write_dropped(self, conn: Any) -> None:
        conn.execute("DELETE FROM dropped_rows")
        conn.executemany(
            "INSERT INTO dropped_rows VALUES (?, ?, ?, ?, ?)",
            [(t, d.rows, d.from_ns, d.to_ns, d.thinnings) for t, d in self.dropped.items()],
        )

    def note(self) -> str | None:
        """One line for the session's notes: what was thinned, and whether the aggregates alone outgrew the cap."""
        if not self.cut_ns:
            return None
        rows = ", ".join(f"{t} {d.rows:,}" for t, d in self.dropped.items() if d.rows)
        text = (
            f"--max-db-size {self.max_bytes / 2**20:,.0f} MiB: the detail before {self.cut_ns / 1e9:.1f} s was "
            f"thinned, oldest first (rows dropped: {rows}; table dropped_rows); op_stats, thread_breakdown and the "
            "other per-second tables are exact over the whole recording"
        )
        if self.over_cap_bytes:
            text += (
                f"; the tables never thinned took {self.over_cap_bytes / 2**20:,.1f} MiB of it, so little detail "
                "could be kept: raise --max-db-size"
            )
        return text


def _size(p: Path) -> int:
    try:
        return os.stat(p).st_size
    except FileNotFoundError:
        return 0


def _used_bytes(conn: Any) -> int:
    bs, used = conn.execute(
        "SELECT block_size, used_blocks FROM pragma_database_size() WHERE database_name = current_database()"
    ).fetchall()[0]
    return int(bs) * int(used)


def _cut_ns(conn: Any, need_bytes: int) -> int | None:
    """The whole second T such that the detail rows before it take about ``need_bytes``; None when there is no
    detail to thin. Each table's bytes are its blocks (pragma_storage_info), spread over its rows evenly."""
    bs = conn.execute(
        "SELECT block_size FROM pragma_database_size() WHERE database_name = current_database()"
    ).fetchall()[0][0]
    by_sec: dict[int, float] = {}
    for table, col in THINNED.items():
        blocks = conn.execute(
            f"SELECT count(DISTINCT block_id) FROM pragma_storage_info('{table}') WHERE block_id >= 0"
        ).fetchall()[0][0]
        sec = col if col == "sec" else f"{col} // 1000000000"
        rows = conn.execute(f"SELECT {sec} AS s, count(*) FROM {table} GROUP BY s").fetchall()
        total = sum(n for _, n in rows)
        if not total:
            continue
        per_row = blocks * bs / total
        for s, n in rows:
            by_sec[int(s)] = by_sec.get(int(s), 0.0) + n * per_row
    if not by_sec:
        return None
    last = max(by_sec) - KEEP_LAST_S
    acc = 0.0
    for s in sorted(by_sec):
        if s > last:
            break
        acc += by_sec[s]
        if acc >= need_bytes:
            return (s + 1) * 1_000_000_000
    return (last + 1) * 1_000_000_000 if last >= min(by_sec) else None
