"""Two `tracer record` runs, one rank each, of one 2-rank job (the stand-in NCCL of nccl_ranks.py): recordings made
as two hosts would make them, analysed as one job with `tracer ranks --db a --db b` (issue 19, item 4).

Each recorder launches one rank process with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and the
communicator id file they share; the second recorder starts DELAY_S after the first, so the two recordings' ts_ns
count from origins about DELAY_S apart. Rank 1 sleeps SLOW_MS longer every step, so rank 0 waits for it in its
cudaStreamSynchronize (the stand-in collective completes when both ranks have arrived).

Ground truth from outside the tracer: each rank's pid from its own report (rank-<R>.json), and the wall clock
read by this test just before starting each recorder.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PY, ROOT, TRACER, query, workload

from tracer.analysis.db import open_trace
from tracer.analysis.job import PID_STRIDE, job_alignment

pytestmark = pytest.mark.bpf

STEPS, SLOW_RANK, SLOW_MS = 200, 1, 15.0  # ~3.5 s of steps: at least 2 whole seconds to compare
DELAY_S = 1.3  # the second recorder starts this much later
S = 1_000_000_000


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], dict[int, int], list[int]]:
    """([rank0.duckdb, rank1.duckdb], {rank: pid} from the ranks' reports, wall clock before each recorder)."""
    tmp = tmp_path_factory.mktemp("job")
    report = tmp / "report"
    procs, before, dbs = [], [], []
    for rank in (0, 1):
        # the rank's environment through env(1), which execs the rank: the recorder's own environment has no rank
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "10.0.0.1",  # the job id both ranks share (MASTER_ADDR:PORT)
            "MASTER_PORT": "29511",
            "FAKE_NCCL_ID_FILE": str(tmp / "nccl.id"),
        }
        cmd = ["env", *(f"{k}={v}" for k, v in env.items()), PY, workload("nccl_ranks.py"), "--steps", str(STEPS)]
        cmd += ["--report-dir", str(report)]
        cmd += ["--slow-rank", str(SLOW_RANK), "--slow-ms", str(SLOW_MS)]
        dbs.append(tmp / f"rank{rank}.duckdb")
        before.append(time.time_ns())
        procs.append(
            subprocess.Popen(
                [str(TRACER), "record", "--db", str(dbs[-1]), "--", *cmd],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
        )
        if rank == 0:
            time.sleep(DELAY_S)
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, out + err
    pids = {doc["rank"]: doc["pid"] for doc in (json.loads(f.read_text()) for f in report.glob("rank-*.json"))}
    assert sorted(pids) == [0, 1]
    return dbs, pids, before


def test_tracer_ranks_over_both_recordings_names_the_slow_rank(job) -> None:
    dbs, pids, _ = job
    # GIVEN two recordings, one rank each  WHEN `tracer ranks` reads both as one job
    r = subprocess.run(
        [str(TRACER), "ranks", "--db", str(dbs[0]), "--db", str(dbs[1]), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    # THEN both ranks are in its table, each its own process: rank 1 is recording 1's pid, keyed by the recording
    assert [(row["rank"], row["pid"]) for row in out["ranks"]] == [(0, pids[0]), (1, PID_STRIDE + pids[1])]
    # AND the slow rank is the straggler, asleep, and rank 0 waits for it
    st = out["straggler"]
    assert st is not None, out["note"]
    assert (st["rank"], st["pid"], st["phase"]) == (SLOW_RANK, PID_STRIDE + pids[1], "asleep")
    assert [w["rank"] for w in st["waiting"]] == [0]
    assert "2 recordings (1 host) as one job, aligned by wall clock to ±" in out["note"]
    # AND no launcher: each recorder started its rank itself
    assert out["launchers"] == []


def test_each_recording_read_the_wall_clock_at_its_start(job) -> None:
    dbs, _, before = job
    for db, t in zip(dbs, before, strict=True):
        ((real, read, mono),) = query(db, "SELECT realtime_at_start_ns, clock_read_ns, start_mono_ns FROM session")
        # THEN its realtime start follows the moment the test started its recorder (by its start-up, seconds)
        assert t < real < t + 30 * S
        # AND the two clocks were read back to back: within a millisecond (microseconds, unless preempted)
        assert 0 <= read < 1_000_000 and mono > 0
    with open_trace(dbs) as c:
        al = job_alignment(c)
    assert al is not None
    second = al.recordings[1]
    # AND the second recording, started DELAY_S later (plus the difference of the two recorders' start-ups), is
    # shifted by its offset rounded to whole seconds, the rest reported as its residual and within the bound
    assert 0.8 * S < second.offset_ms * 1e6 < 3 * S
    assert second.shift_s == round(second.offset_ms / 1000) and abs(second.residual_ms) <= 500
    assert al.bound_ms >= abs(second.residual_ms)
