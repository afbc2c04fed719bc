"""tracer.recorder.store's write-failure path (issue 11): after the first failed write the store stops writing, marks
the
session (disk_full when the disk is full), closes DuckDB, and the process exits on the StoreError with no
nanobind "leaked" report and no abort; what was committed before stays readable and says how it ended.

The writer runs in a child process: the leak report and the abort happen at interpreter exit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import pytest

from tests.support.need import need, need_root
from tracer.analysis.db import open_trace, recording_state

REPO = Path(__file__).resolve().parent.parent

# Writes one committed batch, then bigger and bigger ones until the store fails; exits 5 on the StoreError the
# way `tracer record` does (its message on stderr), without calling close(): the store must not need it.
WRITER = textwrap.dedent(
    """
    import resource, signal, sys, time
    from pathlib import Path
    import numpy as np
    from tracer.errors import StoreError
    from tracer.recorder.store import Store

    path, fsize = Path(sys.argv[1]), int(sys.argv[2])
    s = Store(path)
    s.execute("INSERT INTO session (session_id, status) VALUES (1, 'recording')")
    n = 1000
    cols = lambda k, n: {"ts_ns": np.arange(n) + k, "dur_ns": np.full(n, 5), "pid": np.full(n, 1),
                         "tid": np.full(n, 1), "op": ["cudaMalloc"] * n}
    s.put("cuda_calls", cols(0, n))
    s.sync()
    print("committed", n, flush=True)
    if fsize:  # a file-size limit instead of a full disk: writes past it fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    try:
        for i in range(1, 10_000):
            s.put("cuda_calls", cols(i * 10**9, 20_000))
            time.sleep(0.005)
    except StoreError as e:
        print(f"error: {e.message}", file=sys.stderr)
        print(f"  {e.hint}", file=sys.stderr)
        sys.exit(5)
    sys.exit(0)
    """
)


def run_writer(db: Path, fsize: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WRITER, str(db), str(fsize)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def check_clean_exit(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == 5, (p.returncode, p.stderr[-2000:])
    assert p.stdout.startswith("committed 1000")
    for bad in ("nanobind", "leaked", "terminate called", "Traceback", "FATAL"):
        assert bad not in p.stderr, p.stderr[-2000:]
    assert "error: " in p.stderr


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only): the full disk of the issue."""
    need_root("mounting a tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    need(mount.returncode == 0, f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full(tiny_tmpfs):
    # GIVEN a store on a 1 MiB file system  WHEN its writes fill it
    db = tiny_tmpfs / "t.duckdb"
    p = run_writer(db)
    # THEN one clear error, exit 5, and a clean interpreter exit (no leak report, no abort)
    check_clean_exit(p)
    assert "the disk holding" in p.stderr and "is full" in p.stderr and "tracer stats --db" in p.stderr
    # AND the committed rows are readable, and the DB says it ended on a full disk
    with open_trace(db) as c:
        assert c.execute("SELECT count(*) FROM cuda_calls").fetchone()[0] >= 1000
        st = recording_state(c)
    assert st.status == "disk_full" and not st.finished and "disk filled up" in st.ended


def test_write_failure_without_a_full_disk(tmp_path):
    # GIVEN a file-size limit (EFBIG): a write failure that is not a full disk
    db = tmp_path / "t.duckdb"
    p = run_writer(db, fsize=600_000)
    check_clean_exit(p)
    assert f"writing {db} failed" in p.stderr
    # THEN the committed rows are readable; the status says failed, or (if even that row could not be written)
    # stays 'recording' with no recorder alive, which readers report as gone
    with duckdb.connect(str(db), read_only=True) as c:
        assert c.execute("SELECT count(*) FROM cuda_calls").fetchone()[0] >= 1000
    with open_trace(db) as c:
        st = recording_state(c)
    assert st.status in ("failed", "recording") and not st.live and not st.finished
