"""Who held the CPU while a thread waited for one (``preemptors``) and who woke it from a blocked interval
(``thread_wakers``), each classed as seen from the thread's process: the breakdown lists them, the chains name
their culprits with them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.breakdown.thread_time import MS, S, ThreadTime
from tracer.analysis.recording import RecordingInfo
from tracer.vocabulary import HOLDER_CLASSES, INTERRUPT, OTHER, SELF, TRACER, TREE, WAKER_CLASSES, waker_name

TOP_N = 5  # holders and wakers listed per thread

HolderClass = Literal["self", "tree", "other", "tracer", "interrupt"]  # tracer.vocabulary.WAKER_CLASSES


def holder_class(
    info: RecordingInfo,
    pid: int,
    holder_pid: int | None,
    comm: str | None,
    is_target: bool | None,
    is_tracer: bool | None,
) -> HolderClass:
    """Return whose a task that held the CPU (or woke the thread) was, seen from a thread of ``pid``."""
    if info.is_tracer(holder_pid, comm, is_tracer):
        return TRACER
    if not holder_pid:
        return INTERRUPT
    if holder_pid == pid:
        return SELF
    if is_target or info.in_tree(holder_pid):
        return TREE
    return OTHER


class Holder(Record):
    """A task that held the CPU while the thread waited for one (``preemptors``)."""

    pid: int
    comm: Annotated[str, Field(description="its name")]
    holder: Annotated[
        str, Field(description=" | ".join(HOLDER_CLASSES) + ": own process | own workers | other tenants | tracer")
    ]
    preemptions: Annotated[int, Field(description="times it took the CPU from the thread")]
    runq_ms: Annotated[float, Field(description="run-queue wait it caused the thread (inside calls too), ms")]


class Waker(Record):
    """A task that woke the thread from a blocked interval (``thread_wakers``): the GIL holder, a worker that
    delivered a batch, or an interrupt handler (pid 0), named by its kind as in the table."""

    pid: int
    tid: int
    comm: Annotated[str, Field(description="its name; an interrupt: [timer] | [block] | [net] | [softirq] | [irq]")]
    holder: Annotated[str, Field(description=" | ".join(WAKER_CLASSES))]
    wakeups: int
    blocked_ms: Annotated[float, Field(description="blocked time those wakeups ended, ms")]
    in_call_ms: Annotated[float, Field(description="of which inside CUDA calls, ms")]


Scale = Callable[[int], float]


def holders_of(
    conn: duckdb.DuckDBPyConnection,
    info: RecordingInfo,
    t: ThreadTime,
    limit: int | None = TOP_N,
    scale: Scale | None = None,
) -> tuple[list[Holder], str]:
    """Return who held the CPU while thread ``t`` waited (most first), and a note when not per thread.

    Args:
        scale: per-second weight (0..1) of the rows, for a thread clipped to part of its seconds (chains' steps).
    """
    if not info.has("preemptors"):
        return [], "no preemptors table"
    has_tid = info.has("preemptors", "tid")
    flag = "bool_or(is_tracer)" if info.has("preemptors", "is_tracer") else "NULL"
    rows = conn.execute(
        f"SELECT pid, sec, min(comm), bool_or(is_target), {flag}, sum(preemptions), sum(runq_ns) "
        f"FROM preemptors WHERE sec BETWEEN $a AND $b {'AND tid = $tid' if has_tid else ''} GROUP BY pid, sec",
        {"a": t.first_ns // S, "b": max(t.end_ns - 1, t.first_ns) // S, **({"tid": t.tid} if has_tid else {})},
    ).fetchall()
    acc: dict[int, list] = {}
    for hp, sec, comm, is_target, is_tracer, n, runq in rows:
        k = scale(int(sec)) if scale else 1.0
        a = acc.setdefault(hp, [comm, is_target, is_tracer, 0.0, 0.0])
        # one name per pid whatever the rows' order: pid 0 is swapper/0, swapper/1, ... by CPU
        a[0] = min(a[0] or "", comm or "") or None
        a[3] += (n or 0) * k
        a[4] += (runq or 0) * k
    out = [
        Holder(
            pid=hp,
            comm=comm or "?",
            holder=holder_class(info, t.pid, hp, comm, is_target, is_tracer),
            preemptions=round(n),
            runq_ms=round(runq / MS, 3),
        )
        for hp, (comm, is_target, is_tracer, n, runq) in acc.items()
        if runq > 0 or n >= 0.5
    ]
    out.sort(key=lambda h: (-h.runq_ms, h.pid))
    note = "" if has_tid else "this recording does not say which thread waited: holders of every traced thread"
    return out[:limit], note


def wakers_of(
    conn: duckdb.DuckDBPyConnection,
    info: RecordingInfo,
    t: ThreadTime,
    limit: int | None = TOP_N,
    scale: Scale | None = None,
) -> list[Waker]:
    """Return who woke thread ``t`` from blocked intervals in its span, most blocked time first (``scale``: as
    in :func:`holders_of`)."""
    if not info.has_wakers:
        return []
    rows = conn.execute(
        "SELECT waker_pid, waker_tid, sec, waker_comm, sum(wakeups), sum(blocked_ns), "
        "sum(blocked_ns) FILTER (WHERE in_call) FROM thread_wakers WHERE tid = $tid AND sec BETWEEN $a AND $b "
        "GROUP BY waker_pid, waker_tid, sec, waker_comm",
        {"tid": t.tid, "a": t.first_ns // S, "b": max(t.end_ns - 1, t.first_ns) // S},
    ).fetchall()
    # pid 0 is every interrupt kind: each kind is a waker of its own, as in the table (merged under the least
    # name, a thread's timer waits were labelled [block] after one disk wakeup)
    acc: dict[tuple[int, int, str], list] = {}
    for wp, wt, sec, comm, n, b, ic in rows:
        k = scale(int(sec)) if scale else 1.0
        kind = "" if wp else waker_name(0, comm)
        a = acc.setdefault((int(wp or 0), int(wt or 0), kind), [comm, 0.0, 0.0, 0.0])
        a[0] = min(a[0] or "", comm or "") or None  # one name whatever the rows' order (as holders_of)
        a[1] += (n or 0) * k
        a[2] += (b or 0) * k
        a[3] += (ic or 0) * k
    out = [
        Waker(
            pid=wp,
            tid=wt,
            comm=waker_name(wp, comm),
            # a v2 recording flags the tracer by pid: the name heuristic is only for v1 files
            holder=holder_class(info, t.pid, wp, comm, None, False if info.has("preemptors", "is_tracer") else None),
            wakeups=round(n),
            blocked_ms=round(b / MS, 3),
            in_call_ms=round(ic / MS, 3),
        )
        for (wp, wt, _), (comm, n, b, ic) in acc.items()
        if b > 0 or n >= 0.5
    ]
    out.sort(key=lambda w: (-w.blocked_ms, w.pid, w.tid, w.comm))
    return out[:limit]


def in_call_runq_by_class(t: ThreadTime, holders: list[Holder]) -> dict[str, float]:
    """Split the thread's run-queue wait inside CUDA calls (``call_runq``, one total) between the holder classes
    (:data:`HOLDER_CLASSES`), in ns, from the data: ``preemptors`` holds each holder's whole wait, inside calls and
    outside, and the breakdown holds the part outside calls exactly per class (``runq_<class>``), so what a class
    caused inside calls is its holders' wait less its outside part.

    ``holders`` must be all of them (no top-N: a loaded host's hundred small tenants are a class's wait too), over
    the same span as ``t``. A split in proportion to the holders' whole waits took the in-call wait from the class
    that caused it: a worker that held the CPU only inside syncs and a hog only outside them each got half (issue
    28: ``own_workers4`` read 0.198, under the 0.20 cut). Where the excesses are all 0 (rounding, an old
    recording), the wait is split in proportion to the whole waits."""
    total = float(t.ns("call_runq"))
    out = dict.fromkeys(HOLDER_CLASSES, 0.0)
    if total <= 0:
        return out
    whole = dict.fromkeys(HOLDER_CLASSES, 0.0)
    for h in holders:
        if h.holder in whole:
            whole[h.holder] += h.runq_ms * MS
    excess = {c: max(whole[c] - t.ns(f"runq_{c}"), 0.0) for c in HOLDER_CLASSES}
    basis = excess if sum(excess.values()) > 0 else whole
    norm = sum(basis.values())
    if norm <= 0:
        return out
    return {c: total * basis[c] / norm for c in HOLDER_CLASSES}
