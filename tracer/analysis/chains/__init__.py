"""Causal chains: why the training loop was slow, each cause ranked by the share of the training thread's time
it cost, with the culprit (process, thread, Python line) and fixes written for this trace.

Contract: a detector is ``detect(ctx: ChainContext) -> list[CausalChain]`` in a module of its own, named for its
category, with its thresholds at the top; :data:`DETECTORS` lists them and :func:`compute_chains` runs every one
and ranks the result worst first. Severity comes from the cost share (``context.grade``: HIGH >= 20 %, MEDIUM
>= 5 %), read from the thread's exact time breakdown (:mod:`tracer.analysis.breakdown`), or from its estimate on
a recording made before the breakdown existed (then ``basis`` says ``estimated``). The tracer's own processes
are never a culprit and no fix touches them; their cost is reported by ``tracer breakdown``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import duckdb

from tracer.analysis import waitgraph
from tracer.analysis.chains import (
    allocation_churn,
    blocking_io,
    cpu_contention,
    cpu_placement,
    dataloader_starvation,
    gc_pause,
    gil_contention,
    gpu_bound,
    hang,
    host_python,
    launch_bound,
    lock_contention,
    memory_pressure,
    process_churn,
    stored,
    straggler_rank,
    sync_stall,
    yielding,
)
from tracer.analysis.chains.context import ChainContext, Subject
from tracer.analysis.chains.coverage import EXPLAINS, coverage
from tracer.analysis.chains.model import (
    CATEGORIES,
    SEVERITIES,
    AllocationChurnEvidence,
    CausalChain,
    ChainsResult,
    CpuContentionEvidence,
    Culprit,
    DataloaderStarvationEvidence,
    Evidence,
    GpuBoundEvidence,
    HangEvidence,
    LaunchBoundEvidence,
    MemoryPressureEvidence,
    ProcessChurnEvidence,
    StragglerRankEvidence,
    SyncStallEvidence,
)
from tracer.analysis.gcpause import gc_paused

# the blocked waits a category is about, where it is about one kind (stack_time.blocked_kind): its path follows
# those waits, not the thread's heaviest ones
WAIT_KINDS: dict[str, frozenset[str]] = {
    "lock_contention": frozenset({"lock"}),
    "gil_contention": frozenset({"gil"}),
    "blocking_io": frozenset({"io"}),
}
# the parts a category's path follows, where not every part it explains (coverage.EXPLAINS): a stall's and the
# GPU's are the waits for the GPU, not the host work they serialize
PATH_PARTS: dict[str, tuple[str, ...]] = {
    "sync_stall": ("sync", "copy"),
    "gpu_bound": ("sync", "copy"),
    "host_python": ("cpu",),
    "launch_bound": ("cpu", "launch"),
}
# categories whose thread waits on another rank's: the generic path would end at this host's GPU, which is not
# the cause (their detectors name the straggler); they get no path rather than a wrong one
NO_GENERIC_PATH = frozenset({"straggler_rank"})

__all__ = [
    "CATEGORIES",
    "DETECTORS",
    "SEVERITIES",
    "AllocationChurnEvidence",
    "CausalChain",
    "ChainContext",
    "ChainsResult",
    "CpuContentionEvidence",
    "Culprit",
    "DataloaderStarvationEvidence",
    "Detector",
    "Evidence",
    "GpuBoundEvidence",
    "HangEvidence",
    "LaunchBoundEvidence",
    "MemoryPressureEvidence",
    "ProcessChurnEvidence",
    "StragglerRankEvidence",
    "Subject",
    "SyncStallEvidence",
    "compute_all",
    "compute_chains",
    "detect_all",
    "select",
    "store_chains",
    "write_chains",
]

Detector = Callable[[ChainContext], list[CausalChain]]
DETECTORS: tuple[Detector, ...] = (
    cpu_contention.detect,
    sync_stall.detect,
    allocation_churn.detect,
    process_churn.detect,
    memory_pressure.detect,
    dataloader_starvation.detect,
    launch_bound.detect,
    gpu_bound.detect,
    straggler_rank.detect,
    gil_contention.detect,
    blocking_io.detect,
    host_python.detect,
    lock_contention.detect,
    cpu_placement.detect,
    gc_pause.detect,
    hang.detect,
)


def detect_all(ctx: ChainContext) -> list[CausalChain]:
    """Run every detector; return all chains worst first (a hang, then severity, then share of the thread's time). A
    chain another one explains (a rank's waits for a straggler rank, the GIL waits behind a fault storm's thread, a
    symptom whose wait path ends at another chain's root: :mod:`yielding`) comes after every chain that is a cause."""
    with gc_paused():
        chains = straggler_rank.mark_explained(ctx, [c for d in DETECTORS for c in d(ctx)])
    chains = memory_pressure.explained_by_storms(chains)
    chains = gc_pause.explained_by_gc(chains)
    chains = cpu_placement.explains(chains)
    chains = yielding.yield_to_roots([with_path(ctx, c) for c in chains])
    # a hung job's chain leads: whatever slowed its steps before, it now makes none
    chains.sort(
        key=lambda c: (
            c.explained_by is not None,
            c.category != hang.CATEGORY,
            SEVERITIES.index(c.severity),
            -c.share,
            -c.impact_ms,
            c.id,
        )
    )
    return chains


def with_path(ctx: ChainContext, c: CausalChain) -> CausalChain:
    """Return ``c`` with its wait path (tracer.analysis.waitgraph) from its thread and the parts of the thread's
    time its category explains (coverage.EXPLAINS), unless its detector set one, or it is about no subject."""
    if c.path or c.root is not None or c.tid is None or c.category in NO_GENERIC_PATH:
        return c
    s = next((x for x in ctx.subjects if x.tid == c.tid), None)
    parts = PATH_PARTS.get(c.category) or [p for p, cats in EXPLAINS.items() if c.category in cats]
    if s is None or not parts:
        return c
    t = waitgraph.trace(ctx, s, parts, WAIT_KINDS.get(c.category))
    return c.model_copy(update={"path": t.path, "root": t.root, "branches": t.branches}) if t.path else c


def compute_chains(
    conn: duckdb.DuckDBPyConnection,
    pid: int | None = None,
    severity: str | None = None,
    limit: int = 10,
    ctx: ChainContext | None = None,
) -> ChainsResult:
    """Return causal chains worst first, optionally only for ``pid`` and at one ``severity`` (high|medium|low).

    Of the whole recording (no ``pid``), the answer ``tracer record`` stored at its end is served where it still
    holds (:mod:`stored`); otherwise every detector runs.

    ``ctx``: the detectors' inputs when the caller has loaded them already (``ChainContext.load(conn, pid)``):
    trace_stats shares them with its own breakdown, which would otherwise load every thread's time twice."""
    sev = severity.upper() if severity else None
    if sev is not None and sev not in SEVERITIES:
        raise ValueError(f"unknown severity {severity!r}; use one of high, medium, low")
    kept = stored.load(conn) if pid is None else None
    if kept is not None:
        return select(kept, sev, limit)
    return select(compute_all(conn, pid, ctx), sev, limit)


def select(found: ChainsResult, severity: str | None, limit: int) -> ChainsResult:
    """Return ``found`` (every chain) cut to the chains at ``severity`` (upper case; None: all), then to ``limit``;
    the counts by severity and the coverage stay those of every chain found."""
    chains = [c for c in found.chains if c.severity == severity] if severity else found.chains
    return found.model_copy(update={"chains": chains[: max(limit, 0)], "total": len(chains)})


@gc_paused()  # the coverage after the detectors makes as many small objects as they do (see gcpause)
def compute_all(
    conn: duckdb.DuckDBPyConnection, pid: int | None = None, ctx: ChainContext | None = None
) -> ChainsResult:
    """Run every detector (no stored answer read); return every chain found, with the counts and the coverage."""
    ctx = ctx or ChainContext.load(conn, pid)
    chains = detect_all(ctx)
    counts = {s: sum(1 for c in chains if c.severity == s) for s in SEVERITIES}
    note = ctx.times.note
    if ctx.times.basis != "exact" and not ctx.info.has_wakers:
        note = (note + "; " if note else "") + "dataloader_starvation needs wakers, which this recording lacks"
    training = ctx.training
    return ChainsResult(
        chains=chains,
        total=len(chains),
        by_severity=counts,
        basis=ctx.times.basis,
        note=note,
        training_tid=training.tid if training else None,
        coverage=coverage(ctx, chains),  # every chain found: a severity filter or the limit explains nothing less
    )


def write_chains(rw_conn: duckdb.DuckDBPyConnection, chains: Sequence[CausalChain]) -> int:
    """Append ``chains`` to ``causal_chains`` with computed_at = now; return the number written.

    ``evidence`` holds the chain's measured part: share, impact, thread, basis, culprit and the category's
    evidence fields, so SQL reads them as ``evidence->>'share'``."""
    for c in chains:
        evidence = {
            "share": c.share,
            "impact_ms": c.impact_ms,
            "tid": c.tid,
            "basis": c.basis,
            "culprit": c.culprit.model_dump() if c.culprit else None,
            "explained_by": c.explained_by,
            "path": [h.model_dump() for h in c.path],
            "root": c.root.model_dump() if c.root else None,
            "branches": [h.model_dump() for h in c.branches],
            **c.evidence.model_dump(),
        }
        rw_conn.execute(
            "INSERT INTO causal_chains (id, computed_at, severity, category, start_ns, end_ns, pids, op, summary, "
            "evidence, recommendations) VALUES (?, now(), ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                c.id,
                c.severity,
                c.category,
                c.start_ns,
                c.end_ns,
                c.pids,
                c.op or None,
                c.summary,
                json.dumps(evidence, default=str),
                json.dumps(c.recommendations),
            ],
        )
    return len(chains)


def store_chains(db: str | Path, limit: int = 100) -> int:
    """Compute the chains of the finished recording ``db`` and write them into it (the step ``tracer record`` runs
    after the recorder has closed the file): the worst ``limit`` as ``causal_chains`` rows, and the whole answer
    for the tools to serve (:mod:`stored`); return how many rows were written."""
    with duckdb.connect(str(db)) as rw_conn:
        # No vacuum at this connection's closing checkpoint: it would rewrite the finished file for a few rows, past
        # a --max-db-size cap (tracer/recorder/sizecap.py).
        rw_conn.execute("SET max_vacuum_tasks = 0")
        found = compute_all(rw_conn)
        rw_conn.execute("BEGIN")
        written = write_chains(rw_conn, found.chains[: max(limit, 0)])
        stored.save(rw_conn, found)
        rw_conn.execute("COMMIT")
    return written
