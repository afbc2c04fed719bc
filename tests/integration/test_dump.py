"""`tracer dump` against py-spy (--nonblocking, so neither tool stops the process) on fixtures/workloads/
stuck_threads.py: the same innermost frame (function and line) per thread, the lines the fixture marks, and a
heartbeat that shows no gap while tracer dump reads the process (it never stops it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.interpreters import DEBIAN_PYTHON, pyenv_python
from tests.support.need import need, need_root

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "fixtures" / "workloads" / "stuck_threads.py"
TRACER = [sys.executable, "-m", "tracer.commands.cli"]
MOVING = {"in_spin", "heartbeat"}
MAX_GAP_NS = 50_000_000  # the heartbeat beats every 5 ms; a stop of the process shows as a gap of its length


def marks() -> dict[str, int]:
    """{thread function: the line marked `# stuck: NAME`} in the fixture's source."""
    out = {}
    for i, line in enumerate(FIXTURE.read_text().splitlines(), 1):
        m = re.search(r"# stuck: (\w+)", line)
        if m:
            out[m[1]] = i
    return out


def py_spy() -> str | None:
    for p in (os.environ.get("PYSPY"), str(ROOT / ".venv" / "bin" / "py-spy"), shutil.which("py-spy")):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def interpreters() -> list:
    out = [pytest.param(str(DEBIAN_PYTHON), id="debian-3.11")]
    for v in ("3.10", "3.12", "3.13"):
        out.append(pytest.param(v, id=f"pyenv-{v}"))
    return out


def _python(which: str) -> str:
    if which.startswith("/"):
        need(Path(which).exists(), f"{which} missing")
        return which
    p = pyenv_python(which)
    need(p is not None, f"pyenv python {which} missing")
    return str(p)


