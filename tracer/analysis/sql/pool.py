"""Query workers: every ``run_sql`` statement given a DB path runs in a child process that can be killed.

Why a process (issue 11): DuckDB checks for interrupts only between vectors, so one scalar call over huge values
(``levenshtein`` of two 100 K-char strings, n² steps) runs for half a minute past any ``interrupt()``; list
functions (``len(range(200000000))``) allocate outside ``memory_limit``; and a query that wedges or bloats the
process serving MCP takes every other tool down with it. A worker runs the query under hard limits:

- an address-space limit (RLIMIT_AS): its idle size plus :attr:`SqlLimits.memory_bytes`. DuckDB turns a failed
  allocation into an out-of-memory error; a worker that grew by more than
  :data:`tracer.analysis.sql.worker.RETIRE_GROWTH_BYTES` (allocators keep freed memory) or hit the limit is
  replaced after it answers;
- DuckDB ``memory_limit`` and ``threads``;
- a wall clock: the worker interrupts DuckDB at ``timeout_s``; a worker still busy ``kill_grace_s`` later is
  killed (SIGKILL) and replaced;
- no file writes (issue 17): the DB is opened read-only, then DuckDB's local file system is disabled
  (``disabled_filesystems``) and the configuration locked. The open file is still read, but no statement can
  open another: ``COPY … TO`` the served DB or anywhere else, ``EXPORT``, ``read_csv`` all fail inside DuckDB,
  whatever the statement check let through (``allowed_paths`` cannot do this: DuckDB always adds the DB, its
  ``.wal`` and the temp directory to it). Nothing spills to disk either (no temp directory), so the disk cap is
  zero bytes and ``memory_limit`` bounds each query.

Queries wait for a worker in a fair queue (:mod:`tracer.analysis.sql.fairqueue`): one client (``client=``, an MCP
session) holds at most ``size - 1`` workers, the next free worker goes to the waiting client running fewest
queries, and a query that finds no worker within :attr:`SqlLimits.queue_wait_s` is refused as busy.

The short lane (issue 30): with ``size`` workers held by ``size`` other clients' long queries, a third client's
``select 1`` waited for one of them to end (17-21 s measured, up to the 10 s limit plus the kill and a worker's
start). So the pool keeps ``lane`` more workers that only take a query of a client running nothing, when every
regular slot is taken, and cut it at :data:`LANE_TIMEOUT_S` (its kill follows ``kill_grace_s`` later). A client
gets the lane only while it has nothing running, and waiting clients take it in the fair queue's order (the one
served least recently first), so clients that keep the lane busy delay another by about one lane query each
(at most ``LANE_TIMEOUT_S + kill_grace_s``, plus a worker's start when that query was killed), never by a long
query. The lane has two workers, and a client whose lane query runs to the lane's limit is kept out of the lane
for :data:`LANE_BARRED_S`: one client hogging the lane with queries DuckDB cannot interrupt holds one lane worker
at most, and only once in ten seconds, so another finds the other lane worker ready (with one lane worker a
fourth client's hog made a third's select 1 wait 1.9 s median, 3.2 s max: up to the hog's 2 s, plus the start of
the killed worker's replacement). A lane query runs at :data:`tracer.analysis.sql.limits.LANE_NICE`, above the
regular queries' nice 5, so the client answered there is not starved by the queries it waits beside. Making the
pool bigger instead would give hostile clients one more 10 s query to burn; the lane bounds what it can cost to
~2 s per query.

:class:`SqlPool` keeps ``size`` workers started (``start``) so an ordinary query pays a pipe round trip, not a
process start; a worker keeps its read-only connection open between queries, reopening it when the file changes
(inode, size or mtime) and closing it after ``IDLE_CLOSE_S`` without queries (the read lock it holds would block
a writer). ``tracer sql`` uses the same pool, unstarted: its one query spawns one worker. The worker's side, a
``python -m tracer.analysis.sql.worker`` process, is :mod:`tracer.analysis.sql.worker`.

Protocol, one JSON object per line (worker stdin / a private copy of its stdout):
``{"ready": pid}`` once started; then per request ``{"db", "query", "limit", "timeout_s", "reply_bytes",
"value_chars"}`` -> ``{"result": {...SqlResult}}`` or ``{"error": {"kind", "message", "hint"}}``, with
``"retire": true`` when the worker exits after this answer.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracer.analysis.sql.fairqueue import LOCAL_CLIENT, FairShare, Ticket
from tracer.analysis.sql.limits import LANE_NICE, LIMITS, QueryOutOfMemory, QueryTimeout, SqlError, SqlLimits
from tracer.errors import StoreError, TracerError

if TYPE_CHECKING:
    from tracer.analysis.sql.result import SqlResult

POOL_SIZE = 2  # one query may be killed while the other worker answers the next call at once
# A query still running this long after its interrupt is stuck in one long function call: its replacement
# worker starts then, so that it is ready when the query is killed (kill_grace_s after the interrupt).
STANDBY_AFTER_S = 0.2
READY_S = 30.0  # a worker's start (Python + duckdb + pyarrow imports) on a loaded 2-core machine
CLIENT_WAITING = 4  # queries one client may have waiting for a worker; more are refused at once
# workers kept for clients that run nothing while every regular worker is held by others: two, so that a client
# whose lane query runs to the lane's limit (or is killed there, its worker replaced by one that takes seconds to
# start on a loaded machine) holds one and another client finds the other ready (issue 30: with one, a fourth
# client's uninterruptible queries made a third's select 1 wait 1.9 s median, 3.2 s max, on a quiet VM)
LANE = 2
# A query in the short lane is stopped after this long: enough for a lookup on a recording (select 1 answers in
# milliseconds, a GROUP BY over a million rows in ~0.1 s), short enough that clients taking turns in the lane
# delay another by seconds, not by a 10 s query each.
LANE_TIMEOUT_S = 1.0
# A client whose lane query ran to the lane's limit may not take the lane again for this long (its queries wait
# for a regular worker meanwhile): one client cannot keep a lane worker busy, nor take the other lane worker the
# moment its killed one is being replaced.
LANE_BARRED_S = 10.0
LANE_BARRED_REMEMBERED = 4096  # clients barred from the lane that are remembered (the oldest bars are dropped)
_ERRORS: dict[str, type[TracerError]] = {
    c.__name__: c for c in (SqlError, QueryTimeout, QueryOutOfMemory, StoreError, TracerError)
}


class QueryCancelled(SqlError):
    """The caller gave up on the query (its client disconnected): it was stopped, or never started."""


class Cancel:
    """Lets another thread stop one :meth:`SqlPool.run` call (issue 30: a disconnected MCP client's query ran on
    to its 10 s limit). :meth:`cancel` kills the worker running the query (the pool starts a replacement), or
    ends the wait for one; the call then raises :class:`QueryCancelled`. Safe to call from an event loop: it
    sends a signal and wakes the pool's waiters, nothing more.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cancelled = False
        self._worker: _Worker | None = None
        self._wake: Callable[[], None] | None = None

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            w, wake = self._worker, self._wake
        if w is not None:
            w.signal_kill()  # the thread reading its answer sees the pipe close and discards it
        if wake is not None:
            wake()

    def _hold(self, w: _Worker | None) -> bool:
        """Note ``w`` as the call's worker; False if the call is already cancelled."""
        with self._lock:
            self._worker = w
            return not self.cancelled


