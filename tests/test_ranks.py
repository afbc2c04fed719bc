"""tracer.analysis.ranks and the straggler_rank chain on hand-built recordings of a 3-rank job whose every number
is known: each rank steps in lockstep (load a batch, compute, all_reduce, wait for the GPU); the all_reduce
returns on every rank EXCHANGE after the last rank arrives, so a rank waits there for the slowest one.

Ground truth of :func:`job` (built, so exact): a rank that is not slow waits ``slow_ms + EXCHANGE`` per slow step
in the all_reduce, the slow rank EXCHANGE; the slow rank spends ``slow_ms`` more per slow step in its load phase
(asleep, or on CPU). The analysis compares the ranks over the whole seconds in which all of them were stepping
(:func:`steps_in_window` counts the steps there). Tolerances are the one thing the builder does not decide: the
window's two ends cut a step each (the time of the cut steps and the one sync counted for them differ by at most
a step's slow part, slow_ms), and the blocked time at each end is split by wakers whose wakeup may lie just
outside the window (one wait of <= slow_ms + EXCHANGE per end): (20 + 2 * 20.5) ms over the ~230 steps of 6 s is
0.27 ms per step, and the values are rounded to 0.01 ms.
"""

from __future__ import annotations

import duckdb
import pytest

from tests.support.builder import MS, US, S, TraceBuilder
from tracer.analysis.chains import compute_chains
from tracer.analysis.db import open_trace
from tracer.analysis.ranks.report import ranks_report
from tracer.analysis.recording import load_recording

AGENT, RANK_PIDS = 3000, (3001, 3002, 3003)
COMM_TID = 100  # each rank's gloo thread is its pid + COMM_TID
LOAD_MS, COMPUTE_MS, EXCHANGE_MS, GPU_MS = 3.0, 2.0, 0.5, 0.0
JOB = "run-1"
# per-step tolerance: see the module docstring
PER_STEP_MS = 0.3
# the lines each step's calls come from: copy the batch (after loading it), launch (after computing), sync (after
# the all_reduce)
SITES = ((41, "cudaMemcpyAsync"), (45, "cudaLaunchKernel"), (48, "cudaStreamSynchronize"))


def _stack(line: int, op: str) -> list[tuple]:
    return [
        ("python", "train.py", "<module>", "train.py", 60),
        ("python", "train.py", "step", "train.py", line),
        ("cuda", "libcudart.so.12", op, None, None),
    ]


def job(
    slow_rank: int | None = 2,
    slow_ms: float = 20.0,
    kind: str = "sleep",
    steps: int = 300,
    slow_steps: tuple[int, int] | None = None,
    gpu_ms: float = GPU_MS,
    blip: tuple[int, float] | None = None,
) -> TraceBuilder:
    """A 3-rank job; ``blip`` (step, ms): the slow rank on the CPU that much longer in that one step too."""
    b = TraceBuilder(duration_s=60, target="torchrun --nproc-per-node 3 train.py")
    b.process(AGENT, "pt_elastic", ppid=1)
    for rank, pid in enumerate(RANK_PIDS):
        b.process(pid, "python", ppid=AGENT, first_ns=100 * MS)
        b.processes[-1].update(rank=rank, local_rank=rank, world_size=3, job_id=JOB)
        b.thread(pid, pid + COMM_TID, "pt_gloo_runloop")
    b.processes[0].update(launcher="torchrun")
    copy_at, launch_at, sync_at = (b.stack(_stack(line, op)) for line, op in SITES)
    t = 1_000 * MS  # the loop starts at 1 s
    a, z = slow_steps or (0, steps)
    for i in range(steps):
        extra = slow_ms if slow_rank is not None and a <= i < z else 0.0
        arrive = {}
        for rank, pid in enumerate(RANK_PIDS):
            load = LOAD_MS + (extra if rank == slow_rank else 0.0)
            if blip and i == blip[0] and rank == slow_rank:
                load += blip[1]
            if rank == slow_rank and extra and kind == "sleep":
                b.off_cpu(t + 20 * US, int(extra * MS), pid=pid, waker_pid=0, waker_tid=0, waker_comm="[timer]")
            copy = t + int(load * MS)
            b.call(copy, 10 * US, "cudaMemcpyAsync", pid=pid, bytes=4096, kind="HtoD", stack_id=copy_at)
            b.call(copy + int(COMPUTE_MS * MS), 10 * US, "cudaLaunchKernel", pid=pid, stack_id=launch_at)
            arrive[rank] = copy + int(COMPUTE_MS * MS) + 20 * US
        done = max(arrive.values()) + int(EXCHANGE_MS * MS)
        for rank, pid in enumerate(RANK_PIDS):
            b.off_cpu(
                arrive[rank], done - arrive[rank], pid=pid, waker_pid=pid, waker_tid=pid + COMM_TID,
                waker_comm="pt_gloo_runloop",
            )  # fmt: skip
            b.call(done + 10 * US, int(gpu_ms * MS) + 20 * US, "cudaStreamSynchronize", pid=pid, stack_id=sync_at)
        t = done + int(gpu_ms * MS) + 100 * US
    b.duration_s = t / 1e9 + 1
    return b


