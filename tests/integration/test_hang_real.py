"""The ``hang`` chain on real recordings (issue 29): jobs that stop making progress, each named with the thread
that is stuck, its line, and what it waits on.

- ``hang_ranks.py`` under torchrun (gloo, 3 ranks, torch 2.13 on the CPU): rank 1 blocks opening a FIFO nobody
  writes (a stalled file system) while ranks 0 and 2 wait in the all_reduce. Recorded by ``--pid`` of torchrun's
  agent AFTER the hang began: the chain names rank 1, its line and what it opens, and ranks 0 and 2 in all_reduce
  at their line. Ground truth: the fixture's printed ranks and pids, its marked lines.
- ``hang.py deadlock``: two threads of one process each wait for the lock the other holds (attached after).
- ``hang.py sync``: a stand-in CUDA loop that steps, then waits in a cudaStreamSynchronize that never returns:
  the steps stopped, named from the step markers.
- ``hang.py loader``: the loop's data worker died; the loop waits for its next batch.
- ``hang.py healthy``: steps to the end: no hang chain.
- ``hang_loader.py``: a real torch DataLoader whose worker is SIGKILLed while it writes a batch; the prefetch thread
  blocks reading the half-written batch and the loop waits for it forever (torch's dead-worker check never runs).
- ``nccl_ranks.py --hang-rank 1``: three ranks on the stand-in libnccl.so.2; rank 1 stops before a collective the
  others entered: named "one collective behind" from the per-communicator counts.

The untraced truth of each (no progress once ``stuck`` is printed; the healthy loop never stops) is in the
fixtures' docstrings. Needs root, BPF and (for the ranks) torch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PY, ROOT, TRACER, query, record, start_record, workload

from tests.support.need import need_nothing_missing
from tracer.snapshot import kernel

pytestmark = pytest.mark.bpf

VENV_PY = ROOT / ".venv" / "bin" / "python"
HANG = Path(workload("hang.py"))
RANKS = Path(workload("hang_ranks.py"))
SECONDS = "5"


def marks(path: Path) -> dict[str, int]:
    """{MARK: line} of the ``# MARK`` comments in a fixture."""
    lines = enumerate(path.read_text().splitlines(), 1)
    return {m[1]: i for i, line in lines if (m := re.search(r"# ([A-Z_]+)$", line))}


