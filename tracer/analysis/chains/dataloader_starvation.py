"""dataloader_starvation: the training thread blocked, off CPU, until one of its data workers woke it: it was
waiting for a batch.

Source: ``thread_wakers``, exact per waker. Cost: the thread's blocked time outside CUDA calls that a worker
process of the traced tree ended (a process that launches kernels itself is another rank, not a worker). What
the workers were doing meanwhile (their own breakdown) decides the fix: busy on CPU means too few workers or
too costly a ``__getitem__``; mostly blocked means a slow hand-off (IPC, prefetch too shallow) or slow storage.
The extra wait for a respawn wave's first batch is process_churn's.

The advice follows the root of the workers' own time, not a share of their CPU against a cut-off (issue 28): of
their time not on CPU, which dominates decides, each a ratio far from 1 on a real job (:func:`worker_time`):

- blocked, woken by something outside the pool and the training process (a storage service, a FUSE daemon, the
  network, the disk): root ``external_wait``, the path ending at that waker, named by what it is (a helper process
  of the job is not a worker); the fix is more workers or deeper prefetch, the count from the thread's wait;
- runnable, waiting for a CPU, at least half as long as on it: root ``cpu_capacity`` (every core the job may use
  was busy), with their hottest line; the fix is a cheaper transform, more cores, or fewer processes than cores;
- on CPU: root ``on_cpu`` at their hottest line;
- blocked until the training process or a sibling woke them (a hand-off that takes long): the slow hand-off.

A recording without wakers cannot tell a batch from a sleep: no chain, and the chains' note says so.

Workers that were slow because they queued for a CPU behind other tenants' processes do not starve the loader
by themselves: that part of the wait (the workers' run-queue time behind other processes, as a share of their
working time) is cpu_contention's, against the process that held the CPU (:func:`loader_wait`). Without it, a
CPU hog on the training cores ranked as a starved loader with the hog second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tracer.analysis.breakdown.holders import Holder, Waker
from tracer.analysis.breakdown.thread_time import ThreadTime
from tracer.analysis.chains.applies import helper_pids, is_dataloader_worker
from tracer.analysis.chains.context import (
    HIGH_SHARE,
    LOW_SHARE,
    MEDIUM_SHARE,
    ChainContext,
    Subject,
    clip,
    grade,
)
from tracer.analysis.chains.gil_contention import lines
from tracer.analysis.chains.model import (
    CausalChain,
    Culprit,
    DataloaderStarvationEvidence,
    Hop,
    LineTime,
    Root,
    WorkerLoad,
)
from tracer.analysis.chains.process_churn import respawn_stalls, respawn_windows
from tracer.analysis.recording import most_alive_at_once
from tracer.analysis.stack_time import Frame, StackTime, blocked_stacks, sampled_stacks, syscall_of
from tracer.vocabulary import waker_name

CATEGORY = "dataloader_starvation"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
S = 1_000_000_000
# workers runnable at least half as long as they ran were short of cores: the root is CPU capacity, not their code
CAPACITY_RUNQ_PER_CPU = 0.5
STACK_FRAMES = 6  # a root's stack, innermost first: enough to see the call it waits in and the lines above it
MAX_WORKERS_ADVISED = 64


def _respawn_waits(ctx: ChainContext, s: Subject, respawned: dict[int, tuple[int, int]]) -> float:
    """Return the subject's blocked time (outside calls) ended by freshly respawned workers in their first
    seconds: process_churn's cost, not a steady loader's."""
    if not respawned:
        return 0.0
    total = 0.0
    for wp, sec, ns in ctx.conn.execute(
        "SELECT waker_pid, sec, sum(blocked_ns) FROM thread_wakers WHERE tid = ? AND NOT in_call "
        "AND list_contains(?, waker_pid) AND sec BETWEEN ? AND ? GROUP BY 1, 2",
        [s.tid, list(respawned), s.start_ns // S, s.end_ns // S],
    ).fetchall():
        a, b = respawned[wp]
        if a // S <= sec <= (b - 1) // S:
            total += ns or 0
    return total


@dataclass(frozen=True)
class LoaderWait:
    """A subject's waits for its data workers, and the part of them that other tenants' processes caused."""

    wakers: list[Waker]  # the workers that ended its blocked intervals
    woken_ns: float  # its blocked time outside calls that they ended (respawn waves' first seconds left out)
    foreign_ns: float  # of woken_ns, the share the workers spent queued for a CPU held by other processes
    foreign_holders: list[Holder]  # those processes; runq_ms: the subject's wait each caused through the workers


def loader_wait(ctx: ChainContext, s: Subject) -> LoaderWait:
    """Return how long subject ``s`` blocked until its data workers woke it, and how much of that wait the
    workers' queueing behind other processes explains (their run-queue time behind other processes over their
    working time, on CPU or runnable, within the subject's steps: removing the other process removes that share
    of each batch's latency, to first order)."""
    key = ("loader_wait", s.tid)
    if key in ctx.memo:
        return ctx.memo[key]
    if not ctx.info.has_wakers:  # an older recording cannot tell a batch from a sleep
        return LoaderWait([], 0.0, 0.0, [])
    trainers = {x.pid for x in ctx.subjects if x.launches}
    helpers = helper_pids(ctx, s.tid)  # commands it waited for to finish deliver no batches
    wakers = [
        w
        for w in ctx.wakers(s)
        if w.holder == "tree"
        and w.pid not in trainers
        and w.pid not in helpers
        and ctx.info.process_role(w.pid) != "tracer"
    ]
    # with DataLoader workers, only they hand batches over: a helper of the job that woke the thread while it
    # lived (a storage service signalling it is ready) is not a worker (issue 28)
    if any(is_dataloader_worker(ctx, w.pid) for w in wakers):
        wakers = [w for w in wakers if is_dataloader_worker(ctx, w.pid)]
    woken = sum((w.blocked_ms - w.in_call_ms) * MS for w in wakers)
    stalls = respawn_stalls(ctx, s)
    if stalls is None:  # no wakers in sched: the respawns' windows, whole seconds
        woken -= _respawn_waits(ctx, s, respawn_windows(ctx, s))
    else:  # each respawn's first batch, beyond a usual batch's wait, is process_churn's cost
        woken -= sum(min(st.batch_wait_ns, st.cost_ns) for st in stalls)
    working = foreign = 0.0
    clipped = []
    pool = _pool_pids(ctx, s, {w.pid for w in wakers})
    _worker_wakers(ctx, [t.tid for pid in {w.pid for w in wakers} for t in ctx.threads_of(pid)])
    for pid in {w.pid for w in wakers}:
        for whole in ctx.threads_of(pid):
            t = clip(whole, s.start_ns, s.end_ns)
            if t.wall <= 0:
                continue
            # a wait for a source (a storage service, the network) is part of each batch's latency, as their CPU
            # is: without it, workers latency-bound on a source were "slow" only by their run-queue time (their
            # sources over their whole span, pro-rated to the part inside the steps)
            working += t.wall - t.ns("blocked") + _source_ns(ctx, whole.tid, pool) * t.wall / max(whole.wall, 1)
            foreign += t.ns("runq_other")
            clipped.append(t)
    held = {h.pid: h for h in ctx.other_holders(clipped)}
    foreign_ns = woken * foreign / working if woken > 0 and working > 0 else 0.0
    # each holder's part of the workers' queueing, as the subject's wait it caused through them
    total = sum(h.runq_ms for h in held.values())
    holders = sorted(
        (
            h.model_copy(update={"runq_ms": round(foreign_ns / MS * h.runq_ms / total, 3)})
            for h in held.values()
            if total
        ),
        key=lambda h: (-h.runq_ms, h.pid),
    )
    out = LoaderWait(wakers, max(woken, 0.0), foreign_ns, holders if foreign_ns > 0 else [])
    ctx.memo[key] = out
    return out


