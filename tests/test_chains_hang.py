"""The hang chain on hand-built recordings (tracer.analysis.chains.hang): which job is hung, and who is named.

The truth is built in: each recording states where each thread is stuck (its snapshot) and since when, and
whether its loop stepped. The real jobs (torchrun, a deadlock, a sync that never returns, a dead worker) are
tests/integration/test_hang_real.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

from tests.tracedb import MS, S, TraceBuilder, insert_rows
from tracer.analysis.chains import compute_chains

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
TRAIN = "/job/train.py"


def frames(*fs: tuple[str, str, int]) -> str:
    return json.dumps([{"function": f, "file": p, "line": n} for f, p, n in fs])


def snap(pid: int, tid: int, at: int, blocked_ns: int | None, syscall: str, fr: str, **kw) -> dict:
    return dict(ts_ns=at, reason=kw.get("reason", "end"), pid=pid, tid=tid, comm=kw.get("comm", "python"),
                rank=kw.get("rank"), state=kw.get("state", "sleeping"), syscall=syscall, wchan=kw.get("wchan", ""),
                blocked_since_ns=None if blocked_ns is None else at - blocked_ns, native="", frames=fr,
                waits_on=kw.get("waits_on", ""))  # fmt: skip


def write(tmp: Path, b: TraceBuilder, snaps: list[dict], ranks: dict[int, int] | None = None) -> Path:
    db = b.write(tmp / "t.duckdb")
    with duckdb.connect(str(db)) as con:
        for pid, r in (ranks or {}).items():
            con.execute(
                "UPDATE processes SET rank = ?, world_size = ?, job_id = 'j' WHERE pid = ?", [r, len(ranks), pid]
            )
        insert_rows(con, "thread_snapshots", snaps)
    return db


def chains_of(db: Path) -> list:
    with duckdb.connect(str(db), read_only=True) as con:
        return compute_chains(con, limit=100).chains


def hung_ranks(tmp: Path, stuck_running: bool = False, other: bool = False) -> Path:
    """Three ranks of a gloo job attached after the hang: ranks 0 and 2 in all_reduce, rank 1 in an open (or,
    with ``stuck_running``, on the CPU: a rank stuck in a loop of its own) for the whole 10 s recording. With
    ``other``, a second job (pid 500) runs beside it, as under the node agent."""
    b = TraceBuilder(duration_s=10.0)
    end = 10 * S
    if other:
        b.process(500, "python", cmdline="other.py")
        b.thread(500, 500, "python")
    b.process(100, "python", cmdline="torchrun")
    snaps = []
    for r, pid in enumerate((101, 102, 103)):
        b.process(pid, "python", ppid=100)
        b.thread(pid, pid, "python")
        b.thread(pid, pid + 1000, "gloo")  # a gloo thread's short timer waits
        b.off_cpu(1 * S, 13 * MS, pid=pid, tid=pid + 1000)  # a gloo thread's timer wait: its worst off-CPU time
        if r == 1 and stuck_running:  # on the CPU all along: no off-CPU interval
            snaps.append(snap(pid, pid, end, 0, "", frames(("decode", TRAIN, 30), ("main", TRAIN, 50)),
                              rank=r, state="running"))  # fmt: skip
            continue
        b.off_cpu(0, end, pid=pid, tid=pid)  # blocked all along
        if r == 1:
            snaps.append(snap(pid, pid, end, 40 * S, "openat", frames(("load", TRAIN, 42), ("main", TRAIN, 50)),
                              rank=r, waits_on="/mnt/nfs/shard-7.bin", wchan="rpc_wait_bit_killable"))  # fmt: skip
        else:
            fr = frames(("all_reduce", C10D, 3252), ("main", TRAIN, 58))
            snaps.append(snap(pid, pid, end, 41 * S, "futex", fr, rank=r))
        snaps.append(snap(pid, pid + 1000, end, 2 * MS, "epoll_wait", "[]", rank=r, comm="gloo"))
    return write(tmp, b, snaps, {101: 0, 102: 1, 103: 2})


def test_hung_ranks_name_the_rank_outside_the_collective(tmp_path: Path) -> None:
    (c,) = [c for c in chains_of(hung_ranks(tmp_path)) if c.category == "hang"]
    assert c.severity == "HIGH"
    ev = c.evidence
    assert ev.ranks_stuck == [1] and c.culprit.pid == 102 and c.culprit.kind == "rank"
    assert c.culprit.code_site == f"{TRAIN}:42 load"
    assert {t.rank for t in ev.waiting} == {0, 2} and {t.collective for t in ev.waiting} == {"all_reduce"}
    assert {t.site for t in ev.waiting} == {f"{TRAIN}:58 main"}
    assert c.root.kind == "hung" and "/mnt/nfs/shard-7.bin" in c.root.detail
    assert any("findmnt -T /mnt/nfs/shard-7.bin" in r for r in c.recommendations)
    assert [h.edge for h in c.path] == ["start", "collective"] and c.path[-1].pid == 102
    assert not [t for t in ev.waiting + ev.stuck if t.comm == "gloo"]  # threads without Python frames: not listed


def test_asked_about_another_job_s_pid_the_hang_is_not_listed(tmp_path: Path) -> None:
    # GIVEN the hung ranks and another job beside them; WHEN the chains of one pid are asked for
    db = hung_ranks(tmp_path, other=True)
    with duckdb.connect(str(db), read_only=True) as con:
        other = compute_chains(con, pid=500, limit=100).chains
        rank = compute_chains(con, pid=102, limit=100).chains
    # THEN the other job's pid gets no hang chain (it was listed), and a rank's gets the job's, judged whole
    assert not [c for c in other if c.category == "hang"]
    ((c,),) = [[c for c in rank if c.category == "hang"]]
    assert c.culprit.pid == 102 and c.pids == [101, 102, 103]


def test_a_hang_leads_the_chains(tmp_path: Path) -> None:
    assert chains_of(hung_ranks(tmp_path))[0].category == "hang"


def test_a_rank_running_outside_the_collective_is_named(tmp_path: Path) -> None:
    """Rank 1 spins on the CPU in its own code while ranks 0 and 2 wait in all_reduce."""
    (c,) = [c for c in chains_of(hung_ranks(tmp_path, stuck_running=True)) if c.category == "hang"]
    assert c.evidence.ranks_stuck == [1] and c.culprit.code_site == f"{TRAIN}:30 decode"
    assert c.evidence.stuck[0].doing == "running on CPU"


def test_worst_stall_is_the_stuck_main_thread(tmp_path: Path) -> None:
    """A rank's worst stall is its main thread's wait since before the recording (its snapshot), clipped to the
    recording, not its gloo thread's 13 ms."""
    from tracer.analysis.stats import process_rows

    with duckdb.connect(str(hung_ranks(tmp_path)), read_only=True) as con:
        worst = {r.pid: r.worst_stall_ms for r in process_rows(con)}
    assert worst[101] == 10_000.0 and worst[102] == 10_000.0


