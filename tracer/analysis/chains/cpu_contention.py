"""cpu_contention: the thread was runnable and waited for a CPU that another task held.

Cost: the thread's run-queue time, outside calls (``runq_self/tree/other``, exact) and inside them
(``call_runq_ns``, split between holder classes by what each class's holders in ``preemptors`` caused beyond
its exact wait outside calls: :func:`in_call_runq_by_class`), as a share of its steps' time. Two
chains at most per thread: *other* (other tenants' processes: the fix is on the host) and *own* (its own threads
and workers: the fix is in the job). The tracer's share is never counted: it is reported as the tracer's cost.
Run-queue time behind a thread of the job that is faulting in memory is left to memory_pressure. The *other*
chain also counts the thread's waits for batches that its data workers were late with because they queued
behind other processes (``via_workers_ms``, from :func:`dataloader_starvation.loader_wait`). The share of the
thread's waits that its placement explains (idle CPUs outside its affinity, a used-up cgroup quota:
:func:`cpu_placement.placement_of`) is cpu_placement's, not this chain's.
"""

from __future__ import annotations

from tracer.analysis.breakdown.holders import Holder
from tracer.analysis.chains.applies import has_dataloader, is_dataloader_worker
from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, Subject, grade
from tracer.analysis.chains.cpu_placement import placement_of
from tracer.analysis.chains.dataloader_starvation import loader_wait
from tracer.analysis.chains.memory_pressure import storm_threads
from tracer.analysis.chains.model import CausalChain, CpuContentionEvidence, Culprit
from tracer.analysis.recording import most_alive_at_once

