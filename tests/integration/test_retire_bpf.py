"""Bounded recorder memory (issue 21), with real eBPF: a job that forks 2,000 short-lived processes leaves nothing
of them in the recorder once they have exited, and each still has its row.

The recorder runs in a child Python (as `tracer record` does, with the same Recorder) that prints the sizes of its
per-process containers after the run; the job forks its processes and then lives on for longer than the recorder
waits before retiring an exited process, so everything it forked has retired by the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, WORKLOADS, query

from tracer.recorder.session import RETIRE_AFTER_NS

pytestmark = pytest.mark.bpf

PROCS = 2_000
RATE = 500  # starts a second: a quarter of what the lifecycle ring holds between two drains, so none is lost

_RUN = """
import json, sys
from pathlib import Path
from tracer.recorder import Recorder, RecordOptions

rec = Recorder(RecordOptions(db=Path(sys.argv[1]), command=sys.argv[2:]))
summary = rec.run()
r, py, m = rec.resolver, rec.pyrt, rec.maps
live_refs = {ref for refs in r._refs_of.values() for ref in refs}
print(json.dumps({
    "status": summary.status,
    "processes": summary.processes,
    "tree": sorted(rec.tree.procs),  # the processes it still keeps, its own (role tracer) too
    "targets": len(rec.tree.targets()),
    "threads": sorted(rec.tree.threads),
    # each per-process container's keys: pids (tids for the call counts)
    "by_pid": {
        "maps": sorted(m._maps),
        "py_targets": sorted(py.targets),
        "py_parents": sorted(py.parents),
        "py_codes": sorted(py._codes),
        "py_pending": sorted(rec._py_pending),
        "stack_refs": sorted(r._refs_of),
        "kernel_handles": sorted(r.handle_names),
        "kernels": sorted(r._kernels),
    },
    "calls_by_tid": sorted(rec._calls_by_tid),
    # stacks cached that no tracked process owns
    "orphan_stacks": len((set(r._frames) | set(r._ref_op)) - live_refs),
}))
"""


def test_forked_processes_leave_the_recorder_once_exited(tmp_path: Path) -> None:
    # GIVEN a job that forks 2,000 processes of /bin/true, then lives on past the retirement delay
    db = tmp_path / "churn.duckdb"
    linger = RETIRE_AFTER_NS / 1e9 + 2.5
    job = f"/usr/bin/python3 {WORKLOADS / 'fork_churn.py'} --procs {PROCS} --rate {RATE}; sleep {linger}"
    # WHEN the recorder records it to the end
    p = subprocess.run(
        [sys.executable, "-c", _RUN, str(db), "/bin/sh", "-c", job],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    # THEN it kept only the processes that were still running or exited within the delay (sh, sleep)...
    assert got["status"] == "target_exited" and got["processes"] >= PROCS + 2, got
    tree, threads = set(got["tree"]), set(got["threads"])
    assert got["targets"] <= 3 and len(threads) <= 3, got
    # ...and nothing of the others in any per-process cache: every key is a process (thread) it still keeps, and
    # no cached stack is left without the process that owned it
    for k, pids in got["by_pid"].items():
        assert set(pids) <= tree, (k, got)
    assert set(got["calls_by_tid"]) <= threads, got
    assert got["orphan_stacks"] == 0, got
    # ...and every forked process has its row, with its exit
    forked = {pid for (pid,) in query(db, "SELECT pid FROM processes WHERE comm = 'true'")}
    assert not forked & (tree | threads), forked & (tree | threads)
    rows = query(db, "SELECT count(*), count(exit_ns), count(exit_code) FROM processes WHERE comm = 'true'")
    notes = query(db, "SELECT notes FROM session")[0][0]
    assert rows == [(PROCS, PROCS, PROCS)], (rows, notes)
