"""chains.cpu_placement: a thread that waited for a CPU behind its own workers while CPUs outside its affinity
had room, or while its cgroup's quota was used up, gets a chain whose root is the placement and whose advice
names the setting to change (taskset, Slurm, the quota); cpu_contention leaves that wait to it; recordings
without the placement tables get no such chain."""

from __future__ import annotations

import pytest
from tracedb import HOG_PID, MAIN_PID, MS, builder

from tracer.analysis.chains import compute_chains
from tracer.analysis.chains.cpu_placement import CATEGORY, explains
from tracer.analysis.db import open_trace

WORKER = MAIN_PID + 1


def chains(tmp_path, b):
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        return compute_chains(c, limit=100).chains


def behind(b, pid: int, comm: str, ms: float = 17) -> None:
    """The training thread waits ``ms`` for a CPU held by ``pid`` in every 100 ms step, the whole run."""
    for i in range(600):
        b.off_cpu(
            i * 100 * MS + 3 * MS, int(ms * MS), reason="preempted", runq_ns=int(ms * MS), by_pid=pid, by_comm=comm
        )


def confined(exec_from: str | None = "taskset -c 0 python train.py", env: str | None = None, idle: float = 0.95):
    b = builder("healthy")
    behind(b, WORKER, "pt_data_worker")
    b.placement(MAIN_PID, "0", exec_from=exec_from, env=env)
    b.idle_cpus({0: 0.0, 1: idle})
    return b


def test_confined_by_taskset_is_the_root_not_the_workers(tmp_path):
    # GIVEN the job pinned by `taskset -c 0` to CPU 0 of 2, its worker holding that CPU 17% of the steps, CPU 1 idle
    found = chains(tmp_path, confined())
    (ch,) = [c for c in found if c.category == CATEGORY]
    # THEN the wait is the placement's, with the pin and its setter named and the affinity widened as the fix
    assert ch.severity == "MEDIUM" and ch.share == pytest.approx(0.17, abs=0.01)
    assert ch.root is not None and ch.root.kind == "placement"
    assert "affinity {0} of 2 CPUs" in ch.root.detail and "taskset -c 0" in ch.root.detail
    assert "CPU 1 idle 95%" in ch.root.detail
    assert ch.evidence.trigger == "confined" and ch.evidence.cpus_allowed == "0"
    assert "Widen the affinity" in ch.recommendations[0] and "taskset" in ch.recommendations[0]
    assert [h.edge for h in ch.path] == ["start", "cpu_held_by"]
    assert (ch.path[0].tid, ch.path[0].role) == (MAIN_PID, "training")
    assert (ch.path[1].pid, ch.path[1].role) == (WORKER, "worker")
    # AND no cpu_contention chain tells it to lower num_workers
    assert not [c for c in found if c.category == "cpu_contention" and c.explained_by is None]


def test_unpinned_job_keeps_its_contention(tmp_path):
    # GIVEN the same waits with the job free to use both CPUs
    b = builder("healthy")
    behind(b, WORKER, "pt_data_worker")
    b.placement(MAIN_PID, "0-1")
    b.idle_cpus({0: 0.0, 1: 0.0})
    found = chains(tmp_path, b)
    # THEN nothing is put on the placement: its own workers are the cause
    assert not [c for c in found if c.category == CATEGORY]
    (own,) = [c for c in found if c.category == "cpu_contention"]
    assert own.evidence.holder_class == "own" and "num_workers" in own.recommendations[0]


def test_other_tenants_on_its_cpu_stay_cpu_contention(tmp_path):
    # GIVEN the pinned job waiting behind another tenant's hog on its CPU (not its own threads)
    b = builder("healthy")
    behind(b, HOG_PID, "stress-ng")
    b.placement(MAIN_PID, "0", exec_from="taskset -c 0 python train.py")
    b.idle_cpus({0: 0.0, 1: 0.9})
    found = chains(tmp_path, b)
    # THEN the hog is named, not the placement
    assert not [c for c in found if c.category == CATEGORY]
    (other,) = [c for c in found if c.category == "cpu_contention"]
    assert other.evidence.holder_class == "other" and other.explained_by is None


