"""MCP while recording (tracer/live.py): a real MCP client asks `tracer record --mcp-http` about a recording in
progress, and gets answers over what has been flushed so far, growing as the job runs; the recording is unharmed.

Real eBPF, the real MCP SDK client over HTTP.
"""

from __future__ import annotations

import signal
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
    # GIVEN a training job recorded with --mcp-http
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


def test_the_node_agent_answers_live_over_mcp_about_a_job_started_after_it(tmp_path: Path) -> None:
    """`tracer record --mcp-http` with no target (the node agent): a job started after it is answered about live,
    by pid, with its exact call counts (its own, written at exit) and its known HIGH cause (allocation_churn,
    test_diagnosis_real's alloc scenario), while the agent goes on recording."""
    from conftest import read_counts

    port = _free_port()
    counts = tmp_path / "counts"
    counts.mkdir()
    rec = subprocess.Popen(
        [str(TRACER), "record", "--db", str(tmp_path / "node.duckdb"), "--mcp-http", f"127.0.0.1:{port}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    job = None
    try:
        assert rec.stderr is not None
        for line in rec.stderr:  # GIVEN the agent is attached, with no CUDA job of ours yet
            if "tracing every CUDA process" in line:
                break
        else:
            raise AssertionError(f"the agent exited early: {rec.wait()}")
        assert _wait_port(port, 90), "the live MCP server never listened"
        url = f"http://127.0.0.1:{port}/mcp"
        # WHEN a job starts after it (ahead of a shared machine's other tenants: nice -15) and ends
        cmd = ["nice", "-n", "-15", PY, workload("alloc_stress.py"), "--iterations", "1000"]
        job = subprocess.Popen([*cmd, "--counts-dir", str(counts)], stdout=subprocess.DEVNULL)
        assert job.wait(timeout=120) == 0
        ((own,),) = [[c["counts"] for c in read_counts(counts) if c["pid"] == job.pid]]

        # THEN get_trace_stats for its pid, live, has its exact call counts (a snapshot a second or two behind: a
        # loaded recorder's may not come within the server's wait, which then answers from the one before, where
        # the job may not be yet)
        def malloc_calls() -> int:
            r, _ = anyio.run(call, url, "get_trace_stats", {"pid": job.pid})
            if r.is_error and "is not in this trace" in r.content[0].text:
                return -1
            assert not r.is_error, r.content
            return sum(o["calls"] for o in r.structured_content["ops"] if o["op"] == "cudaMalloc")

        deadline = time.monotonic() + 60
        while (n := malloc_calls()) != own["cudaMalloc"] and time.monotonic() < deadline:
            time.sleep(1)
        assert n == own["cudaMalloc"]
        # AND get_causal_chains for it names its cause, HIGH
        r, _ = anyio.run(call, url, "get_causal_chains", {"pid": job.pid, "limit": 100})
        assert not r.is_error, r.content
        assert ("allocation_churn", "HIGH") in {(c["category"], c["severity"]) for c in r.structured_content["chains"]}
        # AND the agent runs on until stopped, then ends normally with no server left behind
        assert rec.poll() is None
        rec.send_signal(signal.SIGINT)
        out, err = rec.communicate(timeout=120)
        assert rec.returncode == 0, err
        assert not _wait_port(port, 0.5), "the live server outlived the recording"
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        if rec.poll() is None:
            rec.kill()
            rec.wait()


def test_a_hung_job_gets_its_hang_chain_live(tmp_path: Path) -> None:
    """Issue 29: attached to a job that is already hung (hang.py deadlock: two threads each wait for the lock the
    other holds, the main thread joins them), with --mcp-http, the hang chain and the thread dump are served while
    the recording runs, within its first seconds."""
    import re

    hang = Path(workload("hang.py"))
    marks = {m[1]: i for i, x in enumerate(hang.read_text().splitlines(), 1) if (m := re.search(r"# ([A-Z_]+)$", x))}
    job = subprocess.Popen([PY, str(hang), "deadlock"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    rec = None
    try:
        assert job.stdout is not None
        line = job.stdout.readline()
        assert "stuck" in line, line
        port = _free_port()
        db = tmp_path / "hung.duckdb"
        rec = subprocess.Popen(
            [str(TRACER), "record", "--pid", str(job.pid), "--duration", "30", "--db", str(db),
             "--mcp-http", f"127.0.0.1:{port}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert _wait_port(port, 90), "the live MCP server never listened"
        url = f"http://127.0.0.1:{port}/mcp"
        t0 = time.monotonic()
        hang_chain = None
        while hang_chain is None and time.monotonic() - t0 < 20:
            # the server listens while the recorder still attaches: an early snapshot has no process yet
            r, _ = anyio.run(call, url, "get_causal_chains", {})
            assert not r.is_error, r.content
            hang_chain = next((c for c in r.structured_content["chains"] if c["category"] == "hang"), None)
            if hang_chain is None:
                time.sleep(1)
        waited = time.monotonic() - t0
        # THEN the live recording names the deadlock, each thread at its line, seconds after the server listens
        assert hang_chain is not None, "no hang chain within 20 s of the live server listening"
        assert hang_chain["severity"] == "HIGH" and "deadlock" in hang_chain["summary"]
        for mark in ("STUCK_A", "STUCK_B"):
            assert f"hang.py:{marks[mark]} " in hang_chain["summary"]
        # AND get_thread_dump serves every stuck thread's line from the snapshots, live
        dump, _ = anyio.run(call, url, "get_thread_dump", {"pid": job.pid})
        assert not dump.is_error, dump.content
        lines = {f["line"] for t in dump.structured_content["threads"] for f in t["frames"][:1]}
        assert {marks["STUCK_A"], marks["STUCK_B"]} <= lines
        print(f"hang chain served live {waited:.1f} s after the server listened")
    finally:
        if rec is not None:
            rec.terminate()
            rec.communicate(timeout=120)
        job.kill()
        job.wait()
    assert rec.returncode == 0 or rec.returncode == 130, rec.returncode
