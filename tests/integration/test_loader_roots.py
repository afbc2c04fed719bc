"""Real eBPF (issue 28): a starved loader's chain follows the root of the workers' time, not a share of their CPU.

- storage: fixtures/workloads/storage_loader.py, two workers fetching each sample from a local storage service
  that answers after 15 ms. Truth (untraced, measured here): the loop with 8 workers against 2 (its docstring:
  -73% on the 2-vCPU VM). The chain's root is the external wait: the workers' recv line, woken by the service,
  a helper named ``storage_proxy`` and not counted as a worker; the advice is more workers.
- the same service started outside the job (a daemon the job did not start): the path ends at another process.
- oversubscribed: train.py's three CPU-bound workers and the training process pinned to one core (the demo's shape:
  3 workers and the trainer on too few cores). Truth (untraced, measured here): the loop with a 10x cheaper
  transform (--worker-cpu-ms 2 against 20; 5.3 s against 0.8 s on the VM). The root is CPU capacity at their hot
  line; the advice a cheaper transform, more cores or fewer workers than cores.

Stability (the issue: an answer must not flip between recordings): the decision is which of the workers' ways of
not running dominates; each test checks that the recording is far from the cut-off (3x on either side), and
shorter runs of the storage and oversubscribed jobs are recorded 5 times each: the same root at HIGH or MEDIUM on
every one.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from _helpers import PY, WORKLOADS, Recording, assert_root_found, cached, workload

from tracer.analysis.chains import CausalChain, compute_chains
from tracer.analysis.db import open_trace

pytestmark = pytest.mark.bpf

STORAGE = "storage_loader.py"
MARGIN = 3.0  # the recording's ratio is at least this far from the decision's cut-off (module docstring)


def marked_line(name: str, marker: str) -> int:
    for i, line in enumerate((WORKLOADS / name).read_text().splitlines(), 1):
        if re.search(rf"\S.*#\s*{marker}\s*$", line):
            return i
    raise AssertionError(f"no # {marker} in {name}")


def loop_s(cmd: list[str], pattern: str) -> float:
    """The shorter of two untraced runs' loop time."""
    best = float("inf")
    for _ in range(2):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        best = min(best, float(re.search(pattern, r.stderr).group(1)))
    return best


def starved(r: Recording) -> CausalChain:
    with open_trace(r.db) as c:
        found = [x for x in compute_chains(c, limit=100).chains if x.category == "dataloader_starvation"]
    assert found, "no dataloader_starvation chain"
    ch = found[0]
    assert ch.severity in ("HIGH", "MEDIUM"), ch
    assert_root_found(r.db)  # and the training thread's lost time has its root found (issue 28)
    return ch


# --- workers latency-bound on a storage service -----------------------------------------------------------------


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> tuple[Recording, float]:
    loss = 1 - loop_s(workload(STORAGE, "--workers", "8"), r"loop_s=([0-9.]+)") / loop_s(
        workload(STORAGE, "--workers", "2"), r"loop_s=([0-9.]+)"
    )
    return cached("loader-storage", tmp_path_factory, workload(STORAGE, "--workers", "2")), loss


def test_storage_bound_workers_root_at_the_service(storage) -> None:
    r, loss = storage
    ch = starved(r)
    # THEN the root is the external wait at the workers' recv line, woken by the storage service
    wait = f"{STORAGE}:{marked_line(STORAGE, 'WORKER_WAIT')} _recv_exact"
    assert ch.root is not None and ch.root.kind == "external_wait", ch.root
    assert ch.root.site.endswith(wait) and "recv" in ch.root.detail and "storage_proxy" in ch.root.detail
    assert "recv" in ch.root.stack[:2]
    # AND the path: training -> a worker (woken_by) -> the service, a helper of the job, not a worker
    assert [(h.role, h.edge) for h in ch.path] == [
        ("training", "start"),
        ("worker", "woken_by"),
        ("helper", "woken_by"),
    ]
    assert ch.path[0].pid == r.pid and ch.path[1].comm == "pt_data_worker" and ch.path[2].comm == "storage_proxy"
    assert ch.evidence.worker_count == 2 and {w.comm for w in ch.evidence.workers} == {"pt_data_worker"}
    # AND the advice is more workers and deeper prefetch, never the hand-off
    rec = ch.recommendations[0]
    assert "raise num_workers to about" in rec and "prefetch_factor" in rec and "hand-off" not in rec
    # AND the cost is the untraced loss of 2 workers against 8
    assert 0.6 * loss <= ch.share <= 1.25 * loss, (ch.share, loss)
    # AND the decision is far from its cut-off: blocked on the source vs on CPU or runnable
    for w in ch.evidence.workers:
        assert w.blocked_share >= MARGIN * (w.cpu_share + w.runq_share), w


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Recording:
    """The service started outside the job, before the recording."""
    d = Path(tempfile.mkdtemp(prefix="storage-"))
    sock = d / "proxy.sock"
    srv = subprocess.Popen([str(PY), str(WORKLOADS / STORAGE), "--serve", str(sock)])
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.exists()
        return cached(
            "loader-storage-outside", tmp_path_factory, workload(STORAGE, "--workers", "2", "--socket", str(sock))
        )
    finally:
        srv.kill()
        srv.wait()
        if sock.exists():
            os.unlink(sock)
        d.rmdir()


