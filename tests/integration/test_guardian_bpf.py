"""The guardian (tracer/recorder/guardian.py): whatever kills the recorder, no traced process stays stopped.

Real eBPF: late_load.py opens the stand-in libcudart after start, which the probes stop it for (a library-load
hold). The recorder is told to wait before attaching (a test hook), is killed with SIGKILL meanwhile, and the
target must run on within a second and finish its work; the DB keeps what was written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import duckdb
from conftest import PY, ROOT, TRACER, workload

from tracer import procfs
from tracer.recorder.attach import HOLD_DELAY_ENV


def _state(pid: int) -> str | None:
    st = procfs.stat(pid)
    return None if st is None else st.state


def _children(pid: int) -> list[int]:
    # procfs's (the one /proc parser): a thread of the recorder that ended between listing its tasks and reading
    # their children files raised FileNotFoundError here (suite run 6 of stop 39)
    return procfs.children(pid)


def test_sigkill_of_the_recorder_releases_a_held_target(tmp_path: Path) -> None:
    # GIVEN a recording of late_load.py whose library-load hold the recorder will not release for 60 s
    db = tmp_path / "killed.duckdb"
    rec = subprocess.Popen(
        [str(TRACER), "record", "--db", str(db), "--", PY, workload("late_load.py"), "--delay", "0.5", "--calls", "20"],
        cwd=ROOT,
        env={**os.environ, HOLD_DELAY_ENV: "60"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        target = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and target is None:
            kids = [c for c in _children(rec.pid) if _state(c) == "T"]
            target = kids[0] if kids else None
            time.sleep(0.05)
        assert target is not None, "the target was never held"
        time.sleep(0.5)
        assert _state(target) == "T"  # still held: the recorder sleeps in its hold handler
        # WHEN the recorder dies at once, with no chance to clean up
        os.kill(rec.pid, signal.SIGKILL)
        rec.wait(timeout=10)
        killed_at = time.monotonic()
        # THEN the target runs on within a second, and finishes its work
        while _state(target) == "T" and time.monotonic() - killed_at < 5:
            time.sleep(0.01)
        resumed_after = time.monotonic() - killed_at
        assert _state(target) != "T", "the target is still stopped 5 s after the recorder died"
        assert resumed_after < 1.0, resumed_after
        deadline = time.monotonic() + 30
        while _state(target) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(target) in (None, "Z"), "the target did not finish"
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
    # AND the DB the recorder left opens, with its session row (still marked recording: nobody finished it)
    with duckdb.connect(str(db), read_only=True) as c:
        ((status, recorder_pid),) = c.execute("SELECT status, recorder_pid FROM session").fetchall()
    assert status == "recording" and recorder_pid == rec.pid


def test_a_killed_recording_claims_every_call_it_wrote_and_its_summaries_their_own_horizon(tmp_path: Path) -> None:
    # GIVEN a training job being recorded (calls written every 5 s, per-second summaries every 10 s)
    db = tmp_path / "k.duckdb"
    rec = subprocess.Popen(
        [str(TRACER), "record", "--db", str(db), "--"]
        + [PY, workload("train.py"), "--duration", "30", "--workers", "1", "--steps", "20"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    job: list[int] = []
    try:
        # WHEN the recorder is killed outright 12 s after it starts: calls are written every 5 s from its probes
        # being live (1.5-5 s of start-up), the summaries not yet (10 s after their first second)
        assert rec.stderr is not None
        first = rec.stderr.readline().decode()
        assert first.startswith("recording into"), first
        time.sleep(12)
        job = _children(rec.pid)
        os.kill(rec.pid, signal.SIGKILL)
        rec.wait()
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
        for pid in job:  # the launched job runs on after a SIGKILL (by design): end it here
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    # THEN the file opens, and its detail horizon covers every call it holds (it had stopped at the oldest summary
    # row held back: 0.49 s against calls over ~6 s)...
    with duckdb.connect(str(db), read_only=True) as c:
        last_call = c.execute("SELECT max(ts_ns) FROM cuda_calls").fetchone()[0]
        flushed, summaries = c.execute("SELECT flushed_ns, summaries_flushed_ns FROM session").fetchone()
        last_second = c.execute("SELECT max(sec) FROM thread_breakdown").fetchone()[0]
    assert last_call is not None and flushed >= last_call, (flushed, last_call)
    # ...and the summaries' own horizon says how far they go: no summary row past it
    assert summaries <= flushed
    assert last_second is None or (last_second + 1) * 1e9 <= summaries + 1e9
