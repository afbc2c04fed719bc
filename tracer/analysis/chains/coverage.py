"""Coverage: which parts of the training thread's time the chains explain, and where the rest goes (issue 18).

The breakdown accounts for every nanosecond of the thread's steps (tracer.analysis.breakdown); the chains explain
some of it. After the chains, each part that is at least ``MIN_PART`` of the steps is either *explained* (a chain
of the thread names its cause: :data:`EXPLAINS` says which categories account for which part) or listed as
*unexplained*, with its top code sites: on-CPU samples for ``cpu``, off-CPU stacks for ``blocked``, the calls'
stacks for a CUDA part, the holders of the CPU for a run-queue wait. ``unexplained_share`` is the sum of the
unexplained parts: what a user is left without a *why* for.

Two parts are explained without a chain of their own:

- waiting for the GPU (``sync``, ``copy``) and the host work it hides (``cpu``, ``launch``) when the GPU is the
  limit: a ``gpu_bound`` chain, or, short of one, a thread whose waits for the GPU (at least MIN_PART of its
  steps) no ``sync_stall`` chain calls a stall. The thread waits because the device is busy, which is the goal
  of a training loop. Without a chain, the part says ``root:gpu`` (:data:`GPU_ROOT`): the wait-for graph's root,
  not a chain. Waits for the GPU spent mostly runnable (``cuda_calls.runq_ns``) are waits for a CPU: the GPU is
  not the limit then, and the chains that explain waits for a CPU explain them (issue 28);
- ``runq_tracer``: the tracer's own CPU, which the breakdown names as such (and ``bench/overhead`` measures).

Besides, the wait-for graph (:mod:`tracer.analysis.waitgraph`) follows each group of the thread's *lost* time
(blocked, the waits the tracer's own process ended apart; waiting for a CPU, the tracer's apart; waiting for the
GPU) to its root: ``root_found_share`` is the share of that time whose root it found, and each part names the kind
of its root.

And the thread's CPU outside calls is a chain's when most of its samples (``AT_SITE``) run under the function of
that chain's code site: the Python of the code that makes the churned calls (the ctypes or binding work around
51,000 cudaMalloc/cudaFree a second) is part of what that code costs.
"""

from __future__ import annotations

from collections.abc import Sequence

from tracer.analysis import waitgraph
from tracer.analysis.chains.context import ChainContext, Subject
from tracer.analysis.chains.model import CausalChain, Coverage, PartCoverage
from tracer.analysis.stack_time import blocked_stacks, sampled_stacks, top_lines
from tracer.analysis.taxonomy import CALL_PART_NAMES, PART_NAMES, RUNQ_PART_NAMES

MIN_PART = 0.05  # a part this share of the steps or more is explained or listed
AT_SITE = 0.5  # the CPU part is a chain's when this share of its samples runs under the chain's code site
MS = 1_000_000
SITES = 3  # code sites listed per unexplained part

# part -> the chain categories whose cause accounts for it
EXPLAINS: dict[str, frozenset[str]] = {
    # sync_stall: the stall serializes the host's work with the GPU's (the fix overlaps them)
    # gc_pause: the collector runs on the thread's own CPU
    "cpu": frozenset({"host_python", "launch_bound", "memory_pressure", "gpu_bound", "sync_stall", "gc_pause"}),
    "launch": frozenset({"launch_bound", "host_python", "gpu_bound", "sync_stall"}),
    "sync": frozenset({"sync_stall", "gpu_bound", "straggler_rank"}),
    "copy": frozenset({"sync_stall", "gpu_bound", "straggler_rank"}),
    "alloc": frozenset({"allocation_churn"}),
    "free": frozenset({"allocation_churn"}),
    "other": frozenset({"sync_stall", "allocation_churn", "straggler_rank"}),
    "runq_self": frozenset({"cpu_contention", "gil_contention", "cpu_placement"}),
    "runq_tree": frozenset({"cpu_contention", "dataloader_starvation", "process_churn", "cpu_placement"}),
    "runq_other": frozenset({"cpu_contention", "cpu_placement"}),
    "blocked": frozenset(
        {
            "gil_contention",
            "blocking_io",
            "lock_contention",
            "dataloader_starvation",
            "process_churn",
            "straggler_rank",
            "memory_pressure",
        }
    ),
}
GPU_PARTS = frozenset({"sync", "copy", "cpu", "launch"})  # explained when the GPU is the limit (module docstring)
TRACER_PART = "runq_tracer"
GPU_ROOT = "root:gpu"  # not a chain: the wait-for graph's root, the GPU (the thread waits for a busy device)
# The training thread's lost time: its waits (blocked, for a CPU but the tracer's, for the GPU), traced by the
# wait-for graph in these groups, one path each (tracer.analysis.waitgraph.trace)
LOST_GROUPS: tuple[tuple[str, ...], ...] = (("blocked",), ("runq_self", "runq_tree", "runq_other"), ("sync", "copy"))


