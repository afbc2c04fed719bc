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
import queue
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tracer.errors import StoreError
from tracer.schema import APP_ID, SCHEMA_VERSION, TABLE_BY_NAME, TABLES

log = logging.getLogger(__name__)

# Rows gathered per table before an insert. 10k rows x ~14 columns is a few MB of Arrow: the knee of DuckDB's
# append curve without holding much memory.
FLUSH_ROWS = 10_000


def check_db_path(path: Path, force: bool) -> None:
    """Raise StoreError unless a new trace DB can be written at ``path``."""
    parent = path.parent if str(path.parent) else Path(".")
    try:
        is_dir, writable, exists = parent.is_dir(), os.access(parent, os.W_OK), path.exists()
    except OSError as e:  # a parent we may not even look into
        raise StoreError(f"cannot use {path}: {e.strerror}", "choose another --db path") from None
    if not is_dir:
        raise StoreError(f"directory {parent} does not exist", f"create it first: mkdir -p {parent}")
    if not writable:
        raise StoreError(f"cannot write to directory {parent}", "choose another --db path")
    if exists and not force:
        raise StoreError(
            f"{path} already exists",
            "pass --force to overwrite it, or choose another --db path (one recording per file)",
        )


class Store:
    """A trace DB open for writing."""

    def __init__(self, path: Path, force: bool = False) -> None:
        check_db_path(path, force)
        if path.exists():
            path.unlink()
            wal = path.with_name(path.name + ".wal")
            if wal.exists():
                wal.unlink()
        self.path = path
        try:
            self.conn = duckdb.connect(str(path))
        except duckdb.Error as e:
            raise StoreError(f"cannot create {path}: {e}") from None
        for t in TABLES:
            self.conn.execute(t.ddl())
        self.conn.execute("INSERT INTO meta VALUES ('app', ?), ('schema_version', ?)", [APP_ID, str(SCHEMA_VERSION)])
        self.rows_written: dict[str, int] = {}
        self._q: queue.Queue[tuple[str, Any, Any] | None] = queue.Queue()
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
        self._q.put(("rows", table, pa.Table.from_arrays(arrays, names=t.column_names)))

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> None:
        """Queue one statement; it runs on the writer thread after every batch queued before it."""
        if self._error:
            raise self._failure()
        self._q.put(("sql", sql, list(params or [])))

    def sync(self) -> None:
        """Block until everything queued so far is written."""
        done = threading.Event()
        self._q.put(("call", done.set, None))
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
            shutil.copyfile(self.path, tmp)
            with duckdb.connect(str(tmp)) as c:
                c.execute("UPDATE session SET status = 'snapshot' WHERE status = 'recording'")
            os.replace(tmp, dest)
            if on_done is not None:
                on_done()

        self._q.put(("call", take, None))

    def _run(self) -> None:
        pending: dict[str, list[pa.Table]] = {}
        stop = False
        while not stop:
            items = [self._q.get()]
            while True:  # take whatever else is queued, so one insert covers many batches
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is None:
                    stop = True
                elif item[0] == "rows":
                    pending.setdefault(item[1], []).append(item[2])
                else:
                    self._flush(pending)  # statements and markers keep their place in the order
                    self._guard(item)
                if self._error:
                    return  # _fail closed the connection: nothing more is written, sync() no longer waits
            self._flush(pending)
            if self._error:
                return

    def _flush(self, pending: dict[str, list[pa.Table]]) -> None:
        for table, parts in pending.items():
            if self._error:
                break
            self._guard(("insert", table, pa.concat_tables(parts, promote_options="permissive")))
        pending.clear()

    def _guard(self, item: tuple[str, Any, Any]) -> None:
        kind, a, b = item
        try:
            if kind == "insert":
                self._insert(a, b)
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
        except Exception as e2:  # noqa: BLE001 - best effort, the disk may be full
            log.warning("could not mark %s as %s: %s", self.path, status, e2)
        try:
            self.conn.close()
        except Exception as e2:  # noqa: BLE001 - an invalidated instance may refuse even this
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

    def _insert(self, table: str, tbl: pa.Table) -> None:
        cols = TABLE_BY_NAME[table].column_names
        self.conn.register("_batch", tbl)
        try:
            self.conn.execute(f"INSERT INTO {table} SELECT {', '.join(cols)} FROM _batch")
        finally:
            self.conn.unregister("_batch")
        self.rows_written[table] = self.rows_written.get(table, 0) + tbl.num_rows

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
