"""cpu_placement: the thread waited for a CPU because of where the job may run, not because the host's CPUs were
busy (issue 28): CPUs outside its allowed set (affinity, the cgroup's cpuset) sat idle meanwhile (*confined*),
or its cgroup had used up its CPU quota (*throttled*, cpu.max). The fix is the placement: widen the affinity,
raise the quota; fewer workers would only hide it.

Cost, per second of the thread's steps, from its waits for a CPU ``R`` (outside calls and inside them):

- throttled: ``min(R, T)``, ``T`` the cgroup's throttled time in that second (cgroup_cpu, summed over CPUs);
- confined: of the rest of ``R``, the part behind the job's own threads (other tenants on its CPUs are
  cpu_contention's) times ``min(1, I / D)``: ``D`` the job's waits for a CPU in that second (in CPUs), ``I`` the
  room for them on the CPUs outside its set (cpu_idle: their idle time, and a fair share of their busy time,
  :func:`_room`): what those CPUs could have absorbed of the job's queue, the thread's share of it in
  proportion.

:func:`placement_of` is shared with cpu_contention, which leaves this share of the thread's waits to this chain.
Needs the recording's placement tables (process_placement, cpu_idle, cgroup_cpu); older recordings get none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracer import procfs
from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, Subject, grade
from tracer.analysis.chains.model import CausalChain, CpuPlacementEvidence, Culprit, Hop, Root
from tracer.analysis.recording import DATALOADER_COMM

CATEGORY = "cpu_placement"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
S = 1_000_000_000
RUNQ = ("runq_self", "runq_tree", "runq_other", "runq_tracer", "call_runq")
EXPLAINS_HALF = 0.5  # see explains()
LAUNCHERS = ("taskset", "numactl")  # commands that set the affinity of the command they run


@dataclass
class Placement:
    """Where a process may run, from its latest process_placement row (or its nearest ancestor's)."""

    pid: int
    allowed: frozenset[int]
    cgroup: str | None
    cpuset: frozenset[int] | None
    limit_cgroup: str | None
    quota_us: int | None
    period_us: int | None
    exec_from: str | None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class PlacementCost:
    """What the placement cost a subject."""

    placement: Placement
    online: frozenset[int]
    runq_ns: float  # its waits for a CPU in its steps (all of R)
    own_runq_ns: float  # of which behind its own threads and workers (the in-call part: ChainContext.in_call_runq)
    confined_ns: float  # of the waits behind its own threads, what the idle CPUs outside its set could have run
    throttled_ns: float  # of all its waits, those while its cgroup was throttled
    throttled_own_ns: float  # of which behind its own threads
    outside_idle: dict[int, float]  # CPU -> idle share over the seconds it waited
    throttled_periods: int
    demand_cpus: float  # the job's CPUs in use plus waiting, over those seconds

    @property
    def cost_ns(self) -> float:
        return self.confined_ns + self.throttled_ns

    def keep(self, own: bool) -> float:
        """The share of the thread's waits behind its own threads (``own``) or other tenants that is left to
        cpu_contention once this placement's part is taken out."""
        total = self.own_runq_ns if own else self.runq_ns - self.own_runq_ns
        taken = self.confined_ns + self.throttled_own_ns if own else self.throttled_ns - self.throttled_own_ns
        return max(0.0, 1.0 - taken / total) if total > 0 else 1.0


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject whose waits for a CPU its placement explains."""
    out = []
    for s in ctx.subjects:
        pc = placement_of(ctx, s)
        if pc is None:
            continue
        sev = grade(s.share(pc.cost_ns), HIGH, MEDIUM, LOW)
        if sev is None:
            continue
        out.append(_chain(ctx, s, pc, sev))
    return out


def explains(chains: list[CausalChain]) -> list[CausalChain]:
    """Return ``chains`` with each cpu_contention chain of a thread whose cpu_placement chain costs it at least
    half as much (a third of their waits together) marked as explained by that one: the waits left to it are the
    placement's too (with the job spread over the CPUs it may not use now, they shrink), and its fix (fewer
    workers) comes after widening it. Below that, the job wants many more CPUs than the placement hides (four
    CPU-bound workers on two CPUs): its own contention stays a cause of its own."""
    by_tid = {c.tid: c for c in chains if c.category == CATEGORY}
    out = []
    for c in chains:
        p = by_tid.get(c.tid)
        if (
            p is not None
            and c.category == "cpu_contention"
            and c.explained_by is None
            and p.impact_ms >= EXPLAINS_HALF * c.impact_ms
            and (getattr(c.evidence, "holder_class", "") == "own" or p.evidence.trigger != "confined")  # type: ignore[union-attr]
        ):
            c = c.explained(p, f"The job's placement comes first: {p.root.detail if p.root else CATEGORY}.")
        out.append(c)
    return out


def placement_of(ctx: ChainContext, s: Subject) -> PlacementCost | None:
    """Return what ``s``'s placement cost it (None: the recording has no placement, or nothing narrowed it)."""
    key = (CATEGORY, s.tid)
    if key not in ctx.memo:
        ctx.memo[key] = _placement_of(ctx, s)
    return ctx.memo[key]


