"""Issue 17, live mode: the live MCP server (tracer/live.py) never outlives its recorder, and stops within a
second of SIGTERM even with a tool call in flight.

No eBPF needed: the recorder's half is the real :class:`tracer.live.LiveServer`, in a stand-in recorder process
whose snapshots are copies of a hand-built trace DB (tests/integration/test_live_server.py does the same with a
real `tracer record`). A tool call waits for a snapshot the stand-in never takes (up to FRESH_WAIT_S), which is
what made the server slow to stop.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from tracedb import build

from bench.hostile_corpus import call
from tracer import procfs

REPO = Path(__file__).resolve().parent.parent
RECORDER = """
import shutil, sys, time
from tracer.live import LiveServer
live = LiveServer(sys.argv[2], None, lambda p: shutil.copy(sys.argv[1], p))
live.start()
print(live.proc.pid, live.dir, flush=True)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("live") / "trace.duckdb"
    build("healthy", p)
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    return procfs.is_alive(pid)


def children(pid: int) -> list[int]:
    return procfs.children(pid)


def wait_gone(pid: int, timeout_s: float) -> float | None:
    """Seconds until ``pid`` is gone (or a zombie), None if it is still there after ``timeout_s``."""
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        if not alive(pid):
            return time.monotonic() - t
        time.sleep(0.01)
    return None


@contextmanager
def recorder(db: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path, str]]:
    """A stand-in recorder serving ``db`` live; yields it, its server's pid, the snapshot dir and the MCP URL.
    Whatever is left is killed at the end."""
    port = free_port()
    rec = subprocess.Popen(
        [sys.executable, "-c", RECORDER, str(db), f"127.0.0.1:{port}"], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert rec.stdout is not None
    pid, snapshots = rec.stdout.readline().split()
    server, where = int(pid), Path(snapshots)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert alive(server), (where / "server.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the live server did not start"
            time.sleep(0.1)
        yield rec, server, where, f"http://127.0.0.1:{port}/mcp"
    finally:
        for p in (server, rec.pid):
            if alive(p):
                os.kill(p, signal.SIGKILL)
        rec.wait()
        shutil.rmtree(where, ignore_errors=True)


def listening(url: str) -> bool:
    try:
        httpx.get(url.replace("/mcp", "/healthz"), timeout=1)
        return True
    except httpx.HTTPError:
        return False


def test_the_live_server_dies_with_its_recorder_killed(db: Path):
    with recorder(db) as (rec, server, snapshots, url):
        r, _ = anyio.run(call, url, "get_trace_stats", {})
        assert not r.is_error  # it serves
        workers = children(server)
        assert workers
        # WHEN the recorder is killed outright
        os.kill(rec.pid, signal.SIGKILL)
        rec.wait()
        # THEN its server follows within about a second, with its query workers and the snapshots
        gone = wait_gone(server, 5)
        assert gone is not None and gone < 1.5, gone
        assert not listening(url)
        assert not snapshots.exists()
        # AND its query workers, which wait on a pidfd of their server, exit with it
        last = max(wait_gone(w, 5) or 0.0 for w in workers) if workers else 0.0
        assert not [w for w in workers if alive(w)] and last < 0.5, last


def test_the_live_server_stops_within_a_second_of_sigterm(db: Path):
    with recorder(db) as (_, server, _snapshots, url):
        started = threading.Event()

        def in_flight() -> None:
            async def go() -> None:
                from mcp import Client

                async with Client(url) as c:
                    started.set()
                    await c.call_tool("get_trace_stats", {})  # waits for a snapshot that never comes

            try:
                anyio.run(go)
            except Exception:  # the server goes away under it
                pass

        threading.Thread(target=in_flight, daemon=True).start()
        assert started.wait(30)
        time.sleep(0.3)
        t = time.monotonic()
        os.kill(server, signal.SIGTERM)
        gone = wait_gone(server, 5)
        assert gone is not None and gone < 1.0, (gone, time.monotonic() - t)
        assert not listening(url)


def test_a_server_started_after_its_recorder_died_does_not_serve(tmp_path: Path):
    # the recorder's death before the parent-death signal is armed: caught by the parent pid check
    snapshots = tmp_path / "tracer-live-x"
    snapshots.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "tracer.commands.live_server", "1", str(snapshots), "mcp", "serve", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "the recorder is gone" in r.stderr
    assert not snapshots.exists()
