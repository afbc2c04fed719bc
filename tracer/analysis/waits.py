"""How long a thread's waits were, by who ended them: per waker, the exact wakeups and blocked time
(``thread_wakers``) and the spread of the single waits (``sched``): "each wait was a 5.1 ms timer".

``sched`` holds every off-CPU interval of 1 ms or more and every one inside a CUDA call; of the shorter ones
outside calls it keeps a sample (1 in ``--sched-sample-every``). So a waker's ``wakeups`` and ``blocked_ms`` are
exact, and its histogram counts the stored intervals: whole from 1 ms up, a sample below. A wait's length here is
its blocked part (off CPU until woken; the run-queue wait after the wakeup is the breakdown's ``runq_*``). Wakers
are named as everywhere (:mod:`tracer.vocabulary`): a task by its comm, an interrupt by its kind.
"""

from __future__ import annotations

import statistics
from typing import Annotated

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.breakdown.holders import holder_class, wakers_of
from tracer.analysis.breakdown.load import load_thread_times
from tracer.analysis.breakdown.thread_time import MS, ThreadTime
from tracer.analysis.recording import RecordingInfo, load_recording
from tracer.vocabulary import waker_name

# histogram bins, upper edges in ms (the last is open): decades, with 5 ms apart (the GIL's timed wait)
EDGES_MS: tuple[float, ...] = (0.01, 0.1, 1.0, 5.0, 10.0, 100.0, 1000.0)
LABELS: tuple[str, ...] = ("<10us", "10-100us", "0.1-1ms", "1-5ms", "5-10ms", "10-100ms", "0.1-1s", ">=1s")
MAX_WAKERS = 10


class WakerWaits(Record):
    """The waits one waker ended."""

    waker: Annotated[str, Field(description="its name: a comm, or an interrupt's kind ([timer], [block], ...)")]
    pid: Annotated[int, Field(description="its process (0: an interrupt)")]
    tid: int
    holder: Annotated[str, Field(description="self | tree | other | tracer | interrupt, seen from the thread")]
    wakeups: Annotated[int, Field(description="exact (thread_wakers)")]
    blocked_ms: Annotated[float, Field(description="exact blocked time those wakeups ended, ms")]
    in_call_ms: Annotated[float, Field(description="of which inside CUDA calls (a sync that sleeps), ms")]
    stored: Annotated[int, Field(description="its waits stored in sched (every one >= 1 ms; a sample below)")]
    typical_ms: Annotated[float | None, Field(description="median stored wait, ms")]
    max_ms: Annotated[float | None, Field(description="longest stored wait, ms")]
    histogram: Annotated[dict[str, int], Field(description="stored waits per length bin (non-empty bins)")]


class Waits(Record):
    """A thread's blocked time by who ended each wait, with how long the waits were."""

    pid: int | None
    tid: int | None
    comm: str
    blocked_ms: Annotated[float, Field(description="the thread's blocked time outside CUDA calls (breakdown), ms")]
    in_call_off_cpu_ms: Annotated[float, Field(description="off CPU inside CUDA calls (breakdown), ms")]
    wakers: Annotated[list[WakerWaits], Field(description="most blocked time first (at most 10)")]
    more_wakers: Annotated[int, Field(description="wakers left out")]
    headline: Annotated[str, Field(description="one line: the largest wakers with their typical wait")]
    note: Annotated[str, Field(description="what the numbers rest on")]


