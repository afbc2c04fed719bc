"""Writing a trace DB: schema creation, the session row, and batched Arrow inserts from one writer thread.

Every insert goes through :meth:`Store.put`, which queues a column batch; a single writer thread appends queued
batches for the same table together (DuckDB is fast on bulk appends and slow on many small ones: peers.md table
5, 10k-row Arrow batches reach ~2.4 M rows/s). :meth:`Store.close` drains the queue, checkpoints and hands the
file to the sudo user, so Ctrl-C or a dying target still leaves a DB that opens.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tracer.errors import StoreError
from tracer.newfile import check_new_file
from tracer.recorder import sizecap
from tracer.schema import APP_ID, SCHEMA_VERSION, TABLE_BY_NAME, TABLES
from tracer.sqltext import literal

log = logging.getLogger(__name__)

# Rows gathered per table before an insert: a batch that fills sooner than FLUSH_S goes at once. 30k rows x ~14
# columns is ~5 MB of Arrow; DuckDB's MEMORY_LIMIT below commits far more at once (3 M rows). A train.py loop queues
# ~3k calls a second, so 30k leaves FLUSH_S the one that decides there (10k flushed every 3.3 s, not 5).
FLUSH_ROWS = 30_000
# ...or for at most this long. Every flush pays a fixed ~15 ms of the writer's CPU whatever its rows (measured with
# thread_time, issue 33: ~4 ms an insert for each of calls, sched and stacks, ~2.5 ms for the session row's
# horizon, ~2 ms for the commit), and the live MCP view and the end flush on demand, so nothing needs the rows
# sooner: 5 s and 30k rows, not 2 s and 10k, wrote 7-10 transactions for 19-20 on a ~35 s train.py recording
# and the writer's CPU fell a third (bench/README.md). A SIGKILL loses at most this much of the detail
# (session.flushed_ns says how far the file goes).
FLUSH_S = 5.0
# ...except the per-second summaries, a handful of rows each (host_samples, cpu_idle, thread_breakdown, ...): they
# wait up to SUMMARY_FLUSH_S. An insert costs ~1-2 ms of CPU however few its rows (DuckDB's planning, not the
# rows), and with a dozen summary tables beside cuda_calls and sched a 2 s flush cost ~50 ms of CPU, 2.5% of a
# core on train.py (issue 33: the tables added since, not the rows, made the recorder's cost creep up). Nothing
# references a summary row, so holding them back leaves no dangling reference in a killed recorder's file. The
# session row keeps two horizons, each true of its own tables: flushed_ns for the detail rows (calls, off-CPU
# intervals, stacks: a killed recorder keeps all the calls it wrote) and summaries_flushed_ns for these. A
# statement, a marker (sync, a live snapshot) and the end write them with the rest.
SUMMARY_FLUSH_S = 10.0
SUMMARY_TABLES = frozenset(
    {
        "host_samples",
        "cgroup_cpu",
        "cpu_idle",
        "process_placement",
        "thread_breakdown",
        "sched_stats",
        "thread_wakers",
        "preemptors",
        "offcpu_stacks",
        "cpu_samples",
        "gc_collections",
        "thread_snapshots",
    }
)
# DuckDB's buffer pool keeps every block it wrote loaded until memory_limit (default 80% of RAM) presses it, so the
# recorder's RSS grew with the file it was writing (issue 21: +17-22 MiB over bench/churn_memory's 100 K processes
# and 20 MiB file, duckdb_memory()'s BASE_TABLE following the file). Over this limit the written blocks are evicted
# first (they are on disk: dropping them costs nothing); only rows not yet checkpointed would spill, to temp_dir.
# A commit needs its table's in-memory row group at hand: 8 MiB failed commits of 10 K-row batches in
# tests/test_store.py, 16 MiB did not, and 32 MiB commits 3 M rows at once over 20 MiB of unspilled rows.
MEMORY_LIMIT = 32 * 2**20
# ...and the rows not yet checkpointed are held in memory, ~1.5x their WAL bytes (24 MiB at DuckDB's default 16 MiB
# of WAL in bench/churn_memory): checkpointing at 8 MiB of WAL keeps them near 12 MiB, with the rest of
# MEMORY_LIMIT for the commit and the checkpoint's own blocks. (Under --max-db-size the thinner checkpoints, at
# sizecap.wal_limit: at most 16 MiB, for caps over 320 MiB.)
CHECKPOINT_WAL = 8 * 2**20


class _Inbox:
    """The writer thread's queue. Row batches are queued without waking the writer, which wakes at least every
    FLUSH_S anyway: waking a thread per batch (several tables per drain, 5 drains a second) was the recorder's
    largest single cost in py-spy (queue.Queue's Condition.notify, 18% of its samples, mostly GIL hand-offs).
    Statements, markers, the end, and a table reaching FLUSH_ROWS do wake it."""

    def __init__(self) -> None:
        self._items: deque[tuple[str, Any, Any, float] | None] = deque()  # (kind, a, b, when queued); None: end
        self._rows: dict[str, int] = {}  # rows queued per table since the writer last took them
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def put_rows(self, table: str, tbl: pa.Table) -> None:
        """Queue a row batch; wake the writer only when its table has FLUSH_ROWS rows queued."""
        with self._lock:
            self._items.append(("rows", table, tbl, time.monotonic()))
            n = self._rows[table] = self._rows.get(table, 0) + tbl.num_rows
        if n >= FLUSH_ROWS:
            self._wake.set()

    def put(self, kind: str | None, a: Any = None, b: Any = None) -> None:
        """Queue a statement (``sql``) or a marker (``call``), or the end (None), and wake the writer."""
        with self._lock:
            self._items.append(None if kind is None else (kind, a, b, time.monotonic()))
        self._wake.set()

    def take(self, timeout: float) -> list[tuple[str, Any, Any, float] | None]:
        """Return everything queued, waiting up to ``timeout`` s for a wake-up first."""
        self._wake.wait(timeout)
        self._wake.clear()  # before taking: a wake-up for an item put after this is not lost
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._rows.clear()
        return items


def _hold_s(table: str) -> float:
    """How long a table's rows may wait for their insert."""
    return SUMMARY_FLUSH_S if table in SUMMARY_TABLES else FLUSH_S


def _concat(parts: list[pa.Table]) -> pa.Table:
    """One table of the queued batches of one DB table. A column that is dictionary-encoded in some batches and
    not in others (or with other index types) is decoded in those batches (DuckDB stores the values either way);
    NULL-typed columns (a batch that lacked the column) are promoted by concat."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0].schema
    differ = [i for i, f in enumerate(first) if any(p.schema.field(i).type != f.type for p in parts[1:])]
    if differ:
        parts = [_decode(p, differ) for p in parts]
    return pa.concat_tables(parts, promote_options="permissive")


def _decode(tbl: pa.Table, columns: list[int]) -> pa.Table:
    """``tbl`` with its dictionary-encoded columns among ``columns`` decoded to their value type."""
    for i in columns:
        t = tbl.schema.field(i).type
        if pa.types.is_dictionary(t):
            tbl = tbl.set_column(i, tbl.schema.field(i).with_type(t.value_type), tbl.column(i).cast(t.value_type))
    return tbl


class Store:
    """A trace DB open for writing."""

    def __init__(
        self, path: Path, force: bool = False, start_mono_ns: int | None = None, max_bytes: int | None = None
    ) -> None:
        """``start_mono_ns``: the session's start (CLOCK_MONOTONIC). Given, each periodic write also advances
        ``session.flushed_ns`` to when its newest rows were queued, in the same transaction, so a recording whose
        recorder is killed says truly how far it goes. ``max_bytes``: keep the file and its WAL under it by
        thinning the oldest detail rows after a write (tracer/recorder/sizecap.py)."""
        check_new_file(path, force, "--db", StoreError)
        if path.exists():
            path.unlink()
            wal = path.with_name(path.name + ".wal")
            if wal.exists():
                wal.unlink()
        self.path = path
        try:
            self.conn = sizecap.connect(path, max_bytes) if max_bytes else duckdb.connect(str(path))
        except duckdb.Error as e:
            raise StoreError(f"cannot create {path}: {e}") from None
        # One DuckDB thread: the writer appends a few batches a second, which a second thread does not speed up,
        # and on a small box every thread the recorder runs competes with the job it watches.
        self.conn.execute("SET threads = 1")
        self.temp_dir = path.with_name(path.name + ".tmp")
        self.conn.execute(f"SET memory_limit = '{MEMORY_LIMIT}B'")
        # Where rows would spill over memory_limit: beside the file, as DuckDB does by default for a file, but
        # named here because the capped store's default database is in memory (sizecap.connect), whose default
        # is ./.tmp in the user's working directory. DuckDB removes the directory it made when it closes.
        self.conn.execute(f"SET temp_directory = {literal(str(self.temp_dir))}")
        if not max_bytes:
            self.conn.execute(f"SET checkpoint_threshold = '{CHECKPOINT_WAL}B'")
        self.thinner = sizecap.Thinner(path, max_bytes) if max_bytes else None
        for t in TABLES:
            self.conn.execute(t.ddl())
        self.conn.execute("INSERT INTO meta VALUES ('app', ?), ('schema_version', ?)", [APP_ID, str(SCHEMA_VERSION)])
        self.rows_written: dict[str, int] = {}
        self._q = _Inbox()
        self._start_mono_ns = start_mono_ns
        self._closed = False
        self._error: BaseException | None = None
        self.status_marked: str | None = None  # the status _fail() managed to write after a failed write
        self._writer = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._writer.start()

    # --- batched appends -----------------------------------------------------------------------------------

    def put(self, table: str, columns: Mapping[str, Sequence[Any] | pa.Array | Any]) -> None:
        """Queue rows for ``table`` given as columns (lists / numpy arrays / Arrow arrays), in any order.

        Columns the table has but ``columns`` lacks are written as NULL.
        """
        if self._error:
            raise self._failure()
        t = TABLE_BY_NAME[table]
        n = len(next(iter(columns.values()))) if columns else 0
        if n == 0:
            return
        arrays = []
        for name in t.column_names:
            v = columns.get(name)
            arrays.append(pa.nulls(n) if v is None else v if isinstance(v, pa.Array) else pa.array(v))
        self._q.put_rows(table, pa.Table.from_arrays(arrays, names=t.column_names))

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> None:
        """Queue one statement; it runs on the writer thread after every batch queued before it."""
        if self._error:
            raise self._failure()
        self._q.put("sql", sql, list(params or []))

    def sync(self) -> None:
        """Block until everything queued so far is written."""
        done = threading.Event()
        self._q.put("call", done.set)
        while self._writer.is_alive() and not done.wait(0.05):
            pass

    def snapshot(self, dest: Path, on_done: Callable[[], None] | None = None) -> None:
        """Queue a consistent copy of the DB at ``dest``, taken by the writer thread after everything queued before
        it: a checkpoint, a file copy, the copy's session marked ``snapshot``, then an atomic rename (a reader of
        ``dest`` sees the old copy or the new one, never half of one). The live MCP server reads it
        (tracer/live.py): no other process can open a DuckDB file while it is being written."""

        def take() -> None:
            self.conn.execute("CHECKPOINT")
            tmp = dest.with_name(dest.name + ".tmp")
            try:
                shutil.copyfile(self.path, tmp)
                with duckdb.connect(str(tmp)) as c:
                    c.execute("UPDATE session SET status = 'snapshot' WHERE status = 'recording'")
                os.replace(tmp, dest)
            except OSError as e:  # its directory went (its reader stopped): a lost snapshot, not a lost recording
                log.warning("a snapshot of %s at %s failed: %s", self.path, dest, e)
                return
            if on_done is not None:
                on_done()

        self._q.put("call", take)

    def _run(self) -> None:
        try:
            self._write_loop()
        except Exception as e:  # a dead writer would drop every later row silently: fail instead
            log.error("the writer of %s stopped: %s", self.path, e)
            self._fail(e)

    def _write_loop(self) -> None:
        pending: dict[str, list[pa.Table]] = {}
        since: dict[str, float] = {}  # per table: when its oldest pending batch was queued
        newest: dict[str, float] = {}  # ...and its newest
        stop = False
        while not stop:
            # Rows wait up to FLUSH_S, or SUMMARY_FLUSH_S for the summaries (or FLUSH_ROWS per table): each insert
            # costs 1-2 ms of CPU whatever its size, and the recorder queues a few tables every drain (5 a second).
            now = time.monotonic()
            # (at least every FLUSH_S: a row batch queued meanwhile does not wake the writer)
            items = self._q.take(max(0.0, min([FLUSH_S, *(since[t] + _hold_s(t) - now for t in since)])))
            for item in items:
                if item is None:
                    stop = True
                elif item[0] == "rows":
                    table, when = item[1], item[3]
                    since.setdefault(table, when)
                    newest[table] = when
                    pending.setdefault(table, []).append(item[2])
                else:
                    self._flush(pending, since, newest, list(pending))  # statements and markers keep their place
                    self._guard(item[:3])
                if self._error:
                    return  # _fail closed the connection: nothing more is written, sync() no longer waits
            if due := self._due(pending, since, stop):
                self._flush(pending, since, newest, due)
            if self._error:
                return

    @staticmethod
    def _due(pending: dict[str, list[pa.Table]], since: dict[str, float], stop: bool) -> list[str]:
        """The tables to write now: all at the end; else those over FLUSH_ROWS, and once any table has waited its
        hold, every other table as well but the summaries, which go all together once one of them has waited
        SUMMARY_FLUSH_S (one transaction, one commit, for the tables that are due at about the same time)."""
        if stop:
            return list(pending)
        now = time.monotonic()
        full = {t for t, parts in pending.items() if sum(p.num_rows for p in parts) >= FLUSH_ROWS}
        waited = {t for t in pending if now - since[t] >= _hold_s(t)}
        summaries = any(t in SUMMARY_TABLES for t in waited)
        if not waited:
            return list(full)
        return [t for t in pending if t in full or t not in SUMMARY_TABLES or summaries]

    def _flush(
        self,
        pending: dict[str, list[pa.Table]],
        since: dict[str, float],
        newest: dict[str, float],
        tables: list[str],
    ) -> None:
        """Write the pending rows of ``tables`` in one transaction and drop them from the three dicts. Each of the
        session's two horizons (detail rows, summaries) moves to the newest batch written, or to the oldest batch of
        its own kind still held back if that is earlier: a summary held back does not hold back the calls'."""
        if tables and not self._error:
            upto = max(newest[t] for t in tables)
            horizons = []
            for summary in (False, True):
                held = [since[t] for t in pending if t not in tables and (t in SUMMARY_TABLES) == summary]
                horizons.append(min([upto, *held]))
            self._guard(("insert", {t: pending[t] for t in tables}, (horizons[0], horizons[1])))
            if self.thinner is not None and not self._error:
                self._guard(("call", lambda: self.thinner.after_write(self.conn), None))
        for t in tables:
            pending.pop(t, None)
            since.pop(t, None)
            newest.pop(t, None)

    def _guard(self, item: tuple[str, Any, Any]) -> None:
        kind, a, b = item
        try:
            if kind == "insert":
                self._insert_all(a, b)
            elif kind == "sql":
                self.conn.execute(a, b)
            elif kind == "call":
                a()
        except Exception as e:  # the first failure ends the writing; the recorder reports it (issue 11)
            log.error("writing %s failed: %s", self.path, e)
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        """Stop writing after the first failed write, and leave what was committed readable.

        Runs on the writer thread, which exits after it. The session is marked 'disk_full' (or 'failed') as a
        best effort: a full disk may refuse even that row, and readers then report a recorder that is gone. The
        connection is closed here: its committed transactions stay in the file and its WAL, and no DuckDB object
        is left to the exiting interpreter (a live connection at exit makes nanobind print a "leaked" report; a
        writer thread still inside DuckDB at exit can abort the process). From then on put() and execute() raise
        :class:`StoreError`, sync() returns at once, and close() only hands the file to the sudo user.
        """
        self._error = e
        status = "disk_full" if _disk_full(e) else "failed"
        try:
            self.conn.execute("UPDATE session SET status = ? WHERE status = 'recording'", [status])
            self.status_marked = status
        except Exception as e2:  # best effort, the disk may be full
            log.warning("could not mark %s as %s: %s", self.path, status, e2)
        try:
            self.conn.close()
        except Exception as e2:  # an invalidated instance may refuse even this
            log.warning("closing %s after the failure: %s", self.path, e2)

    @property
    def failed(self) -> bool:
        """True once a write failed: nothing more is written (see :meth:`_fail`)."""
        return self._error is not None

    def _failure(self) -> StoreError:
        """The error every later put() / execute() raises: what failed, and that the data before it is kept.

        Waits for the writer thread to finish :meth:`_fail` first: the caller may exit on this error, and a thread
        still inside DuckDB (closing, checkpointing) when the interpreter exits aborts the process.
        """
        if threading.current_thread() is not self._writer:
            self._writer.join()
        e = self._error
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        keep = f"The data written before it is in {self.path}: tracer stats --db {self.path}"
        if _disk_full(e):
            where = self.path.parent if str(self.path.parent) else Path(".")
            return StoreError(
                f"the disk holding {self.path} is full: {first}",
                f"Free space (df -h {where}) or record to another disk with --db. {keep}",
            )
        return StoreError(f"writing {self.path} failed: {first}", keep)

    def _insert_all(self, pending: dict[str, list[pa.Table]], queued_until: tuple[float, float] | None = None) -> None:
        """Append each table's batches, all in one transaction: a commit costs more CPU than a small insert. With
        ``queued_until`` (monotonic s: up to when the detail rows, and the summaries, were all queued) the session
        row's flushed_ns and summaries_flushed_ns move there in the same transaction."""
        written = {}
        self.conn.begin()
        try:
            for table, parts in pending.items():
                written[table] = self._insert(table, parts)
            if queued_until is not None and self._start_mono_ns is not None:
                detail, summaries = (int(t * 1e9) - self._start_mono_ns for t in queued_until)
                self.conn.execute(
                    "UPDATE session SET flushed_ns = greatest(coalesce(flushed_ns, 0), ?), "
                    "summaries_flushed_ns = greatest(coalesce(summaries_flushed_ns, 0), ?)",
                    [detail, summaries],
                )
            self.conn.commit()
        except BaseException:
            try:
                self.conn.rollback()
            except duckdb.Error:
                pass  # a failed commit has already ended the transaction; the first error is the one to report
            raise
        for table, n in written.items():
            self.rows_written[table] = self.rows_written.get(table, 0) + n

    def _insert(self, table: str, parts: list[pa.Table]) -> int:
        """Append the batches to ``table``; return the rows appended.

        The batch is read by DuckDB's replacement scan (the local variable ``_batch`` named in the statement), not
        registered as a view: register() and unregister() each change the catalog inside the transaction, and
        cost twice what the insert itself does (~1 ms and ~0.5 ms of CPU against ~1.5 ms per table and flush, with
        ~15 tables written every flush: the writer's largest cost in py-spy, issue 33)."""
        _batch = _concat(parts)  # noqa: F841 - read by name by the statement below
        cols = TABLE_BY_NAME[table].column_names
        try:
            self.conn.execute(f"INSERT INTO {table} SELECT {', '.join(cols)} FROM _batch")
        except duckdb.Error as e:
            raise type(e)(f"appending {_batch.num_rows} rows to {table}: {e}") from e
        return _batch.num_rows

    @property
    def error(self) -> BaseException | None:
        """The first write error, if any."""
        return self._error

    def close(self) -> None:
        """Write everything queued, checkpoint, and hand the file to the sudo user; idempotent.

        After a failed write (:attr:`failed`) the connection is already closed: this only hands the file over.
        """
        if self._writer.is_alive():
            self._q.put(None)
            self._writer.join()
        if self._closed:
            return
        self._closed = True
        if self._error is not None:
            _chown_to_sudo_user(self.path)
            return
        try:
            if self.thinner is not None:  # the last checkpoint must not rewrite kept detail past the cap
                self.conn.execute(sizecap.NO_VACUUM)
            self.conn.execute("CHECKPOINT")
        except duckdb.Error as e:
            log.warning("checkpoint failed: %s", e)
        self.conn.close()
        _chown_to_sudo_user(self.path)


def _disk_full(e: BaseException | None) -> bool:
    """True when ``e`` says the file system is out of space (ENOSPC, or a quota: EDQUOT)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    msg = str(e).lower()
    return "no space left on device" in msg or "disk quota exceeded" in msg


def _chown_to_sudo_user(path: Path) -> None:
    uid, gid = os.environ.get("SUDO_UID"), os.environ.get("SUDO_GID")
    if os.geteuid() != 0 or not uid or not gid:
        return
    for p in (path, path.with_name(path.name + ".wal")):
        try:
            os.chown(p, int(uid), int(gid))
        except OSError:
            pass
