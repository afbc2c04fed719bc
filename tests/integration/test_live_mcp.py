"""MCP while recording (tracer/live.py): a real MCP client asks `tracer record --mcp-http` about a recording in
progress, and gets answers over what has been flushed so far, growing as the job runs; the recording is unharmed.

Real eBPF, the real MCP SDK client over HTTP.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
from conftest import PY, ROOT, TRACER, workload

sys.path.insert(0, str(ROOT / "tests"))
from bench.hostile_corpus import call


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


def _end_job(recorder: int) -> None:
    """SIGTERM the recorded job (train.py, the recorder's child, and its workers; not the live server or the
    guardian): the recording then ends as the target exits."""
    import os
    import signal

    from tracer import procfs

    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    todo, job = [p for p in procfs.children(recorder) if b"train.py" in cmdline(p)], []
    while todo:
        pid = todo.pop()
        job.append(pid)
        todo += procfs.children(pid)
    for pid in job:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass  # gone already


def test_tools_answer_during_the_recording_and_grow_with_it(tmp_path: Path) -> None:
    # GIVEN a 25 s training job recorded with --mcp-http
    port = _free_port()
    db = tmp_path / "live.duckdb"
    rec = subprocess.Popen(
        [
            str(TRACER),
            "record",
            "--db",
            str(db),
            "--mcp-http",
            f"127.0.0.1:{port}",
            "--",
            PY,
            workload("train.py"),
            "--duration",
            "120",  # ended by the test once it has asked (a loaded machine's start-up alone can take 20 s)
            "--workers",
            "1",
            "--persistent-workers",
            "--steps",
            "20",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def calls(r) -> int:
        return sum(o["calls"] for o in r.structured_content["ops"])

    try:
        assert _wait_port(port, 90), "the live MCP server never listened"
        url = f"http://127.0.0.1:{port}/mcp"
        # WHEN get_trace_stats is asked twice, a few seconds apart, while the job runs (the first time once the
        # probes are live: the server listens before they attach, which a loaded machine can take 20 s to do)
        deadline = time.monotonic() + 90
        while True:
            first, _ = anyio.run(call, url, "get_trace_stats", {})
            assert not first.is_error, first.content
            if calls(first) > 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        # (a snapshot slower than the server's FRESH_WAIT_S on a loaded machine is served at the next call)
        deadline = time.monotonic() + 60
        while True:
            time.sleep(4)
            second, _ = anyio.run(call, url, "get_trace_stats", {})
            if second.is_error or calls(second) > calls(first) or time.monotonic() > deadline:
                break
        sql, _ = anyio.run(call, url, "run_sql", {"query": "SELECT status, flushed_ns FROM session"})
        # THEN each answers, from a snapshot of the recording in progress that grows between the two
        assert not first.is_error and not second.is_error, (first.content, second.content)
        assert not sql.is_error, sql.content
        ((status, flushed_ns),) = sql.structured_content["rows"]
        assert status == "snapshot" and flushed_ns > 0

        assert calls(second) > calls(first) > 0
        # AND the thread snapshots (taken at attach) are served live too
        dump, _ = anyio.run(call, url, "get_thread_dump", {})
        assert not dump.is_error and dump.structured_content["threads"], dump.content
    finally:
        _end_job(rec.pid)
        out, err = rec.communicate(timeout=120)
    # AND the recording itself ends normally, with its DB and no server left behind
    assert rec.returncode == 0, err
    assert "live MCP server stopped" not in err
    assert not _wait_port(port, 0.5), "the live server outlived the recording"
    import duckdb

    with duckdb.connect(str(db), read_only=True) as c:
        assert c.execute("SELECT status FROM session").fetchone()[0] == "target_exited"