def _placement_of(ctx: ChainContext, s: Subject) -> PlacementCost | None:
    info = ctx.info
    if not (info.has("process_placement") and info.has("cpu_idle")):
        return None
    pl = placements(ctx).get(s.pid) or _inherited(ctx, s.pid)
    if pl is None:
        return None
    idle = _idle_by_sec(ctx)
    online = frozenset(c for per in idle.values() for c in per)
    outside = online - pl.allowed
    throttled = _throttled_by_sec(ctx, pl.limit_cgroup) if pl.limit_cgroup and info.has("cgroup_cpu") else {}
    if not outside and not throttled:
        return None
    job = _job_runq_by_sec(ctx)
    # the own threads' part of the in-call run queue, as cpu_contention splits it (ChainContext.in_call_runq)
    ic = ctx.in_call_runq(s)
    w_all = ic["self"] + ic["tree"] + ic["other"]
    w_own = (ic["self"] + ic["tree"]) / w_all if w_all else 0.0
    acc = dict.fromkeys(("runq", "own", "confined", "thr", "thr_own", "demand"), 0.0)
    idle_w: dict[int, float] = {}
    for sec, row in s.time.by_sec.items():
        r = float(sum(row.get(p, 0) for p in RUNQ))
        if r <= 0:
            continue
        own = row.get("runq_self", 0) + row.get("runq_tree", 0) + row.get("call_runq", 0) * w_own
        acc["runq"] += r
        acc["own"] += own
        t = min(r, throttled.get(sec, (0.0, 0))[0])
        acc["thr"] += t
        acc["thr_own"] += t * own / r
        per = idle.get(sec, {})
        d = job.get(sec, (0.0, 0.0))
        free = sum(_room(per.get(c, 0.0), d[0]) for c in outside)
        if d[0] > 0:  # only the waits behind its own threads: other tenants on its CPUs are cpu_contention's
            acc["confined"] += own * (1 - t / r) * min(1.0, free / d[0])
        acc["demand"] += r * (d[0] + d[1])
        for c in outside:
            idle_w[c] = idle_w.get(c, 0.0) + r * per.get(c, 0.0)
    runq = acc["runq"]
    if runq <= 0:
        return None
    periods = sum(n for _, n in throttled.values())
    return PlacementCost(
        placement=pl,
        online=online,
        runq_ns=runq,
        own_runq_ns=acc["own"],
        confined_ns=acc["confined"],
        throttled_ns=acc["thr"],
        throttled_own_ns=acc["thr_own"],
        outside_idle={c: w / runq for c, w in sorted(idle_w.items())},
        throttled_periods=periods,
        demand_cpus=acc["demand"] / runq,
    )


