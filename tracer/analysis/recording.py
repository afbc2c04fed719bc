"""What a recording holds, loaded once and shared by the analyses: session basics, the process tree with roles,
which tables and columns exist, and who the tracer was.

A DB from before schema v2 lacks ``threads``, ``thread_breakdown``, ``thread_wakers`` and several columns
(``processes.role``, ``preemptors.tid`` / ``is_tracer``, ``sched.waker_*``); a v2 DB whose recorder did not run
the time accounting has those tables empty. :class:`RecordingInfo` says which case holds so each analysis can
fall back (and say so) instead of failing on a missing column.

The recorder's own processes (``processes.role = 'tracer'``, ``preemptors.is_tracer``, ``session.recorder_pid``)
are never the traced target, never a culprit and never the main pid. A v1 recording has none of those marks;
there the recorder is recognised by its process name (:data:`TRACER_COMMS`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import duckdb
import numpy as np

from tracer.analysis.db import session_row
from tracer.vocabulary import (
    CHILD_ROLE,
    DATALOADER_COMM,
    DATALOADER_ROLE,
    LAUNCHER_ROLE,
    MAIN_ROLE,
    RANK_ROLE,
    TARGET_ROLE,
    TRACER_ROLE,
)

S = 1_000_000_000
# The recorder's process name (the `tracer` console script): how a v1 recording, which has no role or
# is_tracer column, names it in preemptors.
TRACER_COMMS: frozenset[str] = frozenset({"tracer"})


class Proc(NamedTuple):
    """One process of the recording (``processes`` row). A named tuple, not a dataclass: a fork-heavy recording
    has 200 K of them, and a frozen dataclass's constructor cost 8x as much (0.4 s of every analysis; issue 21)."""

    pid: int
    ppid: int | None
    comm: str
    role: str  # as the recorder wrote it: tracer.vocabulary.RECORDED_ROLES (target | tracer)
    first_ns: int
    exit_ns: int | None
    exit_code: int | None
    # its place in a distributed job (schema v3; None on older recordings and outside a job)
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    job_id: str | None = None
    launcher: str | None = None  # set on a process that started ranks (torchrun's agent, mpirun)
    host: str | None = None  # its recording's host, in a job of several recordings (tracer.analysis.job)


class ProcTable(Mapping[int, Proc]):
    """The recording's processes by pid, held as :class:`Proc`'s columns (lists of Python values, in pid order); a
    Proc is built when one is asked for. Built as 200 K named tuples up front, a fork-heavy recording's processes
    took 0.35 s of every analysis's start (issue 28's 2 s per tool); most analyses read a few hundred of them, and
    the questions asked of all of them (who is the tracer, a rank, a worker) read one or two columns."""

    def __init__(self, columns: list[list[Any]]) -> None:
        assert len(columns) == len(Proc._fields), columns
        self._cols = columns
        self._row = dict(zip(columns[0], range(len(columns[0])), strict=True))
        self._changed: dict[int, Proc] = {}  # a process given a rank after loading (an NCCL communicator's)

    @classmethod
    def of(cls, procs: Iterable[Proc]) -> ProcTable:
        rows = sorted(procs, key=lambda p: p.pid)
        return cls([list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in Proc._fields])

    def __getitem__(self, pid: int) -> Proc:
        p = self._changed.get(pid)
        if p is not None:
            return p
        i = self._row[pid]
        return Proc._make([c[i] for c in self._cols])

    def get(self, pid: int | None, default: Proc | None = None) -> Proc | None:  # type: ignore[override]
        return self[pid] if pid in self._row else default

    def __contains__(self, pid: object) -> bool:
        return pid in self._row

    def __iter__(self) -> Iterator[int]:
        return iter(self._cols[0])

    def __len__(self) -> int:
        return len(self._cols[0])

    def replace(self, pid: int, **changes: Any) -> None:
        """Change fields of process ``pid`` (its columns are left as loaded: :meth:`column` applies the change)."""
        self._changed[pid] = self[pid]._replace(**changes)

    def column(self, name: str) -> list[Any]:
        """Return field ``name`` of every process, in pid order (not to be modified)."""
        col = self._cols[Proc._fields.index(name)]
        if not self._changed:
            return col
        col = list(col)
        for pid, p in self._changed.items():
            col[self._row[pid]] = getattr(p, name)
        return col

    def pids_in(self, name: str, values: Collection[Any]) -> list[int]:
        """Return the pids whose field ``name`` is one of ``values``, in pid order."""
        return [pid for pid, v in zip(self._cols[0], self.column(name), strict=True) if v in values]

    def pids_set(self, name: str) -> list[int]:
        """Return the pids whose field ``name`` is set (not NULL, not empty), in pid order."""
        return [pid for pid, v in zip(self._cols[0], self.column(name), strict=True) if v is not None and v != ""]