def waits(conn: duckdb.DuckDBPyConnection, pid: int | None = None, tid: int | None = None) -> Waits:
    """Return thread ``tid``'s waits by waker (default: ``pid``'s driver thread, or the training thread)."""
    info = load_recording(conn)
    times = load_thread_times(conn, info, pid)
    t = times.pick(pid, tid)
    if t is None and pid is not None and tid is None:
        # a process with no CUDA thread (a data worker, a storage helper): its main thread, else the thread that
        # blocked the longest, which is the one a question about its waits is about (issue 28)
        own = times.of_pid(pid)
        t = next((x for x in own if x.tid == pid), None) or max(own, key=lambda x: x.ns("blocked"), default=None)
    if t is None:
        return Waits(
            pid=pid,
            tid=tid,
            comm="",
            blocked_ms=0.0,
            in_call_off_cpu_ms=0.0,
            wakers=[],
            more_wakers=0,
            headline=(
                f"no thread of pid {pid} in the recording's time accounting"
                if pid is not None
                else "no thread to follow: the recording has no CUDA thread"
            ),
            note="",
        )
    stored = _stored(conn, info, t)
    exact = wakers_of(conn, info, t, limit=None)
    rows = []
    for w in exact:
        _, lens = stored.pop(_key(w.pid, w.tid, w.comm), ("", []))
        rows.append(_row(w.comm, w.pid, w.tid, w.holder, w.wakeups, w.blocked_ms, w.in_call_ms, lens))
    for (wp, wt, _), (name, lens) in stored.items():  # stored waits with no exact row: no waker seen, an old file
        rows.append(_row(name, wp, wt, _class(info, t, wp, name), len(lens), sum(lens), 0.0, lens))
    rows.sort(key=lambda r: (-r.blocked_ms, r.pid, r.tid, r.waker))
    note = (
        "wakeups and blocked_ms are exact (thread_wakers); typical/max/histogram are of the waits stored in sched: "
        "every one of 1 ms or more and every one inside a CUDA call, a sample of the shorter ones"
    )
    if not info.has_wakers:
        note = "this recording has no thread_wakers: every number is of the waits stored in sched"
    top = rows[:3]
    headline = f"thread {t.tid} ({t.comm}) blocked {t.ns('blocked') / MS:,.1f} ms outside CUDA calls" + (
        ": " + "; ".join(_said(r) for r in top) if top else ", woken by no one recorded"
    )
    return Waits(
        pid=t.pid,
        tid=t.tid,
        comm=t.comm,
        blocked_ms=round(t.ns("blocked") / MS, 3),
        in_call_off_cpu_ms=round(t.ns("call_off_cpu") / MS, 3),
        wakers=rows[:MAX_WAKERS],
        more_wakers=max(len(rows) - MAX_WAKERS, 0),
        headline=headline,
        note=note,
    )


def _key(pid: int | None, tid: int | None, name: str) -> tuple[int, int, str]:
    """One waker, whichever table names it: a task by (pid, tid), an interrupt (pid 0) by its kind."""
    return (int(pid or 0), int(tid or 0), "" if pid else name)


def _stored(
    conn: duckdb.DuckDBPyConnection, info: RecordingInfo, t: ThreadTime
) -> dict[tuple, tuple[str, list[float]]]:
    """Return {waker key: (its name, the blocked ms of each stored wait it ended)} for thread ``t``."""
    out: dict[tuple, tuple[str, list[float]]] = {}
    if not info.has("sched", "waker_pid"):
        return out
    for wp, wt, wc, blocked in conn.execute(
        "SELECT waker_pid, waker_tid, waker_comm, dur_ns - coalesce(runq_ns, 0) FROM sched WHERE tid = ? "
        "AND reason <> 'preempted' AND dur_ns > coalesce(runq_ns, 0)",
        [t.tid],
    ).fetchall():
        name = waker_name(wp, wc)  # no waker seen (NULL) is [unseen], as thread_wakers names it
        out.setdefault(_key(wp, wt, name), (name, []))[1].append(blocked / MS)
    return out


def _class(info: RecordingInfo, t: ThreadTime, pid: int, name: str) -> str:
    """The waker's class as wakers_of gives it (pid 0, an interrupt or no waker seen: interrupt)."""
    return holder_class(info, t.pid, pid, name, None, False if info.has("preemptors", "is_tracer") else None)


def _row(
    name: str,
    pid: int,
    tid: int,
    holder: str,
    wakeups: int,
    blocked_ms: float,
    in_call_ms: float,
    lens: list[float],
) -> WakerWaits:
    hist: dict[str, int] = {}
    for v in lens:
        label = LABELS[next((i for i, e in enumerate(EDGES_MS) if v < e), len(EDGES_MS))]
        hist[label] = hist.get(label, 0) + 1
    return WakerWaits(
        waker=name,
        pid=pid,
        tid=tid,
        holder=holder,
        wakeups=int(wakeups),
        blocked_ms=round(blocked_ms, 3),
        in_call_ms=round(in_call_ms, 3),
        stored=len(lens),
        typical_ms=round(statistics.median(lens), 3) if lens else None,
        max_ms=round(max(lens), 3) if lens else None,
        histogram={label: hist[label] for label in LABELS if label in hist},
    )


def _said(r: WakerWaits) -> str:
    typical = f", typically {r.typical_ms:,.2f} ms each" if r.typical_ms is not None else ""
    return f"{r.waker} {r.wakeups:,}x, {r.blocked_ms:,.1f} ms{typical}"
