"""The query worker's side of :mod:`tracer.analysis.sql.pool`: a ``python -m tracer.analysis.sql.worker`` process
that answers one query at a time, read from stdin, on a connection that cannot write (issue 17), under an
address-space limit; the protocol is described in :mod:`tracer.analysis.sql.pool`.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from tracer.analysis.sql.limits import LANE_NICE, LIMITS, WORKER_NICE, QueryOutOfMemory, SqlLimits
from tracer.errors import StoreError, TracerError, hidden_directories, redact

IDLE_CLOSE_S = 30.0  # close the DB after this long without queries: the read lock it holds would block a writer
RETIRE_GROWTH_BYTES = 256 << 20


def _statm() -> tuple[int, int]:
    """(address space, resident) bytes of this process."""
    vm, rss = Path("/proc/self/statm").read_text().split()[:2]
    page = os.sysconf("SC_PAGE_SIZE")
    return int(vm) * page, int(rss) * page


def _limit_address_space(extra: int | None) -> None:
    """Set the soft RLIMIT_AS to the current size plus ``extra`` bytes (None: unlimited).

    Only the soft limit moves, so the worker can lift it to open a DB (DuckDB reserves address space at open)
    and lower it again; SQL cannot call setrlimit.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = resource.RLIM_INFINITY if extra is None else _statm()[0] + extra
    if hard != resource.RLIM_INFINITY and (soft == resource.RLIM_INFINITY or soft > hard):
        soft = hard
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def query_db_config(limits: SqlLimits) -> dict[str, str | bool | int]:
    """The DuckDB settings of a query worker's connection, added to :data:`tracer.analysis.db.READ_CONFIG`."""
    return {
        "memory_limit": f"{limits.duckdb_memory_bytes >> 20}MiB",
        "threads": int(limits.threads),
        "temp_directory": "",  # no spilling: a query over memory_limit fails rather than writes to disk
        # $HOME must not show in duckdb_settings(): nothing is read from or written to these (no file system)
        "home_directory": "/nonexistent",
        "secret_directory": "/nonexistent",
        "lock_configuration": False,  # locked by open_query_db, once the file system is off
    }


def open_query_db(path: str | Path, config: dict[str, str | bool | int], *, validate: bool = True) -> Any:
    """Open the trace DB at ``path`` read-only for queries: validated, then unable to touch any other file.

    The open file keeps being read; no statement can open another one (``COPY … TO``, ``EXPORT``, ``read_csv``,
    ``ATTACH``) or undo this: the local file system is disabled and the configuration locked after the open
    (the open itself goes through that file system).

    Args:
        validate: check that the file is a readable trace DB (False: the same file, unchanged, passed already).
    """
    from tracer.analysis.db import connect_read_only, open_trace

    conn = open_trace(path, config=config) if validate else connect_read_only(path, config)
    try:
        conn.execute("SET disabled_filesystems = 'LocalFileSystem'")
        conn.execute("SET lock_configuration = true")
    except BaseException:  # never hand out a connection that could still write
        conn.close()
        raise
    return conn


class _Connections:
    """The worker's read-only connection: a fresh DuckDB instance for each query (issue 30).

    DuckDB keeps state per instance, not per cursor (an external resource registered by one query was read by
    another client's later query), so each call opens the file anew and :meth:`close` drops the instance after it;
    the file is validated again only when it was replaced or changed (same device, inode, size and mtime: open
    and harden take 25-45 ms, validation as much again, on a loaded 2-core host).
    """

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        limits = SqlLimits(duckdb_memory_bytes=int(cfg["duckdb_memory_bytes"]), threads=int(cfg["threads"]))
        self.duckdb_config = query_db_config(limits)
        self.validated: tuple[Any, ...] | None = None  # the file (path, dev, ino, size, mtime) last validated
        self.conn: Any = None
        self.idle_rss: int | None = None

    def get(self, path: str) -> Any:
        from tracer.analysis.db import check_file

        st = check_file(path).stat()
        key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self.close()  # never two at once: DuckDB would hand back the same cached instance
        _limit_address_space(None)
        try:
            self.conn = open_query_db(path, self.duckdb_config, validate=key != self.validated)
            self.validated = key
            self.conn.sql("SELECT 1").to_arrow_table()  # start DuckDB's threads before measuring
        finally:
            _limit_address_space(int(self.cfg["memory_bytes"]))
        if self.idle_rss is None:
            self.idle_rss = _statm()[1]
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # an invalidated instance may refuse even this
                pass
        self.conn = None

    def forget(self) -> None:
        """Close, and validate the file again at the next open (it failed to open or read)."""
        self.close()
        self.validated = None


