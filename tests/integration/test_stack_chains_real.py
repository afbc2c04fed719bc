"""Real eBPF, issue 18: the chains built on the stacks outside calls (off-CPU stacks, on-CPU samples) name the
cause, the Python line and a share of the training thread's time within a stated band of the workload's own
untraced ground truth.

Each truth is measured by the workload itself or in the test, never taken from the tracer:

- gil_thread.py: the loop's wall time with and without its metrics thread, by the loop's own clock, in the
  recorded run and in a run recorded the same way without the thread; the loss share is 1 - t_without / t_with.
  Untraced (two runs each, 2-vCPU VMs): t_without 1.57-1.59 s, t_with 3.07-3.70 s for 300 steps, 48-58% lost,
  the spread being how fast a woken thread runs on the VM of the day. Traced the loss is larger, 0.69-0.72
  (t_with 5.2-5.6 s), and it is the observer effect of a uprobe, not a bias of the chain: a probed call lasts
  ~20 us longer on this VM (~10 us a trap), while the loop has released the GIL for it, long enough for the
  waiting metrics thread to wake and take the lock, so the loop loses a 5 ms switch interval on nearly every
  CUDA call instead of on some (FAKE_CUDA_LAUNCH_US=25 untraced, a call as long as a probed one, loses 0.71).
  The chain describes the run it recorded, so it is held to that run's loss: the GIL waits alone (the run-queue
  waits after each hand-over are cpu_contention's) less the sync waits they displaced (the GPU ran the queued
  kernels while the loop waited for the lock), within [0.6, 1.25] x the traced loss share. The untraced loss is
  measured too, and the traced one may only exceed it. On a faster VM (2026-11-27: untraced loss 0.43-0.45,
  traced 0.61-0.63) the waits alone read 0.82 of the steps, 1.3 x the loss: 0.9 s of the 3.4 s of waits
  overlapped the GPU's 4 ms a step, and the chain now reads 0.61.
- checkpoint_io.py: the run's own clock: the time inside ``save_checkpoint`` less the thread's waits for a CPU
  meanwhile (/proc/thread-self/schedstat), printed as ``save_own_share``: 0.13-0.15 of the loop untraced, against
  a with/without loss of 0.14-0.25 (three runs each; the disk and the other tests' load vary). The chain counts
  the D-state waits and the writes' kernel CPU, which is that own time: expected within [0.6, 1.4] x it.
- lock_wait.py: the loop's wall time untraced with and without its logging thread (which holds the lock the loop
  takes each step for 8 ms of every 8.5), measured here (the shorter of two runs each): 1.28 s against 2.64 s
  for 300 steps, 51% lost; 1.68 s against 3.79 s beside the suite, 56%. The chain counts the lock waits alone,
  in the run it recorded, so it is held to that run's own clock: the time in the lock's acquire less the loop's
  waits for a CPU meanwhile, over its wall (``lock_blocked_share``; 0.49 untraced beside the suite), within
  [0.7, 1.25] x it. Against the untraced loss it read 1.39 x under two loads (suite run 1 of stop 37): the load
  delays the holder's wake-up from its 8 ms write while it holds the lock, which lengthens the waits of the run
  recorded, and the shorter of two untraced runs is the one the load touched least.
- batch_build.py: the run's own clock in ``build_batch`` less its run-queue waits (``build_own_share``): 0.30-0.48
  untraced under load with 3 ms kernels (0.76-0.79 wall clock with the waits; 1.0 s vs 5.1-8.4 s for 300 steps
  with --rows 0); 0.81 on a quiet, faster VM with the fixture's 1 ms kernels (see its docstring). The
  chain's cost is the Python work between each sync and the next launch: expected within [0.7, 1.35] x it (the
  gap also holds the loop's own bookkeeping between build_batch and the launch).
"""

from __future__ import annotations

import re
import subprocess

import pytest
from _helpers import PY, WORKLOADS, Recording, cached, workload

from tracer.analysis.chains import CausalChain, compute_chains

pytestmark = pytest.mark.bpf


def marker_line(name: str, marker: str) -> int:
    """The line of fixtures/workloads/NAME whose code ends in ``# MARKER``."""
    for i, line in enumerate((WORKLOADS / name).read_text().splitlines(), 1):
        if re.search(rf"\S.*#\s*{marker}\s*$", line):
            return i
    raise AssertionError(f"no # {marker} in {name}")


