"""The recording inside a trace DB: its session row, how it ended (or that its recorder is still writing it), and
whether this tracer can read it (:func:`validate`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.db.files import LIVE_HINT, RECORD_HINT, read_error
from tracer.analysis.job import JOB_SESSION, is_job
from tracer.errors import StoreError
from tracer.procfs import boot_id, process_start_ticks
from tracer.schema import APP_ID, SCHEMA_VERSION


class RecordingState(Record):
    """How the recording in a trace DB ended, or that its recorder is still writing it."""

    status: Annotated[
        str,
        Field(description="session.status: complete | interrupted | target_exited | failed | disk_full | recording"),
    ]
    live: Annotated[bool, Field(description="a recorder is writing this DB now (its pid lives, same boot)")]
    finished: Annotated[
        bool, Field(description="the recorder's final flush ran (exact aggregates, processes, chains written)")
    ]
    ended: Annotated[str, Field(description="how the recording ended, in one sentence")]
    recorder_pid: Annotated[int | None, Field(description="pid of the recorder, when recorded")] = None
    flushed_ns: Annotated[
        int | None, Field(description="ts_ns up to which the detail rows were written (session.flushed_ns)")
    ] = None
    summaries_flushed_ns: Annotated[
        int | None,
        Field(description="ts_ns up to which the per-second summaries were written (session.summaries_flushed_ns)"),
    ] = None


_ENDED = {
    "complete": "the recording finished (--duration reached)",
    "interrupted": "the recording was stopped with Ctrl-C",
    "target_exited": "the recording ended when the traced program exited",
    "failed": "the recorder stopped on an error; the data written before it is here",
    "disk_full": "the recording ended when the disk filled up; the data committed before that is here",
    "snapshot": "a snapshot of a recording in progress (tracer record --mcp-http): it covers up to session.flushed_ns",
}


def recorder_alive(pid: int | None, start_ticks: int | None, boot: str | None) -> bool:
    """True when the recorder identified by (pid, start ticks, boot id) is running now."""
    if pid is None or start_ticks is None:
        return False
    if boot is not None and boot != boot_id():
        return False
    return process_start_ticks(pid) == start_ticks


def session_row(
    conn: duckdb.DuckDBPyConnection, columns: Sequence[str], expressions: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """Return the recording's session row (the last one) as {name: value} for ``columns`` then ``expressions``,
    in that order; None when the table has no row. On a job of several recordings, its one combined row
    (``job_session``: the rules per column are :data:`tracer.analysis.job.SESSION_RULES`).

    A column the file's schema lacks (written by an older recorder: a v1 file has no recorder identity) reads
    None, as a NULL would, so callers need not check the schema version.

    Args:
        columns: session column names.
        expressions: name -> SQL expression over the session's columns, computed by DuckDB in the same query
            (``epoch_ns(started_at)``: its timestamp arithmetic, not Python's; a TIMESTAMPTZ itself would need
            pytz to reach Python).
    """
    if not all(c.isidentifier() for c in columns):  # names from our code, spliced into the query's regex
        raise ValueError(f"not session column names: {list(columns)}")
    extra = "".join(f", {sql} AS {name}" for name, sql in (expressions or {}).items())
    table = JOB_SESSION if is_job(conn) else "session"
    # COLUMNS(regex) selects those of the names this file's schema has, in one query; session_id is in every
    # schema, so the match is never empty (DuckDB refuses an empty one)
    cur = conn.execute(
        f"SELECT COLUMNS('^({'|'.join(('session_id', *columns))})$'){extra} FROM {table} "
        "ORDER BY session_id DESC LIMIT 1"
    )
    row = cur.fetchone()
    if row is None:
        return None
    have = dict(zip((d[0] for d in cur.description or []), row, strict=True))
    return {name: have.get(name) for name in (*columns, *(expressions or {}))}


_STATE_COLUMNS = ("status", "recorder_pid", "recorder_start_ticks", "boot_id", "flushed_ns", "summaries_flushed_ns")


def thinned_note(conn: duckdb.DuckDBPyConnection) -> str | None:
    """One line saying which detail rows ``tracer record --max-db-size`` thinned (table dropped_rows), or None when
    none were (or the recording predates the table). On a job: each recording's rows, the latest cut."""
    try:
        rows = conn.execute(
            "SELECT table_name, sum(rows), max(to_ns) FROM dropped_rows GROUP BY table_name HAVING sum(rows) > 0 "
            "ORDER BY table_name"
        ).fetchall()
    except duckdb.CatalogException:  # an older recording: nothing was ever thinned
        return None
    if not rows:
        return None
    cut = max(r[2] for r in rows)
    dropped = ", ".join(f"{t} {int(n):,}" for t, n, _ in rows)
    return (
        f"detail rows before {cut / 1e9:.1f} s were thinned to keep the file under --max-db-size ({dropped} rows "
        "dropped; table dropped_rows): per-call, off-CPU interval and stack rows cover only the time after it; "
        "op_stats, thread_breakdown and the per-second tables are exact over the whole recording"
    )