PARENT_POLL_S = 0.5  # how often the parent is looked for when no pidfd could be opened on it


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone (it was killed without closing the pool): never outlive the server.

    The wait is on a pidfd of the parent, readable the moment it exits: a 0.5 s poll of getppid() left a worker
    running 0.6 s after its server's death under two loads (suite run 1 of stop 38). Not PR_SET_PDEATHSIG: the
    kernel sends it when the *thread* that started us ends, and the pool starts workers from whichever thread
    needs one. The getppid() after the pidfd is open catches a parent that died before it. (A parent that dies closes
    our stdin too, and _worker_main exits at once on that.)"""
    try:
        fd = os.pidfd_open(parent)
    except (OSError, AttributeError):  # a kernel before 5.3: poll
        fd = None
    while os.getppid() == parent:
        if fd is None:
            time.sleep(PARENT_POLL_S)
        else:
            select.select([fd], [], [])
    os._exit(0)


def _hidden(db: str) -> tuple[str, ...]:
    """The directories a query's error may not name (:func:`tracer.errors.redact`): the DB's directory, as given
    and resolved (also when the file is a link into another). Values are never redacted: a trace holds paths of
    its own (Python files) that may share these prefixes."""
    return hidden_directories([os.path.dirname(os.path.abspath(db)), os.path.dirname(os.path.realpath(db))])


def _query(conns: _Connections, req: dict[str, Any], hidden: list[str]) -> Any:
    """Run request ``req`` on a fresh connection; ``hidden`` gets the directories its errors may not name once
    the DB is open."""
    from tracer.analysis.sql.run import execute

    conn = conns.get(req["db"])
    hidden[:] = _hidden(req["db"])
    return execute(
        conn,
        req["query"],
        req["limit"],
        req["timeout_s"],
        reply_bytes=req["reply_bytes"],
        value_chars=req["value_chars"],
    )


def _serve(cfg: dict[str, Any], inp: Any, out: Any, on_ready: Callable[[], None] | None = None) -> None:
    """Answer requests from ``inp`` on ``out`` until ``inp`` closes; ``on_ready`` runs just before the hello."""
    import duckdb

    from tracer.analysis.db import is_damaged
    from tracer.analysis.sql.run import execute

    conns = _Connections(cfg)
    _limit_address_space(int(cfg["memory_bytes"]))
    if cfg.get("preopen"):
        try:
            conn = conns.get(cfg["preopen"])  # validates it once, ahead of the first request
            # one query through the whole path: its first run costs ~150 ms of CPU (lazy imports, DuckDB's first
            # statements), paid here, at the start's priority, not by the first client (issue 30: the short lane's
            # first select 1 beside saturating queries took 2-3 s)
            execute(conn, "SELECT 1", 1, float(cfg["timeout_s"]), reply_bytes=1 << 10, value_chars=16)
        except (TracerError, duckdb.Error):
            conns.forget()  # the first request reports it
        conns.close()

    def send(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg, ensure_ascii=False).encode("utf-8", "backslashreplace") + b"\n")
        out.flush()

    if on_ready is not None:
        on_ready()
    send({"ready": os.getpid()})
    while True:
        ready, _, _ = select.select([inp], [], [], IDLE_CLOSE_S)
        if not ready:
            conns.close()  # release the file's read lock while nobody asks
            continue
        line = inp.readline()
        if not line:
            return
        retire = False
        hidden: list[str] = []  # set once the DB is open: the errors after that are the query's
        try:
            req = json.loads(line)
            query = functools.partial(_query, conns, req, hidden)
            res = _at_nice(req.get("nice"), query) if on_ready is not None else query()
            reply: dict[str, Any] = {"result": res.model_dump(mode="json")}
        except TracerError as e:
            reply = {"error": {"kind": type(e).__name__, "message": redact(e.message, hidden), "hint": e.hint}}
            # DuckDB invalidates its instance after an internal or fatal error: start afresh
            retire = isinstance(e, QueryOutOfMemory) or any(s in e.message for s in ("INTERNAL Error", "FATAL"))
            if isinstance(e, StoreError):
                conns.forget()
        except MemoryError:
            reply = {"error": {"kind": "QueryOutOfMemory", "message": "the query ran out of memory", "hint": ""}}
            retire = True
        except duckdb.Error as e:  # opening or re-validating the DB
            reply = {"error": {"kind": "StoreError", "message": str(e).splitlines()[0][:300], "hint": ""}}
            retire = not is_damaged(e)
            conns.forget()
        except Exception as e:  # a bug here must come back as an answer, not a dead worker
            reply = {"error": {"kind": "SqlError", "message": f"query worker error: {type(e).__name__}: {e}"[:500]}}
            retire = True
        if conns.idle_rss is not None and _statm()[1] - conns.idle_rss > int(cfg.get("retire_growth", 0) or 0):
            retire = True
        conns.close()  # nothing the query did outlives it: the next call gets a fresh instance
        if retire:
            reply["retire"] = True
        send(reply)
        if retire:
            return


_base_nice: int | None = None  # this process's nice at its start: what the pool's "nice" of a request adds to


def _lower_priority() -> None:
    """Every thread of this process LANE_NICE below where the process started. Done once the worker is ready, not
    at its start (issue 30): a replacement worker started at nice 5 while other queries took every core needed
    5-6 s instead of ~1 s, and a client in the short lane waited for it. A start is the same bounded work whoever
    asks (imports, opening the DB); what a client chooses, its queries, runs lower (:func:`_at_nice`)."""
    global _base_nice
    _base_nice = os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's nice, on Linux
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), _base_nice + LANE_NICE)
        except (OSError, ValueError):  # a thread that just ended
            pass


def _name_thread(name: bytes) -> None:
    """Set the calling thread's name (its /proc comm), which threads it starts inherit: what runs a query can be
    told from the worker's own threads (the priority test reads it)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _at_nice(nice: int | None, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread of its own at ``nice`` (default WORKER_NICE) below the worker's start, and return
    what it returns or raise what it raises. DuckDB's threads, started by it when it opens the instance, inherit
    that nice; this process's other threads keep theirs, so the next query may run higher (a thread may lower its
    own priority, never raise it without privilege). The pool asks for LANE_NICE in the short lane, whose
    queries are cut at 1 s: a client answered there competes less with the regular queries it waits beside."""
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            _name_thread(b"sql-lane" if nice == LANE_NICE else b"sql-query")  # DuckDB's threads inherit it
            if _base_nice is not None:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _base_nice + (nice or WORKER_NICE))
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller as is
            box["error"] = e

    th = threading.Thread(target=go, name="query")
    th.start()
    th.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _worker_main(argv: list[str]) -> NoReturn:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the terminal is for the parent; it kills us
    cfg = json.loads(argv[0]) if argv else asdict(LIMITS) | {"preopen": None}
    cfg.setdefault("retire_growth", RETIRE_GROWTH_BYTES)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    # the protocol gets a private copy of stdout; fd 1 goes to /dev/null so nothing else can write into it
    out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    try:
        # below the server's priority once started: a query that takes every core must not slow the tools that
        # answer in the server
        _serve(cfg, sys.stdin.buffer, out, on_ready=_lower_priority)
    except BrokenPipeError:  # the parent closed our pipe: it is done with us
        pass
    # Nothing is left to finish (read-only connections, no spill files, the replies flushed), and the interpreter's
    # finalisation took 0.6-0.9 s (DuckDB's and the imports' teardown), during which the watcher thread cannot take
    # the GIL to exit: a worker whose server was killed outlived it by that much (suite run 1 of stop 38).
    os._exit(0)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