@dataclass
class Source:
    """Something outside the worker pool and the training process that ended the workers' waits."""

    pid: int  # 0: an interrupt ([net], [block], [timer])
    tid: int
    comm: str
    ns: float = 0.0
    wakeups: float = 0.0


@dataclass
class WorkerTime:
    """Where the workers' time went, and who ended their waits (issue 28: the root of a starved loader)."""

    wall_ns: float
    cpu_ns: float
    runq_ns: float
    blocked_ns: float
    source_ns: float  # blocked until a source (not the pool, not the training process) woke them
    sources: list[Source]  # most first
    wait: StackTime | None  # where they waited for the sources, their heaviest stack

    @property
    def working_ns(self) -> float:
        return self.cpu_ns + self.runq_ns

    @property
    def root(self) -> str:
        """external_wait | cpu_capacity | on_cpu | hand_off: which of their ways of not running dominates."""
        if self.source_ns > self.working_ns:
            return "external_wait"
        if self.working_ns >= self.blocked_ns - self.source_ns:
            return "cpu_capacity" if self.runq_ns >= CAPACITY_RUNQ_PER_CPU * self.cpu_ns else "on_cpu"
        return "hand_off"


def _pool_pids(ctx: ChainContext, s: Subject, workers: set[int]) -> frozenset[int]:
    """The processes whose wakeups of a worker are the loader's own hand-off, not a source: the training
    processes and the workers with every sibling of theirs."""
    key = ("pool_pids", s.tid, frozenset(workers))  # asked twice per subject; the tree walk is 200 K processes
    if key not in ctx.memo:
        trainers = {x.pid for x in ctx.subjects if x.launches}
        comms = {ctx.info.comm(p) for p in workers}
        # the few processes so named, each walked up to s.pid, not the whole tree walked down from it
        named = {*ctx.info.named(comms), *ctx.info.dataloader_pids}
        sibs = {p for p in named if ctx.info.descends_from(p, s.pid)}
        ctx.memo[key] = frozenset({*trainers, s.pid, *workers, *sibs})
    return ctx.memo[key]