def _room(idle: float, waiting: float) -> float:
    """Return the share of a CPU outside the job's set that its ``waiting`` threads (in CPUs) would have had: its
    idle time, and of its busy time a fair share beside one task of another tenant (CFS gives k runnable threads
    k / (k + 1) of a CPU one other task wants). A CPU busy with others is not closed to the job: on a shared
    host, the CPU its pin keeps it off is seldom idle."""
    k = max(waiting, 0.0)
    return idle + (1.0 - idle) * k / (k + 1.0)


def placements(ctx: ChainContext) -> dict[int, Placement]:
    """Return the latest placement row of each subject's process and of its ancestors (memoized): a job that
    exec'd 200 K helpers has as many rows, and only these few are asked for."""
    key = (CATEGORY, "rows")
    if key not in ctx.memo:
        wanted: set[int] = set()
        for s in ctx.subjects:
            p = ctx.info.procs.get(s.pid)
            wanted.add(s.pid)
            while p is not None and p.ppid is not None and p.ppid not in wanted:
                wanted.add(p.ppid)
                p = ctx.info.procs.get(p.ppid)
        out: dict[int, Placement] = {}
        for pid, cpus, cg, cpuset, lim, q, p, ex, env in ctx.conn.execute(
            "SELECT pid, cpus_allowed, cgroup, cpuset_cpus, limit_cgroup, quota_us, period_us, exec_from, env "
            "FROM process_placement WHERE list_contains(?, pid) ORDER BY ts_ns",
            [sorted(wanted)],
        ).fetchall():
            prev = out.get(pid)
            allowed = procfs.parse_cpu_list(cpus or "")
            cs = procfs.parse_cpu_list(cpuset) if cpuset else None
            out[pid] = Placement(
                pid=pid,
                allowed=allowed & cs if cs else allowed,
                cgroup=cg,
                cpuset=cs,
                limit_cgroup=lim,
                quota_us=q,
                period_us=p,
                exec_from=ex or (prev.exec_from if prev else None),
                env=dict(kv.partition("=")[::2] for kv in (env or "").split()),
            )
        ctx.memo[key] = out
    return ctx.memo[key]


def _inherited(ctx: ChainContext, pid: int) -> Placement | None:
    """A forked process without a row of its own has its nearest ancestor's placement."""
    rows, seen = placements(ctx), set()
    p = ctx.info.procs.get(pid)
    while p is not None and p.ppid is not None and p.pid not in seen:
        seen.add(p.pid)
        if p.ppid in rows:
            return rows[p.ppid]
        p = ctx.info.procs.get(p.ppid)
    return None


def _idle_by_sec(ctx: ChainContext) -> dict[int, dict[int, float]]:
    """sec -> CPU -> its idle share (the sample ending in the middle of the next second covers this one)."""
    key = (CATEGORY, "idle")
    if key not in ctx.memo:
        out: dict[int, dict[int, float]] = {}
        for sec, cpu, idle, busy in ctx.conn.execute(
            "SELECT (ts_ns - 500000000) // 1000000000, cpu, idle_ns, busy_ns FROM cpu_idle"
        ).fetchall():
            tot = (idle or 0) + (busy or 0)
            if tot > 0:
                out.setdefault(int(sec), {})[int(cpu)] = (idle or 0) / tot
        ctx.memo[key] = out
    return ctx.memo[key]


def _throttled_by_sec(ctx: ChainContext, cgroup: str) -> dict[int, tuple[float, int]]:
    """sec -> (throttled ns, throttled periods) of ``cgroup`` in that second (differences of cpu.stat)."""
    rows = ctx.conn.execute(
        "SELECT ts_ns, throttled_ns, nr_throttled FROM cgroup_cpu WHERE cgroup = ? ORDER BY ts_ns", [cgroup]
    ).fetchall()
    out: dict[int, tuple[float, int]] = {}
    for (t0, n0, p0), (t1, n1, p1) in zip(rows, rows[1:], strict=False):
        if t1 > t0 and n1 >= n0:
            sec = (t1 - 500_000_000) // S
            out[int(sec)] = (float(n1 - n0) * S / (t1 - t0), max(int(p1 - p0), 0))
    return out


