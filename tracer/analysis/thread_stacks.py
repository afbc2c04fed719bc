"""Where threads spent time outside the moments of their CUDA calls, by stack: on CPU (``cpu_samples``) or blocked
(``offcpu_stacks``), ranked by time. ``tracer flame`` draws them; MCP ``get_stacks(mode=...)`` lists them.

A blocked stack is classified by what it waits in (:mod:`tracer.analysis.stack_time`: gil, lock, io, sleep, cuda,
other). Times are exact for blocked stacks (counted in kernel) and sampled for CPU (samples x the period).
"""

from __future__ import annotations

from typing import Annotated, Literal

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.code_site import site_of
from tracer.analysis.db import session_row
from tracer.analysis.stack_time import blocked_kind, load_frames, thread_name

MODES = ("on-cpu", "off-cpu")
Mode = Literal["on-cpu", "off-cpu"]
MS = 1_000_000


class StackFrame(Record):
    """One frame, outermost first."""

    kind: Annotated[str, Field(description="python | native")]
    module: Annotated[str | None, Field(description="shared object (native) or module file (python)")]
    function: Annotated[str | None, Field(description="demangled function or Python qualname")]
    file: Annotated[str | None, Field(description="source file when known")]
    line: Annotated[int | None, Field(description="executing line (python) when known")]


class ThreadStack(Record):
    """One stack of one thread and the time it spent there."""

    pid: int
    tid: int
    thread: Annotated[
        str, Field(description="the thread by its OS name, else 'thread TID (hottest function, file:line)'")
    ]
    stack_id: Annotated[int | None, Field(description="stacks.stack_id; null when the stack was not captured")]
    site: Annotated[str | None, Field(description="innermost user Python frame: 'file:line function'")]
    ms: Annotated[float, Field(description="time in this stack: blocked (off-cpu, exact) or sampled CPU (on-cpu)")]
    share: Annotated[float, Field(description="of the thread's time in this mode, 0..1")]
    samples: Annotated[int, Field(description="on-cpu: samples; off-cpu: blocked intervals")]
    state: Annotated[str, Field(description="off-cpu: S | D; on-cpu: cpu")]
    wait: Annotated[str, Field(description="off-cpu: gil | lock | io | sleep | cuda | other; on-cpu: cpu")]
    in_call: Annotated[bool, Field(description="inside a CUDA call")]
    frames: Annotated[list[StackFrame], Field(description="outermost first")]


class ThreadStacksResult(Record):
    """Stacks of one mode, most time first."""

    mode: Annotated[str, Field(description="on-cpu | off-cpu")]
    pid: int | None
    tid: int | None
    sample_hz: Annotated[int | None, Field(description="on-CPU samples per second of CPU (0: sampling was off)")]
    total_ms: Annotated[float, Field(description="the time of every stack matched, before the limit")]
    distinct_stacks: int
    stacks: list[ThreadStack]


class NoStacks(LookupError):
    """The recording has no stacks of that mode (made before issue 18, or with the capture switched off)."""


def _has_table(conn: duckdb.DuckDBPyConnection, table: str) -> bool:
    """True when the recording has ``table``: a table of a .duckdb file, or a view of a Parquet dataset."""
    return bool(conn.execute("SELECT count(*) FROM duckdb_columns() WHERE table_name = ?", [table]).fetchone()[0])