def chains_of(r: Recording) -> list[CausalChain]:
    with r.conn() as c:
        return compute_chains(c, limit=100).chains


def one(chains: list[CausalChain], category: str) -> CausalChain:
    found = [c for c in chains if c.category == category]
    assert found, [(c.category, c.severity, c.share, c.summary) for c in chains]
    return found[0]


def printed(r: Recording, key: str) -> float:
    m = re.search(rf"{key}=([0-9.]+)", r.output)
    assert m, r.output
    return float(m.group(1))


def untraced_wall(*args: str) -> float:
    out = subprocess.run([str(PY), *args], capture_output=True, text=True, timeout=120, check=True).stderr
    return float(re.search(r"wall=([0-9.]+)s", out).group(1))


def loop_wall(r: Recording) -> float:
    """The loop's wall time, as the workload printed it in a recorded run."""
    return printed(r, r"gil_thread: steps=\d+ wall")


@pytest.fixture(scope="module")
def gil(tmp_path_factory):
    """The GIL recording, the loss its metrics thread caused in it (see the module docstring), and the loss
    untraced: the least disturbed of two runs each, as other tenants' load only ever adds time."""
    script = str(WORKLOADS / "gil_thread.py")
    untraced = 1 - min(untraced_wall(script, "--steps", "300", "--no-metrics") for _ in range(2)) / min(
        untraced_wall(script, "--steps", "300") for _ in range(2)
    )
    r = cached("stack-gil", tmp_path_factory, workload("gil_thread.py", "--steps", "300"), timeout=300)
    alone = cached("stack-gil-alone", tmp_path_factory, workload("gil_thread.py", "--steps", "300", "--no-metrics"))
    return r, 1 - loop_wall(alone) / loop_wall(r), untraced


@pytest.fixture(scope="module")
def lock(tmp_path_factory):
    script = str(WORKLOADS / "lock_wait.py")
    without = min(untraced_wall(script, "--no-logger") for _ in range(2))
    with_ = min(untraced_wall(script) for _ in range(2))
    r = cached("stack-lock", tmp_path_factory, workload("lock_wait.py"), timeout=300)
    return r, printed(r, "lock_blocked_share"), 1 - without / with_


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return cached("stack-checkpoint", tmp_path_factory, workload("checkpoint_io.py"), timeout=300)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return cached("stack-batch", tmp_path_factory, workload("batch_build.py"), timeout=300)


def test_gil_contention_names_the_metrics_thread_and_its_line(gil):
    # GIVEN a loop whose process runs a pure-Python metrics thread; WHEN chains are computed
    r, truth, untraced = gil
    ch = one(chains_of(r), "gil_contention")
    # THEN the waits are the training thread's, the culprit is the metrics thread at its hot line
    metrics_tid = int(re.search(r"metrics_tid=(\d+)", r.output).group(1))
    assert ch.severity == "HIGH" and ch.tid != metrics_tid and r.pid in ch.pids
    assert ch.culprit.tid == metrics_tid and ch.culprit.relation == "own_process"
    hot = marker_line("gil_thread.py", "GIL_HOT")
    assert ch.culprit.code_site.endswith(f"gil_thread.py:{hot} aggregate_metrics"), ch.culprit
    assert ch.culprit.comm == f"thread {metrics_tid} (aggregate_metrics, gil_thread.py:{hot})"
    # and its share is the loss the thread caused in the recorded run, within the band the module docstring
    # states; the probes' observer effect only ever adds to the untraced loss
    assert 0.6 * truth <= ch.share <= 1.25 * truth, (ch.share, truth, untraced)
    assert truth >= 0.9 * untraced, (truth, untraced)


def test_gil_contention_outranks_the_syncs_it_stretches(gil):
    r = gil[0]
    mine = [c for c in chains_of(r) if not (c.category == "cpu_contention" and c.evidence.holder_class == "other")]
    assert mine[0].category == "gil_contention", [(c.category, c.share) for c in mine]


