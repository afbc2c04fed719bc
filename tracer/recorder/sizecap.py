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
- A checkpoint's vacuum merges the small row group each checkpoint appends with its neighbours, and after a
  thinning it rewrites the row groups after the cut: a checkpoint can write about everything the file holds anew
  (used blocks + WAL), into free blocks first, then at its end, and frees the old blocks only after. The file
  then reaches max(its size, 2 x used + WAL), with the WAL still beside it (a 5 MiB cap: 0.92 MiB used + 0.25 of
  WAL grew the file from 0.93 to 2.14 MiB; 2.36 + 0.17 reached 4.83). So the trigger is on 2 x (used + WAL),
  and the thinner runs every checkpoint itself, after it has made that room: DuckDB's own checkpoints are off
  (``checkpoint_threshold`` out of reach), else one could start while the room is not there. (A trigger on used
  + WAL at 60% of the cap let a real recording reach 1.02x the cap.)
- The vacuum cannot be off for good: the never-thinned tables then keep one small row group per checkpoint, and
  a replay passed a 5 MiB cap after 60 s (7.3 MiB at 80 s). Only the last checkpoints run without it (NO_VACUUM:
  Store.close, the causal chains), which saves rewriting the whole file at the end (+0.9 to 1.3 MiB of a 5 MiB
  cap for 5 KiB of WAL).