def _of(chain: CausalChain, s: Subject) -> bool:
    """True when ``chain`` is about subject ``s``'s thread (or its process, for a chain without a thread)."""
    return chain.tid == s.tid if chain.tid is not None else s.pid in chain.pids


def _gpu_limited(ctx: ChainContext, s: Subject, mine: Sequence[CausalChain]) -> bool:
    """True when the thread's waits for the GPU are the device being the limit, not a stall to fix: a gpu_bound
    chain says so, or the thread waits for the GPU MIN_PART of its steps or more and no sync_stall chain calls
    its waits a stall."""
    cats = {c.category for c in mine}
    waits = s.share(s.time.ns("sync", "copy"))
    if waitgraph.sync_runq_share(ctx, s) >= waitgraph.RUNQ_IN_SYNC:
        return False  # most of those waits were for a CPU, not for the GPU (issue 28)
    return "gpu_bound" in cats or ("sync_stall" not in cats and waits >= MIN_PART)


def _function(site: str) -> tuple[str, str]:
    """Return (file, function) of a code site 'file:line function': the site's function, whatever its line."""
    where, _, function = site.partition(" ")
    return where.rsplit(":", 1)[0], function


def _cpu_stacks(ctx: ChainContext, s: Subject) -> list:
    """The thread's sampled stacks outside calls within its steps, read once: the CPU part's sites and its share
    under the chains' code both use them."""
    key = ("coverage_cpu_stacks", s.tid, s.start_ns, s.end_ns)
    if key not in ctx.memo:
        ctx.memo[key] = sampled_stacks(ctx.conn, [s.tid], ctx.in_steps(s, "cpu"), outside_calls=True).get(s.tid, [])
    return ctx.memo[key]


def _cpu_at_sites(ctx: ChainContext, s: Subject, mine: Sequence[CausalChain]) -> tuple[list[str], float]:
    """Return the categories of the chains under whose code site's function at least AT_SITE of the thread's
    sampled CPU outside calls runs (a frame of the sample's stack is in that function: the line that makes the
    calls and its neighbours, a cudaMalloc's and the cudaFree's after it), and the share of those samples under any
    chain's site.

    A part mostly under the chain's code is the chain's (the loop around the churned calls is its glue). Short of
    AT_SITE the share under the sites is still the chain's and only the rest is unexplained: the stand-in alloc
    fixture's 25 samples put 48% or 52% under its churn, and the part flipped between all and nothing of 10%."""
    sited: dict[tuple[str, str], str] = {}
    for c in mine:
        sites = [c.culprit.code_site] if c.culprit is not None and c.culprit.code_site else []
        # and where the chain's ops are called from: a churn's cudaFree in another function than its cudaMalloc
        ops = {c.op} | {o.op for o in getattr(c.evidence, "ops", []) if getattr(o, "op", None)}
        ops.discard("")
        if ops:
            sites += [site for site, *_ in ctx.top_sites(s.pid, ops, s.tid, limit=5) if site]
        sited.update({_function(site): c.category for site in sites})
    if not sited or not ctx.info.has("cpu_samples"):
        return [], 0.0
    stacks = _cpu_stacks(ctx, s)
    total = sum(x.ns for x in stacks)
    under: dict[str, float] = {}
    anywhere = 0.0
    for x in stacks:
        here = {(f[3] or "", f[2] or "") for f in x.frames if f[0] == "python"}
        cats = {cat for site, cat in sited.items() if site in here}
        for cat in cats:
            under[cat] = under.get(cat, 0.0) + x.ns
        anywhere += x.ns if cats else 0.0
    if not total:
        return [], 0.0
    return sorted(cat for cat, ns in under.items() if ns >= AT_SITE * total), anywhere / total


