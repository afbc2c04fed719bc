"""The stored thread snapshots (``thread_snapshots``, written by the recorder through tracer.snapshot): per
thread, its latest snapshot (at or before a time), its Python stack, kernel state and how long it had been
blocked. The root of a wait that no switch-out explains: a thread blocked since before the recording began."""

from __future__ import annotations

import json

import duckdb

from tracer.analysis import Record
from tracer.analysis.recording import table_columns


class DumpFrame(Record):
    function: str
    file: str
    line: int


class DumpThread(Record):
    pid: int
    tid: int
    name: str
    rank: int | None
    state: str
    syscall: str | None
    wchan: str
    blocked_ms: float | None  # off CPU for this long at the snapshot (0: running)
    reason: str  # the snapshot's: attach | idle | end
    at_ms: float  # when it was read, ms since the recording began
    native: str
    frames: list[DumpFrame]  # innermost first
    waits_on: str = ""  # the file its blocking call waits on (a path, pipe:[N], socket:[N]); "" none or unknown


class ThreadDump(Record):
    threads: list[DumpThread]
    note: str = ""


def thread_dump(conn: duckdb.DuckDBPyConnection, pid: int | None = None, at_ms: float | None = None) -> ThreadDump:
    """Each thread's latest snapshot (at or before ``at_ms`` when given), of process ``pid`` or all."""
    cols = table_columns(conn)
    if "thread_snapshots" not in cols:
        return ThreadDump(threads=[], note="this recording has no thread snapshots (recorded before they existed)")
    where, params = ["1=1"], []
    if pid is not None:
        where.append("pid = ?")
        params.append(pid)
    if at_ms is not None:
        where.append("ts_ns <= ?")
        params.append(int(at_ms * 1e6))
    waits_on = "waits_on" if "waits_on" in cols["thread_snapshots"] else "''"  # absent before it was stored
    rows = conn.execute(
        f"""SELECT pid, tid, comm, rank, state, syscall, wchan, ts_ns - blocked_since_ns, reason, ts_ns, native, frames,
                   {waits_on}
            FROM thread_snapshots WHERE {" AND ".join(where)}
            QUALIFY row_number() OVER (PARTITION BY pid, tid ORDER BY ts_ns DESC) = 1
            ORDER BY pid, tid""",
        params,
    ).fetchall()
    threads = [
        DumpThread(
            pid=r[0],
            tid=r[1],
            name=r[2],
            rank=r[3],
            state=r[4],
            syscall=r[5],
            wchan=r[6] or "",
            blocked_ms=None if r[7] is None else round(r[7] / 1e6, 1),
            reason=r[8],
            at_ms=round(r[9] / 1e6, 1),
            native=r[10] or "",
            frames=[DumpFrame(**f) for f in json.loads(r[11] or "[]")],
            waits_on=r[12] or "",
        )  # fmt: skip
        for r in rows
    ]
    return ThreadDump(threads=threads, note="" if threads else "no thread snapshot matches")
