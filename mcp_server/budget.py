"""A tool call's work stops: past its time budget, or once its client has left (issue 30).

A crafted recording (cuda_calls a CPU-burning view) kept compare_traces busy for 300 s in the server, and
compare_processes(pids=[3247]*2000) for 20 s; a client that disconnected left run_sql's query running to its
timeout. So every tool's DuckDB work runs under :func:`budget`, which interrupts its connections past the budget or
when the call is cancelled, and heavy sync tools are :func:`cancellable`: they run in a thread whose work
:class:`Stop` ends when the SDK cancels the call.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

import anyio
import duckdb

from tracer.analysis.sql.pool import Cancel
from tracer.errors import TracerError

P = ParamSpec("P")
T = TypeVar("T")
# an analysis answers in well under a second on a real recording; a recording this slow to read is damaged or
# crafted (the server's own default; a server's limits may set another, mcp_server.state.ToolLimits)
TOOL_BUDGET_S = 30.0


class Stop:
    """Stops one tool call's work once its client has left: interrupts the DuckDB connections under
    :func:`budget` in the call's thread, and cancels its run_sql query (:class:`tracer.analysis.sql.pool.Cancel`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stopped = False
        self._conns: list[duckdb.DuckDBPyConnection] = []
        self.sql = Cancel()

    def add(self, conns: Sequence[duckdb.DuckDBPyConnection]) -> bool:
        """Interrupt ``conns`` when the call is stopped; False if it is already (nothing more should run)."""
        with self._lock:
            self._conns.extend(conns)
            return not self.stopped

    def remove(self, conns: Sequence[duckdb.DuckDBPyConnection]) -> None:
        with self._lock:
            for c in conns:
                if c in self._conns:
                    self._conns.remove(c)

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            conns = list(self._conns)
        self.sql.cancel()
        for c in conns:
            try:
                c.interrupt()
            except duckdb.Error:  # closed meanwhile
                pass


# the current tool call's Stop, set by in_thread: anyio runs the thread in a copy of the caller's context
_call_stop: ContextVar[Stop | None] = ContextVar("tracer_call_stop", default=None)


def call_stop() -> Stop | None:
    """The running tool call's :class:`Stop`; None outside :func:`in_thread` (a sync tool the SDK runs itself)."""
    return _call_stop.get()


async def in_thread(fn: Callable[[], T], limiter: anyio.CapacityLimiter | None = None) -> T:
    """Run ``fn`` in a worker thread; if the call is cancelled (its client disconnected, the server stopping),
    stop its work (:class:`Stop`) and leave the thread to end, which it then does within moments."""
    stop = Stop()
    token = _call_stop.set(stop)
    try:
        return await anyio.to_thread.run_sync(fn, limiter=limiter, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        stop.stop()
        raise
    finally:
        _call_stop.reset(token)


def cancellable(fn: Callable[P, T]) -> Callable[P, Awaitable[T]]:
    """A sync tool made async so its work stops when the client leaves: the SDK runs a sync tool in a thread it
    waits for (cancelling the call waits too), so a heavy tool ran on after its client was gone."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        return await in_thread(functools.partial(fn, *args, **kwargs))

    return call


@contextmanager
def budget(*conns: duckdb.DuckDBPyConnection, seconds: float = TOOL_BUDGET_S) -> Iterator[None]:
    """Interrupt the DuckDB work on ``conns`` once ``seconds`` have passed, or once the call's client has left
    (:class:`Stop`): the tool then fails with :func:`over_budget` rather than burning the server's CPU."""
    stop = _call_stop.get()
    if stop is not None and not stop.add(conns):
        stop.remove(conns)
        raise duckdb.InterruptException("the call was cancelled")
    timer = threading.Timer(seconds, lambda: [c.interrupt() for c in conns])
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if stop is not None:
            stop.remove(conns)


def over_budget(seconds: float = TOOL_BUDGET_S) -> TracerError:
    """The error of a call :func:`budget` stopped after ``seconds``."""
    return TracerError(
        f"the analysis was stopped after {seconds:g} s, its time budget: a recording this slow to read is "
        "damaged or crafted",
        "Check the recording (tracer info FILE), or record again.",
    )
