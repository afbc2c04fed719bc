"""Issue 30: a client that disconnects mid-call leaves no work behind.

Before, a disconnected client's run_sql query ran on in its worker to the 10 s limit, and compare_traces on a
crafted recording (or compare_processes on a long list) in the server until its budget or SIGTERM (337
CPU-seconds measured). Each test serves a recording over real HTTP, calls a tool that burns CPU through the
SDK's client, leaves after 1.5 s, and reads the CPU time the work uses afterwards from /proc: a bound the old
code breaks on any box (it kept a core busy), and that holds on a loaded one (the fix leaves nothing running).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import duckdb
from mcp import Client
from tracedb import build

from tests.support.serving import wait_healthy
from tracer import procfs

REPO = Path(__file__).resolve().parent.parent
SERVE = "import sys; from mcp_server.http import serve_http; serve_http(sys.argv[1], '127.0.0.1', int(sys.argv[2]))"
BURN_SQL = "SELECT count(*) FROM range(100000000000) t(x) WHERE hash(x) % 7 = 3"  # minutes of CPU, interruptible
LEAVE_AFTER_S = 1.5
WINDOW_S = 3.0  # CPU is read over this long, from 1 s after the client left
CPU_AFTER = 0.3  # CPU-seconds the server may use in the window (the old code: about a core's worth, 3 s)


def cpu_s(pid: int) -> float | None:
    """CPU time (user + system) of ``pid`` in seconds; None once it is gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if f[0] == "Z":
        return None
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def served(db: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(db), str(port)], cwd=REPO, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        yield proc, f"{base}/mcp"
    finally:
        proc.kill()
        proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call_and_leave(url: str, tool: str, args: dict[str, Any]) -> bool:
    """Call ``tool`` and disconnect after LEAVE_AFTER_S; True if it was still running then."""

    async def go() -> bool:
        with anyio.move_on_after(LEAVE_AFTER_S) as scope:
            async with Client(url, read_timeout_seconds=120) as c:
                await c.call_tool(tool, args)
        return scope.cancelled_caught

    return anyio.run(go)


def warm(url: str) -> None:
    async def go() -> None:
        async with Client(url) as c:
            assert not (await c.call_tool("run_sql", {"query": "select 1"})).is_error
            assert not (await c.call_tool("get_trace_stats", {})).is_error

    anyio.run(go)


def test_a_disconnected_clients_query_is_stopped(tmp_path: Path):
    # GIVEN a served recording, its query workers started
    db = tmp_path / "t.duckdb"
    build("healthy", db)
    with served(db) as (proc, url):
        warm(url)
        workers = procfs.children(proc.pid)
        before = {p: cpu_s(p) or 0.0 for p in workers}
        # WHEN a client sends a query that runs for minutes and leaves after 1.5 s
        assert call_and_leave(url, "run_sql", {"query": BURN_SQL})
        left = time.monotonic()
        busy = max(workers, key=lambda p: (cpu_s(p) or 1e9) - before[p])  # gone (killed) counts as the busy one
        time.sleep(1.0)
        # THEN the worker running it is stopped at once (before, it ran to the 10 s limit)
        start = cpu_s(busy)
        time.sleep(WINDOW_S)
        end = cpu_s(busy)
        used = 0.0 if start is None or end is None else end - start
        assert used < CPU_AFTER, f"the query's worker used {used:.2f} CPU-s in {WINDOW_S:g} s after its client left"
        assert time.monotonic() - left < 10  # measured before the old code's interrupt would have stopped it
        warm(url)  # and the server answers the next client


def test_a_disconnected_clients_compare_traces_is_stopped(tmp_path: Path):
    # GIVEN a recording next to the served one whose cuda_calls is a view that burns CPU (minutes per scan)
    build("healthy", tmp_path / "a.duckdb")
    build("healthy", tmp_path / "crafted.duckdb")
    with duckdb.connect(str(tmp_path / "crafted.duckdb")) as c:
        c.execute("ALTER TABLE cuda_calls RENAME TO cc_real")
        c.execute(
            "CREATE VIEW cuda_calls AS SELECT c.* FROM cc_real c, range(5000000) r "
            "WHERE r.range = 0 OR hash(r.range, c.ts_ns) = 0"
        )
    with served(tmp_path / "a.duckdb") as (proc, url):
        warm(url)
        # WHEN a client compares against it and leaves after 1.5 s
        assert call_and_leave(url, "compare_traces", {"before": "crafted.duckdb"})
        time.sleep(1.0)
        # THEN the server's CPU goes quiet (before: it burned on to the 30 s budget, 337 s before the budget)
        start = cpu_s(proc.pid)
        time.sleep(WINDOW_S)
        end = cpu_s(proc.pid)
        assert start is not None and end is not None
        assert end - start < CPU_AFTER, (
            f"the server used {end - start:.2f} CPU-s in {WINDOW_S:g} s after the client left"
        )
        warm(url)