@dataclass
class RecordingInfo:
    """Facts about one recording that every analysis needs (see the module docstring)."""

    columns: dict[str, frozenset[str]]
    duration_ns: int = 0
    cpu_cores: int = 0
    mem_bytes: int = 0
    target: str = ""
    recorder_pid: int | None = None
    procs: ProcTable = field(default_factory=lambda: ProcTable.of([]))
    main_pid: int | None = None
    has_breakdown: bool = False
    has_wakers: bool = False
    nccl_ranked: frozenset[int] = frozenset()  # processes that took their rank from an NCCL communicator

    def has(self, table: str, column: str | None = None) -> bool:
        """Return True when the DB has ``table`` (and its ``column``)."""
        cols = self.columns.get(table)
        return cols is not None and (column is None or column in cols)

    def comm(self, pid: int | None) -> str:
        p = self.procs.get(pid) if pid is not None else None
        return p.comm if p else "?"

    @cached_property
    def tracer_pids(self) -> frozenset[int]:
        """The recorder's own pids. Computed once: roles and holders ask per process, and a fork-heavy recording
        has tens of thousands (rebuilt per call, this set was 59% of `tracer stats` at 16 K processes)."""
        pids = set(self.procs.pids_in("role", (TRACER_ROLE,)))
        if self.recorder_pid:
            pids.add(self.recorder_pid)
        return frozenset(pids)

    @cached_property
    def children(self) -> dict[int, list[int]]:
        """{pid: the pids it forked}, built once for :meth:`descendants`."""
        kids: dict[int, list[int]] = {}
        for pid, ppid in zip(self.procs, self.procs.column("ppid"), strict=True):
            if ppid is not None and ppid != pid:
                kids.setdefault(ppid, []).append(pid)
        return kids

    def is_tracer(self, pid: int | None, comm: str | None = None, flagged: bool | None = None) -> bool:
        """Return True when a task is the tracer: flagged so by the recorder, one of its pids, or (v1) its name."""
        if flagged:
            return True
        if pid is not None and pid in self.tracer_pids:
            return True
        return flagged is None and comm in TRACER_COMMS

    def in_tree(self, pid: int | None) -> bool:
        """Return True when ``pid`` is a process of the traced tree (not the tracer)."""
        p = self.procs.get(pid) if pid is not None else None
        return p is not None and p.role != TRACER_ROLE

    @cached_property
    def rank_pids(self) -> dict[int, int]:
        """{pid: rank} of each rank's own process: a process with a rank whose parent is not that rank of that job
        (a rank's forked DataLoader workers inherit its environment, so its rank, and are not ranks)."""
        out: dict[int, int] = {}
        for pid in self.procs.pids_set("rank"):
            p = self.procs[pid]
            if p.role == TRACER_ROLE:
                continue
            parent = self.procs.get(p.ppid) if p.ppid is not None else None
            if parent is None or (parent.rank, parent.job_id) != (p.rank, p.job_id):
                out[p.pid] = p.rank
        return out

    def process_role(self, pid: int) -> str:
        """Return main | rank | launcher | dataloader_worker | child | tracer for ``pid``: the one definition of a
        process's role, which every analysis, view and export uses. In a distributed job each rank's own process
        is a ``rank`` (each one trains) and the process that started them (torchrun's agent) a ``launcher``."""
        p = self.procs.get(pid)
        if p is not None and p.role == TRACER_ROLE or pid in self.tracer_pids:
            return TRACER_ROLE
        if pid in self.rank_pids:
            return RANK_ROLE
        if p is not None and p.launcher:
            return LAUNCHER_ROLE
        if pid == self.main_pid:
            return MAIN_ROLE
        if p is not None and p.comm == DATALOADER_COMM:
            return DATALOADER_ROLE
        return CHILD_ROLE

    @cached_property
    def dataloader_pids(self) -> frozenset[int]:
        """The pids whose :meth:`process_role` is ``dataloader_worker``, found once: the chains ask it of every
        process (200 K role look-ups were a tenth of `tracer chains` on issue 21's recording). Only a process named
        as a worker can have the role, so only those are asked."""
        named = self.procs.pids_in("comm", (DATALOADER_COMM,))
        return frozenset(pid for pid in named if self.process_role(pid) == DATALOADER_ROLE)

    def target_pids(self) -> list[int]:
        """Return the traced tree's pids (tracer processes left out), in pid order."""
        tracer = self.tracer_pids
        return [
            pid
            for pid, role in zip(self.procs, self.procs.column("role"), strict=True)
            if role != TRACER_ROLE and pid not in tracer
        ]

    def named(self, comms: set[str] | frozenset[str]) -> list[int]:
        """Return the pids of the processes whose name is one of ``comms``, in pid order."""
        return self.procs.pids_in("comm", comms)

    def children_of(self, pid: int) -> list[Proc]:
        """Return the processes ``pid`` forked, in pid order."""
        return [self.procs[c] for c in sorted(self.children.get(pid, []))]

    def launchers(self) -> list[Proc]:
        """Return the processes that started ranks (torchrun's agent, mpirun), in pid order."""
        return [self.procs[pid] for pid in self.procs.pids_set("launcher")]

    def descendants(self, pid: int) -> list[Proc]:
        """Return every process forked (directly or not) from ``pid``, in pid order."""
        seen: set[int] = {pid}
        out, todo = [], list(self.children.get(pid, []))
        while todo:
            c = todo.pop()
            if c in self.procs and c not in seen:
                seen.add(c)
                out.append(self.procs[c])
                todo.extend(self.children.get(c, []))
        return sorted(out, key=lambda p: p.pid)

    def descends_from(self, pid: int, ancestor: int) -> bool:
        """Return True when ``pid`` is one of :meth:`descendants` of ``ancestor``: its parents, each a known process,
        lead to ``ancestor``. Walks up from one process instead of down the whole tree (200 K processes)."""
        seen = {pid}
        p = self.procs.get(pid)
        while p is not None and p.ppid is not None and p.ppid != p.pid:
            if p.ppid == ancestor:
                return pid != ancestor
            if p.ppid in seen:
                return False
            seen.add(p.ppid)
            p = self.procs.get(p.ppid)
        return False