def recording_state(conn: duckdb.DuckDBPyConnection) -> RecordingState:
    """Return how the recording in the open trace DB ended (or that it is live), from its last session row.

    Raises:
        StoreError: no session row (the recording never started or was cut off before its first write).
    """
    s = session_row(conn, _STATE_COLUMNS)
    if s is None:
        raise StoreError(
            "the DB has no session row: the recording never started or was cut off early",
            "Record again: sudo tracer record -- python train.py",
        )
    status = str(s.get("status") or "")
    pid, flushed, summaries = s.get("recorder_pid"), s.get("flushed_ns"), s.get("summaries_flushed_ns")
    if status != "recording":
        ended = _ENDED.get(status, f"the recording ended with status {status!r}")
        return RecordingState(
            status=status,
            live=False,
            finished=status not in ("failed", "disk_full", "snapshot"),
            ended=ended,
            recorder_pid=pid,
            flushed_ns=flushed,
            summaries_flushed_ns=summaries,
        )
    if recorder_alive(pid, s.get("recorder_start_ticks"), s.get("boot_id")):
        return RecordingState(
            status=status, live=True, finished=False, ended=f"still being recorded by pid {pid}", recorder_pid=pid
        )
    who = f"the recorder (pid {pid})" if pid is not None else "the recorder"
    upto = (
        f"the data up to its last flush (session.flushed_ns = {flushed:,} ns, {flushed / 1e9:.1f} s) is here"
        if flushed is not None
        else "the data it had written is here"
    )
    if flushed is not None and summaries is not None and summaries < flushed:
        upto += (
            f"; the per-second summaries (written every 10 s) up to {summaries / 1e9:.1f} s "
            "(session.summaries_flushed_ns)"
        )
    return RecordingState(
        status=status,
        live=False,
        finished=False,
        ended=f"{who} is gone: killed or crashed; {upto}",
        recorder_pid=pid,
        flushed_ns=flushed,
        summaries_flushed_ns=summaries,
    )


def validate(conn: duckdb.DuckDBPyConnection, name: str = "the DB") -> RecordingState:
    """Return the recording state if ``conn`` holds a trace DB of a schema we can read, not being recorded now.

    Raises:
        StoreError: not ours, newer or unknown schema, damaged, no session row, or a live recording.
    """
    try:
        rows = conn.execute("SELECT key, value FROM meta WHERE key IN ('app', 'schema_version')").fetchall()
    except duckdb.CatalogException:
        raise StoreError(f"{name} is not a cuda-host-tracer trace DB (no meta table)", RECORD_HINT) from None
    except duckdb.Error as e:
        raise read_error(name, e) from None
    meta = dict(rows)
    if meta.get("app") != APP_ID:
        raise StoreError(f"{name} is not a cuda-host-tracer trace DB (meta app = {meta.get('app')!r})", RECORD_HINT)
    try:
        version = int(meta.get("schema_version", "0"))
    except ValueError:
        version = 0
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{name} has schema version {version}; this tracer reads up to {SCHEMA_VERSION}",
            "Upgrade cuda-host-tracer (pip install -U cuda-host-tracer).",
        )
    if version < 1:
        raise StoreError(f"{name} has an unknown schema version {meta.get('schema_version')!r}", RECORD_HINT)
    try:
        state = recording_state(conn)
    except StoreError as e:
        raise StoreError(f"{name}: {e.message}", e.hint) from None
    except duckdb.Error as e:
        raise read_error(name, e) from None
    if state.live:
        raise StoreError(f"{name} is still being recorded ({state.ended})", LIVE_HINT)
    return state