def chains(db: Path) -> list[dict]:
    r = subprocess.run([str(TRACER), "chains", "--db", str(db), "--json"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)["chains"]


def _json(command: str, db: Path) -> dict:
    r = subprocess.run([str(TRACER), command, "--db", str(db), "--json"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def hang_of(db: Path) -> dict:
    found = [c for c in chains(db) if c["category"] == "hang"]
    assert len(found) == 1, [c["summary"] for c in chains(db)]
    return found[0]


def _wait_lines(proc: subprocess.Popen, pattern: str, count: int, timeout: float) -> list[str]:
    assert proc.stdout is not None
    got: list[str] = []
    end = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        got += [m.group(0) for m in re.finditer(pattern, line)]  # the ranks' lines may interleave
    assert len(got) == count, f"{pattern!r}: {got}"
    return got


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. torchrun starts each rank in a session of its own, so killing the
    agent's process group left the hung ranks running, orphaned, after the test."""
    for p in kernel.tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _torch_missing() -> str | None:
    r = subprocess.run([str(VENV_PY), "-c", "import torch.distributed.run"], capture_output=True, text=True)
    return None if r.returncode == 0 else "torch is not installed in .venv: run ./setup.sh"


def test_hung_ranks_name_the_rank_outside_the_collective(tmp_path: Path) -> None:
    need_nothing_missing(_torch_missing())
    cmd = [str(VENV_PY), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(RANKS)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                           cwd=tmp_path)  # fmt: skip
    try:
        lines = _wait_lines(job, r"hang_ranks: rank=\d+ (pid=\d+|stuck)", 6, timeout=180)
        pids = {int(m[1]): int(m[2]) for x in lines if (m := re.search(r"rank=(\d+) pid=(\d+)", x))}
        assert sorted(pids) == [0, 1, 2]
        time.sleep(1.0)  # the hang began before the recording
        db = tmp_path / "ranks.duckdb"
        r = record(["--pid", str(job.pid), "--duration", SECONDS, "--db", str(db)], timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        _kill_tree(job.pid)
        job.wait()
    c = hang_of(db)
    line = marks(RANKS)
    ev = c["evidence"]
    assert c["severity"] == "HIGH"
    assert ev["ranks_stuck"] == [1]
    assert c["culprit"]["pid"] == pids[1] and c["culprit"]["kind"] == "rank"
    assert c["culprit"]["code_site"].endswith(f"hang_ranks.py:{line['STUCK_OPEN']} main")
    stuck = next(t for t in ev["stuck"] if t["pid"] == pids[1])
    assert stuck["syscall"] == "openat" and stuck["waits_on"].endswith("shard-00042.bin")
    assert not stuck["in_collective"]
    waiting = {t["rank"]: t for t in ev["waiting"]}
    assert set(waiting) == {0, 2}
    for t in waiting.values():
        assert t["collective"] == "all_reduce"
        assert t["site"].endswith(f"hang_ranks.py:{line['ALLREDUCE_STUCK']} main")
        assert t["blocked_ms"] >= float(SECONDS) * 1000  # blocked since before the recording
    assert c["root"]["kind"] == "hung" and "rank 1" in c["summary"]
    assert any("shard-00042.bin" in x for x in c["recommendations"])
    # the overview leads with the hang; each rank's worst stall is its stuck main thread's, not a gloo timer's
    stats = _json("stats", db)
    assert stats["top_chain"].startswith("The job made no step")
    worst = {g["pid"]: g["worst_stall_ms"] for g in stats["process_groups"]}
    assert all(worst[p] >= float(SECONDS) * 1000 for p in pids.values())
    assert "never ran in the recording" in _json("ranks", db)["note"]


def _attach(tmp_path: Path, mode: str) -> tuple[Path, int]:
    proc = subprocess.Popen([PY, str(HANG), mode], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pid = int(re.search(r"pid=(\d+)", _wait_lines(proc, r"pid=\d+ mode=\w+ stuck", 1, timeout=60)[0])[1])
        db = tmp_path / f"{mode}.duckdb"
        r = record(["--pid", str(pid), "--duration", SECONDS, "--db", str(db)], timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        proc.kill()
        proc.wait()
    return db, pid


def test_deadlock_named(tmp_path: Path) -> None:
    db, pid = _attach(tmp_path, "deadlock")
    c = hang_of(db)
    line = marks(HANG)
    sites = {t["site"] for t in c["evidence"]["stuck"] if t["doing"] == "waits for a lock"}
    assert {f"{HANG}:{line['STUCK_A']} deadlock.<locals>.take_a_then_b",
            f"{HANG}:{line['STUCK_B']} deadlock.<locals>.take_b_then_a"} <= sites  # fmt: skip
    assert "deadlock" in c["summary"] and c["severity"] == "HIGH"
    assert c["pids"] == [pid]


def _launched(tmp_path: Path, *args: str, duration: str = "8") -> Path:
    db = tmp_path / f"{args[0]}.duckdb"
    r = record(["--duration", duration, "--db", str(db), "--", PY, str(HANG), *args], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return db


def test_sync_that_never_returns_named(tmp_path: Path) -> None:
    db = _launched(tmp_path, "sync", "--steps", "30")
    c = hang_of(db)
    ev = c["evidence"]
    assert ev["trigger"] == "steps_stopped" and ev["step_ms"] is not None
    assert c["culprit"]["code_site"].endswith(f"hang.py:{marks(HANG)['STUCK_SYNC']} cuda_loop")
    assert ev["stuck"][0]["doing"].startswith("waits for the GPU")


def test_dead_loader_worker_named(tmp_path: Path) -> None:
    db = _launched(tmp_path, "loader", "--steps", "20")
    c = hang_of(db)
    top = c["evidence"]["stuck"][0]
    assert c["culprit"]["code_site"].endswith(f"hang.py:{marks(HANG)['STUCK_GET']} loader")
    assert top["doing"].startswith("waits for a batch")
    assert "exited" in c["summary"]


def test_healthy_loop_has_no_hang(tmp_path: Path) -> None:
    db = _launched(tmp_path, "healthy", "--seconds", "4")
    assert not [c for c in chains(db) if c["category"] == "hang"]


NCCL_RANKS = Path(workload("nccl_ranks.py"))
HANG_AT = 30  # the stuck rank's collectives: it stops before its 31st; the others enter it


def test_nccl_rank_one_collective_behind_named(tmp_path: Path) -> None:
    """Three ranks on the stand-in libnccl.so.2; rank 1 stops before its collective HANG_AT + 1 and blocks in a
    pipe read (HANG_SITE), the others enter that collective and wait in their cudaStreamSynchronize. Ground truth
    from the fixture's arguments: rank 1 entered HANG_AT ncclAllReduce calls, ranks 0 and 2 HANG_AT + 1."""
    db = tmp_path / "nccl_hang.duckdb"
    args = ["--ranks", "3", "--steps", "100000", "--hang-rank", "1", "--hang-at", str(HANG_AT)]
    env = dict(os.environ, FAKE_NCCL_TIMEOUT_S="600")  # the waiting ranks never give up during the recording
    r = record(["--duration", "8", "--db", str(db), "--", PY, str(NCCL_RANKS), *args], timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    stuck_pid = int(re.search(r"rank=1 pid=(\d+) stuck", r.stderr + r.stdout)[1])
    # each rank by its environment's RANK (nccl_comms may miss a set-up made while the probes were attaching)
    counts = {int(rank): int(n) for rank, n in query(db, (
        "SELECT r.rank, sum(p.calls) FROM nccl_progress p JOIN processes r USING (pid) "
        "WHERE p.op = 'ncclAllReduce' GROUP BY r.rank"))}  # fmt: skip
    assert counts == {0: HANG_AT + 1, 1: HANG_AT, 2: HANG_AT + 1}
    c = hang_of(db)
    ev = c["evidence"]
    assert ev["trigger"] == "steps_stopped"
    assert ev["ranks_stuck"] == [1] and c["culprit"]["pid"] == stuck_pid and c["culprit"]["kind"] == "rank"
    assert c["culprit"]["code_site"].endswith(f"nccl_ranks.py:{marks(NCCL_RANKS)['HANG_SITE']} _hang")
    assert len(ev["behind"]) == 1 and ev["behind"][0].startswith("rank 1 is one collective behind")
    assert "rank 1 is one collective behind" in c["summary"]
    waiting = {t["rank"]: t for t in ev["waiting"]}
    assert set(waiting) == {0, 2}
    assert all(t["collective"] == f"ncclAllReduce #{HANG_AT + 1}" for t in waiting.values())
    sync = next(i for i, x in enumerate(NCCL_RANKS.read_text().splitlines(), 1) if "# SYNC_SITE" in x)
    assert all(t["site"].endswith(f"nccl_ranks.py:{sync} run_rank") for t in waiting.values())


TORCH_LOADER = Path(workload("hang_loader.py"))
HUNG_S = 8  # the loader job is killed this long after its worker died


def test_real_dataloader_worker_killed_names_the_dead_worker(tmp_path: Path) -> None:
    """A real torch DataLoader (num_workers=1) iterated by a prefetch thread; its worker is SIGKILLed mid-write of a
    batch, and the loop waits forever (the fixture's docstring: how torch behaves, and the untraced truth)."""
    need_nothing_missing(_torch_missing())
    db = tmp_path / "torch_loader.duckdb"
    # importing torch under the tracer took 25 s on the loaded 2-vCPU VM (10 s untraced) before the first step: the
    # job is ended HUNG_S after its worker died, whenever that is, and the recording ends with it
    rec = start_record(["--duration", "300", "--db", str(db), "--", str(VENV_PY), str(TORCH_LOADER), "--steps", "30"])
    try:
        assert rec.stderr is not None
        end = time.monotonic() + 240
        m = None
        while m is None and time.monotonic() < end:
            line = rec.stderr.readline()
            if not line:
                break
            m = re.search(r"hang_loader: pid=(\d+) worker=(\d+) killed", line)
        assert m, "the fixture's worker never died"
        pid, worker = int(m[1]), int(m[2])
        time.sleep(HUNG_S)
        os.kill(pid, signal.SIGKILL)
        _, err = rec.communicate(timeout=180)
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
    assert rec.returncode == 0, err
    c = hang_of(db)
    ev = c["evidence"]
    # the loop's last steps (the two batches queued before the half-written one) come within the checkpoint's 2 s
    # of the worker's death
    assert ev["trigger"] == "steps_stopped" and c["pids"] == [pid] and ev["stalled_ms"] >= (HUNG_S - 2) * 1000
    assert c["culprit"]["code_site"].endswith(f"hang_loader.py:{marks(TORCH_LOADER)['STUCK_BATCH']} main")
    # the dead worker is named, with how it died
    assert f"its child pid {worker} (pt_data_worker)" in c["summary"] and "killed by SIGKILL" in c["summary"]
    assert "deadlock" not in c["summary"]
    assert any(f"pid {worker}" in x and "timeout=" in x for x in c["recommendations"])
    # the prefetch thread is listed where it blocks: reading the half-written batch from the worker's pipe
    assert ev["stuck"][0]["doing"] == "waits for another thread (join / condition)"  # queue.Queue.get
    prefetch = next(t for t in ev["stuck"] if t["site"] and t["site"].endswith("prefetch"))
    assert prefetch["syscall"] == "read" and prefetch["doing"].startswith("waits for a batch from its data workers")
