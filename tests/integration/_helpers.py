"""Shared helpers for the real-eBPF recording tests: record a workload with ``tracer record`` (optionally with
a CPU hog pinned next to it), open the DB, and cache each scenario so modules that need the same recording
share it within one pytest session."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from tests.support.need import need_nothing_missing

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "fixtures" / "workloads"
PY = ROOT / ".venv" / "bin" / "python"
TRACER = ROOT / ".venv" / "bin" / "tracer"
HOG_NAME = "hogzilla"
HOG_THREADS = 3

_cache: dict[str, Recording] = {}


def bpf_available() -> str | None:
    """Return why real recordings cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if not TRACER.exists():
        return "tracer not installed in .venv"
    if not os.path.exists(f"/lib/modules/{os.uname().release}/build"):
        return "no kernel headers"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc not importable"
    return None


def skip_without_bpf() -> None:
    need_nothing_missing(bpf_available())


def ensure_fixtures() -> None:
    subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT / "fixtures")], check=True)


@dataclass
class Recording:
    db: Path
    pid: int  # the target's pid (the recorded command's process)
    hog_pid: int | None = None
    output: str = ""

    def conn(self) -> duckdb.DuckDBPyConnection:
        return duckdb.connect(str(self.db), read_only=True)

    def q(self, sql: str, params: list | None = None) -> list[tuple]:
        with self.conn() as c:
            return c.execute(sql, params or []).fetchall()

    def one(self, sql: str, params: list | None = None):
        rows = self.q(sql, params)
        return rows[0][0] if rows else None


def workload(name: str, *args: str) -> list[str]:
    return [str(PY), str(WORKLOADS / name), *args]


def start_hog(seconds: float, cpu: int = 0, name: str = HOG_NAME, threads: int = 1) -> subprocess.Popen:
    """Start cpu_hog.py pinned to ``cpu``, outside any traced tree; wait until it has renamed itself."""
    p = subprocess.Popen(
        [
            "taskset",
            "-c",
            str(cpu),
            str(PY),
            str(WORKLOADS / "cpu_hog.py"),
            "--seconds",
            str(seconds),
            "--name",
            name,
            "--threads",
            str(threads),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{p.pid}/comm").read_text().strip() == name:
                break
        except OSError:
            break
        time.sleep(0.02)
    return p


def record(
    db: Path,
    cmd: list[str],
    *,
    duration: float | None = None,
    hog_seconds: float | None = None,
    timeout: float = 120,
) -> Recording:
    """``tracer record --db db --force -- cmd``; with ``hog_seconds`` a hog runs pinned on CPU 0 meanwhile."""
    hog = start_hog(hog_seconds, threads=HOG_THREADS) if hog_seconds else None
    try:
        args = [str(TRACER), "record", "--db", str(db), "--force"]
        if hog is not None and (os.cpu_count() or 1) > 1:
            args = ["taskset", "-c", f"1-{os.cpu_count() - 1}", *args]  # keep the recorder off the hog's CPU
        if duration:
            args += ["--duration", str(duration)]
        r = subprocess.run([*args, "--", *cmd], capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    con = duckdb.connect(str(db), read_only=True)
    try:
        from tracer.analysis.stats import main_pid

        pid = main_pid(con)
    finally:
        con.close()
    assert pid, out
    return Recording(db=db, pid=pid, hog_pid=hog.pid if hog else None, output=out)


def cached(name: str, tmp_path_factory, cmd: list[str], **kw) -> Recording:
    """Record scenario ``name`` once per pytest session (modules that need the same recording share it)."""
    if name not in _cache:
        skip_without_bpf()
        ensure_fixtures()
        d = tmp_path_factory.mktemp(f"rec-{name}")
        _cache[name] = record(d / f"{name}.duckdb", cmd, **kw)
    return _cache[name]


# The scenarios, each a few seconds of workload. The hog runs on CPU 0 and so does the target (taskset).
SCENARIOS: dict[str, dict] = {
    # train.py (one persistent worker) pinned on CPU 0 with a 3-thread hog on CPU 0; the recorder on CPU 1. Each
    # step queues 20 ms of device time (20 kernels of 1 ms), more than its host work takes even when CPU 0 is
    # shared four ways and the suite loads the other: every sync sleeps, and its wakeup waits for the CPU the hog
    # holds. With one-wave kernels (20 us) a slowed host found the queue drained, no sync slept, and the calls'
    # run-queue time read 0 (issue 31, a loaded full run)
    "contention": dict(
        cmd=[
            "taskset",
            "-c",
            "0",
            *workload(
                "train.py",
                "--workers",
                "1",
                "--epochs",
                "1",
                "--steps",
                "150",
                "--worker-cpu-ms",
                "0.5",
                "--persistent-workers",
                "--kernel-us",
                "1000",
            ),
        ],
        hog_seconds=120,
    ),
    "sync": dict(cmd=workload("sync_heavy.py", "--steps", "60")),
    "train_workers": dict(cmd=workload("train.py", "--workers", "2", "--epochs", "3", "--steps", "10")),
    "respawn": dict(cmd=workload("train.py", "--epochs", "4", "--respawn-workers")),
    "memory": dict(cmd=workload("memory_pressure.py", "--gb", "1")),
    "alloc": dict(cmd=workload("alloc_stress.py")),
    "healthy": dict(cmd=workload("healthy.py")),
    # a non-main thread makes the CUDA syncs: sync_heavy's loop run from a threading.Thread
    "thread": dict(
        cmd=[
            str(PY),
            "-c",
            (
                f"import sys, threading; sys.path.insert(0, {str(WORKLOADS)!r})\n"
                "import sync_heavy\n"
                "t = threading.Thread(target=sync_heavy.main, args=(['--steps', '40'],), name='cuda-worker')\n"
                "t.start(); t.join()\n"
            ),
        ],
    ),
}


def scenario(name: str, tmp_path_factory) -> Recording:
    s = dict(SCENARIOS[name])
    cmd = s.pop("cmd")
    return cached(name, tmp_path_factory, cmd, **s)


def tracer_json(*args: str) -> dict:
    """Run ``tracer ARGS --json`` and parse stdout."""
    r = subprocess.run([str(TRACER), *args, "--json"], capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def alloc_site_line() -> int:
    """The line of alloc_stress.py marked ``# ALLOC_SITE``."""
    for i, line in enumerate((WORKLOADS / "alloc_stress.py").read_text().splitlines(), 1):
        if re.search(r"\S.*#\s*ALLOC_SITE\s*$", line):  # a code line ending in the marker, not the docstring
            return i
    raise AssertionError("no # ALLOC_SITE marker in alloc_stress.py")


# issue 28's bound: on every diagnosis fixture, the share of the training thread's lost time whose root the wait-for
# graph found (coverage.root_found_share)
ROOT_FOUND_MIN = 0.9


def assert_root_found(db: Path | str) -> None:
    """Assert that the recording's training thread has at least ROOT_FOUND_MIN of its lost time's root found."""
    from tracer.analysis.chains import compute_chains
    from tracer.analysis.db import open_trace

    with open_trace(db) as c:
        cv = compute_chains(c, limit=100).coverage
    assert cv is not None, "no training thread"
    assert cv.root_found_share >= ROOT_FOUND_MIN, (
        cv.root_found_share,
        cv.lost_share,
        [(p.part, p.share, p.root) for p in cv.parts],
    )