- The WAL is checkpointed at WAL_SHARE of the cap (DuckDB's default is 16 MiB).
- A table with a row holds at least one block, and a thinning frees only whole row groups: under a cap the file
  gets blocks and row groups scaled to it (block_size(), row_group_size()), else a 5 MiB cap thinned once and
  ended at 6.2 MB.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracer.errors import UsageError
from tracer.sqltext import literal

log = logging.getLogger(__name__)

# The detail tables thinned, with the column that places a row in time (ts_ns, or the second of a per-second
# profile row). Every other table is an exact aggregate or lifecycle record and is never thinned.
THINNED: dict[str, str] = {"cuda_calls": "ts_ns", "sched": "ts_ns", "offcpu_stacks": "sec", "cpu_samples": "sec"}
# Thin when what a checkpoint may reach, 2 x (used blocks + WAL) (the module docstring), passes this share of the
# cap, down to LOW_WATER. The rest is headroom for what a checkpoint writes beyond that (measured within 3%) and
# what the end writes (op_stats, processes, threads, the causal chains).
HIGH_WATER = 0.9
LOW_WATER = 0.6
WAL_SHARE = 0.05  # the WAL is checkpointed at this share of the cap, within [WAL_MIN, WAL_MAX]
WAL_MIN = 256 * 1024
WAL_MAX = 16 * 2**20  # DuckDB's default
OUT_OF_REACH = 2**50  # DuckDB's checkpoint_threshold under a cap: the thinner checkpoints instead
BLOCK_MIN, BLOCK_MAX = 16 * 1024, 256 * 1024  # DuckDB's smallest block size, and its default
ROWS_MIN, ROWS_MAX = 8192, 122_880  # rows per row group: a few vectors of 2,048, and DuckDB's default
# The last checkpoints (Store.close, the causal chains) run without the vacuum: it would rewrite the whole file for
# a few rows (the module docstring).
NO_VACUUM = "SET max_vacuum_tasks = 0"
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
    """The WAL size at which the thinner checkpoints, under a cap of ``max_bytes``."""
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
    default database (readers open it as any other: both are in the file), and DuckDB's own checkpoints off:
    :class:`Thinner` checkpoints at :func:`wal_limit` (see the module docstring for why each)."""
    import duckdb  # the recorder's store imports it anyway; kept here so parse_size stays light for the CLI

    conn = duckdb.connect(":memory:")
    try:
        conn.execute(
            f"ATTACH {literal(str(path))} AS recording (BLOCK_SIZE {block_size(max_bytes)}, "
            f"ROW_GROUP_SIZE {row_group_size(max_bytes)})"
        )
        conn.execute("USE recording")
        conn.execute(f"SET checkpoint_threshold = '{OUT_OF_REACH}B'")
    except BaseException:
        conn.close()
        raise
    return conn


@dataclass
class Dropped:
    """What thinning dropped from one table: rows, and the time range they covered (ns since session start)."""

    rows: int = 0
    from_ns: int | None = None  # the oldest dropped row's time
    to_ns: int = 0  # the cut: every row of the table before it was dropped
    thinnings: int = 0


@dataclass
class Thinner:
    """Runs on the store's writer thread after each write: thins the detail when the file nears ``max_bytes``,
    and checkpoints the WAL (DuckDB's own checkpoints are off under a cap: :func:`connect`)."""

    path: Path
    max_bytes: int
    dropped: dict[str, Dropped] = field(default_factory=dict)
    cut_ns: int = 0  # no detail row before this is left (0: nothing thinned)
    kept_bytes: int = 0  # the never-thinned tables' blocks after a thinning, when they took over half of its aim
    _wal_limit: int = 0
    _high: int = 0

    def __post_init__(self) -> None:
        self._high = int(HIGH_WATER * self.max_bytes)
        self._wal_limit = wal_limit(self.max_bytes)

    def file_bytes(self) -> tuple[int, int]:
        """(the file's size, its WAL's size)."""
        return _size(self.path), _size(_wal(self.path))

    def after_write(self, conn: Any) -> bool:
        """Thin if the next checkpoint could pass the cap, then checkpoint a full WAL; return True when it thinned.
        Cheap while the file is small: two stat calls (the used blocks are at most the file)."""
        file, wal = self.file_bytes()
        wal_room = max(wal, self._wal_limit)  # the WAL a checkpoint may see: this one, or the next one's
        thinned = False
        if 2 * (file + wal_room) > self._high:
            used = _used_bytes(conn)
            if 2 * (used + wal_room) > self._high:
                thinned = self.thin(conn, used + wal_room - int(LOW_WATER * self.max_bytes / 2))
                used = _used_bytes(conn)
                aim = LOW_WATER * self.max_bytes / 2 - self._wal_limit  # the used bytes a thinning aims at
                if used > aim and (never := used - _detail_bytes(conn)) > aim / 2:  # not only the kept seconds
                    self.kept_bytes = never
                if thinned:
                    log.info("thinned the detail before %.1f s: %d bytes used", self.cut_ns / 1e9, used)
        if self.file_bytes()[1] >= self._wal_limit:  # thinning checkpoints, but may have found nothing to thin
            conn.execute("CHECKPOINT")
        return thinned

    def thin(self, conn: Any, need_bytes: int) -> bool:
        """Drop the oldest detail rows worth about ``need_bytes``, record what went, and checkpoint (the WAL
        with them); False when there was nothing to drop."""
        cut = _cut_ns(conn, need_bytes)
        if cut is None or cut <= self.cut_ns:
            return False
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
        conn.execute("CHECKPOINT")  # frees the deleted row groups' blocks for the next writes
        return True

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
        if self.kept_bytes:
            text += (
                f"; the tables never thinned took {self.kept_bytes / 2**20:,.1f} MiB of it, so little detail "
                "could be kept: raise --max-db-size"
            )
        return text


def disk_bytes(path: Path) -> int:
    """What the cap bounds: the size of the file at ``path`` and of its WAL (0 for either that is missing)."""
    return _size(path) + _size(_wal(path))


def _wal(path: Path) -> Path:
    return path.with_name(path.name + ".wal")


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


def _table_bytes(conn: Any, table: str, block_size: int) -> int:
    """The bytes of the blocks that hold ``table``'s rows."""
    q = f"SELECT count(DISTINCT block_id) FROM pragma_storage_info('{table}') WHERE block_id >= 0"
    return int(conn.execute(q).fetchall()[0][0]) * block_size


def _block_size(conn: Any) -> int:
    q = "SELECT block_size FROM pragma_database_size() WHERE database_name = current_database()"
    return int(conn.execute(q).fetchall()[0][0])


def _detail_bytes(conn: Any) -> int:
    """The bytes of the detail tables' blocks: what a checkpoint's vacuum may rewrite."""
    bs = _block_size(conn)
    return sum(_table_bytes(conn, t, bs) for t in THINNED)


def _cut_ns(conn: Any, need_bytes: int) -> int | None:
    """The whole second T such that the detail rows before it take about ``need_bytes``; None when there is no
    detail to thin. Each table's bytes are its blocks (pragma_storage_info), spread over its rows evenly."""
    bs = _block_size(conn)
    by_sec: dict[int, float] = {}
    for table, col in THINNED.items():
        size = _table_bytes(conn, table, bs)
        sec = col if col == "sec" else f"{col} // 1000000000"
        rows = conn.execute(f"SELECT {sec} AS s, count(*) FROM {table} GROUP BY s").fetchall()
        total = sum(n for _, n in rows)
        if not total:
            continue
        per_row = size / total
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