def most_alive_at_once(procs: list[Proc], end_ns: int) -> int:
    """Return the most of ``procs`` alive at one time (one still running at the end lives to ``end_ns``): a
    pool's size, also for one whose workers are forked anew every epoch (hundreds over a recording)."""
    edges = []
    for p in procs:
        edges += [(p.first_ns, 1), (p.exit_ns if p.exit_ns is not None else end_ns + 1, -1)]
    alive = most = 0
    for _, d in sorted(edges):  # at a tie, an exit (-1) sorts before a start: workers replaced, not added
        alive += d
        most = max(most, alive)
    return most


def table_columns(conn: duckdb.DuckDBPyConnection) -> dict[str, frozenset[str]]:
    """Return {table: its columns} for the DB's main schema (not an attached one's: a job's recordings)."""
    cols: dict[str, set[str]] = {}
    for t, c in conn.execute(
        "SELECT table_name, column_name FROM duckdb_columns() WHERE schema_name = 'main' AND NOT internal "
        "AND database_name = current_database()"
    ).fetchall():
        cols.setdefault(t, set()).add(c)
    return {t: frozenset(c) for t, c in cols.items()}


def load_recording(conn: duckdb.DuckDBPyConnection) -> RecordingInfo:
    """Return the :class:`RecordingInfo` of the DB behind ``conn``."""
    info = RecordingInfo(columns=table_columns(conn))
    s = session_row(conn, ("duration_s", "cpu_cores", "mem_bytes", "target", "recorder_pid"))
    if s:
        info.duration_ns = int((s["duration_s"] or 0) * S)
        info.cpu_cores, info.mem_bytes = int(s["cpu_cores"] or 0), int(s["mem_bytes"] or 0)
        info.target, info.recorder_pid = s["target"] or "", s["recorder_pid"]
    role = f"coalesce(role, '{TARGET_ROLE}')" if info.has("processes", "role") else f"'{TARGET_ROLE}'"
    dist = ("rank", "local_rank", "world_size", "job_id", "launcher", "host")  # host: a job's (tracer.analysis.job)
    dist_sql = ", ".join(c if info.has("processes", c) else "NULL" for c in dist)  # v3 columns
    cols = _columns(
        conn.execute(
            f"SELECT pid, ppid, coalesce(comm, ''), {role}, coalesce(first_ns, 0)::BIGINT, exit_ns, exit_code, "
            f"{dist_sql} FROM processes ORDER BY pid"
        )
    )
    info.procs = ProcTable(cols)  # in Proc's field order, as is: 200 K processes (issue 21)
    if info.has("nccl_comms"):
        _ranks_from_nccl(conn, info)
    info.main_pid = _main_pid(info)
    if info.has("thread_breakdown"):
        # rows with wall time: a table holding only fault counters is not a time breakdown
        info.has_breakdown = bool(
            conn.execute("SELECT count(*) > 0 FROM thread_breakdown WHERE coalesce(wall_ns, 0) > 0").fetchone()[0]
        )
    if info.has("thread_wakers"):
        info.has_wakers = bool(conn.execute("SELECT count(*) > 0 FROM thread_wakers").fetchone()[0])
    if info.duration_ns <= 0 and info.has("session", "flushed_ns"):
        # a recording in progress (a live --mcp-http snapshot) or killed before its end wrote no duration: it
        # spans what it has flushed (issue 29: a hung job with no CUDA call had a 0 s recording and no hang chain)
        row = conn.execute("SELECT max(flushed_ns) FROM session").fetchone()
        info.duration_ns = int(row[0] or 0) if row else 0
    if info.duration_ns <= 0 and info.has("cuda_calls"):
        end = conn.execute("SELECT max(ts_ns + dur_ns) FROM cuda_calls").fetchone()
        info.duration_ns = int(end[0] or 0) if end else 0
    return info


