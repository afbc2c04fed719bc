"""Collective progress per rank: how many NCCL collectives each rank of a communicator has entered.

The recorder counts every NCCL collective call at its entry, per (process, op, ncclComm_t) (``nccl_progress``,
counted in kernel, never sampled). A communicator handle is a pointer, different in every process; the ranks of
one communicator share only its unique id, whose hash ``nccl_comms`` holds per (process, handle). Joined on that,
the counts of one communicator's ranks can be compared: ranks run the same collectives in the same order, so a
rank whose count is lower than the others' has not reached the collective they are waiting in. That rank is the
one they wait for, named without Flight Recorder or any setting at launch.

Old recordings have no ``nccl_progress`` table: they have no progress (an empty list).
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from tracer.analysis.recording import RecordingInfo

S = 1_000_000_000


@dataclass(frozen=True)
class RankCalls:
    """One rank's collectives on one communicator."""

    pid: int
    rank: int
    calls: int  # collectives entered (a call still blocked inside is counted)
    last_op: str | None  # the latest one's op (ncclAllReduce ...), None when it made none
    last_ns: int | None  # its entry, ns since the session start


@dataclass(frozen=True)
class CommProgress:
    """The ranks of one communicator (one unique id) seen in the recording, and their collective counts."""

    id_hash: int
    nranks: int
    ranks: list[RankCalls]  # by rank

    @property
    def ahead(self) -> int:
        """The most collectives any of its ranks has entered."""
        return max((r.calls for r in self.ranks), default=0)

    @property
    def behind(self) -> list[RankCalls]:
        """Its ranks that have entered fewer collectives than the most advanced one: the ones the others wait for."""
        top = self.ahead
        return [r for r in self.ranks if r.calls < top]

    @property
    def leaders(self) -> list[RankCalls]:
        """Its ranks at the most advanced count: inside (or past) the collective the others have not reached."""
        top = self.ahead
        return [r for r in self.ranks if r.calls == top]


_PROGRESS_SQL = """
WITH c AS (
    SELECT DISTINCT pid, comm, id_hash, nranks, rank FROM nccl_comms WHERE ret = 0 AND comm <> 0
), p AS (
    SELECT pid, comm, sum(calls)::BIGINT AS calls, arg_max(op, last_ns) AS last_op, max(last_ns) AS last_ns
    FROM nccl_progress GROUP BY pid, comm
)
SELECT c.id_hash, c.nranks, coalesce(c.pid, p.pid), c.rank, coalesce(p.calls, 0), p.last_op, p.last_ns,
    count(*) OVER (PARTITION BY coalesce(c.pid, p.pid)) AS handles
FROM c FULL JOIN p USING (pid, comm)
ORDER BY c.id_hash NULLS LAST, c.rank, 3
"""


def comm_progress(conn: duckdb.DuckDBPyConnection, info: RecordingInfo) -> list[CommProgress]:
    """Return every communicator with at least two ranks in the recording, its ranks' collective counts; [] for a
    recording without ``nccl_progress`` (made before it) or without NCCL.

    A process whose communicator set-up the recording missed (it joined before the probes were attached) has
    counts but no unique id: when it has one communicator and a rank from its environment, it is counted in its
    job's world communicator (the one whose size is its world size), else with the job's other such ranks."""
    if not (info.has("nccl_progress") and info.has("nccl_comms")):
        return []
    by_id: dict[object, CommProgress] = {}
    for id_hash, nranks, pid, rank, calls, last_op, last_ns, handles in conn.execute(_PROGRESS_SQL).fetchall():
        last = None if last_ns is None else int(last_ns)
        if id_hash is not None:
            cp = by_id.setdefault(int(id_hash), CommProgress(int(id_hash), int(nranks), []))
            cp.ranks.append(RankCalls(int(pid), int(rank), int(calls), last_op, last))
            continue
        p = info.procs.get(int(pid))
        if handles != 1 or p is None or p.rank is None or p.world_size is None:
            continue  # no way to tell which of its communicators the others share
        world = next(
            (c for c in by_id.values() if c.nranks == p.world_size and all(r.rank != p.rank for r in c.ranks)),
            None,
        )
        if world is None:
            world = by_id.setdefault(("job", p.job_id), CommProgress(0, int(p.world_size), []))
        world.ranks.append(RankCalls(int(pid), int(p.rank), int(calls), last_op, last))
    for cp in by_id.values():
        cp.ranks.sort(key=lambda r: (r.rank, r.pid))
    return [cp for cp in by_id.values() if len(cp.ranks) >= 2]


def behind_summary(cp: CommProgress, r: RankCalls) -> str:
    """'rank R is one collective behind (40 on communicator 1a2b..., the others 41: ncclAllReduce)'."""
    n = cp.ahead - r.calls
    word = "one collective" if n == 1 else f"{n} collectives"
    op = cp.leaders[0].last_op or "a collective"
    return (
        f"rank {r.rank} is {word} behind: {r.calls} collective{'s' if r.calls != 1 else ''} on communicator "
        f"{cp.id_hash:016x}, the others {cp.ahead} (their last: {op})"
    )