def _sites(ctx: ChainContext, s: Subject, part: str) -> list[str]:
    """Return where the thread spent ``part``: 'site (ms)' of its heaviest code sites or holders."""
    if part == "cpu" and ctx.info.has("cpu_samples"):
        stacks = _cpu_stacks(ctx, s)
        return [f"{x.site or '(no Python frame)'} ({x.ns / MS:,.0f} ms sampled)" for x in top_lines(stacks, SITES)]
    if part == "blocked" and ctx.info.has("offcpu_stacks"):
        stacks = [b for b in blocked_stacks(ctx.conn, s.tid, ctx.in_steps(s, "blocked")) if not b.in_call]
        return [f"{x.site or '(no Python frame)'} ({x.ns / MS:,.0f} ms)" for x in top_lines(stacks, SITES)]
    if part in CALL_PART_NAMES:
        ops = [o.op for o in ctx.ops_of(s.pid, lambda o: o.part == part)]
        return [
            f"{site or '(no stack)'} ({ns / MS:,.0f} ms in {n:,} stored calls)"
            for site, n, ns, _ in ctx.top_sites(s.pid, ops, s.tid, limit=SITES)
        ]
    if part in RUNQ_PART_NAMES:
        holders, _ = ctx.holders(s)
        return [f"{h.comm} {h.pid} [{h.holder}] ({h.runq_ms:,.0f} ms)" for h in holders[:SITES]]
    return []


def coverage(ctx: ChainContext, chains: Sequence[CausalChain]) -> Coverage | None:
    """Return the training thread's coverage by ``chains`` (every chain found, before any filter); None when the
    recording has no training thread."""
    s = ctx.training
    if s is None or s.time.wall <= 0:
        return None
    mine = [c for c in chains if _of(c, s)]
    gpu = _gpu_limited(ctx, s, mine)
    # syncs spent mostly runnable waited for a CPU: the chains that explain waits for a CPU explain them
    cpu_bound_syncs = waitgraph.sync_runq_share(ctx, s) >= waitgraph.RUNQ_IN_SYNC
    found, lost, roots = root_found(ctx, s)
    parts = []
    for part in PART_NAMES:
        ns = s.time.ns(part)
        share = s.share(ns)
        if share < MIN_PART:
            continue
        explains = EXPLAINS.get(part, frozenset())
        if cpu_bound_syncs and part in ("sync", "copy"):
            explains = EXPLAINS["runq_other"] | EXPLAINS["runq_tree"] | EXPLAINS["runq_self"]
        by = sorted({c.category for c in mine if c.category in explains})
        left = 0.0 if by else 1.0  # the part's share that nothing explains
        if not by and part == "cpu":
            by, under = _cpu_at_sites(ctx, s, mine)
            left = 0.0 if by else 1.0 - under
        if not by and part == TRACER_PART:
            by, left = ["tracer"], 0.0
        elif not by and gpu and part in GPU_PARTS:
            by, left = [GPU_ROOT], 0.0
        parts.append(
            PartCoverage(
                part=part,
                ms=round(ns / MS, 1),
                share=round(share, 4),
                explained_by=by,
                top_sites=[] if by else _sites(ctx, s, part),
                root=roots.get(part),
                unexplained_share=round(share * left, 4),
            )
        )
    unexplained = sum(p.unexplained_share for p in parts)
    return Coverage(
        tid=s.tid,
        pid=s.pid,
        steps_ms=round(s.time.wall / MS, 1),
        parts=parts,
        unexplained_share=round(unexplained, 4),
        lost_share=round(s.share(lost), 4),
        root_found_share=round(found / lost, 4) if lost > 0 else 1.0,
    )


def root_found(ctx: ChainContext, s: Subject) -> tuple[float, float, dict[str, str]]:
    """Return (ns of the thread's lost time whose root the wait-for graph found, its lost time, part -> the kind of
    the root its group's path ends at): each group of LOST_GROUPS traced once."""
    found = lost = 0.0
    roots: dict[str, str] = {}
    for group in LOST_GROUPS:
        t = waitgraph.trace(ctx, s, group)
        if t.ns <= 0:
            continue
        lost += t.ns * (1 - t.tracer)  # the waits the tracer ended are its cost, as its CPU is
        found += t.ns * t.found
        if t.root is not None:
            roots.update(dict.fromkeys(group, t.root.kind))
    return found, lost, roots
