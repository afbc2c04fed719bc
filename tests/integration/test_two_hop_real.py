"""Real eBPF, issue 28: a two-hop wait. lock_io.py's training loop waits on a lock that its reader thread holds
while blocked reading from a named pipe whose writer, the storage service, is a process outside the traced job.
The lock chain must be HIGH or MEDIUM, and its wait path must go training thread -> the reader (woken_by) -> an
external wait at the reader's read line, naming the storage process; in every recording (RUNS of them), since a
diagnosis that flips between runs of the same job is not one a user can act on.

Ground truth, untraced, measured here before the recordings (the shorter of two runs each): the loop's wall time
with and without the reader. On the 2-vCPU VM under the other tests' load (2026-11-28): 1.58-1.68 s without,
2.67-2.77 s with it for 300 steps, 37-41% lost. The chain counts the lock waits alone: expected within
[0.7, 1.25] x the loss share, as test_stack_chains_real.py holds lock_wait.py's.
"""

from __future__ import annotations

import os
import re
import subprocess
from contextlib import contextmanager

import pytest
from _helpers import PY, ROOT_FOUND_MIN, WORKLOADS, ensure_fixtures, record, skip_without_bpf
from test_stack_chains_real import marker_line

from tracer.analysis.chains import compute_chains

pytestmark = pytest.mark.bpf

SCRIPT = str(WORKLOADS / "lock_io.py")
RUNS = 3


@contextmanager
def storage(tmp_path, name: str):
    """A named pipe and the storage service writing to it, started here: outside any traced tree."""
    fifo = tmp_path / f"{name}.fifo"
    os.mkfifo(fifo)
    feeder = subprocess.Popen([str(PY), SCRIPT, "--feed", str(fifo)])
    try:
        yield str(fifo), feeder.pid
    finally:
        feeder.kill()
        feeder.wait()


def untraced_wall(*args: str) -> float:
    out = subprocess.run([str(PY), SCRIPT, *args], capture_output=True, text=True, timeout=120, check=True).stderr
    return float(re.search(r"wall=([0-9.]+)s", out).group(1))


@pytest.fixture(scope="module")
def two_hop(tmp_path_factory):
    skip_without_bpf()
    ensure_fixtures()
    d = tmp_path_factory.mktemp("two-hop")
    without = min(untraced_wall("--no-reader") for _ in range(2))
    walls = []
    for i in range(2):
        with storage(d, f"truth{i}") as (fifo, _):
            walls.append(untraced_wall("--fifo", fifo))
    truth = 1 - without / min(walls)
    runs = []
    for i in range(RUNS):
        with storage(d, f"rec{i}") as (fifo, feeder_pid):
            r = record(d / f"two-hop-{i}.duckdb", [str(PY), SCRIPT, "--fifo", fifo], timeout=300)
        runs.append((r, feeder_pid))
    return runs, truth


def test_the_lock_chain_follows_the_holder_to_its_read_from_outside_the_job(two_hop):
    runs, truth = two_hop
    wait, io = marker_line("lock_io.py", "LOCK_WAIT"), marker_line("lock_io.py", "LOCK_IO")
    for r, feeder_pid in runs:
        reader = int(re.search(r"reader_tid=(\d+)", r.output).group(1))
        with r.conn() as c:
            res = compute_chains(c, limit=100)
        ch = next((x for x in res.chains if x.category == "lock_contention"), None)
        assert ch is not None, [(x.category, x.severity, x.summary) for x in res.chains]
        assert ch.severity in ("HIGH", "MEDIUM") and 0.7 * truth <= ch.share <= 1.25 * truth, (ch.share, truth)
        # training thread -> the reader, which woke it -> the reader's read, ended by the storage process
        assert [(h.tid, h.edge) for h in ch.path] == [(r.pid, "start"), (reader, "woken_by")], ch.path
        assert ch.path[0].role == "training" and ch.path[0].site.endswith(f"lock_io.py:{wait} main")
        # the reader woke the thread from (nearly) all its lock waits: its hop carries the first hop's share. Both
        # are of ALL the thread's lost time, whose other parts (waits for a CPU) grow with the machine's load: 0.90
        # on a quiet VM, 0.73 in a suite run under two loads, where an absolute >= 0.8 failed
        assert ch.path[1].share >= 0.95 * ch.path[0].share and ch.path[1].state == "blocked", ch.path
        assert ch.root.kind == "external_wait" and ch.root.site.endswith(f"lock_io.py:{io} fetch"), ch.root
        assert f"storage_feed (pid {feeder_pid}), a process outside the job" in ch.root.detail, ch.root
        assert " in read " in ch.root.detail
        # and the training thread's lost time has its root found
        assert res.coverage.root_found_share >= ROOT_FOUND_MIN, res.coverage