def _start(python: str, tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    beat = tmp_path / "beat"
    proc = subprocess.Popen([python, str(FIXTURE), str(beat), *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, beat


class StopWatch(threading.Thread):
    """Polls the state of every thread of ``pid`` (/proc/PID/task/*/stat) until stopped, and keeps each state it
    saw: a process stopped by a signal reads 'T', one stopped by ptrace 't' (what py-spy without --nonblocking does).
    The direct check that the dump never stops it, whatever else runs on the machine."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.states, self.polls = pid, set(), 0
        self._done = threading.Event()

    def run(self) -> None:
        task = Path(f"/proc/{self.pid}/task")
        while not self._done.is_set():
            for t in task.iterdir():
                try:
                    self.states.add((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
                except (OSError, IndexError):
                    pass
            self.polls += 1
            time.sleep(0.001)

    def stop(self) -> set[str]:
        self._done.set()
        self.join()
        return self.states


def _dump(pid: int) -> tuple[list[dict], int, int]:
    watch = StopWatch(pid)
    watch.start()
    t0 = time.monotonic_ns()
    out = subprocess.run([*TRACER, "dump", "--pid", str(pid), "--json"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)  # fmt: skip
    t1 = time.monotonic_ns()
    states = watch.stop()
    assert out.returncode == 0, out.stderr
    assert watch.polls > 0 and not states & {"T", "t"}, f"a thread of the process was stopped: {sorted(states)}"
    return json.loads(out.stdout), t0, t1


@pytest.mark.parametrize("which", interpreters())
def test_dump_matches_py_spy_and_never_stops(which: str, tmp_path: Path) -> None:
    need_root("reading another process's memory")
    python = _python(which)
    spy = py_spy()
    need(spy is not None, "py-spy missing (pip install py-spy)")
    proc, beat = _start(python, tmp_path)
    try:
        time.sleep(1.0)  # beats before the dump: the window starts at the last one
        ours, t0, t1 = _dump(proc.pid)
        theirs = json.loads(subprocess.run([spy, "dump", "--json", "--nonblocking", "--pid", str(proc.pid)],
                                           capture_output=True, text=True, timeout=60, check=True).stdout)  # fmt: skip
        time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    line = marks()
    # ours by tid, py-spy's by os_thread_id; the fixture names its threads, the main thread is "main"
    mine = {t["tid"]: t for t in ours}
    assert {t["pid"] for t in ours} == {proc.pid}
    seen = set()
    for t in theirs:
        tid = t.get("os_thread_id")
        if tid is None:  # py-spy --nonblocking on 3.10 (no native_thread_id): by the name the fixture gave
            want = "main" if t.get("thread_name") == "MainThread" else t.get("thread_name")
            tid = next((k for k, m in mine.items() if any(f["function"] == want for f in m["frames"])), None)
        assert tid in mine, f"py-spy's thread {tid} missing from tracer dump"
        f_ours, f_spy = mine[tid]["frames"][0], t["frames"][0]
        func = f_spy["name"].split(".")[-1]  # py-spy names a method by its qualname on some versions only
        assert f_ours["function"].split(".")[-1] == func, (mine[tid]["frames"], t["frames"])
        ours_marked = next(f for f in mine[tid]["frames"] if f["function"] in line)
        seen.add(ours_marked["function"])
        if ours_marked["function"] not in MOVING:
            assert f_ours["line"] == f_spy["line"], (f_ours, f_spy)
            assert ours_marked["line"] == line[ours_marked["function"]], mine[tid]["frames"]
    assert {"in_lock", "in_pipe", "in_cond", "in_sleep", "in_spin", "heartbeat", "main"} <= seen
    by_func = {next(f["function"] for f in t["frames"] if f["function"] in line): t for t in ours if t["frames"]}
    assert by_func["in_pipe"]["syscall"] == "read" and by_func["in_pipe"]["state"] == "sleeping"
    assert by_func["in_lock"]["syscall"] == "futex"
    # the heartbeat kept beating while tracer dump read the process: each gap, less the time the heartbeat waited
    # for a CPU within it (a loaded machine delays a 5 ms sleeper's wakeups by tens of ms: 60 ms under two loads)
    # and the time the spinner, which holds the GIL the heartbeat needs, did (55 ms under two loads), is its sleep;
    # a stop is not a wait for a CPU and shows whole
    beats = [tuple(map(int, x.split())) for x in beat.read_text().splitlines() if len(x.split()) == 3]
    first = max((i for i, (b, _, _) in enumerate(beats) if b <= t0), default=0)  # the beat before the dump began
    last = next((i for i, (b, _, _) in enumerate(beats) if b >= t1), len(beats) - 1)  # and the first after it ended
    window = beats[first : last + 1]
    gaps = [(b2 - b1) - (r2 - r1) - (s2 - s1) for (b1, r1, s1), (b2, r2, s2) in zip(window, window[1:], strict=False)]
    assert len(window) >= 2 and max(gaps) <= MAX_GAP_NS, (
        f"heartbeat gap of {max(gaps, default=0) / 1e6:.0f} ms not waiting for a CPU, against {MAX_GAP_NS / 1e6:.0f} ms"
    )


def test_deadlock_both_threads_in_acquire(tmp_path: Path) -> None:
    need_root("reading another process's memory")
    proc, _ = _start(str(DEBIAN_PYTHON), tmp_path, "--deadlock")
    try:
        ours, _, _ = _dump(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    line = marks()
    inner = {t["frames"][0]["function"]: t for t in ours if t["frames"]}
    for name in ("deadlock_a", "deadlock_b"):
        assert inner[name]["frames"][0]["line"] == line[name]
        assert inner[name]["syscall"] == "futex" and inner[name]["state"] == "sleeping"


def test_missing_pid_is_a_clear_error() -> None:
    out = subprocess.run([*TRACER, "dump", "--pid", "999999999"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "no process" in out.stderr and "Traceback" not in out.stderr


def test_recording_stores_snapshots_of_threads_blocked_before_it(tmp_path: Path) -> None:
    """Attached after the threads blocked, the recording has no switch-out of them; its thread_snapshots still
    give each one's line and a blocked-since before the recording began, at attach and at the end, and the
    MCP tool serves them."""
    import anyio
    import duckdb
    from mcp import Client

    from mcp_server.server import build_server
    from tests.integration._helpers import TRACER as TRACER_BIN
    from tests.integration._helpers import skip_without_bpf
    from tracer.analysis.thread_dump import thread_dump

    skip_without_bpf()
    proc, _ = _start(str(DEBIAN_PYTHON), tmp_path)
    db = tmp_path / "r.duckdb"
    try:
        time.sleep(1.0)  # blocked for a while before the recording
        out = subprocess.run([str(TRACER_BIN), "record", "--pid", str(proc.pid), "--duration", "3", "--db", str(db)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
    finally:
        proc.kill()
        proc.wait()
    line = marks()
    with duckdb.connect(str(db), read_only=True) as c:
        reasons = {r[0] for r in c.execute("SELECT DISTINCT reason FROM thread_snapshots").fetchall()}
        assert {"attach", "end"} <= reasons
        dump = thread_dump(c)
    by = {next((f.function for f in t.frames if f.function in line), None): t for t in dump.threads}
    for name in ("in_lock", "in_pipe", "in_cond", "in_sleep"):
        t = by[name]
        assert next(f.line for f in t.frames if f.function == name) == line[name]
        assert t.state == "sleeping" and t.reason == "end"
        # blocked since before the recording began: longer than the recording's 3 s (plus the 1 s before it)
        assert t.blocked_ms is not None and t.blocked_ms > 3500, t
    assert by["in_pipe"].syscall == "read"

    async def go():
        async with Client(build_server(db)) as c:
            return await c.call_tool("get_thread_dump", {"pid": proc.pid})

    r = anyio.run(go)
    assert any(t["frames"] and t["frames"][0]["function"] == "in_lock" for t in r.structured_content["threads"])


IDLE_JOB = """
import threading, time
def work():
    t = time.monotonic()
    while time.monotonic() - t < 1.5:  # on CPU: no snapshot while it runs
        pass
    time.sleep(5)  # SLEEPS
t = threading.Thread(target=work)
t.start()
t.join()
"""


def test_a_thread_that_stops_during_the_recording_is_snapshotted_once(tmp_path: Path) -> None:
    """The recorder's per-second look: a thread that stops running during the recording is read once it has been
    off CPU for a second (the look skips threads that ran since the last tick), and not again while it stays
    stopped; one blocked from the start (the main thread, in join) once too."""
    import duckdb

    from tests.integration._helpers import TRACER as TRACER_BIN
    from tests.integration._helpers import skip_without_bpf

    skip_without_bpf()
    db = tmp_path / "idle.duckdb"
    out = subprocess.run([str(TRACER_BIN), "record", "--db", str(db), "--", str(DEBIAN_PYTHON), "-c", IDLE_JOB],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    with duckdb.connect(str(db), read_only=True) as c:
        rows = c.execute(
            "SELECT tid, ts_ns, blocked_since_ns, syscall FROM thread_snapshots WHERE reason = 'idle' ORDER BY ts_ns"
        ).fetchall()
    by_tid: dict[int, list[tuple]] = {}
    for r in rows:
        by_tid.setdefault(r[0], []).append(r)
    sleeper = [v for v in by_tid.values() if v[0][3] == "clock_nanosleep"]
    assert len(sleeper) == 1 and len(sleeper[0]) == 1, rows  # once, though it stayed asleep ~3 more ticks
    _, ts, since, _ = sleeper[0][0]
    # read a second or two after it stopped (a tick is a second, later on a loaded machine): not before it had been
    # off CPU a second (0.1 s for the clocks the two figures come from), and not a tick late or more
    assert 0.9 <= (ts - since) / 1e9 < 3.0, rows
    assert all(len(v) == 1 for v in by_tid.values()), rows


def test_thread_dump_of_a_recording_without_snapshots(tmp_path: Path) -> None:
    import duckdb

    from tracer.analysis.thread_dump import thread_dump

    with duckdb.connect(str(tmp_path / "old.duckdb")) as c:
        c.execute("CREATE TABLE session (session_id INTEGER)")
        d = thread_dump(c)
    assert d.threads == [] and "no thread snapshots" in d.note
