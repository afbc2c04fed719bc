"""Issue 17, live mode with the real recorder: after a `kill -9` of `tracer record --mcp-http`, its live MCP server
stopped answering within about a second (it was found still answering 30 minutes later), taking its query workers
and the snapshots with it, while the recorded job runs on.

Real eBPF (root). tests/test_live_server_tie.py covers the same, and SIGTERM, with a stand-in recorder.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import PY, ROOT, TRACER, workload

from tracer import procfs

if os.environ.get("CI") == "true" and os.geteuid() != 0:  # CI must run this, not skip it
    pytest.fail("CI=true: tests/integration/test_live_server.py needs root (eBPF)", pytrace=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    return procfs.is_alive(pid)


def _children(pid: int) -> dict[int, str]:
    """The living children of ``pid`` and their command lines."""
    out = {}
    for child in procfs.children(pid):
        try:
            out[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return out


def test_the_live_server_dies_with_a_killed_recorder(tmp_path: Path) -> None:
    # GIVEN a training job recorded with --mcp-http, its live server answering
    port = _free_port()
    rec = subprocess.Popen(
        [str(TRACER), "record", "--db", str(tmp_path / "t.duckdb"), "--mcp-http", f"127.0.0.1:{port}", "--"]
        + [PY, workload("train.py"), "--duration", "120", "--workers", "1", "--steps", "20"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: the job is ended by it at the end
    )
    try:
        deadline = time.monotonic() + 90
        while not _listening(port):
            assert rec.poll() is None, rec.stderr.read().decode() if rec.stderr else ""
            assert time.monotonic() < deadline, "the live MCP server never listened"
            time.sleep(0.1)
        ((server, cmd),) = ((p, c) for p, c in _children(rec.pid).items() if "tracer.commands.live_server" in c)
        snapshots = Path(cmd.split()[4])
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()["status"] == "ok"
        workers = list(_children(server))
        assert workers and snapshots.name.startswith("tracer-live-") and snapshots.exists()
        # WHEN the recorder is killed outright
        os.kill(rec.pid, signal.SIGKILL)
        rec.wait()
        t = time.monotonic()
        while _alive(server) and time.monotonic() - t < 5:
            time.sleep(0.01)
        gone = time.monotonic() - t
        # THEN its server is gone within about a second, with its workers and snapshots; the port is free
        assert not _alive(server) and gone < 1.5, gone
        assert not _listening(port)
        assert not snapshots.exists()
        # AND its query workers, which wait on a pidfd of their server, exit with it
        t = time.monotonic()
        while [w for w in workers if _alive(w)] and time.monotonic() - t < 5:
            time.sleep(0.01)
        assert not [w for w in workers if _alive(w)] and time.monotonic() - t < 0.5, time.monotonic() - t
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
        try:
            os.killpg(rec.pid, signal.SIGKILL)  # the recorded job (ours), which the recorder's death left running
        except ProcessLookupError:
            pass
