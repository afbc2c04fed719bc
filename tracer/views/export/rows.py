"""The rows an export draws from a trace DB: the time window, the event budget, and one query per kind of event.

Every function takes a read-only connection (:func:`tracer.analysis.db.open_trace`) and a :class:`Selection`, and
yields Arrow record batches, so an exporter streams a recording of any size in bounded
memory. Columns added in schema v2 (``processes.role``, ``sched.waker_*``, ``sched.in_call``,
``cuda_calls.kernel_note``, ``host_samples.tracer_cpu_ms``, the ``threads`` and ``thread_breakdown`` tables)
read as NULL or empty from a v1 DB.

The budget (``max_events``) is on individual calls and off-CPU intervals together, the only tables that grow
with the recording's length times its call rate. When the window holds more, the longest rows are kept: a 20 ms
preemption and a 20 ms sync matter equally, and the slow tail is what a timeline is opened for. Lifecycle
events, host samples and chains are never dropped (a few per second at most), nor are the on-CPU samples, which
``cpu_samples`` already holds per second: :func:`sample_lines` reads the few heaviest lines of each sampled
thread-second, so they grow with the recording's length times its threads, not its call rate.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import duckdb
import pyarrow as pa

from tracer.analysis.code_site import Frame, user_frame
from tracer.analysis.db import session_row
from tracer.analysis.stack_time import load_frames

BATCH_ROWS = 50_000  # Arrow batch size: ~10 MB of call rows, a fraction of a second of formatting each
Row = dict[str, object]


@dataclass(frozen=True)
class Selection:
    """What an export covers: a window in ns since session start and the rows the budget keeps."""

    start_ns: int
    end_ns: int
    # rows with (dur_ns, ts_ns) at or above this pair are kept, None: every row in the window
    keep_from: tuple[int, int] | None = None
    calls_in_window: int = 0
    off_cpu_in_window: int = 0
    calls_kept: int = 0
    off_cpu_kept: int = 0
    notes: list[str] = field(default_factory=list)
    # only these processes' rows (a rank's file of `tracer export --per-rank`); None: every process
    pids: tuple[int, ...] | None = None

    def only(self, column: str = "pid") -> str:
        """Return `` AND column IN (...)`` restricting a query to the selection's processes, or '' for all."""
        if self.pids is None:
            return ""
        return f" AND {column} IN ({', '.join(str(int(p)) for p in self.pids) or 'NULL'})"

    @property
    def params(self) -> dict[str, int]:
        d, t = self.keep_from if self.keep_from else (-1, 0)
        return {"t0": self.start_ns, "t1": self.end_ns, "kd": d, "kt": t}


# an interval row (cuda_calls, sched) overlaps the window and passes the budget
_IN = "ts_ns < $t1 AND ts_ns + dur_ns > $t0 AND (dur_ns > $kd OR (dur_ns = $kd AND ts_ns <= $kt))"
_WINDOW = "ts_ns < $t1 AND ts_ns + dur_ns > $t0"
# a per-second row (cpu_samples, thread_breakdown) whose second starts in the window
_SEC = "sec * 1000000000 >= $t0 AND sec * 1000000000 < $t1"


class Columns:
    """Which tables and columns the DB has: a v1 DB lacks the v2 additions, which then read as NULL."""

    def __init__(self, conn: duckdb.DuckDBPyConnection) -> None:
        self._cols: dict[str, set[str]] = {}
        for t, c in conn.execute(
            # this database's own: a job's attached recordings are in information_schema too
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_catalog = current_database()"
        ).fetchall():
            self._cols.setdefault(t, set()).add(c)

    def has_table(self, table: str) -> bool:
        return table in self._cols

    def has_column(self, table: str, column: str) -> bool:
        return column in self._cols.get(table, ())

    def pick(self, table: str, *names: str, alias: str = "") -> str:
        """Return a select list of ``names`` from ``table``, with ``NULL AS name`` for each it lacks."""
        pre = f"{alias}." if alias else ""
        return ", ".join(f"{pre}{n}" if n in self._cols.get(table, ()) else f"NULL AS {n}" for n in names)


def session_span(conn: duckdb.DuckDBPyConnection) -> tuple[int, int | None]:
    """Return (recording length in ns, wall-clock start in Unix ns or None) of the latest session."""
    s = session_row(conn, ("duration_s",), {"start_unix_ns": "epoch_ns(started_at)"})
    if s is None:
        return 0, None
    start = s["start_unix_ns"]
    return int((s["duration_s"] or 0) * 1e9), (int(start) if start is not None else None)