def _job_runq_by_sec(ctx: ChainContext) -> dict[int, tuple[float, float]]:
    """sec -> (the job's waits for a CPU, its CPU in use), in CPUs: every target thread's."""
    key = (CATEGORY, "job")
    if key not in ctx.memo:
        cols = ctx.info.columns.get("thread_breakdown", frozenset())
        runq = " + ".join(f"coalesce({p}_ns, 0)" for p in RUNQ if f"{p}_ns" in cols) or "0"
        busy = "coalesce(wall_ns, 0) - coalesce(blocked_ns, 0) - coalesce(call_off_cpu_ns, 0)"
        busy = busy if "call_off_cpu_ns" in cols else "coalesce(cpu_ns, 0)"
        tracer = sorted(ctx.info.tracer_pids) or [-1]
        rows = ctx.conn.execute(
            f"SELECT sec, sum({runq}), sum({busy} - ({runq.replace('coalesce(call_runq_ns, 0)', '0')})) "
            "FROM thread_breakdown WHERE NOT list_contains(?, pid) GROUP BY sec",
            [tracer],
        ).fetchall()
        ctx.memo[key] = {int(sec): (float(r or 0) / S, max(float(b or 0), 0.0) / S) for sec, r, b in rows}
    return ctx.memo[key]


def set_by(ctx: ChainContext, pl: Placement, online: frozenset[int]) -> tuple[str, str]:
    """Return (who narrowed the placement, its kind: taskset | slurm | cpuset | quota | affinity)."""
    found = [c for c in map(_from_launcher, _launch_commands(ctx, pl.pid)) if c]
    if found:  # its arguments where a command line has them (an exec seen in a batch names the file only)
        cmd = next((c for c in found if len(c.split()) > 1), found[0])
        return f"the launcher's `{_short(cmd)}`", "taskset"
    cpt = pl.env.get("SLURM_CPUS_PER_TASK")
    if cpt or "SLURM_JOB_ID" in pl.env:
        return f"Slurm (--cpus-per-task={cpt or '?'}, SLURM_CPUS_PER_TASK)", "slurm"
    if pl.cpuset is not None and pl.cpuset < online:
        return f"the cgroup {pl.cgroup}'s cpuset {procfs.format_cpu_list(pl.cpuset)} (a container's CPU set)", "cpuset"
    return "its parent or itself (sched_setaffinity)", "affinity"


def _launch_commands(ctx: ChainContext, pid: int) -> list[str]:
    """The command lines that ran before ``pid``'s image and above it: its exec_from, its ancestors', the
    recording's target."""
    rows = placements(ctx)
    out = []
    seen: set[int] = set()
    p = ctx.info.procs.get(pid)
    while p is not None and p.pid not in seen:
        seen.add(p.pid)
        if p.pid in rows and rows[p.pid].exec_from:
            out.append(rows[p.pid].exec_from or "")
        p = ctx.info.procs.get(p.ppid) if p.ppid is not None else None
    if ctx.info.target:
        out.append(ctx.info.target)
    return out


def _from_launcher(cmd: str) -> str | None:
    """Return ``cmd`` from its launcher word on (`nice -n 5 taskset -c 0 python x.py` -> `taskset -c 0 python
    x.py`); None when no launcher runs it."""
    words = cmd.split()
    i = next((i for i, w in enumerate(words) if w.rsplit("/", 1)[-1] in LAUNCHERS), None)
    return None if i is None else " ".join(words[i:])


def _short(cmd: str, n: int = 60) -> str:
    return cmd if len(cmd) <= n else cmd[: n - 1] + "…"