def test_a_busy_cpu_outside_still_leaves_room(tmp_path):
    # GIVEN CPU 1 fully busy with another tenant: a fair share of it was still open to the pinned job
    found = chains(tmp_path, confined(idle=0.0))
    (ch,) = [c for c in found if c.category == CATEGORY]
    # THEN part of the wait (not all) is the placement's: its 0.17 waiting CPUs would get 0.17 / 1.17 of a CPU
    # there, so 0.145 of the 0.17
    assert ch.share == pytest.approx(0.17 / 1.17, abs=0.005)
    assert "busy with other processes" in ch.root.detail


def test_slurm_is_named_when_its_environment_placed_it(tmp_path):
    found = chains(tmp_path, confined(exec_from=None, env="SLURM_CPUS_PER_TASK=1 SLURM_JOB_ID=77"))
    (ch,) = [c for c in found if c.category == CATEGORY]
    assert "Slurm" in ch.evidence.set_by and "--cpus-per-task=" in ch.recommendations[0]


def test_throttled_by_its_quota(tmp_path):
    # GIVEN the job in a cgroup with half a CPU, throttled 400 ms a second, waiting 17 ms a step behind a worker
    b = builder("healthy")
    behind(b, WORKER, "pt_data_worker")
    b.placement(MAIN_PID, "0-1", cgroup="/job", limit_cgroup="/job", quota_us=50_000, period_us=100_000)
    b.idle_cpus({0: 0.3, 1: 0.3})
    b.throttling("/job", 50_000, 100_000, 400 * MS)
    found = chains(tmp_path, b)
    (ch,) = [c for c in found if c.category == CATEGORY]
    # THEN the quota is the root and the fix raises it
    assert ch.evidence.trigger == "throttled" and ch.evidence.quota_cpus == 0.5
    assert ch.root.kind == "placement" and "cgroup /job quota 0.50 CPUs" in ch.root.detail
    assert "Raise the CPU quota of cgroup /job" in ch.recommendations[0]
    assert ch.share == pytest.approx(0.17, abs=0.01)
    assert not [c for c in found if c.category == "cpu_contention" and c.explained_by is None]


def test_recording_without_placement_tables(tmp_path):
    # GIVEN an older recording: no process_placement, cpu_idle or cgroup_cpu at all
    b = builder("healthy")
    behind(b, WORKER, "pt_data_worker")
    found = chains(tmp_path, b)
    with open_trace(tmp_path / "t.duckdb") as c:
        tables = {r[0] for r in c.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    assert "process_placement" not in tables
    # THEN the chains are today's: the workers' contention, no placement
    assert not [c for c in found if c.category == CATEGORY]
    assert [c.evidence.holder_class for c in found if c.category == "cpu_contention"] == ["own"]


def test_own_contention_is_the_placements_from_a_third_of_their_waits(tmp_path):
    # GIVEN the thread's own-job contention (unpinned) and a placement chain of the same thread
    b = builder("healthy")
    behind(b, WORKER, "pt_data_worker")
    b.placement(MAIN_PID, "0-1")
    b.idle_cpus({0: 0.0, 1: 0.0})
    (own,) = [c for c in chains(tmp_path, b) if c.category == "cpu_contention"]
    (tmp_path / "p").mkdir()
    (p,) = [c for c in chains(tmp_path / "p", confined()) if c.category == CATEGORY]
    # THEN the placement explains it when it costs at least half as much (a third of their waits together): four
    # CPU-bound workers pinned beside the training thread on two CPUs stay a contention of their own
    (kept, _) = explains([own, p.model_copy(update={"impact_ms": 0.4 * own.impact_ms})])
    assert kept.explained_by is None
    (marked, _) = explains([own, p.model_copy(update={"impact_ms": 0.6 * own.impact_ms})])
    assert marked.explained_by == p.id and "placement comes first" in marked.summary