def session_info(conn: duckdb.DuckDBPyConnection) -> Row:
    """Return the latest session's environment and event accounting, for the file's header."""
    header = "host target kernel cpu_model cpu_cores gpus driver tracer_version events_traced events_stored events_lost"
    return session_row(conn, header.split()) or {}


def select(
    conn: duckdb.DuckDBPyConnection,
    start_ns: int,
    end_ns: int,
    max_events: int | None,
    pids: tuple[int, ...] | None = None,
) -> Selection:
    """Return the selection for the window [start_ns, end_ns): counts, the budget cut when it binds, and notes
    saying what the export will not hold.

    Args:
        max_events: most call and off-CPU rows to keep, longest first; None or 0 for all of them.
        pids: only these processes' rows (the budget is theirs alone); None for every process.
    """
    w = {"t0": start_ns, "t1": end_ns}
    only = Selection(start_ns, end_ns, pids=pids).only()
    n_calls = _count(conn, f"SELECT count(*) FROM cuda_calls WHERE {_WINDOW}{only}", w)
    n_off = _count(conn, f"SELECT count(*) FROM sched WHERE {_WINDOW}{only}", w)
    notes = []
    ev = session_row(conn, ("events_traced", "events_stored")) or {}
    traced, stored = ev.get("events_traced"), ev.get("events_stored")
    if traced and stored is not None and stored < traced:
        notes.append(
            f"the recording stored {stored:,} of {traced:,} traced CUDA calls (its budget keeps the slow tail and a "
            "sample of the rest): exact counts and percentiles are in tracer stats"
        )
    if not max_events or n_calls + n_off <= max_events:
        return Selection(start_ns, end_ns, None, n_calls, n_off, n_calls, n_off, notes, pids)
    cut = conn.execute(
        f"SELECT dur_ns, ts_ns FROM (SELECT dur_ns, ts_ns FROM cuda_calls WHERE {_WINDOW}{only} UNION ALL "
        f"SELECT dur_ns, ts_ns FROM sched WHERE {_WINDOW}{only}) ORDER BY dur_ns DESC, ts_ns LIMIT 1 OFFSET $n",
        {**w, "n": max_events - 1},
    ).fetchall()[0]  # there are more than max_events >= 1 rows
    keep = (int(cut[0]), int(cut[1]))
    sel = Selection(start_ns, end_ns, keep, pids=pids)
    kept_calls = _count(conn, f"SELECT count(*) FROM cuda_calls WHERE {_IN}{only}", sel.params)
    kept_off = _count(conn, f"SELECT count(*) FROM sched WHERE {_IN}{only}", sel.params)
    notes.append(
        f"--max-events {max_events:,}: kept the longest {kept_calls + kept_off:,} of {n_calls + n_off:,} CUDA calls "
        f"and off-CPU intervals (all of at least {keep[0] / 1e3:,.1f} µs); left out {n_calls - kept_calls:,} calls "
        f"and {n_off - kept_off:,} intervals. Narrow the window (--start/--end) or raise --max-events for them."
    )
    return Selection(start_ns, end_ns, keep, n_calls, n_off, kept_calls, kept_off, notes, pids)


def _count(conn: duckdb.DuckDBPyConnection, sql: str, params: dict[str, int]) -> int:
    return int(conn.execute(sql, params).fetchall()[0][0])


def _dicts(conn: duckdb.DuckDBPyConnection, sql: str, params: dict[str, int]) -> list[Row]:
    """Return the query's rows as dicts (for the small tables: processes, threads, events, samples)."""
    # a cursor of its own: DuckDB 2 refuses a relation query while the connection has an unfinished result,
    # which any fetchone() by an analysis leaves behind
    with conn.cursor() as cur:
        rel = cur.sql(sql, params=params)
        # DuckDB 2 names it to_arrow_table (and warns on the 1.x name)
        table = rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()
    return table.to_pylist()


def _batches(conn: duckdb.DuckDBPyConnection, sql: str, params: Mapping[str, object]) -> Iterator[list[Row]]:
    """Yield the query's rows as lists of dicts, one Arrow batch at a time."""
    with conn.cursor() as cur:
        rel = cur.sql(sql, params=params)
        reader: pa.RecordBatchReader = (
            rel.to_arrow_reader(BATCH_ROWS) if hasattr(rel, "to_arrow_reader") else rel.fetch_arrow_reader(BATCH_ROWS)
        )
        for batch in reader:
            yield batch.to_pylist()