def test_lock_contention_names_the_waiting_line_and_the_holders_line(lock):
    r, truth, loss = lock
    assert loss >= 0.3, loss  # the logger's lock costs the loop untraced (51 % on a quiet VM)
    ch = one(chains_of(r), "lock_contention")
    logger_tid = int(re.search(r"logger_tid=(\d+)", r.output).group(1))
    assert ch.severity == "HIGH" and ch.evidence.holders[0].tid == logger_tid == ch.culprit.tid
    wait, hold = marker_line("lock_wait.py", "LOCK_WAIT"), marker_line("lock_wait.py", "LOCK_HOLD")
    assert ch.evidence.waited_at[0].site.endswith(f"lock_wait.py:{wait} main"), ch.evidence.waited_at
    assert ch.culprit.code_site.endswith(f"lock_wait.py:{hold} emit"), ch.culprit
    assert 0.7 * truth <= ch.share <= 1.25 * truth, (ch.share, truth)


def test_checkpoint_is_blocking_io_at_its_lines_not_a_fault_storm(checkpoint):
    r = checkpoint
    chains = chains_of(r)
    ch = one(chains, "blocking_io")
    lines = {marker_line("checkpoint_io.py", m) for m in ("CKPT_WRITE", "CKPT_FSYNC")}
    top = ch.evidence.sites[0]
    assert any(top.site.split(" ")[0].endswith(f"checkpoint_io.py:{n}") for n in lines), ch.evidence.sites
    assert "save_checkpoint" in top.site and "fsync" in {s.call for s in ch.evidence.sites}
    assert ch.evidence.d_state_ms > 0 and ch.evidence.page_cache_bytes >= 10 * (48 << 20)
    truth = printed(r, "save_own_share")
    assert 0.6 * truth <= ch.share <= 1.4 * truth, (ch.share, truth)
    # the write's page cache is not a fault storm (issue 18: it was HIGH memory_pressure)
    storms = [c for c in chains if c.category == "memory_pressure" and c.evidence.trigger == "fault_storm"]
    assert not storms, [c.summary for c in storms]


def test_host_bound_loop_names_the_batch_building_line(batch):
    r = batch
    ch = one(chains_of(r), "host_python")
    hot = marker_line("batch_build.py", "BUILD_HOT")
    site = ch.evidence.hot_lines[0].site
    assert site.split(" ")[0].endswith(f"batch_build.py:{hot}") and "build_batch" in site, ch.evidence.hot_lines
    assert ch.evidence.hot_lines[0].share >= 0.7 and ch.severity == "HIGH"
    truth = printed(r, "build_own_share")
    assert 0.7 * truth <= ch.share <= 1.35 * truth, (ch.share, truth)


def test_off_cpu_rows_add_up_to_the_blocked_time(gil):
    # every blocked ns of the training thread outside calls is in offcpu_stacks, exactly
    r = gil[0]
    with r.conn() as c:
        for tid, blocked, stacked in c.execute(
            "SELECT b.tid, b.ns, coalesce(o.ns, 0) FROM (SELECT tid, sum(blocked_ns) ns FROM thread_breakdown "
            "GROUP BY tid) b LEFT JOIN (SELECT tid, sum(blocked_ns) ns FROM offcpu_stacks WHERE NOT in_call "
            "GROUP BY tid) o USING (tid)"
        ).fetchall():
            assert stacked == blocked, (tid, blocked, stacked)
        # and every thread of the job is sampled, the one that never calls CUDA included
        sampled = {t for (t,) in c.execute("SELECT DISTINCT tid FROM cpu_samples").fetchall()}
        threads = {t for (t,) in c.execute("SELECT tid FROM threads").fetchall()}
        assert sampled == threads and c.execute("SELECT sample_hz FROM session").fetchone()[0] == 99


@pytest.mark.parametrize("name", ["gil", "lock", "checkpoint", "batch"])
def test_the_chains_leave_at_most_a_tenth_of_the_training_threads_time_unexplained(name, request):
    # GIVEN each workload of this module; WHEN its chains are computed
    r = request.getfixturevalue(name)
    r = r[0] if isinstance(r, tuple) else r
    with r.conn() as c:
        cv = compute_chains(c, limit=100).coverage
    # THEN the parts of 5% or more of the training thread's steps are explained, but for 10% at most
    assert cv is not None and cv.unexplained_share <= 0.10, [(p.part, p.share, p.explained_by) for p in cv.parts]