def test_deadlock_named(tmp_path: Path) -> None:
    b = TraceBuilder(duration_s=10.0)
    b.process(300, "python")
    for tid in (300, 301, 302):
        b.thread(300, tid, "python")
        b.off_cpu(0, 10 * S, pid=300, tid=tid)
    join = frames(("_wait_for_tstate_lock", "/usr/lib/python3.11/threading.py", 1132), ("main", TRAIN, 20))
    db = write(tmp_path, b, [
        snap(300, 300, 10 * S, 30 * S, "futex", join),
        snap(300, 301, 10 * S, 30 * S, "futex", frames(("take_a_then_b", TRAIN, 11)), comm="t1"),
        snap(300, 302, 10 * S, 30 * S, "futex", frames(("take_b_then_a", TRAIN, 16)), comm="t2"),
    ])  # fmt: skip
    (c,) = [c for c in chains_of(db) if c.category == "hang"]
    assert "deadlock" in c.summary and f"{TRAIN}:11 take_a_then_b" in c.summary and f"{TRAIN}:16" in c.summary
    assert {t.doing for t in c.evidence.stuck if t.tid != 300} == {"waits for a lock"}
    assert any("global order" in r for r in c.recommendations)


def test_old_recording_without_snapshots_has_no_hang(tmp_path: Path) -> None:
    b = TraceBuilder(duration_s=10.0)
    b.process(400, "python")
    b.thread(400, 400, "python")
    db = b.write(tmp_path / "t.duckdb")
    with duckdb.connect(str(db)) as con:
        con.execute("DROP TABLE IF EXISTS thread_snapshots")
    assert not [c for c in chains_of(db) if c.category == "hang"]