def processes(conn: duckdb.DuckDBPyConnection, cols: Columns, sel: Selection) -> list[Row]:
    """Return the traced processes alive in the window (pid, ppid, comm, cmdline, first_ns, exit_ns,
    exit_code, role), oldest first."""
    return _dicts(
        conn,
        f"SELECT pid, ppid, comm, cmdline, first_ns, exit_ns, exit_code, {cols.pick('processes', 'role')} "
        "FROM processes WHERE coalesce(first_ns, 0) < $t1 AND (exit_ns IS NULL OR exit_ns >= $t0)"
        f"{sel.only()} ORDER BY coalesce(first_ns, 0), pid",
        {"t0": sel.start_ns, "t1": sel.end_ns},
    )


def threads(conn: duckdb.DuckDBPyConnection, cols: Columns, sel: Selection) -> list[Row]:
    """Return (pid, tid, comm) of every thread with a kept call or off-CPU interval, a ``threads`` row or on-CPU
    samples in the window; comm is NULL where no table names the thread."""
    known = (
        "UNION ALL SELECT pid, tid, comm FROM threads WHERE coalesce(first_ns, 0) < $t1 "
        "AND coalesce(end_ns, $t1) >= $t0"
        if cols.has_table("threads")
        else ""
    )
    sampled = f"UNION ALL SELECT DISTINCT pid, tid, NULL FROM cpu_samples WHERE {_SEC}" if _has_samples(cols) else ""
    return _dicts(
        conn,
        f"""SELECT pid, tid, max(comm) AS comm FROM (
              SELECT pid, tid, comm FROM sched WHERE {_IN}
              UNION ALL SELECT DISTINCT pid, tid, NULL FROM cuda_calls WHERE {_IN}
              {known}
              {sampled})
            WHERE true{sel.only()}
            GROUP BY pid, tid ORDER BY pid, tid""",
        sel.params,
    )


def stacks(conn: duckdb.DuckDBPyConnection, sel: Selection) -> dict[int, tuple[list[str], str | None]]:
    """Return stack_id -> (frames as compact 'file:line function' strings outermost first, the innermost Python
    frame or None) for the stacks of the kept calls.

    Files and modules are cut to their base name: the full paths are in ``tracer stacks``."""
    rows = conn.execute(
        f"""SELECT stack_id, list(frame ORDER BY depth),
                   (list(frame ORDER BY depth DESC) FILTER (WHERE kind = 'python'))[1]
            FROM (
              SELECT stack_id, depth, kind,
                     CASE WHEN file IS NOT NULL
                          THEN regexp_extract(file, '[^/]*$') || ':' || coalesce(CAST(line AS VARCHAR), '?')
                          ELSE coalesce(regexp_extract(module, '[^/]*$'), '?') END
                     || ' ' || coalesce(function, '?') AS frame
              FROM stacks
              WHERE stack_id IN (
                SELECT DISTINCT stack_id FROM cuda_calls WHERE {_IN} AND stack_id IS NOT NULL{sel.only()}))
            GROUP BY stack_id""",
        sel.params,
    ).fetchall()
    return {int(sid): (list(frames), label) for sid, frames, label in rows}


def calls(conn: duckdb.DuckDBPyConnection, cols: Columns, sel: Selection) -> Iterator[list[Row]]:
    """Yield the kept CUDA calls of the window (every cuda_calls column), in batches."""
    pick = cols.pick(
        "cuda_calls",
        "ts_ns",
        "dur_ns",
        "pid",
        "tid",
        "op",
        "layer",
        "bytes",
        "kind",
        "stream",
        "kernel",
        "ret",
        "stack_id",
        "off_cpu_ns",
        "runq_ns",
        "kernel_note",
    )
    return _batches(conn, f"SELECT {pick} FROM cuda_calls WHERE {_IN}{sel.only()}", sel.params)


def off_cpu(conn: duckdb.DuckDBPyConnection, cols: Columns, sel: Selection) -> Iterator[list[Row]]:
    """Yield the kept off-CPU intervals of the window (every sched column), in batches."""
    pick = cols.pick(
        "sched",
        "ts_ns",
        "dur_ns",
        "pid",
        "tid",
        "comm",
        "cpu",
        "reason",
        "runq_ns",
        "preempted_by_pid",
        "preempted_by_comm",
        "waker_pid",
        "waker_tid",
        "waker_comm",
        "in_call",
    )
    return _batches(conn, f"SELECT {pick} FROM sched WHERE {_IN}{sel.only()}", sel.params)