# (waker pid, waker tid, its name, blocked ns outside calls, wakeups): one waker of a worker thread
WakerRow = tuple[int, int, str, float, float]
WAIT_SITE_THREADS = 4  # the wait site is read from the threads that waited on sources longest (a query each)


def _worker_wakers(ctx: ChainContext, tids: list[int]) -> None:
    """Read the wakers of every thread in ``tids`` not read yet, in one query (a loader that re-forks its workers
    has hundreds of them: a query each doubled `tracer chains` on the demo's recording, 1.3 -> 2.6 s), into
    ctx.memo."""
    need = sorted({t for t in tids if ("worker_wakers", t) not in ctx.memo})
    if not need:
        return
    got: dict[int, list[WakerRow]] = {t: [] for t in need}
    for tid, wp, wt, comm, n, ns in ctx.conn.execute(
        "SELECT tid, coalesce(waker_pid, 0), coalesce(waker_tid, 0), waker_comm, sum(wakeups), "
        "coalesce(sum(blocked_ns) FILTER (WHERE NOT in_call), 0) FROM thread_wakers "
        "SEMI JOIN (SELECT unnest($t) AS x) ON tid = x GROUP BY ALL",
        {"t": need},
    ).fetchall():
        got[int(tid)].append((int(wp), int(wt), waker_name(int(wp), comm), float(ns or 0), float(n or 0)))
    for t, rows in got.items():
        ctx.memo[("worker_wakers", t)] = rows


def _sources(ctx: ChainContext, tid: int, pool: frozenset[int]) -> list[WakerRow]:
    """The wakers of worker thread ``tid`` outside ``pool`` (and not the tracer): its sources."""
    _worker_wakers(ctx, [tid])
    return [
        w for w in ctx.memo[("worker_wakers", tid)] if w[0] not in pool and not ctx.info.is_tracer(w[0] or None, w[2])
    ]


def _source_ns(ctx: ChainContext, tid: int, pool: frozenset[int]) -> float:
    return sum(w[3] for w in _sources(ctx, tid, pool))