def test_a_service_outside_the_job_ends_the_path_at_another_process(outside) -> None:
    ch = starved(outside)
    assert ch.root is not None and ch.root.kind == "external_wait" and "outside the job" in ch.root.detail
    assert (ch.path[-1].role, ch.path[-1].comm) == ("other_process", "storage_proxy")
    assert ch.evidence.worker_count == 2


# --- CPU-bound workers on oversubscribed cores --------------------------------------------------------------------

OVER = ["--workers", "3", "--persistent-workers", "--epochs", "1", "--steps", "150", "--kernel-us", "200"]


def pinned(*args: str) -> list[str]:
    return ["taskset", "-c", "0", *workload("train.py", *OVER, *args)]


@pytest.fixture(scope="module")
def oversubscribed(tmp_path_factory) -> tuple[Recording, float]:
    wall = r"wall=([0-9.]+)s"
    loss = 1 - loop_s(pinned("--worker-cpu-ms", "2"), wall) / loop_s(pinned("--worker-cpu-ms", "20"), wall)
    return cached("loader-oversubscribed", tmp_path_factory, pinned("--worker-cpu-ms", "20")), loss


def test_cpu_bound_workers_on_full_cores_root_at_cpu_capacity(oversubscribed) -> None:
    r, loss = oversubscribed
    ch = starved(r)
    # THEN the root is CPU capacity at the workers' hot line (the transform), not a slow hand-off
    assert ch.root is not None and ch.root.kind == "cpu_capacity", ch.root
    assert ch.root.site and ch.root.site.endswith("busy_cpu") and ch.root.stack
    assert [(h.role, h.state) for h in ch.path] == [("training", "blocked"), ("worker", "runq")]
    rec = ch.recommendations[0]
    assert "waited for a CPU" in rec and "cheaper" in rec and "more cores" in rec and "hand-off" not in rec
    assert ch.evidence.worker_count == 3
    # AND its cost is at most the loss the transform's cost brings (a 10x cheaper one, untraced)
    assert ch.share <= 1.25 * loss, (ch.share, loss)
    # AND far from the cut-off: runnable at least MARGIN x half their CPU time, blocked a small part
    for w in ch.evidence.workers:
        assert w.runq_share >= MARGIN * 0.5 * w.cpu_share and w.blocked_share * MARGIN <= w.cpu_share + w.runq_share


# --- the same answer on every recording (issue 28: "5 of 5") ------------------------------------------------------

REPEATS = 5


SHORT = {
    "storage": (workload(STORAGE, "--workers", "2", "--steps", "60"), "external_wait"),
    "oversubscribed": (
        [
            "taskset",
            "-c",
            "0",
            *workload("train.py", *[a if a != "150" else "60" for a in OVER], "--worker-cpu-ms", "20"),
        ],
        "cpu_capacity",
    ),
}


@pytest.mark.parametrize("cmd,root", list(SHORT.values()), ids=list(SHORT))
def test_the_root_is_the_same_on_every_recording(tmp_path, cmd: list[str], root: str) -> None:
    # GIVEN the same job recorded REPEATS times; WHEN each recording's chains are computed
    from _helpers import record

    got = []
    for i in range(REPEATS):
        ch = starved(record(tmp_path / f"r{i}.duckdb", cmd))
        got.append((ch.root.kind if ch.root else None, ch.severity in ("HIGH", "MEDIUM")))
    # THEN every one gives the same root, at HIGH or MEDIUM
    assert got == [(root, True)] * REPEATS, got