def steps_in_window(b: TraceBuilder) -> int:
    """The steps the analysis compares the ranks over (built truth): the syncs of a rank in the whole seconds
    where every rank was stepping, from the last rank's first launch to the first rank's last sync's end."""
    start = max(
        min(r["ts_ns"] for r in b.cuda_calls if r["pid"] == p and r["op"] == "cudaLaunchKernel") for p in RANK_PIDS
    )
    end = min(
        max(r["ts_ns"] + r["dur_ns"] for r in b.cuda_calls if r["pid"] == p and r["op"] == "cudaStreamSynchronize")
        for p in RANK_PIDS
    )
    a, z = -(-start // S) * S, end // S * S
    syncs = [r for r in b.cuda_calls if r["pid"] == RANK_PIDS[0] and r["op"] == "cudaStreamSynchronize"]
    return sum(1 for r in syncs if a <= r["ts_ns"] < z)


def _write(tmp_path, b: TraceBuilder):
    b.write(tmp_path / "t.duckdb")
    return open_trace(tmp_path / "t.duckdb")


def _straggler_chains(c: duckdb.DuckDBPyConnection):
    return [x for x in compute_chains(c, limit=100).chains if x.category == "straggler_rank"]


def test_roles_ranks_and_launcher(tmp_path):
    b = job()
    # a DataLoader worker forked by rank 1 inherits its environment, so its rank: it is not a rank of its own
    b.process(3010, "pt_data_worker", ppid=RANK_PIDS[1])
    b.processes[-1].update(rank=1, local_rank=1, world_size=3, job_id=JOB)
    with _write(tmp_path, b) as c:
        info = load_recording(c)
    assert info.rank_pids == {3001: 0, 3002: 1, 3003: 2}
    assert [info.process_role(p) for p in (AGENT, *RANK_PIDS, 3010)] == [
        "launcher",
        "rank",
        "rank",
        "rank",
        "dataloader_worker",
    ]


def test_the_sleeping_rank_is_the_straggler_and_the_others_wait_for_it(tmp_path):
    b = job(slow_rank=2, slow_ms=20, kind="sleep")
    with _write(tmp_path, b) as c:
        (ch,) = _straggler_chains(c)
        rep = ranks_report(c)
    ev = ch.evidence
    assert (ev.rank, ev.pid, ev.phase, ev.world_size, ev.job_id) == (2, 3003, "asleep", 3, JOB)
    assert ev.steps == steps_in_window(b)
    # truth: 20 ms more asleep per step; ranks 0 and 1 wait 20 ms per step more than rank 2 in the all_reduce
    assert ev.phase_excess_ms_per_step == pytest.approx(20, abs=PER_STEP_MS)
    assert ev.lost_ms_per_step == pytest.approx(20, abs=PER_STEP_MS)
    assert sorted(w.rank for w in ev.waiting) == [0, 1]
    assert all(w.extra_wait_ms_per_step == pytest.approx(20, abs=PER_STEP_MS) for w in ev.waiting)
    assert ev.persistent and ch.severity == "HIGH" and ch.culprit.pid == 3003 and ch.culprit.relation == "peer_rank"
    assert sorted(ch.pids) == sorted(RANK_PIDS) and ch.tid in (3001, 3002)
    # where: the load lies between a step's sync and the next batch's copy; the all_reduce between launch and sync
    assert ev.straggler_stretch == (
        "between cudaStreamSynchronize at train.py:48 step and cudaMemcpyAsync at train.py:41 step"
    )
    assert (
        ev.wait_stretch == "between cudaLaunchKernel at train.py:45 step and cudaStreamSynchronize at train.py:48 step"
    )
    assert "Rank 2 (pid 3003" in ch.summary and "ranks 0 and 1 wait" in ch.summary
    # the table: one row per rank, the straggler marked, per-step phases
    assert [(r.rank, r.straggler) for r in rep.ranks] == [(0, False), (1, False), (2, True)]
    rows = {r.rank: r for r in rep.ranks}
    assert rows[2].phases_ms_per_step["asleep"] == pytest.approx(20, abs=PER_STEP_MS)
    assert rows[0].phases_ms_per_step["collective"] == pytest.approx(20 + EXCHANGE_MS, abs=PER_STEP_MS)
    assert rows[2].phases_ms_per_step["collective"] == pytest.approx(EXCHANGE_MS, abs=PER_STEP_MS)
    assert rep.launchers[0].pid == AGENT and rep.chain_id == ch.id
    # the path (issue 28): the waiting rank waited in the collective for rank 2, which carries all of that time
    assert [(h.pid, h.edge, h.role, h.share, h.ms) for h in ch.path[:2]] == [
        (ch.tid, "start", "rank", 1.0, ev.lost_ms),
        (3003, "collective", "rank", 1.0, ev.lost_ms),
    ]


def test_a_rank_slow_on_cpu(tmp_path):
    with _write(tmp_path, job(slow_rank=0, slow_ms=10, kind="cpu")) as c:
        (ch,) = _straggler_chains(c)
    assert (ch.evidence.rank, ch.evidence.phase) == (0, "cpu")
    assert ch.evidence.phase_excess_ms_per_step == pytest.approx(10, abs=PER_STEP_MS)
    assert ch.evidence.lost_ms_per_step == pytest.approx(10, abs=PER_STEP_MS)
    # its path ends on rank 0's CPU: the straggler's own work is the root
    assert [(h.pid, h.edge, h.state) for h in ch.path] == [(ch.tid, "start", "blocked"), (3001, "collective", "on_cpu")]
    assert ch.root is not None and ch.root.kind == "on_cpu"


def test_a_short_job_is_compared_over_its_one_whole_second(tmp_path):
    # GIVEN a job of 80 steps, rank 2 on the CPU 20 ms longer each: a 2.05 s loop from 1.0 s, one whole second
    # inside it; after its last step rank 2 sleeps while ranks 0 and 1 tear down on the CPU (as a real job's ranks
    # did: the edge seconds are not like the loop's)
    b = job(slow_rank=2, slow_ms=20, kind="cpu", steps=80)
    end = max(r["ts_ns"] + r["dur_ns"] for r in b.cuda_calls if r["pid"] == RANK_PIDS[2])
    b.off_cpu(end + 10 * US, int(b.duration_s * S) - end - 20 * US, pid=RANK_PIDS[2], waker_pid=0, waker_comm="[timer]")
    with _write(tmp_path, b) as c:
        (ch,) = _straggler_chains(c)
    # THEN the ranks are compared over that second, not its edges pro-rated: its steps, and the 20 ms a step
    assert ch.evidence.steps == steps_in_window(b) > 30
    assert ch.evidence.phase_excess_ms_per_step == pytest.approx(20, abs=PER_STEP_MS)


def test_a_healthy_job_has_no_straggler(tmp_path):
    with _write(tmp_path, job(slow_rank=None)) as c:
        assert _straggler_chains(c) == []
        rep = ranks_report(c)
    assert len(rep.ranks) == 3 and rep.straggler is None and not any(r.straggler for r in rep.ranks)


def test_a_straggler_confined_to_a_window(tmp_path):
    # steps 1000-1099 of 2100 are slow (20 ms more): 2.4 s in the middle of a 10 s loop
    b = job(slow_rank=1, slow_ms=20, steps=2100, slow_steps=(1000, 1100))
    with _write(tmp_path, b) as c:
        (ch,) = _straggler_chains(c)
    ev = ch.evidence
    assert ev.rank == 1 and not ev.persistent
    # truth (built): the slow steps start at step 1000's start and end at step 1100's start
    sync = sorted(r["ts_ns"] for r in b.cuda_calls if r["op"] == "cudaStreamSynchronize" and r["pid"] == 3002)
    start, end = sync[999], sync[1099]  # the end of the step before each
    # the hot range is whole seconds (the breakdown's grain), clipped to the window: the slow steps and < 1 s more
    assert ch.start_ns <= start < ch.start_ns + 10**9 and ch.end_ns - 10**9 < end <= ch.end_ns
    assert "confined" in ch.summary
    # the others lost 20 ms in each of the 100 slow steps
    assert ev.lost_ms == pytest.approx(100 * 20, abs=2100 * PER_STEP_MS / 10)


def test_a_lone_hot_second_is_left_out_of_the_straggler_s_range(tmp_path):
    # GIVEN the confined straggler above, and one step 1,700 (~4 s after its slowdown) where it lost the CPU for
    # 300 ms (a busy host): one hot second on its own
    b = job(slow_rank=1, slow_ms=20, steps=2100, slow_steps=(1000, 1100), blip=(1700, 300.0))
    sync = sorted(r["ts_ns"] for r in b.cuda_calls if r["op"] == "cudaStreamSynchronize" and r["pid"] == 3002)
    with _write(tmp_path, b) as c:
        (ch,) = _straggler_chains(c)
    # THEN the range is the slowdown's seconds, not stretched to the lone second
    assert ch.start_ns <= sync[999] < ch.start_ns + 10**9 and ch.end_ns - 10**9 < sync[1099] <= ch.end_ns
    assert ch.end_ns < sync[1699] and not ch.evidence.persistent


@pytest.mark.parametrize("after", [1, 2])
def test_a_hot_second_of_another_cause_near_the_slowdown_is_left_out_of_its_range(tmp_path, after: int):
    # GIVEN the confined straggler above, asleep, and a step ``after`` seconds past its slowdown where it was on the
    # CPU 300 ms longer (a busy host took its CPU): a hot second one cool second from the slowdown, or beside it
    steps_per_s = round(1000 / (LOAD_MS + COMPUTE_MS + EXCHANGE_MS + GPU_MS + 0.1))  # a healthy step: 178 a second
    blip = 1100 + after * steps_per_s
    b = job(slow_rank=1, slow_ms=20, steps=2100, slow_steps=(1000, 1100), blip=(blip, 300.0))
    sync = sorted(r["ts_ns"] for r in b.cuda_calls if r["op"] == "cudaStreamSynchronize" and r["pid"] == 3002)
    with _write(tmp_path, b) as c:
        (ch,) = _straggler_chains(c)
    # THEN the range is the seconds it was asleep in, not stretched to the second it was slow on the CPU
    assert ch.evidence.phase == "asleep" and not ch.evidence.persistent
    assert ch.start_ns <= sync[999] < ch.start_ns + 10**9 and ch.end_ns - 10**9 < sync[1099] <= ch.end_ns
    assert ch.end_ns <= sync[blip - 1], (ch.end_ns, sync[blip - 1])


def test_waiting_ranks_gpu_waits_are_explained_by_the_straggler(tmp_path):
    # each step also waits 30 ms for the GPU after the all_reduce: every rank gets a sync_stall chain of its own
    with _write(tmp_path, job(slow_rank=2, slow_ms=20, gpu_ms=30)) as c:
        res = compute_chains(c, limit=100)
    (st,) = [x for x in res.chains if x.category == "straggler_rank"]
    stalls = {x.tid: x for x in res.chains if x.category == "sync_stall"}
    assert set(stalls) == set(RANK_PIDS)
    # THEN the waiting ranks' chains point at the straggler chain and rank after every cause; the straggler's own
    # sync_stall stays a cause
    assert stalls[3001].explained_by == st.id and stalls[3002].explained_by == st.id
    assert stalls[3003].explained_by is None
    order = [x.id for x in res.chains]
    assert order.index(stalls[3001].id) > order.index(stalls[3003].id)
    assert "straggler rank 2" in stalls[3001].summary


def test_a_recording_without_rank_columns_reads(tmp_path):
    # a v2 recording: processes without the v3 columns
    job().write(tmp_path / "t.duckdb")
    with duckdb.connect(str(tmp_path / "t.duckdb")) as c:
        for col in ("rank", "local_rank", "node_rank", "world_size", "job_id", "launcher"):
            c.execute(f"ALTER TABLE processes DROP COLUMN {col}")
    with open_trace(tmp_path / "t.duckdb") as c:
        info = load_recording(c)
        rep = ranks_report(c)
        assert _straggler_chains(c) == []
    assert info.rank_pids == {} and info.process_role(AGENT) == "main"
    assert rep.ranks == [] and "schema v3" in rep.note


def test_ranks_without_an_environment_come_from_their_nccl_communicator(tmp_path):
    # GIVEN the job with no rank in any process's environment (a launcher the recorder does not know), but each
    # rank's ncclCommInitRank recorded: the world's communicator (3 ranks, one id), and for rank 0 also a
    # communicator of its own (1 rank) and one that failed
    job().write(tmp_path / "t.duckdb")
    world, solo = 0xC0FFEE, 0xBEEF
    with duckdb.connect(str(tmp_path / "t.duckdb")) as c:
        c.execute("UPDATE processes SET rank = NULL, local_rank = NULL, world_size = NULL, job_id = NULL")
        rows = [(500 * MS + r, pid, pid, 0x1000 + r, world, 3, r, 0) for r, pid in enumerate(RANK_PIDS)]
        rows += [(400 * MS, RANK_PIDS[0], RANK_PIDS[0], 0x2000, solo, 1, 0, 0)]
        rows += [(300 * MS, RANK_PIDS[1], RANK_PIDS[1], 0, 0xBAD, 8, 5, 3)]
        c.executemany(
            "INSERT INTO nccl_comms (ts_ns, pid, tid, comm, id_hash, nranks, rank, ret, dur_ns) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1000)",
            rows,
        )
    with open_trace(tmp_path / "t.duckdb") as c:
        info = load_recording(c)
        (ch,) = _straggler_chains(c)
    # THEN each rank is the world communicator's rank, of one job named by that communicator
    assert info.rank_pids == dict(zip(RANK_PIDS, range(3), strict=True))
    assert {info.procs[p].job_id for p in RANK_PIDS} == {f"nccl:{world:016x}"}
    # AND the straggler is named as with the environment's ranks
    assert (ch.evidence.rank, ch.evidence.pid, ch.evidence.world_size) == (2, 3003, 3)


def test_get_ranks_over_mcp_returns_the_report(tmp_path):
    import anyio
    from mcp import Client

    from mcp_server.server import build_server

    db = job().write(tmp_path / "t.duckdb")

    async def go():
        async with Client(build_server(db)) as c:
            return await c.call_tool("get_ranks", {})

    r = anyio.run(go)
    with open_trace(db) as c:
        want = ranks_report(c).model_dump(mode="json")
    # the MCP tool and `tracer ranks --json` are one record
    assert not r.is_error and r.structured_content == want
    assert r.structured_content["straggler"]["rank"] == 2


def test_a_restarted_rank_is_its_latest_process_and_one_job_is_compared(tmp_path):
    b = job()
    # torchrun restarted rank 1: its first process ran before the loop and exited
    b.process(3020, "python", ppid=AGENT, first_ns=50 * MS, exit_ns=900 * MS)
    b.processes[-1].update(rank=1, local_rank=1, world_size=3, job_id=JOB)
    b.off_cpu(100 * MS, 10 * MS, pid=3020, waker_pid=0, waker_tid=0, waker_comm="[timer]")
    # and a second job's lone rank ran beside it
    b.process(3030, "python", ppid=1, first_ns=50 * MS)
    b.processes[-1].update(rank=0, world_size=1, job_id="other-job")
    b.off_cpu(100 * MS, 10 * MS, pid=3030, waker_pid=0, waker_tid=0, waker_comm="[timer]")
    with _write(tmp_path, b) as c:
        rep = ranks_report(c)
    assert [(r.rank, r.pid) for r in rep.ranks] == [(0, 3001), (1, 3002), (2, 3003)]
    assert rep.job_id == JOB and "2 jobs in this recording" in rep.note and rep.straggler.rank == 2