def held_cpu(conn: duckdb.DuckDBPyConnection, cols: Columns, sel: Selection) -> Iterator[list[Row]]:
    """Yield the kept off-CPU intervals that ended a wait for a CPU inside a CUDA call, with who held the CPU,
    ordered by holder and the start of its hold.

    The holder ran during the last ``runq_ns`` of the interval (it held the CPU until the thread got it
    back)."""
    # the recorder's flag where it wrote one; else (a v1 DB, a recorder that leaves it NULL) containment in a
    # stored call of the same thread
    contained = (
        "EXISTS (SELECT 1 FROM cuda_calls c WHERE c.tid = s.tid AND c.ts_ns <= s.ts_ns "
        "AND c.ts_ns + c.dur_ns >= s.ts_ns + s.dur_ns)"
    )
    in_call = f"coalesce(s.in_call, {contained})" if cols.has_column("sched", "in_call") else contained
    return _batches(
        conn,
        f"""SELECT s.ts_ns, s.dur_ns, s.pid, s.tid, s.comm, s.cpu, s.runq_ns, s.preempted_by_pid AS holder_pid,
                   s.preempted_by_comm AS holder_comm, s.ts_ns + s.dur_ns - s.runq_ns AS hold_ns
            FROM sched s
            WHERE {_IN.replace("ts_ns", "s.ts_ns").replace("dur_ns", "s.dur_ns")}
              AND s.preempted_by_pid IS NOT NULL AND s.runq_ns > 0 AND {in_call}{sel.only("s.pid")}
            ORDER BY holder_pid, hold_ns""",
        sel.params,
    )


def lifecycle(conn: duckdb.DuckDBPyConnection, sel: Selection) -> list[Row]:
    """Return the process events (fork, exec, exit, rename, oom_kill) of the window, never dropped."""
    return _dicts(
        conn,
        "SELECT ts_ns, kind, pid, ppid, child, comm, filename, exit_code FROM process_events "
        f"WHERE ts_ns >= $t0 AND ts_ns < $t1{sel.only()} ORDER BY ts_ns",
        {"t0": sel.start_ns, "t1": sel.end_ns},
    )


def host(conn: duckdb.DuckDBPyConnection, cols: Columns, sel: Selection) -> list[Row]:
    """Return the host samples of the window with per-second rates: ``dt_ns`` is the interval each sample
    closes (the first sample's is taken as 1 s)."""
    pick = cols.pick(
        "host_samples",
        "ts_ns",
        "load1",
        "cpu_busy_pct",
        "runnable",
        "mem_available_bytes",
        "swap_used_bytes",
        "page_alloc_bytes",
        "target_page_alloc_bytes",
        "page_faults",
        "ctx_switches",
        "tracer_cpu_ms",
    )
    return _dicts(
        conn,
        f"""SELECT * FROM (
              SELECT *, coalesce(nullif(ts_ns - lag(ts_ns) OVER (ORDER BY ts_ns), 0), 1000000000) AS dt_ns
              FROM (SELECT {pick} FROM host_samples))
            WHERE ts_ns >= $t0 AND ts_ns < $t1 ORDER BY ts_ns""",
        {"t0": sel.start_ns, "t1": sel.end_ns},
    )


def page_alloc(conn: duckdb.DuckDBPyConnection, cols: Columns, sel: Selection) -> list[Row]:
    """Return (pid, sec, page_alloc_bytes) per traced process and second of the window, from the exact
    per-thread breakdown (v2; empty for a v1 DB)."""
    if not cols.has_table("thread_breakdown"):
        return []
    return _dicts(
        conn,
        "SELECT pid, sec, CAST(sum(page_alloc_bytes) AS BIGINT) AS page_alloc_bytes FROM thread_breakdown "
        f"WHERE {_SEC}{sel.only()} GROUP BY pid, sec ORDER BY pid, sec",
        {"t0": sel.start_ns, "t1": sel.end_ns},
    )


def _has_samples(cols: Columns) -> bool:
    """True when the DB has the on-CPU samples (a recording from before the sampler has no ``cpu_samples``)."""
    return all(cols.has_column("cpu_samples", c) for c in ("sec", "pid", "tid", "stack_id", "samples", "cpu_ns"))


