"""Collective progress per rank (tracer.analysis.collective_progress) on hand-built recordings: the truth is the
counts each recording states per rank, and which communicator set-ups it saw."""

from __future__ import annotations

from pathlib import Path

import duckdb

from tests.tracedb import S, TraceBuilder, insert_rows
from tracer.analysis.collective_progress import behind_summary, comm_progress
from tracer.analysis.recording import load_recording

ID = 0x1234ABCD


def _db(tmp: Path, calls: dict[int, int], seen: set[int], comms_per_pid: int = 1) -> Path:
    """Ranks 0..n-1 as pids 101.. with ``calls`` ncclAllReduce each on their one handle (pid * 16); the set-up
    (nccl_comms) of only the ranks in ``seen``; ``comms_per_pid`` handles with counts per process."""
    b = TraceBuilder(duration_s=10.0)
    b.process(100, "python", cmdline="launcher")
    for r in calls:
        b.process(101 + r, "python", ppid=100)
        b.thread(101 + r, 101 + r, "python")
    db = b.write(tmp / "t.duckdb")
    with duckdb.connect(str(db)) as con:
        for r in calls:
            con.execute("UPDATE processes SET rank = ?, world_size = ?, job_id = 'j' WHERE pid = ?",
                        [r, len(calls), 101 + r])  # fmt: skip
        insert_rows(con, "nccl_comms", [
            dict(ts_ns=0, dur_ns=S, pid=101 + r, tid=101 + r, comm=(101 + r) * 16, id_hash=ID, nranks=len(calls),
                 rank=r, ret=0) for r in sorted(seen)
        ])  # fmt: skip
        insert_rows(con, "nccl_progress", [
            dict(pid=101 + r, op="ncclAllReduce", comm=(101 + r) * 16 + k, calls=n, first_ns=S, last_ns=2 * S + r)
            for r, n in calls.items() for k in range(comms_per_pid)
        ])  # fmt: skip
    return db


def _progress(db: Path) -> list:
    with duckdb.connect(str(db), read_only=True) as con:
        return comm_progress(con, load_recording(con))


def test_the_rank_one_collective_behind_is_named(tmp_path: Path) -> None:
    (cp,) = _progress(_db(tmp_path, {0: 41, 1: 40, 2: 41}, seen={0, 1, 2}))
    assert cp.id_hash == ID and cp.ahead == 41
    assert [(r.rank, r.calls) for r in cp.behind] == [(1, 40)]
    assert [r.rank for r in cp.leaders] == [0, 2]
    assert behind_summary(cp, cp.behind[0]).startswith("rank 1 is one collective behind: 40 collectives")


def test_ranks_in_step_have_none_behind(tmp_path: Path) -> None:
    (cp,) = _progress(_db(tmp_path, {0: 41, 1: 41}, seen={0, 1}))
    assert cp.behind == []


def test_a_rank_whose_set_up_was_missed_joins_its_world_communicator(tmp_path: Path) -> None:
    """Ranks 0 and 1 joined before the probes were attached: counted with rank 2's communicator by their
    environment's rank and world size."""
    (cp,) = _progress(_db(tmp_path, {0: 31, 1: 30, 2: 31}, seen={2}))
    assert cp.id_hash == ID and [(r.rank, r.calls) for r in cp.ranks] == [(0, 31), (1, 30), (2, 31)]
    assert [r.rank for r in cp.behind] == [1]


def test_an_unnamed_handle_among_several_is_not_guessed(tmp_path: Path) -> None:
    """Two handles per process and no set-up seen: which one the other ranks share is unknown."""
    assert _progress(_db(tmp_path, {0: 31, 1: 30}, seen=set(), comms_per_pid=2)) == []


def test_an_old_recording_without_the_table_has_no_progress(tmp_path: Path) -> None:
    db = _db(tmp_path, {0: 41, 1: 40}, seen={0, 1})
    with duckdb.connect(str(db)) as con:
        con.execute("DROP TABLE nccl_progress")
    assert _progress(db) == []
