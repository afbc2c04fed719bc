"""straggler_rank: one rank of a distributed job is slower than the others, and they wait for it in every
collective, so the whole job runs at the straggler's speed.

Found by :mod:`tracer.analysis.ranks` (the rank that waits least in collectives while the others wait at least 5 %
of the window more, its extra time explaining at least half of their wait). The chain is about the rank that waited
most (its thread is the affected one), with the straggler as culprit (``relation`` peer_rank), its phase, and where
in its step the extra time lies (between which two CUDA calls' lines). Cost: each waiting rank's extra collective
wait over the common window (the median of the waiting ranks), which is the time every step would get back.

The waiting ranks' own sync_stall and gpu_bound chains are then marked ``explained_by`` this chain: their waits for
the GPU include the straggler's delay and are not a cause of their own.
"""

from __future__ import annotations

from tracer.analysis import waitgraph
from tracer.analysis.chains.applies import has_dataloader
from tracer.analysis.chains.context import (
    HIGH_SHARE,
    LOW_SHARE,
    MEDIUM_SHARE,
    ChainContext,
    Subject,
    clip,
    grade,
)
from tracer.analysis.chains.model import CausalChain, Culprit, Hop, RankWaitTime, Root, StragglerRankEvidence
from tracer.analysis.db import session_row
from tracer.analysis.ranks import sites
from tracer.analysis.ranks.phases import BLOCKED_PHASES, LABELS
from tracer.analysis.ranks.straggler import Straggler, find_straggler
from tracer.analysis.ranks.table import RankTable, rank_table
from tracer.analysis.taxonomy import RUNQ_PART_NAMES

CATEGORY = "straggler_rank"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
S = 1_000_000_000
# chains of a waiting rank whose time is its wait for the straggler
EXPLAINED_CATEGORIES = ("sync_stall", "gpu_bound")

# what to do about a straggler, by its slow phase
FIXES: dict[str, str] = {
    "asleep": "Rank {rank} sleeps or waits on a timer in its step (a read from slow storage or the network, a "
    "time.sleep, a timed wait): prefetch its input ({prefetch}), move its data to local disk, and check that its "
    "input shard is no larger than the others'.",
    "disk_io": "Rank {rank} waits for its disk: put its data on local or faster storage, or prefetch it in {readers}.",
    "network": "Rank {rank} waits on the network outside collectives (reading remote data): prefetch or cache it.",
    "data_workers": "Rank {rank} waits for its DataLoader workers: give it more workers or cheaper transforms (see "
    "its dataloader_starvation chain).",
    "cpu": "Rank {rank} does more CPU work per step than the others: an unequal split of the data (a bigger shard, "
    "longer sequences), a slower or throttled CPU, or work only it does (logging, checkpoints, evaluation on rank "
    "{rank}). Balance the work (equal shards, bucketing by length) or move it off the step.",
    "runq": "Rank {rank} waits for a CPU: other threads or processes run on its cores (see its cpu_contention "
    "chain); give each rank cores of its own (taskset, numactl, cgroup cpusets).",
    "sync": "Rank {rank} waits longer for its GPU: its kernels take longer (a slower, throttled or shared GPU, or "
    "more work on that rank); compare the GPUs' clocks and utilisation (nvidia-smi -q -d CLOCK,PERFORMANCE).",
    "own_threads": "Rank {rank} blocks on its own threads (the GIL, a lock, a queue) more than the others: see its "
    "thread's wakers in tracer breakdown --pid {pid}.",
}
GENERIC_FIX = "Rank {rank} is slower in its step than the others: see tracer breakdown --pid {pid}."


def table_of(ctx: ChainContext) -> RankTable | None:
    """Return the recording's rank table, computed once per context."""
    key = ("rank_table",)
    if key not in ctx.memo:
        ctx.memo[key] = rank_table(ctx.conn, ctx.info, ctx.times)
    return ctx.memo[key]


def straggler_of(ctx: ChainContext) -> tuple[RankTable, Straggler] | None:
    """Return the rank table and its straggler, computed once per context; None when there is none."""
    key = ("straggler",)
    if key not in ctx.memo:
        table = table_of(ctx)
        st = find_straggler(table) if table is not None else None
        ctx.memo[key] = (table, st) if table is not None and st is not None else None
    return ctx.memo[key]


def _ms(ns: float) -> float:
    return round(ns / MS, 1)


