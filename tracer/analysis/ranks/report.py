"""The per-rank table and the straggler, as records: what ``tracer ranks`` prints and the ``get_ranks`` MCP tool
returns."""

from __future__ import annotations

from typing import Annotated

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.chains import ChainContext
from tracer.analysis.chains.model import StragglerRankEvidence
from tracer.analysis.chains.straggler_rank import detect, table_of
from tracer.analysis.job import job_alignment
from tracer.analysis.ranks.phases import COLLECTIVE, LABELS, PHASES
from tracer.analysis.ranks.straggler import MIN_WINDOW_NS
from tracer.analysis.ranks.table import RankTime

MS = 1_000_000
S = 1_000_000_000


class RankRow(Record):
    """One rank over the window every rank stepped in: its training thread's time by phase."""

    rank: int
    pid: int
    tid: Annotated[int, Field(description="its training thread (its CUDA driver thread, else its main thread)")]
    comm: str
    local_rank: int | None
    steps: Annotated[float | None, Field(description="its steps in the window (its waits for the GPU); null: none")]
    wall_ms: Annotated[float, Field(description="its thread's time in the window, ms")]
    phases_ms: Annotated[dict[str, float], Field(description="time per phase in the window, ms (phases: see legend)")]
    phases_ms_per_step: Annotated[dict[str, float] | None, Field(description="the same per step; null without steps")]
    collective_ms: Annotated[float, Field(description="waiting in collectives, ms")]
    collective_share: Annotated[float, Field(description="of its wall time in the window")]
    top_phase: Annotated[str, Field(description="its largest phase other than collective waits")]
    straggler: Annotated[bool, Field(description="the rank the others wait for")]


class LauncherProc(Record):
    """A process that started ranks (torchrun's agent, mpirun)."""

    pid: int
    comm: str
    launcher: Annotated[str, Field(description="torchrun | torch | mpirun | mpi | srun")]


class RanksResult(Record):
    """The ranks of the distributed job in the recording, and the straggler the others wait for (if any)."""

    ranks: list[RankRow]
    job_id: str | None
    world_size: Annotated[int | None, Field(description="from the ranks' environment (WORLD_SIZE, ...)")]
    launchers: list[LauncherProc]
    window_start_s: Annotated[float | None, Field(description="start of the window every rank stepped in, s")]
    window_end_s: float | None
    steps: Annotated[float | None, Field(description="the job's steps in the window (median of the ranks)")]
    step_ms: Annotated[float | None, Field(description="the job's step time in the window, ms")]
    straggler: Annotated[StragglerRankEvidence | None, Field(description="the slow rank and who waits for it")]
    straggler_summary: str | None
    chain_id: Annotated[str | None, Field(description="the straggler_rank chain's id (tracer chains)")]
    legend: Annotated[dict[str, str], Field(description="what each phase is")]
    note: Annotated[str, Field(description="why there is no table, or its caveats; empty when none")]


def _row(r: RankTime, steps: float | None, straggler: int | None, local_rank: int | None) -> RankRow:
    wall = sum(r.total.values())
    ph = {p: round(r.total.get(p, 0.0) / MS, 1) for p in PHASES if r.total.get(p, 0.0) >= MS / 10}
    per = {p: round(r.total.get(p, 0.0) / steps / MS, 2) for p in ph} if steps else None
    others = {p: v for p, v in r.total.items() if p != COLLECTIVE}
    return RankRow(
        rank=r.rank,
        pid=r.pid,
        tid=r.tid,
        comm=r.thread.comm,
        local_rank=local_rank,
        steps=None if steps is None else round(steps, 1),
        wall_ms=round(wall / MS, 1),
        phases_ms=ph,
        phases_ms_per_step=per,
        collective_ms=round(r.total.get(COLLECTIVE, 0.0) / MS, 1),
        collective_share=round(r.total.get(COLLECTIVE, 0.0) / wall, 4) if wall > 0 else 0.0,
        top_phase=max(others, key=lambda p: (others[p], p)) if others else "",
        straggler=r.rank == straggler,
    )


def ranks_report(conn: duckdb.DuckDBPyConnection) -> RanksResult:
    """Return the per-rank table of the recording and its straggler."""
    ctx = ChainContext.load(conn)
    info = ctx.info
    job = job_alignment(conn)  # several recordings: how well their clocks line up
    job_note = job.note if job is not None else ""
    launchers = [LauncherProc(pid=p.pid, comm=p.comm, launcher=p.launcher) for p in info.launchers()]
    table = table_of(ctx)
    if table is None:
        n = len(info.rank_pids)
        # the ranks whose thread ran or woke in the recording: a thread blocked since before it has no time rows
        timed = sum(1 for p in info.rank_pids if (t := ctx.times.rank_thread(p)) is not None and t.wall > 0)
        why = (
            "no process of this recording has a rank in its environment (RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, "
            "SLURM_PROCID)"
            if n == 0
            else f"{n} rank process{'es' if n != 1 else ''}, {timed} with accounted time: a table needs two"
            + (
                "; the others' threads never ran in the recording (blocked since before it: a hung job? see the "
                "hang chain and their thread snapshots, get_thread_dump)"
                if timed < n
                else ""
            )
        )
        if not info.has("processes", "rank"):
            why = "this recording predates rank identity (schema v3): no ranks recorded"
        return RanksResult(
            ranks=[],
            job_id=None,
            world_size=None,
            launchers=launchers,
            window_start_s=None,
            window_end_s=None,
            steps=None,
            step_ms=None,
            straggler=None,
            straggler_summary=None,
            chain_id=None,
            legend=LABELS,
            note="; ".join(n for n in (why, job_note) if n),
        )
    chains = detect(ctx)
    chain = chains[0] if chains else None
    ev = chain.evidence if chain is not None and isinstance(chain.evidence, StragglerRankEvidence) else None
    steps = table.steps()
    short = ""
    if table.window_ns < MIN_WINDOW_NS:
        short = (
            f"the ranks stepped together for {table.window_ns / S:.2f} s only: too short to tell a straggler from "
            f"noise (it takes {MIN_WINDOW_NS / S:.0f} s)"
        )
    rows = [
        _row(
            r,
            r.steps,
            ev.rank if ev else None,
            info.procs[r.pid].local_rank if r.pid in info.procs else None,
        )
        for r in table.ranks
    ]
    return RanksResult(
        ranks=rows,
        job_id=table.job_id,
        world_size=table.world_size,
        launchers=launchers,
        window_start_s=round(table.start_ns / S, 3),
        window_end_s=round(table.end_ns / S, 3),
        steps=None if steps is None else round(steps, 1),
        step_ms=round(table.window_ns / steps / MS, 2) if steps else None,
        straggler=ev,
        straggler_summary=chain.summary if chain else None,
        chain_id=chain.id if chain else None,
        legend=LABELS,
        note="; ".join(n for n in (table.note, short, job_note) if n),
    )