def _columns(result: duckdb.DuckDBPyConnection) -> list[list[Any]]:
    """Return a query's columns as lists of Python values (None for NULL). Read as columns and zipped into rows,
    200 K processes take half the time of DuckDB's rows of Python tuples (0.13 -> 0.06 s)."""
    out = []
    for col in result.fetchnumpy().values():
        if isinstance(col, np.ma.MaskedArray):
            mask = np.ma.getmaskarray(col)
            col = np.where(mask, None, col.data.astype(object)) if mask.any() else col.data
        out.append(col.tolist())
    return out


def _ranks_from_nccl(conn: duckdb.DuckDBPyConnection, info: RecordingInfo) -> None:
    """Give a process that joined an NCCL communicator, but has no rank in its environment (a launcher the recorder
    does not know, a job that sets up its ranks itself), its rank from the call: in the largest communicator it
    joined (data-parallel ranks are in the world's; a tensor-parallel group is smaller), the job being that
    communicator (its unique id's hash). A rank from the environment is kept: it is the launcher's word."""
    for pid, rank, nranks, id_hash in conn.execute(
        "WITH k AS (SELECT pid, rank, nranks, id_hash, row_number() OVER (PARTITION BY pid ORDER BY nranks DESC, "
        "ts_ns) AS n FROM nccl_comms WHERE ret = 0) SELECT pid, rank, nranks, id_hash FROM k WHERE n = 1"
    ).fetchall():
        p = info.procs.get(pid)
        if p is not None and p.rank is None and p.role != TRACER_ROLE:
            info.nccl_ranked = info.nccl_ranked | {pid}
            info.procs.replace(pid, rank=int(rank), world_size=int(nranks), job_id=f"nccl:{int(id_hash):016x}")


def _main_pid(info: RecordingInfo) -> int | None:
    if info.target.startswith("pid "):
        try:
            pid = int(info.target.split()[1])
            if pid not in info.tracer_pids:
                return pid
        except (IndexError, ValueError):
            pass
    # the root of the traced tree: a target process whose parent is not a target process (the recorder that
    # launched the command is in processes as role tracer, so it cannot be the root)
    procs = info.procs
    tree = set(info.target_pids())
    roots = (
        (first_ns, pid)
        for pid, ppid, first_ns in zip(procs, procs.column("ppid"), procs.column("first_ns"), strict=True)
        if pid in tree and (ppid is None or ppid not in tree)
    )
    # the first root, not every root sorted: a monitoring loop's 200 K commands whose shell is not in the recording
    # are each a root (issue 21's recording)
    first = min(roots, default=None)
    return first[1] if first else None


def main_pid(conn: duckdb.DuckDBPyConnection) -> int | None:
    """Return the traced target's pid: ``pid N`` in session.target, else the root of the traced tree."""
    return load_recording(conn).main_pid