def worker_time(ctx: ChainContext, threads: list[ThreadTime], pool: frozenset[int]) -> WorkerTime:
    """Return where the workers' ``threads`` spent their time and who woke them; ``pool``: the processes whose
    wakeups are the loader's own hand-off (the training processes and every worker)."""
    cpu = sum(t.ns("cpu") for t in threads)
    runq = sum(t.runq_ns for t in threads)
    blocked = sum(t.ns("blocked") for t in threads)
    src: dict[tuple[int, str], Source] = {}
    _worker_wakers(ctx, [t.tid for t in threads])
    by_tid: dict[int, float] = {}
    for t in threads:
        for wp, wt, name, ns, n in _sources(ctx, t.tid, pool):
            # one source per process (a service answers each connection from a thread of its own), an interrupt
            # per kind
            x = src.setdefault((wp, "" if wp else name), Source(wp, wt if wp else 0, name))
            x.ns += ns
            x.wakeups += n
            by_tid[t.tid] = by_tid.get(t.tid, 0.0) + ns
    sources = sorted((x for x in src.values() if x.ns > 0), key=lambda x: (-x.ns, x.pid, x.comm))
    # the pool's heaviest wait that a source ended: the line the workers wait at
    names = {x.comm for x in sources}
    waits: dict[tuple, StackTime] = {}
    if names and ctx.info.has("offcpu_stacks"):
        top = sorted(by_tid, key=lambda t: -by_tid[t])[:WAIT_SITE_THREADS]
        for t in [x for x in threads if x.tid in top]:
            for st in blocked_stacks(ctx.conn, t.tid):
                ns = sum(v for k, v in st.wakers.items() if k in names)
                if ns <= 0:
                    continue
                acc = waits.setdefault((st.site, syscall_of(st.frames)), StackTime(st.stack_id, frames=st.frames))
                acc.ns += ns
    wait = max(waits.values(), key=lambda x: x.ns, default=None)
    wall = float(sum(t.wall for t in threads))
    return WorkerTime(wall, cpu, runq, blocked, sum(x.ns for x in sources), sources, wait)


def _stack(frames: list[Frame]) -> list[str]:
    """A stack innermost first, a few frames: 'file:line function' for Python, the function for native code."""
    out = []
    for kind, _module, fn, file, line in reversed(frames):
        if kind == "python":
            out.append(f"{file}:{line} {fn}")
        elif fn and fn != "?" and not fn.startswith("0x"):
            out.append(fn)
        if len(out) == STACK_FRAMES:
            break
    return out


def _state(ctx: ChainContext, pid: int) -> str:
    """What a process mostly did (on_cpu | runq | blocked), from its threads' breakdown; blocked when unknown."""
    ths = ctx.threads_of(pid)
    parts = {
        "on_cpu": sum(t.ns("cpu") for t in ths),
        "runq": sum(t.runq_ns for t in ths),
        "blocked": sum(t.ns("blocked") for t in ths),
    }
    return max(parts, key=parts.get) if any(parts.values()) else "blocked"


def _source_name(ctx: ChainContext, x: Source) -> tuple[str, str]:
    """(its name for a reader, its role in the path) of a source: a helper process of the job by its name (not a
    worker: issue 28), another process, or an interrupt by kind."""
    if not x.pid:
        kind = {"[net]": "the network", "[block]": "the disk", "[timer]": "a timer"}.get(x.comm, x.comm)
        return f"{x.comm} ({kind})", "kernel"
    comm = ctx.info.comm(x.pid) if x.pid in ctx.info.procs else x.comm
    if ctx.info.in_tree(x.pid):
        return f"{comm} (pid {x.pid}, a helper process of the job)", "helper"
    return f"{comm} (pid {x.pid}, outside the job)", "other_process"


def _training_wait_site(ctx: ChainContext, s: Subject, worker_comms: set[str]) -> str | None:
    """The line where the training thread waited for the workers: its heaviest blocked stack they ended."""
    if not ctx.info.has("offcpu_stacks"):
        return None
    acc: dict[str | None, float] = {}
    for st in blocked_stacks(ctx.conn, s.tid, ctx.in_steps(s, "blocked")):
        ns = sum(v for k, v in st.wakers.items() if k in worker_comms)
        if ns > 0 and st.site:
            acc[st.site] = acc.get(st.site, 0.0) + ns
    return max(acc, key=acc.get) if acc else None