def cancelled() -> QueryCancelled:
    return QueryCancelled("the query was cancelled: its caller left", "Nothing to do; send it again if needed.")


class _Gone(Exception):
    """The worker process ended (or closed its pipe) before answering."""

    def __init__(self, before_request: bool = False) -> None:
        super().__init__()
        self.before_request = before_request
        self.how = "ended"  # how the process ended, once known


class _TooBig(_Gone):
    """The worker's answer grew past what any answer within the reply cap can be (it is killed, not trusted)."""


class _Late(Exception):
    """The worker did not answer before the deadline."""


class _StartFailed(Exception):
    """A worker died or hung while starting; ``how`` says which."""

    def __init__(self, how: str) -> None:
        super().__init__(how)
        self.how = how


# -- the parent's side -------------------------------------------------------------------------------------------
class _Worker:
    """One query worker process and its pipes; used by one thread at a time."""

    def __init__(self, limits: SqlLimits, preopen: str | None) -> None:
        cfg = {**asdict(limits), "preopen": preopen}
        root = str(Path(__file__).resolve().parents[2])  # the worker imports this very tracer package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        env["MALLOC_ARENA_MAX"] = "2"  # glibc reserves 64 MiB of address space per arena and thread otherwise
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tracer.analysis.sql.worker", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        self._buf = bytearray()
        self.ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll_ready(self) -> bool:
        """True once the worker has said it is ready (reads its hello line if it is there, never blocks)."""
        if not self.ready and self.proc.stdout is not None:
            if select.select([self.proc.stdout.fileno()], [], [], 0)[0]:
                try:
                    self.wait_ready(time.monotonic() + 1.0)
                except (_Gone, _Late, SqlError):
                    return False  # the caller that picks it will find out and replace it
        return self.ready

    def wait_ready(self, deadline: float) -> None:
        if self.ready:
            return
        msg = self._read(deadline, 1 << 16)
        if "ready" not in msg:
            raise SqlError(
                f"the query worker did not start: {msg.get('error', {}).get('message', msg)}",
                "Check the installation: python -m tracer.analysis.sql.worker must import duckdb and pyarrow.",
            )
        self.ready = True

    def send(self, request: dict[str, Any]) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise _Gone(before_request=True) from None

    def answer(self, deadline: float, max_bytes: int) -> dict[str, Any]:
        """The worker's answer to the request sent; raises :class:`_Late` at ``deadline`` (call again to go on)."""
        return self._read(deadline, max_bytes)

    def _read(self, deadline: float, max_bytes: int) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Late
            try:
                fd = self.proc.stdout.fileno()
                ready, _, _ = select.select([fd], [], [], left)
                chunk = os.read(fd, 1 << 20) if ready else None
            except (OSError, ValueError):  # the pool closed the pipe under this read (close() from another thread)
                raise _Gone from None
            if chunk is None:
                continue
            if not chunk:
                raise _Gone
            self._buf += chunk
            if len(self._buf) > max_bytes:  # a worker never sends this much: treat it as broken
                raise _TooBig
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        try:
            msg = json.loads(line)
        except ValueError:  # not our protocol: something broke the worker
            raise _Gone from None
        if not isinstance(msg, dict):
            raise _Gone
        return msg

    def signal_name(self) -> str:
        """How the process ended ('SIGKILL', 'exit 1'), waiting briefly for it."""
        try:
            rc = self.proc.wait(2)
        except subprocess.TimeoutExpired:
            return "still running"
        return signal.Signals(-rc).name if rc < 0 else f"exit {rc}"

    def signal_kill(self) -> None:
        """SIGKILL the process, from any thread; the thread using it reaps it (:meth:`kill`)."""
        try:
            self.proc.send_signal(signal.SIGKILL)
        except OSError:
            pass

    def kill(self) -> None:
        """Kill the process (if alive), reap it and close the pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


class SqlPool:
    """Query workers shared by the threads of one process; :meth:`run` is the entry point.

    Args:
        size: most queries running at once with the full time limit (more wait for one to finish).
        lane: more workers kept for the short lane (see the module's docstring); 0 for none.
        lane_timeout_s: the short lane's time limit per query.
        limits: memory and thread limits of each worker, the default timeout / reply cap per query, and how
            long a query waits for a worker.
    """

    def __init__(
        self,
        size: int = POOL_SIZE,
        limits: SqlLimits = LIMITS,
        lane: int = LANE,
        lane_timeout_s: float = LANE_TIMEOUT_S,
    ) -> None:
        self.size = size
        self.lane = max(0, lane)
        self.lane_timeout_s = lane_timeout_s
        self.slots = size + self.lane  # workers kept started: the regular ones and the short lane's
        self._held = {False: 0, True: 0}  # queries holding a worker, regular (False) and in the short lane (True)
        self._lane_barred: dict[str, float] = {}  # client -> monotonic time until which it may not take the lane
        self.limits = limits
        # one worker is always left for another client; a pool of one has nothing to leave
        self._share = FairShare(per_client=max(1, size - 1), max_waiting=CLIENT_WAITING)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._cond = threading.Condition()
        self._warm = False
        self._preopen: str | None = None
        self._closed = False

    def start(self, db: str | Path | None = None) -> SqlPool:
        """Start ``size`` workers now, and replace each one that is killed or retired (a server's pool).

        Args:
            db: open this trace DB in each worker at start, so the first query does not pay for the open.
        """
        with self._cond:
            self._warm = True
            self._preopen = os.path.abspath(db) if db is not None else None
            self._fill()
        return self

    def spawn(self, db: str | Path | None = None) -> None:
        """Start one worker now, if none is alive, without keeping the pool warm (``tracer sql``: the worker's
        start overlaps the caller's own imports).

        Args:
            db: the trace DB the worker opens as soon as it has started.
        """
        with self._cond:
            if not self._all and not self._closed:
                w = _Worker(self.limits, os.path.abspath(db) if db is not None else None)
                self._all.add(w)
                self._idle.append(w)

    def _fill(self) -> None:
        while self._warm and not self._closed and len(self._all) < self.slots:
            w = _Worker(self.limits, self._preopen)
            self._all.add(w)
            self._idle.append(w)
        self._cond.notify_all()

    def _acquire(self, deadline: float, client: str, cancel: Cancel | None = None) -> tuple[_Worker, bool]:
        """A worker for one query of ``client``, counted in its share until :meth:`_done`, and whether it was
        granted in the short lane."""
        try:
            return self._acquire_once(deadline, client, cancel)
        except _StartFailed:  # one that died while starting (killed, or out of memory): one fresh try
            pass
        try:
            return self._acquire_once(deadline, client, cancel)
        except _StartFailed as e:
            raise SqlError(
                f"a query worker failed to start ({e.how})",
                "Retry; if it persists, run `python -m tracer.analysis.sql.worker` to see why.",
            ) from None

    def _lane_for(self, ticket: Ticket) -> bool | None:
        """Which lane ``ticket`` may take a worker in now: False regular, True the short lane, None neither."""
        if self._held[False] < self.size:
            return False
        if (
            self._held[True] < self.lane
            and not self._share.running.get(ticket.client)
            and self._lane_barred.get(ticket.client, 0.0) <= time.monotonic()
        ):
            return True
        return None

    def _bar_from_lane(self, client: str) -> None:
        """``client``'s lane query ran to the lane's limit: keep it out of the lane for :data:`LANE_BARRED_S`."""
        with self._cond:
            now = time.monotonic()
            if len(self._lane_barred) >= LANE_BARRED_REMEMBERED:
                self._lane_barred = {c: t for c, t in self._lane_barred.items() if t > now}
                while len(self._lane_barred) >= LANE_BARRED_REMEMBERED:  # drop the bar that ends first
                    del self._lane_barred[min(self._lane_barred, key=self._lane_barred.__getitem__)]
            self._lane_barred[client] = now + LANE_BARRED_S

    def _acquire_once(self, deadline: float, client: str, cancel: Cancel | None = None) -> tuple[_Worker, bool]:
        with self._cond:
            if self._closed:
                raise SqlError("the query pool is shut down", "The server is stopping; retry after restart.")
            ticket = self._share.enter(client)
            try:
                while True:
                    if self._closed:
                        raise SqlError("the query pool is shut down", "The server is stopping; retry after restart.")
                    if cancel is not None and cancel.cancelled:  # its caller left while it waited in line
                        raise cancelled()
                    short = self._lane_for(ticket)
                    if (
                        short is not None
                        and self._share.next_up(lambda t: self._lane_for(t) is not None) is ticket
                        and (self._idle or len(self._all) < self.slots)
                    ):
                        if self._idle:
                            # a worker that is ready answers now; one still starting (a replacement) only if none
                            # is, then the one started first
                            w = next((x for x in reversed(self._idle) if x.poll_ready()), self._idle[0])
                            self._idle.remove(w)
                        else:
                            w = _Worker(self.limits, self._preopen)
                            self._all.add(w)
                        self._share.grant(ticket)
                        self._held[short] += 1
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SqlError(
                            f"no query worker came free within {self.limits.queue_wait_s:g} s: all {self.size} "
                            "are busy with other queries",
                            "Retry in a few seconds, or narrow the queries that are running.",
                        )
                    self._cond.wait(left)
            except BaseException:
                self._share.leave(ticket)
                raise
            finally:
                self._cond.notify_all()  # whoever is next in line now, or can take another idle worker
        try:
            w.wait_ready(time.monotonic() + READY_S)
        except _Late:
            self._discard(w)
            self._done(client, short)
            raise _StartFailed(f"no answer in {READY_S:g} s") from None
        except (_Gone, SqlError):
            how = w.signal_name()
            self._discard(w)
            self._done(client, short)
            raise _StartFailed(how) from None
        return w, short

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _done(self, client: str, short: bool) -> None:
        """A query of ``client`` (in the short lane or not) no longer holds a worker: the next in line may take one."""
        with self._cond:
            self._share.done(client)
            self._held[short] -= 1
            self._cond.notify_all()

    def _release(self, w: _Worker) -> None:
        with self._cond:
            if self._closed:
                w.kill()
                self._all.discard(w)
            elif len(self._all) > self.slots:  # a standby made it one too many: one goes, the one still starting
                # if any, so the worker that just answered serves the next query at once (issue 30: killing it
                # handed a lane client a standby still starting, 6 s under load)
                extra = next((x for x in self._idle if not x.poll_ready()), w)
                if extra is not w:
                    self._idle.remove(extra)
                    self._idle.append(w)
                extra.kill()
                self._all.discard(extra)
            else:
                self._idle.append(w)
            self._cond.notify_all()  # the waiter whose turn it is, not any one waiter

    def _standby(self) -> None:
        """Start a worker beyond ``size`` now: one that is busy past its interrupt will probably be killed, and
        its replacement should be ready by then, not start only after the kill."""
        with self._cond:
            if self._warm and not self._closed and len(self._all) < 2 * self.slots:  # one per stuck query
                w = _Worker(self.limits, self._preopen)
                self._all.add(w)
                self._idle.append(w)
                self._cond.notify_all()

    def _discard(self, w: _Worker) -> None:
        w.kill()
        with self._cond:
            self._all.discard(w)
            self._fill()
            self._cond.notify_all()

    def worker_pids(self) -> list[int]:
        """Pids of the live worker processes."""
        with self._cond:
            return [w.pid for w in self._all]

    def run(
        self,
        db: str | Path,
        query: str,
        limit: int = 1000,
        timeout_s: float | None = None,
        *,
        reply_bytes: int | None = None,
        client: str | None = None,
        cancel: Cancel | None = None,
    ) -> SqlResult:
        """Run one read-only statement on the trace DB at ``db`` in a worker; see :func:`tracer.analysis.sql.run_sql`.

        Args:
            client: who asks (an MCP session id): the fair queue's unit. None: this process's own caller.
            cancel: lets another thread stop the call (:class:`Cancel`).
        Raises:
            SqlError: refused, DuckDB error, :class:`QueryTimeout` (interrupted or killed at the wall clock),
                :class:`QueryOutOfMemory`, a worker that crashed, an answer over the reply cap, too many queries
                of this client waiting, or no worker free within ``queue_wait_s``. StoreError: unreadable DB.
        """
        timeout_s = self.limits.timeout_s if timeout_s is None else float(timeout_s)
        reply_bytes = self.limits.reply_bytes if reply_bytes is None else int(reply_bytes)
        request = {
            "db": os.path.abspath(db),
            "query": query,
            "limit": int(limit),
            "timeout_s": timeout_s,
            "reply_bytes": reply_bytes,
            "value_chars": self.limits.value_chars,
        }
        # ASCII JSON escapes a character in at most 12 bytes; anything bigger is a broken worker
        max_bytes = 12 * reply_bytes + (1 << 20)
        key = client or LOCAL_CLIENT
        if cancel is not None:
            cancel._wake = self._wake
        for attempt in range(2):
            w, short = self._acquire(time.monotonic() + self.limits.queue_wait_s, key, cancel)
            try:
                if cancel is not None and not cancel._hold(w):
                    self._release(w)
                    raise cancelled()
                cut = short and self.lane_timeout_s < timeout_s  # the lane stops it sooner than asked
                if short:
                    lane_s = min(timeout_s, self.lane_timeout_s)
                    lane_request = {**request, "timeout_s": lane_s, "nice": LANE_NICE}
                    # its standby as a regular query's: only a query DuckDB cannot interrupt is killed
                    reply = self._ask(w, lane_request, lane_s, max_bytes, lane_s + STANDBY_AFTER_S)
                    if cut and (reply.get("error") or {}).get("kind") == QueryTimeout.__name__:
                        raise self._lane_timeout(key)
                else:
                    reply = self._ask(w, request, timeout_s, max_bytes)
            except QueryTimeout:
                if short and cut:
                    raise self._lane_timeout(key) from None
                raise
            except _Gone as e:
                if cancel is not None and cancel.cancelled:
                    raise cancelled() from None
                if e.before_request and attempt == 0:
                    continue  # it died while idle: the query never ran, give it to a fresh worker
                raise QueryOutOfMemory(
                    f"the query crashed its worker process ({e.how}), most likely out of memory "
                    f"(limit {self.limits.memory_bytes >> 20} MiB); the server is unaffected",
                    "Aggregate or filter before building large values (lists, string_agg, repeat).",
                ) from None
            finally:
                if cancel is not None:
                    cancel._hold(None)
                self._done(key, short)
            if "result" in reply:
                from tracer.analysis.sql.result import SqlResult

                return SqlResult.model_validate(reply["result"])
            err = reply.get("error") or {}
            cls = _ERRORS.get(err.get("kind", ""), SqlError)
            raise cls(err.get("message", "the query failed"), err.get("hint", ""))
        raise AssertionError("unreachable")  # pragma: no cover

    def _lane_timeout(self, client: str) -> QueryTimeout:
        self._bar_from_lane(client)
        return QueryTimeout(
            f"query stopped after {self.lane_timeout_s:g} s: other clients' queries held every query worker, so it "
            f"ran in the short lane, which stops a query at {self.lane_timeout_s:g} s",
            f"For {LANE_BARRED_S:g} s this client's queries wait for a regular worker (they then get the full time "
            "limit); or narrow it (WHERE, LIMIT, aggregate).",
        )

    def held(self) -> tuple[int, int]:
        """Queries holding a worker now: (regular, in the short lane)."""
        with self._cond:
            return self._held[False], self._held[True]

    def _ask(
        self, w: _Worker, request: dict[str, Any], timeout_s: float, max_bytes: int, standby_s: float | None = None
    ) -> dict[str, Any]:
        """Send ``request`` to the acquired worker ``w`` and return its answer; ``w`` is back in the pool, or
        killed and replaced, when this returns or raises. A standby worker starts if the answer has not come
        ``standby_s`` after the request (default: :data:`STANDBY_AFTER_S` past the interrupt).

        Raises:
            _Gone: the worker died (``how`` says of what). QueryTimeout, SqlError: killed at the wall clock, or
                an answer over ``max_bytes``.
        """
        start = time.monotonic()
        try:
            w.send(request)
            try:  # DuckDB is interrupted at timeout_s: an answer normally comes by then
                standby_s = timeout_s + STANDBY_AFTER_S if standby_s is None else standby_s
                reply = w.answer(start + standby_s, max_bytes)
            except _Late:
                self._standby()
                reply = w.answer(start + timeout_s + self.limits.kill_grace_s, max_bytes)
        except _Late:
            self._discard(w)
            raise QueryTimeout(
                f"query stopped after {timeout_s:g} s (its worker was killed: the time went into one long "
                "function call that DuckDB cannot interrupt)",
                "Narrow it: smaller inputs to string functions (levenshtein, repeat), WHERE, LIMIT.",
            ) from None
        except _TooBig:  # not a crash, and not memory: say what it was
            self._discard(w)
            raise SqlError(
                f"the query's answer passed {max_bytes:,} bytes, more than any reply within the cap, and was dropped",
                "Select fewer or shorter columns (short names: expr AS a), or fewer rows.",
            ) from None
        except _Gone as e:
            e.how = w.signal_name()
            self._discard(w)
            raise
        if reply.get("retire"):
            self._discard(w)
        else:
            self._release(w)
        return reply

    def close(self) -> None:
        """Kill every worker; later :meth:`run` calls raise :class:`SqlError`."""
        with self._cond:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
            self._idle.clear()
            self._cond.notify_all()
        for w in workers:  # every one signalled before any is reaped: a server's stop waits for one kill, not three
            w.signal_kill()
        for w in workers:
            w.kill()


_default: SqlPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SqlPool:
    """Return this process's pool (created unstarted on first use, closed at exit)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = SqlPool()
            atexit.register(_default.close)
        return _default
