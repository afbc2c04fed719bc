"""Shared set-up of the real-eBPF recording tests: build the stand-in CUDA libraries once, run the real
``tracer record`` as a subprocess, read what it wrote.

Everything here runs the installed recorder (``.venv/bin/tracer``) against the workloads in
``fixtures/workloads``, which call the stand-in libraries (``fixtures/build``) through ctypes and write their
exact per-process call counts to ``--counts-dir``. Nothing on the kernel side is mocked, so the suite is skipped
when not root (and fails under CI=true: tests/support/need.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import pytest

from probes.catalog import CATALOG
from tests.support.need import need_nothing_missing

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "fixtures" / "workloads"
BUILD = ROOT / "fixtures" / "build"
TRACER = ROOT / ".venv" / "bin" / "tracer"
# The Debian interpreter, not a pyenv shim: a shim is a bash script that forks ~40 helpers before the exec.
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else str(ROOT / ".venv" / "bin" / "python")

# Every exported name (versioned ones included: cuMemAlloc_v2) -> the op name the catalog stores.
SYMBOL_TO_OP: dict[str, str] = {sym: spec.op for spec in CATALOG for sym in spec.symbols}


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (BPF and uprobes)"
    if not TRACER.exists():
        return "tracer is not installed in .venv"
    return None


@pytest.fixture(scope="session", autouse=True)
def built_fixtures() -> Path:
    """Build fixtures/ once per session (make is a no-op when up to date); skip everything when not root."""
    need_nothing_missing(_why_not())
    subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT / "fixtures")], check=True)
    assert (BUILD / "libcudart.so.12").exists() and (BUILD / "libcuda.so.1").exists()
    return BUILD


def record(args: list[str], timeout: float = 90, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run ``tracer record ARGS`` to completion; return the finished process (text stdout/stderr)."""
    return subprocess.run(
        [str(TRACER), "record", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw
    )


def start_record(args: list[str], verbose: bool = False) -> subprocess.Popen[str]:
    """Start ``tracer [-v] record ARGS`` in the background (stderr piped, line by line)."""
    cmd = [str(TRACER), *(["-v"] if verbose else []), "record", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, cwd=ROOT)


def workload(name: str) -> str:
    return str(WORKLOADS / name)


@contextmanager
def open_db(path: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    """Open a recorded DB read-only (as an analysis would)."""
    conn = duckdb.connect(str(path), read_only=True)
    try:
        yield conn
    finally:
        conn.close()


def query(path: Path, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with open_db(path) as c:
        return c.execute(sql, params or []).fetchall()


def read_counts(counts_dir: Path) -> list[dict[str, Any]]:
    """Return the workload's per-process counts files (``{"pid", "ppid", "comm", "counts"}``)."""
    return [json.loads(p.read_text()) for p in sorted(counts_dir.glob("*.json"))]


def expected_ops(counts_dir: Path, pids: set[int] | None = None) -> dict[str, int]:
    """Return the workload's own call counts summed per catalog op (ops the catalog does not probe dropped)."""
    total: Counter[str] = Counter()
    for f in read_counts(counts_dir):
        if pids is not None and f["pid"] not in pids:
            continue
        for sym, n in f["counts"].items():
            if sym in SYMBOL_TO_OP:
                total[SYMBOL_TO_OP[sym]] += n
    return dict(total)


def recorded_ops(db: Path, pids: set[int] | None = None) -> dict[str, int]:
    """Return op_stats calls summed per op over every pid (or over ``pids``)."""
    rows = query(db, "SELECT pid, op, sum(calls) FROM op_stats GROUP BY pid, op")
    total: Counter[str] = Counter()
    for pid, op, n in rows:
        if pids is None or pid in pids:
            total[op] += int(n)
    return dict(total)


def wait_sleeping(pid: int, timeout: float = 20) -> None:
    """Block until ``pid`` sits in a nanosleep (a workload's --start-delay), so it can be stopped there."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            nr = Path(f"/proc/{pid}/syscall").read_text().split()[0]
        except (OSError, IndexError):
            wchan, nr = "", ""
        if "nanosleep" in wchan or nr in ("35", "230"):  # x86-64 nanosleep / clock_nanosleep
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} never reached its start delay")


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float = 90) -> list[str]:
    """Read ``proc``'s stderr until a line contains ``needle``; return the lines read."""
    assert proc.stderr is not None
    lines: list[str] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} on the recorder's stderr; got:\n{''.join(lines)}")