def test_nccl_rank_one_collective_behind_is_the_culprit(tmp_path: Path) -> None:
    """NCCL ranks on GPUs: ranks 0 and 2 entered ncclAllReduce #41 (it returned) and wait in their
    cudaStreamSynchronize, so no stack is inside a collective; rank 1 made 40 and blocks in a read. The counts name
    rank 1 "one collective behind"; without them it would be just one of three stuck ranks."""
    b = TraceBuilder(duration_s=10.0)
    end = 10 * S
    b.process(100, "python", cmdline="torchrun")
    snaps, comms, progress = [], [], []
    for r, pid in enumerate((101, 102, 103)):
        b.process(pid, "python", ppid=100)
        b.thread(pid, pid, "python")
        b.off_cpu(0, end, pid=pid, tid=pid)
        if r == 1:
            snaps.append(snap(pid, pid, end, 30 * S, "read", frames(("load", TRAIN, 42), ("main", TRAIN, 50)),
                              rank=r, waits_on="pipe:[77]"))  # fmt: skip
        else:
            fr = frames(("synchronize", "/venv/lib/python3.11/site-packages/torch/cuda/__init__.py", 985),
                        ("main", TRAIN, 60))  # fmt: skip
            snaps.append(snap(pid, pid, end, 30 * S, "futex", fr, rank=r))
        comms.append(dict(ts_ns=0, dur_ns=S, pid=pid, tid=pid, comm=pid * 16, id_hash=7, nranks=3, rank=r, ret=0))
        progress.append(dict(pid=pid, op="ncclAllReduce", comm=pid * 16, calls=40 if r == 1 else 41, first_ns=0,
                             last_ns=0))  # fmt: skip
    db = write(tmp_path, b, snaps, {101: 0, 102: 1, 103: 2})
    with duckdb.connect(str(db)) as con:
        insert_rows(con, "nccl_comms", comms)
        insert_rows(con, "nccl_progress", progress)
    (c,) = [c for c in chains_of(db) if c.category == "hang"]
    ev = c.evidence
    assert ev.ranks_stuck == [1] and c.culprit.pid == 102 and c.culprit.kind == "rank"
    assert c.culprit.code_site == f"{TRAIN}:42 load"
    assert ev.behind and ev.behind[0].startswith("rank 1 is one collective behind")
    assert "rank 1 is one collective behind" in c.summary and "ranks 0, 2 entered ncclAllReduce #41" in c.summary
    assert {t.rank for t in ev.waiting} == {0, 2} and {t.collective for t in ev.waiting} == {"ncclAllReduce #41"}
    # the same snapshots without the counts (a recording made before nccl_progress): no rank is told apart
    with duckdb.connect(str(db)) as con:
        con.execute("DROP TABLE nccl_progress")
    (c,) = [c for c in chains_of(db) if c.category == "hang"]
    assert c.evidence.ranks_stuck == [] and c.evidence.behind == []