def _chain(ctx: ChainContext, s: Subject, pc: PlacementCost, sev: str) -> CausalChain:
    pl = pc.placement
    holders, _ = ctx.holders(s)
    holders = [h for h in holders if h.holder not in ("tracer", "interrupt")]
    workers = [h for h in holders if h.holder == "tree"]
    trigger = (
        "both"
        if pc.confined_ns >= 0.1 * pc.cost_ns and pc.throttled_ns >= 0.1 * pc.cost_ns
        else ("throttled" if pc.throttled_ns > pc.confined_ns else "confined")
    )
    who, how = set_by(ctx, pl, pc.online)
    allowed = procfs.format_cpu_list(pl.allowed)
    quota = pl.quota_us / pl.period_us if pl.quota_us and pl.period_us else None
    idle_short = ", ".join(f"CPU {c} idle {v:.0%}" for c, v in list(pc.outside_idle.items())[:4])
    idle_txt = idle_short
    if idle_txt and max(pc.outside_idle.values()) < 0.5:  # a shared host: room for the job beside the others
        idle_txt += " (busy with other processes, a fair share of it open to the job)"
    if trigger == "throttled":
        detail = (
            f"cgroup {pl.limit_cgroup} quota {quota:.2f} CPUs (cpu.max {pl.quota_us} {pl.period_us}): throttled "
            f"{pc.throttled_periods} periods"
        )
    else:
        detail = f"affinity {{{allowed}}} of {len(pc.online)} CPUs (set by {who})" + (
            f"; {idle_txt}" if idle_txt else ""
        )
        if trigger == "both":
            detail += f"; cgroup {pl.limit_cgroup} quota {quota:.2f} CPUs"
    cost = pc.cost_ns
    share = s.share(cost)
    top = holders[0] if holders else None
    path = [
        Hop(
            tid=s.tid,
            pid=s.pid,
            comm=s.time.comm,
            role="training" if s.training else "job_thread",
            edge="start",
            state="runq",
            share=1.0,
            ms=round(cost / MS, 1),
            site=None,
        )
    ]
    # confined: the waits it counts are those behind the job's own threads, so are the hops
    via = holders if trigger != "confined" else [h for h in holders if h.holder in ("self", "tree")]
    held = sum(h.runq_ms for h in via) or 1.0
    # the heaviest holder is the path's hop, the next two its competing branches (a DataLoader's workers as one,
    # as the wait-for graph groups them): they held the CPU side by side, not one behind the other
    groups: dict[tuple, list] = {}
    for h in via:
        is_worker = h.holder == "tree" and h.comm == DATALOADER_COMM
        role = "worker" if is_worker else {"self": "job_thread", "tree": "helper"}.get(h.holder, "other_process")
        groups.setdefault(("team", h.comm) if is_worker else ("pid", h.pid), [role]).append(h)
    hops = []
    for role, *hs in sorted(groups.values(), key=lambda g: -sum(h.runq_ms for h in g[1:]))[:3]:
        k = sum(h.runq_ms for h in hs) / held
        hops.append(
            Hop(
                tid=None,
                pid=(hs[0].pid or None) if len(hs) == 1 else None,
                comm=hs[0].comm if len(hs) == 1 else f"{hs[0].comm} ({len(hs)} processes)",
                role=role,
                edge="cpu_held_by",
                state="on_cpu",
                share=round(k, 4),
                ms=round(cost / MS * k, 1),
                site=None,
            )
        )
    path += hops[:1]
    recs = _advice(pc, how, who, s, len(workers), quota, trigger)
    summary = (
        f"Thread {s.tid} ({s.time.comm}, pid {s.pid}) waited {cost / MS:,.0f} ms for a CPU ({share:.0%} of its "
        "steps' time) "
        + (
            f"while its cgroup {pl.limit_cgroup} was throttled (quota {quota:.2f} CPUs)"
            if trigger == "throttled"
            else f"while confined to CPUs {{{allowed}}} of {len(pc.online)}"
            + (f" ({idle_short})" if idle_short else "")
            + (f", its cgroup throttled too (quota {quota:.2f} CPUs)" if trigger == "both" else "")
        )
        + (f": behind {top.comm} (pid {top.pid})." if top else ".")
        + " The placement is the limit, not the host's CPUs."
    )
    return ctx.chain(
        s,
        category=CATEGORY,
        severity=sev,
        cost_ns=cost,
        culprit=Culprit(
            kind="host",
            pid=s.pid,
            tid=None,
            comm=f"cgroup {pl.limit_cgroup}" if trigger == "throttled" else f"affinity {{{allowed}}}",
            relation="host",
            code_site=None,
        ),
        summary=summary,
        evidence=CpuPlacementEvidence(
            trigger=trigger,
            runq_ms=round(pc.runq_ns / MS, 1),
            confined_ms=round(pc.confined_ns / MS, 1),
            throttled_ms=round(pc.throttled_ns / MS, 1),
            cpus_allowed=allowed,
            cpus_online=len(pc.online),
            outside_idle_pct={str(c): round(100 * v, 1) for c, v in pc.outside_idle.items()},
            set_by=who,
            cgroup=pl.limit_cgroup,
            quota_cpus=round(quota, 3) if quota else None,
            throttled_periods=pc.throttled_periods,
            job_demand_cpus=round(pc.demand_cpus, 2),
            holders=holders[:5],
        ),
        recommendations=recs,
    ).model_copy(update={"path": path, "root": Root(kind="placement", detail=detail), "branches": hops[1:]})