def _line_of(frames: list[Frame]) -> tuple[str, str]:
    """Return (key, label) of the line a sampled stack ran: the innermost user Python frame as 'file:line
    function' (the key with the full path, the label with the file's base name, as the calls' stacks are
    written), else the innermost native frame ('module function'), for threads without Python."""
    f = user_frame(frames)
    if f is not None:
        return f"{f[3]}:{f[4]} {f[2]}", f"{(f[3] or '?').rsplit('/', 1)[-1]}:{f[4]} {f[2]}"
    if frames:
        _, module, function, _, _ = frames[-1]
        return f"{module} {function}", f"{(module or '?').rsplit('/', 1)[-1]} {function or '?'}"
    return "?", "?"


STACKS_PER_QUERY = 5_000  # stacks whose frames are read at once: bounds the memory of a recording's many stacks


def sample_lines(conn: duckdb.DuckDBPyConnection, cols: Columns, sel: Selection, top: int) -> Iterator[list[Row]]:
    """Yield the on-CPU samples of the window per (pid, tid, sec): the ``top`` lines that thread ran most that
    second, heaviest first, in batches ordered by pid, tid, sec, rank; nothing for a DB without ``cpu_samples``.

    Each row: pid, tid, sec, rank (1 = heaviest), line ('file.py:line function', see :func:`_line_of`; '?'
    where the stack was not captured), samples and cpu_ns on that line, and the second's totals over every line:
    ``total_samples``, ``total_cpu_ns``, ``in_call_samples`` (inside CUDA calls), ``kernel_samples`` (in kernel
    code) and ``lines`` (distinct lines)."""
    if not _has_samples(cols):
        return
    w = {"t0": sel.start_ns, "t1": sel.end_ns}
    sids = [
        int(r[0])
        for r in conn.execute(
            f"SELECT DISTINCT stack_id FROM cpu_samples WHERE {_SEC} AND stack_id IS NOT NULL{sel.only()} ORDER BY 1",
            w,
        ).fetchall()
    ]
    # stack -> line index: the lines are told apart by their full path, labelled by the base name
    index: dict[str, int] = {"?": 0}
    labels = ["?"]
    line_of: list[int] = []
    for i in range(0, len(sids), STACKS_PER_QUERY):
        chunk = sids[i : i + STACKS_PER_QUERY]
        frames = load_frames(conn, chunk)
        for sid in chunk:
            key, label = _line_of(frames.get(sid, []))
            if key not in index:
                index[key] = len(labels)
                labels.append(label)
            line_of.append(index[key])
    in_call = "CASE WHEN in_call THEN samples ELSE 0 END" if cols.has_column("cpu_samples", "in_call") else "0"
    kernel = "CASE WHEN kernel THEN samples ELSE 0 END" if cols.has_column("cpu_samples", "kernel") else "0"
    sql = f"""
        SELECT pid, tid, sec, rank, line, samples, cpu_ns, total_samples, total_cpu_ns, in_call_samples,
               kernel_samples, lines
        FROM (
          SELECT pid, tid, sec, line, samples, cpu_ns,
                 row_number() OVER (PARTITION BY pid, tid, sec ORDER BY samples DESC, cpu_ns DESC, line) AS rank,
                 CAST(sum(samples) OVER (PARTITION BY pid, tid, sec) AS BIGINT) AS total_samples,
                 CAST(sum(cpu_ns) OVER (PARTITION BY pid, tid, sec) AS BIGINT) AS total_cpu_ns,
                 CAST(sum(in_call_samples) OVER (PARTITION BY pid, tid, sec) AS BIGINT) AS in_call_samples,
                 CAST(sum(kernel_samples) OVER (PARTITION BY pid, tid, sec) AS BIGINT) AS kernel_samples,
                 count(*) OVER (PARTITION BY pid, tid, sec) AS lines
          FROM (
            SELECT c.pid, c.tid, c.sec, coalesce(m.line, 0) AS line, CAST(sum(c.samples) AS BIGINT) AS samples,
                   CAST(sum(c.cpu_ns) AS BIGINT) AS cpu_ns, CAST(sum({in_call}) AS BIGINT) AS in_call_samples,
                   CAST(sum({kernel}) AS BIGINT) AS kernel_samples
            FROM cpu_samples c
            LEFT JOIN (SELECT unnest($sids) AS sid, unnest($lines) AS line) m ON c.stack_id = m.sid
            WHERE {_SEC.replace("sec", "c.sec")}{sel.only("c.pid")}
            GROUP BY ALL))
        WHERE rank <= $top
        ORDER BY pid, tid, sec, rank"""
    for batch in _batches(conn, sql, {**w, "sids": sids, "lines": line_of, "top": top}):
        for r in batch:
            r["line"] = labels[r["line"]]
        yield batch