def _ranks_text(ranks: list[int]) -> str:
    names = [str(r) for r in sorted(ranks)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain naming the straggler rank, when the ranks of a job wait for one of them."""
    found = straggler_of(ctx)
    if found is None:
        return []
    table, st = found
    by_tid = {s.tid: s for s in ctx.subjects}
    waits = sorted(st.waits, key=lambda w: (-w.extra_ns, w.rank))
    affected = next((by_tid[w.tid] for w in waits if w.tid in by_tid), None)
    if affected is None:  # a --pid view of one process: the others are not loaded
        return []
    sev = grade(affected.share(st.lost_ns), HIGH, MEDIUM, LOW)
    if sev is None:
        return []
    steps = st.steps
    per_step = (lambda ns: round(ns / steps / MS, 2)) if steps else (lambda ns: None)  # noqa: E731
    others = [w.tid for w in st.waits]
    totals, named = sites.gaps(ctx.conn, [r.tid for r in table.ranks], table.start_ns, table.end_ns)
    mine = sites.straggler_stretch(totals, st.tid, others)
    theirs = sites.wait_stretch(totals, st.tid, others)
    slow_at = sites.name(*mine, named, [st.tid], ctx.frame_of) if mine else None
    wait_at = sites.name(*theirs, named, others, ctx.frame_of) if theirs else None
    proc = ctx.info.procs.get(st.pid)
    # a job of several recordings knows each process's host; one recording has one
    host = (proc.host if proc is not None else None) or (session_row(ctx.conn, ("host",)) or {}).get("host") or ""
    label = LABELS.get(st.phase, st.phase)
    waiting = _ranks_text([w.rank for w in st.waits])
    unit = "per step" if steps else "in all"
    amount = per_step(st.phase_excess_ns) if steps else _ms(st.phase_excess_ns)
    lost = per_step(st.lost_ns) if steps else _ms(st.lost_ns)
    when = (
        "persistent, every step"
        if st.persistent
        else f"confined to t = {st.start_ns / S:.1f}-{st.end_ns / S:.1f} s of the steps "
        f"({table.start_ns / S:.1f}-{table.end_ns / S:.1f} s)"
    )
    summary = (
        f"Rank {st.rank} (pid {st.pid}{', host ' + host if host else ''}) is the straggler: it spends {amount:,} ms "
        f"{unit} more than the other ranks {label}"
        + (f", {slow_at.text()}" if slow_at else "")
        + f"; rank{'s' if len(st.waits) > 1 else ''} {waiting} wait {lost:,} ms {unit} for it in collectives"
        + (f" ({wait_at.text()})" if wait_at else "")
        + f"; {when}. That is {affected.share(st.lost_ns):.0%} of every rank's step time."
    )
    # DataLoader settings only for a job that has DataLoader workers (issue 23)
    dl = has_dataloader(ctx)
    rank_ctx = {
        "rank": st.rank,
        "pid": st.pid,
        "prefetch": "DataLoader num_workers > 0 with prefetch_factor" if dl else "read ahead in a background thread",
        "readers": "DataLoader workers" if dl else "a background thread or process",
    }
    recs = [FIXES.get(st.phase, GENERIC_FIX).format(**rank_ctx)]
    if not st.persistent:
        recs.append(
            f"It is slow only from t = {st.start_ns / S:.1f} s to {st.end_ns / S:.1f} s: look for what rank "
            f"{st.rank} did then (a checkpoint, evaluation, a burst of other work on its host)."
        )
    recs.append(
        f"Expected gain: up to {lost:,} ms {unit} on every rank ({affected.share(st.lost_ns):.0%} of the step "
        f"time), the others' wait for rank {st.rank}; tracer ranks --db … shows each rank's phases."
    )
    evidence = StragglerRankEvidence(
        rank=st.rank,
        pid=st.pid,
        tid=st.tid,
        host=host,
        world_size=table.world_size,
        job_id=table.job_id,
        phase=st.phase,
        phase_label=label,
        steps=None if steps is None else round(steps, 1),
        step_ms=round(table.window_ns / steps / MS, 2) if steps else None,
        phase_excess_ms=_ms(st.phase_excess_ns),
        phase_excess_ms_per_step=per_step(st.phase_excess_ns),
        excess_ms={p: _ms(v) for p, v in sorted(st.excess_ns.items(), key=lambda kv: -kv[1]) if v >= MS / 10},
        lost_ms=_ms(st.lost_ns),
        lost_ms_per_step=per_step(st.lost_ns),
        job_lost_ms=_ms(sum(w.extra_ns for w in st.waits)),
        explained=round(st.explained, 3),
        waiting=[
            RankWaitTime(
                rank=w.rank,
                pid=w.pid,
                tid=w.tid,
                wait_ms=_ms(w.wait_ns),
                extra_wait_ms=_ms(w.extra_ns),
                extra_wait_ms_per_step=per_step(w.extra_ns),
            )
            for w in waits
        ],
        persistent=st.persistent,
        window_start_s=round(table.start_ns / S, 3),
        window_end_s=round(table.end_ns / S, 3),
        straggler_stretch=slow_at.text() if slow_at else None,
        wait_stretch=wait_at.text() if wait_at else None,
    )
    chain = ctx.chain(
        affected,
        category=CATEGORY,
        severity=sev,
        cost_ns=st.lost_ns,
        culprit=Culprit(
            kind="rank",
            pid=st.pid,
            tid=st.tid,
            comm=proc.comm if proc else "?",
            relation="peer_rank",
            code_site=None,  # no stack is taken off CUDA calls: the stretch (evidence) says where
        ),
        summary=summary,
        evidence=evidence,
        recommendations=recs,
        start_ns=st.start_ns,
        end_ns=st.end_ns,
        pids=[r.pid for r in table.ranks],
    )
    path, root = _path(ctx, affected, st, by_tid.get(st.tid))
    return [chain.model_copy(update={"path": path, "root": root})] if path else [chain]


def _phase_parts(phase: str) -> tuple[str, ...]:
    """The parts of a thread's time breakdown that make up a rank phase (ranks/phases.py)."""
    if phase == "runq":
        return RUNQ_PART_NAMES
    if phase in BLOCKED_PHASES:
        return ("blocked",)
    return (phase,)


def _path(
    ctx: ChainContext, affected: Subject, st: Straggler, straggler: Subject | None
) -> tuple[list[Hop], Root | None]:
    """The chain's wait path (issue 28): the waiting rank waited in collectives for the straggler, whose excess
    phase is followed to its root (waitgraph.trace) within the window where it straggled: who held its CPU, the
    line it ran, what it was blocked on. ([], None) when the straggler is not a subject here (a --pid view)."""
    if straggler is None or st.lost_ns <= 0:
        return [], None
    a, b = max(st.start_ns, straggler.start_ns), min(st.end_ns, straggler.end_ns)
    if b <= a:
        return [], None
    window = Subject(clip(straggler.time, a, b), straggler.training, straggler.launches, a, b)
    t = waitgraph.trace(ctx, window, _phase_parts(st.phase))
    if not t.path:
        return [], None
    ms = round(st.lost_ns / MS, 1)
    first = Hop(
        tid=affected.tid,
        pid=affected.pid,
        comm=affected.time.comm,
        role="rank",
        edge="start",
        state="blocked",
        share=1.0,
        ms=ms,
        site=None,  # it waits inside the collective (the evidence's wait_stretch says between which calls)
    )
    # the straggler's hops carry the waiting rank's lost time in proportion to the followed part of its phase
    head = t.path[0]
    k = 1.0 / head.share if head.share > 0 else 0.0
    rest = [
        h.model_copy(update={"share": round(min(h.share * k, 1.0), 3), "ms": round(ms * min(h.share * k, 1.0), 1)})
        for h in t.path[1:]
    ]
    return [
        first,
        head.model_copy(update={"edge": "collective", "role": "rank", "share": 1.0, "ms": ms}),
        *rest,
    ], t.root


def mark_explained(ctx: ChainContext, chains: list[CausalChain]) -> list[CausalChain]:
    """Return ``chains`` with the waiting ranks' sync_stall and gpu_bound chains marked as explained by the
    straggler chain (their waits for the GPU include the wait for the straggler)."""
    straggler = next((c for c in chains if c.category == CATEGORY), None)
    found = straggler_of(ctx) if straggler is not None else None
    if straggler is None or found is None:
        return chains
    waiting = {w.tid: w.rank for w in found[1].waits}
    rank = found[1].rank
    out = []
    for c in chains:
        if c.category in EXPLAINED_CATEGORIES and c.tid in waiting:
            why = (
                f"Rank {waiting[c.tid]} waits here for straggler rank {rank} ({straggler.id}): not a cause of its own."
            )
            c = c.explained(straggler, why)
        out.append(c)
    return out
