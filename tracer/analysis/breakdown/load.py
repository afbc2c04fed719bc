"""Every accounted thread's time: the recorder's exact accounting (``thread_breakdown``, counted in kernel per
(thread, second) with parts that add up to ``wall_ns``) as stored, or for a recording without it the estimate
of :mod:`tracer.analysis.breakdown.estimate`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np

from tracer.analysis.breakdown.estimate import estimate_thread_times
from tracer.analysis.breakdown.thread_time import (
    FIELDS,
    LazyThreads,
    S,
    SecondRows,
    ThreadTime,
    ThreadTimes,
    column_of,
)
from tracer.analysis.recording import RecordingInfo, load_recording
from tracer.analysis.taxonomy import CALL_PART_NAMES

NO_BREAKDOWN = "no breakdown in this recording"


def load_thread_times(
    conn: duckdb.DuckDBPyConnection, info: RecordingInfo | None = None, pid: int | None = None
) -> ThreadTimes:
    """Return every accounted thread's time (of ``pid`` only when given): exact when the recording has
    ``thread_breakdown`` rows, else estimated from op_stats, sched_stats and the stored calls."""
    info = info or load_recording(conn)
    ranks = frozenset(info.rank_pids)  # each rank's process: each has a training thread of its own
    if info.has_breakdown:
        return ThreadTimes("exact", "", _exact(conn, info, pid), ranks)
    threads = estimate_thread_times(conn, info, pid)
    if not threads:
        return ThreadTimes("none", f"{NO_BREAKDOWN}, and no CUDA calls to estimate one from", [], ranks)
    return ThreadTimes(
        "estimated",
        f"{NO_BREAKDOWN} (recorded without per-thread time accounting): estimated from op_stats (exact call time "
        "per process), sched_stats (exact off-CPU and run-queue time per thread) and the stored calls; no page "
        "faults, no wakers",
        threads,
        ranks,
    )


def _exact(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, pid: int | None) -> LazyThreads | list[ThreadTime]:
    """Every thread's exact rows, read as columns: the few (tid, sec) repeats (a long interval closed late) and
    the per-thread totals are summed in numpy, and each thread is made a ThreadTime only when read
    (LazyThreads, its seconds SecondRows). DuckDB's GROUP BY of 20-odd sums costs ~10 ms however few the rows;
    an object per thread and a dict per row cost most of loading a fork-heavy recording (issue 21)."""
    cols = ", ".join(f"coalesce({column_of(f)}, 0)::BIGINT AS f{i}" for i, f in enumerate(FIELDS))
    got = conn.execute(
        f"SELECT pid, tid, sec, {cols} FROM thread_breakdown WHERE ($pid IS NULL OR pid = $pid) ORDER BY pid, tid, sec",
        {"pid": pid},
    ).fetchnumpy()
    tids, secs = np.asarray(got["tid"], dtype=np.int64), np.asarray(got["sec"], dtype=np.int64)
    if not len(tids):
        return []
    pids = np.asarray(got["pid"], dtype=np.int64)
    values = np.column_stack([np.asarray(got[f"f{i}"], dtype=np.int64) for i in range(len(FIELDS))])
    # one row per (tid, sec): sum the repeats
    new = np.ones(len(tids), dtype=bool)
    new[1:] = (tids[1:] != tids[:-1]) | (secs[1:] != secs[:-1]) | (pids[1:] != pids[:-1])
    if not new.all():
        starts = np.flatnonzero(new)
        values = np.add.reduceat(values, starts, axis=0)
        tids, secs, pids = tids[starts], secs[starts], pids[starts]
    firsts = np.flatnonzero(np.r_[True, (tids[1:] != tids[:-1]) | (pids[1:] != pids[:-1])])
    ends = np.r_[firsts[1:], len(tids)]
    totals = np.add.reduceat(values, firsts, axis=0)
    t_tids, t_pids = tids[firsts], pids[firsts]
    meta = _thread_rows(conn, pid) if info.has("threads") else None
    if meta is not None:
        at, found = meta.find(t_pids, t_tids)
        calls = meta.calls_of(at, found)
    else:  # no threads rows: a thread issued CUDA calls when it spent time in them
        calls = (sum(totals[:, FIELDS.index(p)] for p in CALL_PART_NAMES) > 0).astype(np.int64)

    def make(i: int) -> ThreadTime:
        a, b, tid, p = int(firsts[i]), int(ends[i]), int(t_tids[i]), int(t_pids[i])
        m = meta.row(int(at[i])) if meta is not None and found[i] else None
        sec0 = int(secs[a])
        t = ThreadTime(
            pid=p,
            tid=tid,
            comm=(m[2] if m else None) or info.comm(p),
            first_ns=int(m[3]) if m and m[3] is not None else sec0 * S,
            end_ns=int(m[4]) if m and m[4] is not None else (sec0 + 1) * S,
            exited=bool(m[5]) if m else False,
            cuda_calls=int(calls[i]),
            total=dict(zip(FIELDS, totals[i].tolist(), strict=True)),
            by_sec=SecondRows(secs, values, a, b),
        )
        if meta is None:  # its span: through its last second with time
            t.end_ns = max(t.end_ns, int(secs[b - 1]) * S + S)
        return t

    return LazyThreads(t_tids, t_pids, calls, totals, make)


@dataclass
class _ThreadRows:
    """The ``threads`` table as columns sorted by (pid, tid), a thread's row made a tuple only when read: a dict of
    200 K tuples cost 0.1 s (issue 21)."""

    keys: np.ndarray  # _key(pid, tid), sorted
    calls: np.ndarray
    cols: dict[str, np.ndarray]

    def find(self, pids: np.ndarray, tids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return the row index of each (pid, tid), and whether it has one (a tid reused by another process has a
        row of its own; by one process, its first)."""
        if not len(self.keys):
            return np.zeros(len(tids), dtype=np.int64), np.zeros(len(tids), dtype=bool)
        want = _key(pids, tids)
        at = np.minimum(np.searchsorted(self.keys, want), len(self.keys) - 1)
        return at, self.keys[at] == want

    def calls_of(self, at: np.ndarray, found: np.ndarray) -> np.ndarray:
        """Return the CUDA call count of each row :meth:`find` found, 0 for the others."""
        if not len(self.calls):
            return np.zeros(len(at), dtype=np.int64)
        return np.where(found, self.calls[at], 0).astype(np.int64)

    def row(self, i: int) -> tuple:
        """Return row ``i`` as (tid, pid, comm, first_ns, end_ns, exited, cuda_calls), None for NULL."""
        return tuple(_scalar(self.cols[c], i) for c in _THREAD_COLS)


_THREAD_COLS = ("tid", "pid", "comm", "first_ns", "end_ns", "exited", "cuda_calls")


def _scalar(col: np.ndarray, i: int) -> Any:
    v = col[i]
    if v is np.ma.masked:
        return None
    return v.item() if isinstance(v, np.generic) else v


def _key(pids: np.ndarray, tids: np.ndarray) -> np.ndarray:
    return (np.asarray(pids, dtype=np.int64) << 32) | np.asarray(tids, dtype=np.int64)


def _thread_rows(conn: duckdb.DuckDBPyConnection, pid: int | None) -> _ThreadRows:
    got = conn.execute(
        f"SELECT {', '.join(_THREAD_COLS)} FROM threads WHERE ($pid IS NULL OR pid = $pid) ORDER BY pid, tid",
        {"pid": pid},
    ).fetchnumpy()
    keys = _key(np.ma.filled(np.ma.asarray(got["pid"]), 0), np.ma.filled(np.ma.asarray(got["tid"]), 0))
    calls = np.ma.filled(np.ma.asarray(got["cuda_calls"]), 0).astype(np.int64)
    return _ThreadRows(keys, calls, dict(got))