def _check(conn: duckdb.DuckDBPyConnection, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    table = "cpu_samples" if mode == "on-cpu" else "offcpu_stacks"
    if not _has_table(conn, table):
        raise NoStacks(f"this recording has no {table} (recorded before stacks outside calls were captured)")


def thread_stacks(
    conn: duckdb.DuckDBPyConnection,
    mode: str = "on-cpu",
    *,
    pid: int | None = None,
    tid: int | None = None,
    limit: int | None = 20,
) -> ThreadStacksResult:
    """Return the stacks of ``mode`` (on-cpu | off-cpu), of one thread, one process or all, most time first.

    Raises:
        ValueError: an unknown mode.
        NoStacks: the recording has no such stacks.
    """
    _check(conn, mode)
    if mode == "on-cpu":
        sql = (
            "SELECT pid, tid, stack_id, 'cpu', bool_or(in_call), sum(samples), sum(cpu_ns) FROM cpu_samples "
            "WHERE ($pid IS NULL OR pid = $pid) AND ($tid IS NULL OR tid = $tid) GROUP BY pid, tid, stack_id"
        )
    else:
        sql = (
            "SELECT pid, tid, stack_id, state, in_call, sum(intervals), sum(blocked_ns) FROM offcpu_stacks "
            "WHERE ($pid IS NULL OR pid = $pid) AND ($tid IS NULL OR tid = $tid) "
            "GROUP BY pid, tid, stack_id, state, in_call"
        )
    rows = conn.execute(sql, {"pid": pid, "tid": tid}).fetchall()
    rows.sort(key=lambda r: (-r[6], r[1], r[2] if r[2] is not None else -1))
    frames = load_frames(conn, (r[2] for r in rows))
    names = _thread_names(conn, {(r[0], r[1]) for r in rows}, frames)
    per_thread: dict[int, float] = {}
    for r in rows:
        per_thread[r[1]] = per_thread.get(r[1], 0.0) + r[6]
    hz = (session_row(conn, ("sample_hz",)) or {}).get("sample_hz")  # None: an older recording, no sampler
    out = []
    for p, t, sid, state, in_call, n, ns in rows[: limit if limit is not None else len(rows)]:
        fr = frames.get(sid, []) if sid is not None else []
        out.append(
            ThreadStack(
                pid=p,
                tid=t,
                thread=names.get(t, f"thread {t}"),
                stack_id=sid,
                site=site_of(fr),
                ms=round(ns / MS, 3),
                share=round(ns / per_thread[t], 4) if per_thread[t] else 0.0,
                samples=int(n),
                state=state,
                wait="cpu" if mode == "on-cpu" else blocked_kind(fr, state, bool(in_call)),
                in_call=bool(in_call),
                frames=[StackFrame(kind=k, module=m, function=f, file=fl, line=ln) for k, m, f, fl, ln in fr],
            )
        )
    return ThreadStacksResult(
        mode=mode,
        pid=pid,
        tid=tid,
        sample_hz=hz,
        total_ms=round(sum(r[6] for r in rows) / MS, 3),
        distinct_stacks=len({r[2] for r in rows}),
        stacks=out,
    )


def _thread_names(
    conn: duckdb.DuckDBPyConnection, tids: set[tuple[int, int]], frames: dict[int, list]
) -> dict[int, str]:
    """tid -> its name: the OS name where set, else its hottest sampled Python function."""
    if not tids:
        return {}
    comms = dict(conn.execute("SELECT tid, comm FROM threads").fetchall())
    pcomms = dict(conn.execute("SELECT pid, comm FROM processes").fetchall())
    hottest: dict[int, int | None] = {}
    if _has_table(conn, "cpu_samples"):
        for t, sid in conn.execute(
            "SELECT tid, arg_max(stack_id, n) FROM (SELECT tid, stack_id, sum(samples) n FROM cpu_samples "
            "WHERE stack_id IS NOT NULL GROUP BY ALL) GROUP BY tid"
        ).fetchall():
            hottest[t] = sid
    need = [s for s in hottest.values() if s is not None and s not in frames]
    frames = {**frames, **load_frames(conn, need)}
    from tracer.analysis.stack_time import StackTime

    out = {}
    for p, t in tids:
        sid = hottest.get(t)
        st = [StackTime(sid, frames=frames.get(sid, []))] if sid is not None else []
        out[t] = thread_name(comms.get(t, ""), pcomms.get(p, ""), t, st)
    return out