CATEGORY = "cpu_contention"
# Issue 10's scale: a fifth of the steps' time spent waiting for a CPU is the job's main problem.
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return up to two chains per subject: CPU held by other processes, CPU held by the job itself."""
    out = []
    cores = ctx.info.cpu_cores
    workers = most_alive_at_once([ctx.info.procs[p] for p in sorted(ctx.info.dataloader_pids)], ctx.info.duration_ns)
    host = ctx.conn.execute("SELECT max(load1), max(cpu_busy_pct) FROM host_samples").fetchone() or (None, None)
    for s in ctx.subjects:
        t = s.time
        holders, _ = ctx.holders(s)
        holders = [h for h in holders if h.holder != "tracer"]
        storms = {st.tid for st in storm_threads(ctx, s.pid)} - {s.tid}
        # the job's own threads that are faulting in memory: their CPU is memory_pressure's to claim
        self_ns = t.ns("runq_self") * (1 - _storm_cpu_share(ctx, s, storms))
        outside = {"other": t.ns("runq_other"), "own": self_ns + t.ns("runq_tree")}
        # inside calls (a sync's wakeup behind the CPU's holder): each class's own part, from the data
        ic = ctx.in_call_runq(s)
        in_call = {"other": ic["other"], "own": ic["self"] + ic["tree"]}
        lw = loader_wait(ctx, s)
        # the waits the job's placement explains (CPUs it may not use sat idle, or its quota ran out) are
        # cpu_placement's: fewer workers is not their fix
        pc = placement_of(ctx, s)
        for cls in ("other", "own"):
            keep = pc.keep(own=cls == "own") if pc else 1.0
            inside = in_call[cls] * keep
            via = lw.foreign_ns if cls == "other" else 0.0
            cost = outside[cls] * keep + inside + via
            sev = grade(s.share(cost), HIGH, MEDIUM, LOW)
            if sev is None:
                continue
            mine = [h for h in holders if (h.holder == "other") == (cls == "other") and h.holder != "interrupt"]
            if via:
                mine = _merge(mine, lw.foreign_holders)
            parts = ("runq_other",) if cls == "other" else ("runq_self", "runq_tree")
            when = ctx.hot_range(s, lambda r, p=parts: sum(r[x] for x in p))
            out.append(
                _chain(ctx, s, cls, sev, cost, outside[cls] * keep, inside, via, mine, cores, workers, host, when)
            )
    return out


def _merge(direct: list[Holder], via_workers: list[Holder]) -> list[Holder]:
    """Return the holders of both lists, one per pid with their waits summed, most first."""
    acc: dict[int, Holder] = {}
    for h in [*direct, *via_workers]:
        a = acc.get(h.pid)
        acc[h.pid] = (
            h
            if a is None
            else a.model_copy(
                update={"runq_ms": round(a.runq_ms + h.runq_ms, 3), "preemptions": a.preemptions + h.preemptions}
            )
        )
    return sorted(acc.values(), key=lambda h: (-h.runq_ms, h.pid))


def _storm_cpu_share(ctx: ChainContext, s: Subject, storms: set[int]) -> float:
    """Return the part of the process's other threads' CPU time used by fault-storm threads."""
    others = [t for t in ctx.threads_of(s.pid) if t.tid != s.tid]
    cpu = sum(t.ns("cpu") for t in others)
    return sum(t.ns("cpu") for t in others if t.tid in storms) / cpu if cpu else 0.0


def _chain(
    ctx: ChainContext,
    s: Subject,
    cls: str,
    sev: str,
    cost: float,
    outside: float,
    inside: float,
    via: float,
    holders: list[Holder],
    cores: int,
    workers: int,
    host: tuple,
    when: tuple[int, int],
) -> CausalChain:
    t = s.time
    top = holders[0] if holders else None
    relation = {"other": "other_process", "tree": "own_workers", "self": "own_thread"}.get(
        top.holder if top else "", "host"
    )
    culprit = (
        Culprit(
            kind="process" if top.holder != "self" else "thread",
            pid=top.pid,
            tid=None,
            comm=top.comm,
            relation=relation,
            code_site=None,
        )
        if top
        else None
    )
    share = s.share(cost)
    who = f"{top.comm} (pid {top.pid})" if top else ("other processes" if cls == "other" else "its own threads")
    recs: list[str] = []
    if cls == "other":
        if top:
            recs.append(
                f"{top.comm} (pid {top.pid}) held the CPU for {top.runq_ms:,.0f} ms while thread {s.tid} waited: run "
                f"it on other cores (taskset -cp <other cores> {top.pid}) or at a lower priority "
                f"(renice -n 19 -p {top.pid})."
            )
        recs.append(
            f"Give the training process cores nothing else uses: taskset -cp <cores> {s.pid}"
            + (f" (this host has {cores} CPUs)" if cores else "")
            + "; on a shared machine, ask for dedicated CPUs (cgroup cpuset / the scheduler's exclusive mode)."
        )
    else:
        tree = [h for h in holders if h.holder == "tree"]
        # a helper of the job (a storage service, a shell's command) is not a worker: fewer workers would not
        # free its CPU (issue 28)
        helpers = [h for h in tree if not is_dataloader_worker(ctx, h.pid)]
        by_workers = sum(h.runq_ms for h in tree) - sum(h.runq_ms for h in helpers)
        worker_rec = helper_rec = None
        if by_workers > 0 and workers:
            keep = max(cores - 1, 1) if cores else None
            worker_rec = (
                f"Its own {workers} DataLoader worker processes held the CPU while the training thread waited "
                + (
                    f"on {cores} CPUs: lower num_workers to {min(keep, max(workers - 1, 1))} or fewer so a core "
                    "stays free for the main thread."
                    if keep
                    else ": lower num_workers."
                )
            )
        if helpers:
            names = ", ".join(f"{h.comm} (pid {h.pid})" for h in helpers[:3])
            helper_rec = (
                f"Helper processes of the job, not workers, held the CPU while the training thread waited: {names}. "
                f"Give them cores of their own or a lower priority (renice -n 10 -p {helpers[0].pid})."
            )
        first_helpers = sum(h.runq_ms for h in helpers) > by_workers
        recs += [r for r in ((helper_rec, worker_rec) if first_helpers else (worker_rec, helper_rec)) if r]
        if any(h.holder == "self" for h in holders):
            recs.append(
                f"Threads of its own process ({', '.join(sorted({h.comm for h in holders if h.holder == 'self'}))}) "
                "compete with the training thread: cap intra-op threads (torch.set_num_threads"
                + (f"({max(cores - 1, 1)})" if cores else "")
                + " or OMP_NUM_THREADS)"
                + (" and move host-side work into DataLoader workers." if has_dataloader(ctx) else ".")
            )
        if not recs:
            recs.append("Reduce the job's own CPU demand next to the training thread (fewer workers or threads).")
    return ctx.chain(
        s,
        category=CATEGORY,
        severity=sev,
        cost_ns=cost,
        culprit=culprit,
        start_ns=when[0],
        end_ns=when[1],
        pids=[top.pid] if top and ctx.info.in_tree(top.pid) else [],
        summary=(
            f"Thread {s.tid} ({t.comm}, pid {s.pid}) lost {cost / MS:,.0f} ms ({share:.0%} of its steps' time) "
            f"to CPUs held by another process, mostly {who}: {(cost - via) / MS:,.0f} ms waiting for a CPU "
            f"itself, {via / MS:,.0f} ms waiting for batches its data workers were late with while they queued "
            "behind it."
            if via >= MS
            else f"Thread {s.tid} ({t.comm}, pid {s.pid}) waited {cost / MS:,.0f} ms for a CPU ({share:.0%} of "
            f"its steps' time) held by {'another process' if cls == 'other' else 'its own job'}: mostly {who}."
        ),
        evidence=CpuContentionEvidence(
            holder_class=cls,
            runq_ms=round(cost / MS, 1),
            runq_outside_calls_ms=round(outside / MS, 1),
            runq_inside_calls_ms=round(inside / MS, 1),
            via_workers_ms=round(via / MS, 1),
            runq_by_holder_ms={k: round(t.ns(f"runq_{k}") / MS, 1) for k in ("self", "tree", "other", "tracer")},
            holders=holders[:5],
            cpu_cores=cores,
            dataloader_workers=workers,
            max_load1=host[0],
            max_cpu_busy_pct=host[1],
        ),
        recommendations=recs,
    )