def _advice(
    ctx: ChainContext,
    wt: WorkerTime,
    n_workers: int,
    knob: str,
    dl: bool,
    hot: list[LineTime],
    share: float,
) -> tuple[str, str, Root | None, list[Hop]]:
    """Return (the first recommendation, the summary's clause on the workers, the root, the hops past the
    workers) for the workers' root (:attr:`WorkerTime.root`)."""
    cores = ctx.info.cpu_cores
    wall = wt.wall_ns or 1.0
    site = hot[0].site if hot else None
    kind = wt.root
    if kind == "external_wait":
        top = wt.sources[0]
        name, role = _source_name(ctx, top)
        call = syscall_of(wt.wait.frames) if wt.wait else None
        where = wt.wait.site if wt.wait else None
        at = (f" in {call}" if call else "") + (f" at {where}" if where else "")
        each = top.ns / top.wakeups / MS if top.wakeups else 0.0
        # the loop waited `share` of its steps: a pool that many times larger hides the source's latency
        more = min(max(n_workers + 1, math.ceil(n_workers / max(1.0 - share, 1e-3))), MAX_WORKERS_ADVISED)
        rec = (
            f"The {n_workers} workers were blocked {wt.source_ns / wall:.0%} of their time{at}, each wait ended by "
            f"{name}"
            + (f" after {each:,.1f} ms" if each else "")
            + f"; they were on CPU only {wt.cpu_ns / wall:.0%}. The source's latency is the limit, not their CPU: "
            + (
                f"raise {knob} to about {more} and prefetch_factor so more requests are in flight"
                if dl
                else f"raise {knob} to about {more} and queue more items ahead"
            )
            + ", or fetch each batch's samples in parallel inside a worker (a thread pool, batched requests)."
        )
        clause = f"; the workers were blocked {wt.source_ns / wall:.0%} of their time{at}, woken by {name}"
        root = Root(
            kind="external_wait",
            detail=f"the workers' waits{at} ended by {name}" + (f", {each:,.1f} ms each" if each else ""),
            site=where,
            stack=_stack(wt.wait.frames) if wt.wait else [],
        )
        hop = Hop(
            tid=top.tid or None,
            pid=top.pid or None,
            comm=ctx.info.comm(top.pid) if top.pid in ctx.info.procs else top.comm,
            role=role,
            edge="woken_by",
            state=_state(ctx, top.pid) if role == "helper" else ("io" if role == "kernel" else "blocked"),
            share=0.0,  # set by the caller: the part of the lost time through this hop
            ms=0.0,
            site=None,
        )
        return rec, clause, root, [hop]
    if kind == "cpu_capacity":
        procs = f"{n_workers} workers and the training process"
        rec = (
            f"The {n_workers} workers waited for a CPU {wt.runq_ns / wall:.0%} of their time (on CPU "
            f"{wt.cpu_ns / wall:.0%}): every core the job may use was busy ({procs}"
            + (f" on {cores} CPUs" if cores else "")
            + "), so they were short of cores, not slow. Make the transform cheaper"
            + (f" ({hot[0].share:.0%} of their CPU is {site})" if site else "")
            + f", give the job more cores, or keep {knob} below the cores left for them."
        )
        clause = (
            f"; the workers waited for a CPU {wt.runq_ns / wall:.0%} of their time, on CPU {wt.cpu_ns / wall:.0%}"
            + (f" ({hot[0].share:.0%} of it at {site})" if site else "")
        )
        root = Root(
            kind="cpu_capacity",
            detail=f"{procs} wanted more CPU than the cores they could use"
            + (f" (the host has {cores})" if cores else "")
            + f": the workers waited for one {wt.runq_ns / wall:.0%} of their time",
            site=site,
        )
        return rec, clause, root, []
    if kind == "on_cpu":
        busy = wt.cpu_ns / wall
        more = min(max(cores - 1, 1), n_workers * 2) if cores else n_workers * 2
        rec = (
            f"The {n_workers} workers were on CPU {busy:.0%} of their time and still too slow: "
            + (
                f"raise {knob} to {more} (this host has {cores} CPUs)"
                if cores and more > n_workers
                else "the CPUs are all used: make each batch cheaper"
            )
            + ", and move decoding/augmentation to the GPU or precompute it"
            + (f"; {hot[0].share:.0%} of their CPU is {site}." if site else ".")
        )
        clause = f" ({busy:.0%} of their time on CPU" + (f", {hot[0].share:.0%} of it at {site}" if site else "") + ")"
        root = Root(kind="on_cpu", detail=f"the workers' own CPU: {busy:.0%} of their time", site=site)
        return rec, clause, root, []
    busy = wt.cpu_ns / wall
    rec = f"The workers were on CPU only {busy:.0%} of their time while the training thread waited, " + (
        "blocked until the training process handed them work: the hand-off is slow. Raise prefetch_factor, use "
        "pin_memory=True and persistent_workers=True."
        if dl
        else "blocked until the training process handed them work: the hand-off is slow. Queue more items ahead "
        "(a deeper queue between the workers and the training loop)."
    )
    clause = f" ({busy:.0%} of their time on CPU, the rest mostly waiting for the training process)"
    return rec, clause, None, []


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject that blocked waiting for its data workers >= LOW_SHARE of its steps."""
    if not ctx.info.has_wakers:
        return []
    out = []
    trainers = {s.pid for s in ctx.subjects if s.launches}
    for s in ctx.subjects:
        lw = loader_wait(ctx, s)
        woken = lw.woken_ns - lw.foreign_ns  # what the loader itself cost; the rest is cpu_contention's
        sev = grade(s.share(woken), HIGH, MEDIUM, LOW)
        if sev is None:
            continue
        out.append(_chain(ctx, s, lw, woken, sev, trainers))
    return out


def _chain(ctx: ChainContext, s: Subject, lw: LoaderWait, woken: float, sev: str, trainers: set[int]) -> CausalChain:
    t = s.time
    wakers = lw.wakers
    by_pid: dict[int, list] = {}
    for w in wakers:
        by_pid.setdefault(w.pid, []).append(w)
    loads = []
    for pid, ws in sorted(by_pid.items(), key=lambda kv: -sum(w.blocked_ms for w in kv[1])):
        ths = ctx.threads_of(pid)
        wall = sum(x.wall for x in ths)
        loads.append(
            WorkerLoad(
                pid=pid,
                comm=ctx.info.comm(pid) if pid in ctx.info.procs else ws[0].comm,
                cpu_share=round(sum(x.ns("cpu") for x in ths) / wall, 4) if wall else 0.0,
                blocked_share=round(sum(x.ns("blocked") for x in ths) / wall, 4) if wall else 0.0,
                runq_share=round(sum(x.runq_ns for x in ths) / wall, 4) if wall else 0.0,
                wakeups_of_main=sum(w.wakeups for w in ws),
                woke_blocked_ms=round(sum(w.blocked_ms - w.in_call_ms for w in ws), 1),
            )
        )
    # DataLoader settings only for a DataLoader's workers; another producer (a multiprocessing queue) gets
    # the same advice in its own terms
    dl = any(is_dataloader_worker(ctx, p) for p in by_pid)
    # the pool: the processes that hand batches over, by role (one definition: RecordingInfo.process_role) or,
    # outside a DataLoader, by the name of those that woke the thread; a helper they wait on (a storage service,
    # a shell) is not a worker (issue 28)
    comms = {ctx.info.comm(p) for p in by_pid}
    # the few candidates, each walked up to s.pid, not the whole tree (200 K processes) walked down from it
    named = ctx.info.dataloader_pids if dl else {*by_pid, *ctx.info.named(comms)}
    pool = [
        ctx.info.procs[p]
        for p in sorted(named)
        if p not in trainers and p in ctx.info.procs and ctx.info.descends_from(p, s.pid)
    ]
    # the pool's size: the most alive at once (a loader that respawns its workers has forked hundreds)
    live = [p for p in pool if p.exit_ns is None or p.exit_ns > s.start_ns]
    n_workers = most_alive_at_once(live, ctx.info.duration_ns) or len(loads)
    walls = [x for p in by_pid for x in ctx.threads_of(p)]
    top = loads[0]
    blocked = t.ns("blocked")
    # where the workers' CPU went (their on-CPU samples): the transform or decode line to make cheaper
    cpu_stacks = [x for st in sampled_stacks(ctx.conn, [x.tid for x in walls]).values() for x in st]
    hot = [h for h in lines(cpu_stacks) if h.site]
    site = hot[0].site if hot else None
    # each worker's main thread does the work: the threads beside it (a queue's feeder thread, asleep until
    # there is something to send) would dilute the shares of its time
    mains = [x for x in walls if x.tid == x.pid] or walls
    wt = worker_time(ctx, mains, _pool_pids(ctx, s, set(by_pid)))
    n_knob = "num_workers" if dl else "the number of worker processes"
    rec, clause, root, beyond = _advice(ctx, wt, n_workers, n_knob, dl, hot, s.share(woken))
    if root is not None and root.kind in ("cpu_capacity", "on_cpu") and site:
        hot_frames = next((st.frames for st in sorted(cpu_stacks, key=lambda x: -x.ns) if st.site == site), [])
        root = root.model_copy(update={"stack": _stack(hot_frames)})
    recs = [rec, "Check the fix with tracer breakdown: the training thread's blocked share should fall."]
    wall = wt.wall_ns or 1.0
    state = {"external_wait": "blocked", "cpu_capacity": "runq", "on_cpu": "on_cpu"}.get(wt.root, "blocked")
    ms = round(woken / MS, 1)
    path = [
        Hop(
            tid=s.tid,
            pid=s.pid,
            comm=t.comm,
            role="training",
            edge="start",
            state="blocked",
            share=1.0,
            ms=ms,
            site=_training_wait_site(ctx, s, comms),
        ),
        Hop(
            tid=top.pid if any(x.tid == top.pid for x in ctx.threads_of(top.pid)) else None,
            pid=top.pid,
            comm=top.comm,
            role="worker",
            edge="woken_by",
            state=state,
            share=1.0,
            ms=ms,
            site=(wt.wait.site if wt.wait and wt.root == "external_wait" else site),
        ),
    ]
    for h in beyond:  # the source: its part of the workers' time not idle is its part of the loop's wait
        k = (wt.sources[0].ns / (wt.working_ns + wt.source_ns)) if (wt.working_ns + wt.source_ns) else 0.0
        path.append(h.model_copy(update={"share": round(k, 4), "ms": round(woken * k / MS, 1)}))
    code_site = wt.wait.site if wt.root == "external_wait" and wt.wait else site
    ch = ctx.chain(
        s,
        category=CATEGORY,
        severity=sev,
        cost_ns=woken,
        culprit=Culprit(
            kind="workers", pid=top.pid, tid=None, comm=top.comm, relation="own_workers", code_site=code_site
        ),
        pids=list(by_pid),
        summary=(
            f"Thread {s.tid} (pid {s.pid}) blocked {woken / MS:,.0f} ms ({s.share(woken):.0%} of its steps' "
            f"time) until a data worker woke it: it was waiting for batches from {n_workers} worker "
            f"process{'es' if n_workers != 1 else ''}"
            + (f" ({len(loads)} over the recording, re-forked)" if len(loads) > n_workers else "")
            + clause
            + (
                f"; {lw.foreign_ns / MS:,.0f} ms more, while the workers queued behind other processes, "
                "is counted under cpu_contention."
                if lw.foreign_ns >= MS
                else "."
            )
        ),
        evidence=DataloaderStarvationEvidence(
            blocked_ms=round(blocked / MS, 1),
            woken_by_workers_ms=round(woken / MS, 1),
            behind_other_processes_ms=round(lw.foreign_ns / MS, 1),
            wakeups=sum(w.wakeups for w in wakers),
            workers=loads[:8],
            worker_count=n_workers,
            workers_cpu_share=round(wt.cpu_ns / wall, 4),
            cpu_cores=ctx.info.cpu_cores,
            worker_hot_lines=hot,
        ),
        recommendations=recs,
    )
    return ch.model_copy(update={"path": path, "root": root})