def _advice(
    pc: PlacementCost, how: str, who: str, s: Subject, workers: int, quota: float | None, trigger: str
) -> list[str]:
    pl = pc.placement
    need = min(len(pc.online), max(len(pl.allowed) + 1, round(pc.demand_cpus + 0.49)))
    want = procfs.format_cpu_list(set(sorted(pc.online)[:need]))
    recs = []
    if trigger in ("confined", "both"):
        if how == "taskset":
            recs.append(
                f"Widen the affinity: {who} pins the job (its {workers or 'data'} workers inherit it) to CPUs "
                f"{{{procfs.format_cpu_list(pl.allowed)}}} while CPUs outside it had room: drop it or give it more "
                f"CPUs (taskset -c {want} ...); for the running job: taskset -a -cp {want} {s.pid} (and its workers)."
            )
        elif how == "slurm":
            recs.append(
                f"Ask Slurm for more CPUs per task: srun/sbatch --cpus-per-task={need} (the training thread plus its "
                f"data workers wanted ~{pc.demand_cpus:.1f} CPUs), set by {who}."
            )
        elif how == "cpuset":
            recs.append(
                f"Give the container more CPUs: {who} confines it; e.g. docker run --cpuset-cpus={want}, or raise "
                "the pod's CPU request with the static CPU manager."
            )
        else:
            recs.append(
                f"Widen the affinity set by {who}: taskset -a -cp {want} {s.pid} (and its workers), or remove the "
                "os.sched_setaffinity / worker_init_fn that narrows it."
            )
    if trigger in ("throttled", "both") and quota:
        demand = max(pc.demand_cpus, quota)
        recs.append(
            f"Raise the CPU quota of cgroup {pl.limit_cgroup}: {quota:.2f} CPUs (cpu.max {pl.quota_us} "
            f"{pl.period_us}) while the job wanted ~{demand:.1f}: e.g. docker --cpus={max(round(demand + 0.49), 1)}, "
            "the pod's resources.limits.cpu, or write a larger quota to its cpu.max."
        )
    recs.append(
        "Fewer data workers would only trade batches for CPU: fix the placement first, then size num_workers to "
        "the CPUs the job may use."
    )
    return recs
