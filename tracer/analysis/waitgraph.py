"""The wait-for graph (issue 28): follow a part of a thread's lost time, hop by hop, to its root.

A thread's lost time waits on something; the recording says on what:

- blocked (``offcpu_stacks``): the thread that woke it (a lock's holder releasing it, a worker delivering a
  batch, the GIL's holder), or an interrupt (a disk completion, a packet, a timer), or a process outside the job;
- runnable (``runq_*``): the tasks that held its CPU (``preemptors``);
- inside a call that waits for the GPU (``sync``, ``copy``): the GPU, unless the call was mostly runnable and
  waiting for a CPU (``cuda_calls.runq_ns``), in which case the CPU's holders.

A waker that is a thread of the job is followed in turn: what was *it* doing over the seconds in which it woke
the waiter (its own breakdown of those seconds, weighted by the time it ended there)? On CPU: a root, its sampled
lines. Blocked: follow its own wakers. Runnable: CPU capacity. The walk stops at a root (``ROOT_KINDS``), after
``MAX_DEPTH`` hops, or at a thread already on the path (a cycle). At each node it takes the branch that carries
the most time, so the shares multiply along the path: a hop's ``share`` is the part of the traced lost time that
reached it.

Per-second granularity is what the tables hold (``thread_breakdown``, ``offcpu_stacks``, ``cpu_samples`` are per
(thread, second)): "the same seconds" is the resolution of the graph. Each thread visited costs one query on
``offcpu_stacks`` (memoized on the context), plus one on ``cpu_samples`` at an on-CPU root: linear in the rows
of the threads on the path, never in the recording's processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tracer.analysis.breakdown.thread_time import ThreadTime
from tracer.analysis.chains.model import Hop, Root
from tracer.analysis.code_site import Frame, site_of
from tracer.analysis.stack_time import blocked_kind, load_frames, sampled_stacks, syscall_of, top_lines
from tracer.analysis.taxonomy import CALL_PART_NAMES, RUNQ_PART_NAMES
from tracer.vocabulary import (
    BLOCK_WAKER,
    DATALOADER_ROLE,
    HOP_ROLES,
    NET_WAKER,
    RANK_ROLE,
    TIMER_WAKER,
    waker_name,
)

S = 1_000_000_000
MS = 1_000_000
MAX_DEPTH = 4  # hops after the affected thread: a lock holder waiting on a worker waiting on a disk is three
GPU_PARTS = ("sync", "copy")  # calls that wait for the GPU
BLOCKED_PARTS = ("blocked",)
CPU_PARTS = ("cpu", "launch", "alloc", "free", "other")  # the thread's own work (on CPU, in calls that do not wait)
# a sync whose time was mostly runnable waited for a CPU, not for the GPU
RUNQ_IN_SYNC = 0.5
# threads the root-found share's walk may visit, all branches together (a node's wakers read in one query): a
# DataLoader's workers re-forked every epoch are many wakers of a few seconds each (194 on one 6 s recording), the
# heaviest first
REACH_NODES = 256
# a team's state is that of its heaviest TEAM_MIX threads (the rest, a long job's earliest workers, are alike)
TEAM_MIX = 32
STACK_FRAMES = 4  # frames of a root's stack kept, innermost first
# the other ways a path's first fork leads, shown beside the path's own (a few lines, not a dump); one under
# MIN_BRANCH of the lost time is not a competing branch
MAX_BRANCHES = 2
MIN_BRANCH = 0.05

# an interrupt waker -> what the thread waited for
EXTERNAL = {BLOCK_WAKER: "disk", NET_WAKER: "network", TIMER_WAKER: "timer"}

Weight = Callable[[int], float]
TRACER_KEY = ("unknown", "tracer")  # a wait the tracer's own process ended: no root of the job's (Traced.tracer)


@dataclass
class _Row:
    """One thread's blocked time in one second, in one stack, state and waker."""

    sec: int
    stack_id: int | None
    state: str
    in_call: bool
    waker_pid: int | None
    waker_tid: int | None
    waker_comm: str | None
    ns: float


@dataclass
class _Branch:
    """Where some of a node's blocked time leads: a waker thread to follow, or an external root."""

    key: tuple
    ns: float = 0.0
    by_sec: dict[int, float] = field(default_factory=dict)
    rows: list[_Row] = field(default_factory=list)


@dataclass
class _Node:
    tid: int
    pid: int
    comm: str


def _blocked_rows(ctx, tid: int) -> list[_Row]:
    """Return the thread's blocked rows (offcpu_stacks), read once per context."""
    _load_blocked(ctx, [tid])
    return ctx.memo[("waitgraph.blocked", tid)]


def _load_blocked(ctx, tids: Iterable[int]) -> None:
    """Read the blocked rows of those of ``tids`` not read yet, in one query (a node's wakers together: 194
    re-forked workers woke the training thread of one recording)."""
    missing = sorted({t for t in tids if ("waitgraph.blocked", t) not in ctx.memo})
    if not missing:
        return
    rows: dict[int, list[_Row]] = {t: [] for t in missing}
    if ctx.info.has("offcpu_stacks"):
        for tid, sec, sid, state, ic, wp, wt, wc, ns in ctx.conn.execute(
            "SELECT tid, sec, stack_id, state, in_call, waker_pid, waker_tid, waker_comm, sum(blocked_ns) "
            "FROM offcpu_stacks WHERE list_contains(?, tid) GROUP BY ALL",
            [missing],
        ).fetchall():
            rows[int(tid)].append(_Row(int(sec), sid, state or "", bool(ic), wp, wt, wc, float(ns or 0)))
    for t, rs in rows.items():
        ctx.memo[("waitgraph.blocked", t)] = rs


def _frames(ctx, ids: Iterable[int | None]) -> dict[int, list[Frame]]:
    cache: dict[int, list[Frame]] = ctx.memo.setdefault(("waitgraph.frames",), {})
    missing = {i for i in ids if i is not None and i not in cache}
    if missing:
        cache.update(load_frames(ctx.conn, missing))
    return cache


TRAINING, WORKER, HELPER, RANK, JOB_THREAD, OTHER_PROCESS, KERNEL, GPU = HOP_ROLES


def _role(ctx, subject, pid: int | None, tid: int | None) -> str:
    """What a hop's thread is, seen from the affected thread (tracer.vocabulary.HOP_ROLES)."""
    if tid is not None and tid == subject.tid:
        return TRAINING if subject.training else JOB_THREAD
    if not pid:
        return KERNEL
    if not ctx.info.in_tree(pid):
        return OTHER_PROCESS
    role = ctx.info.process_role(pid)
    if role == RANK_ROLE:
        return RANK
    if role == DATALOADER_ROLE:
        return WORKER
    if pid == subject.pid:
        return JOB_THREAD
    return HELPER


def _comm(ctx, pid: int | None, tid: int | None, fallback: str | None = None) -> str:
    t = ctx.times.by_tid(tid) if tid is not None else None
    if t is not None and t.comm:
        return t.comm
    return fallback or (ctx.info.comm(pid) if pid else "") or (f"thread {tid}" if tid else "?")


def _stack(frames: list[Frame]) -> list[str]:
    """A few frames, innermost first: Python ones as 'file:line function', native ones by name."""
    out = []
    for kind, _module, function, file, line in reversed(frames):
        if kind == "python":
            out.append(f"{file}:{line} {function}")
        elif function and function != "?" and not function.startswith("0x"):
            out.append(function)
        if len(out) >= STACK_FRAMES:
            break
    return out


def _branch_key(ctx, node: _Node, r: _Row, frames: list[Frame]) -> tuple:
    """Which way a blocked row leads: ('io', stack) | ('gpu',) | ('ext', what, stack) | ('thread', pid, tid) |
    ('unknown',)."""
    kind = blocked_kind(frames, r.state, r.in_call)
    if kind == "io":
        return ("io", r.stack_id)
    if kind == "cuda":
        return ("gpu",)
    name = waker_name(r.waker_pid, r.waker_comm)
    if not r.waker_pid:
        what = EXTERNAL.get(name)
        return ("ext", what, r.stack_id) if what else ("unknown", name)
    if ctx.info.is_tracer(r.waker_pid, r.waker_comm, None):
        return TRACER_KEY
    if not ctx.info.in_tree(r.waker_pid) and r.waker_pid != node.pid:
        return ("ext", f"{name} (pid {r.waker_pid}), a process outside the job", r.stack_id)
    if r.waker_tid is None or r.waker_tid == node.tid:
        return ("unknown", name)
    return ("thread", int(r.waker_pid), int(r.waker_tid))


def _branches(
    ctx,
    node: _Node,
    mass: dict[int, float] | None,
    weight: Weight,
    in_calls: bool,
    kinds: frozenset[str] | None = None,
    path: set[int] | frozenset[int] = frozenset(),
) -> list[_Branch]:
    """Group the node's blocked rows by where they lead, each second's rows weighted: by ``weight(sec)`` for the
    affected thread (its steps), or scaled to ``mass[sec]`` (the traced time that reached this thread there).
    ``kinds``: only the waits of those kinds (stack_time.blocked_kind: lock, gil, io...). ``path``: the threads
    waiting on this node along the walk; the waits one of them ended left the node's mix (:func:`_state_mix`), so
    its blocked mass goes to its other wakers (given to those rows too, it reached a cycle and was counted as not
    found: 10% of a starved torch loop's waits under two loads, root found 0.8999)."""
    rows = [
        r
        for r in _blocked_rows(ctx, node.tid)
        if (in_calls or not r.in_call) and (r.waker_tid is None or r.waker_tid not in path)
    ]
    if mass is not None:
        per_sec: dict[int, float] = {}
        for r in rows:
            per_sec[r.sec] = per_sec.get(r.sec, 0.0) + r.ns
    frames = _frames(ctx, {r.stack_id for r in rows})
    acc: dict[tuple, _Branch] = {}
    for r in rows:
        if kinds is not None:
            fr = frames.get(r.stack_id, []) if r.stack_id is not None else []
            if blocked_kind(fr, r.state, r.in_call) not in kinds:
                continue
        if mass is not None:
            have = per_sec.get(r.sec, 0.0)
            w = mass.get(r.sec, 0.0) / have if have else 0.0
        else:
            w = weight(r.sec)
        ns = r.ns * w
        if ns <= 0:
            continue
        key = _branch_key(ctx, node, r, frames.get(r.stack_id, []) if r.stack_id is not None else [])
        b = acc.setdefault(key, _Branch(key))
        b.ns += ns
        b.by_sec[r.sec] = b.by_sec.get(r.sec, 0.0) + ns
        b.rows.append(r)
    return sorted(acc.values(), key=lambda b: (-b.ns, str(b.key)))


def _state_mix(
    t: ThreadTime | None, rows: list[_Row], mass: dict[int, float], path: set[int] = frozenset()
) -> dict[str, dict[int, float]]:
    """Split ``mass`` (sec -> ns of traced time reaching thread ``t``) by what ``t`` did in each second: on_cpu,
    runq, blocked (outside calls or inside them, off CPU and not runnable).

    ``path``: the threads that wait on ``t`` along the walk. ``t``'s blocked time that one of them ended is not
    time they waited on it: the waker was running to wake it, so those waits alternate with theirs within the
    second (a persistent DataLoader worker idles until the training thread asks for the next batch, then the
    training thread waits for it). That time leaves the mix, which is of the rest of the second."""
    out: dict[str, dict[int, float]] = {"on_cpu": {}, "runq": {}, "blocked": {}}
    blocked_of: dict[int, float] = {}
    by_path: dict[int, float] = {}
    for r in rows:
        if t is None:
            blocked_of[r.sec] = blocked_of.get(r.sec, 0.0) + r.ns
        if r.waker_tid is not None and r.waker_tid in path:
            by_path[r.sec] = by_path.get(r.sec, 0.0) + r.ns
    for sec, m in mass.items():
        row = t.by_sec.get(sec) if t is not None else None
        if row:
            calls = sum(row.get(p, 0) for p in CALL_PART_NAMES)
            call_off = row.get("call_off_cpu", 0)
            call_runq = row.get("call_runq", 0)
            on = row.get("cpu", 0) + max(calls - call_off, 0)
            runq = sum(row.get(p, 0) for p in RUNQ_PART_NAMES) + call_runq
            blocked = row.get("blocked", 0) + max(call_off - call_runq, 0)
        else:  # no breakdown for it (a pid filter, an old recording): its blocked rows, the rest on CPU
            blocked = min(blocked_of.get(sec, 0.0), S)
            on, runq = S - blocked, 0
        blocked = max(blocked - by_path.get(sec, 0.0), 0.0)
        total = on + runq + blocked
        if total <= 0:
            continue
        for state, v in (("on_cpu", on), ("runq", runq), ("blocked", blocked)):
            if v > 0:
                out[state][sec] = m * v / total
    return out


def _on_cpu_root(ctx, tid: int, mass: dict[int, float]) -> tuple[str | None, Root]:
    """The root at a thread on CPU: its sampled lines over the seconds the traced time reached it."""
    site, stack = None, []
    if ctx.info.has("cpu_samples") and mass:
        top = max(mass.values())
        stacks = sampled_stacks(ctx.conn, [tid], lambda sec: mass.get(sec, 0.0) / top if top else 0.0).get(tid, [])
        lines = top_lines(stacks, 1)
        site = lines[0].site if lines else None
        best = next((x for x in stacks if x.site == site), stacks[0] if stacks else None)
        stack = _stack(best.frames) if best else []
    comm = _comm(ctx, None, tid)
    return site, Root(
        kind="on_cpu", detail=f"{comm} ({tid}) on CPU" + (f" at {site}" if site else ""), site=site, stack=stack
    )


def _external_root(ctx, b: _Branch, comm: str, tid: int) -> tuple[str | None, str, Root]:
    """The root of an external wait: a disk, a network, a timer, a process outside the job; at the thread's own
    line where it waited."""
    heaviest: dict[int | None, float] = {}
    for r in b.rows:
        heaviest[r.stack_id] = heaviest.get(r.stack_id, 0.0) + r.ns
    sid = max(heaviest, key=lambda k: heaviest[k]) if heaviest else None
    frames = _frames(ctx, [sid]).get(sid, []) if sid is not None else []
    site, call = site_of(frames), syscall_of(frames)
    if b.key[0] == "io":
        what, state = "disk I/O" + (" (uninterruptible)" if any(r.state == "D" for r in b.rows) else ""), "io"
    else:
        what, state = b.key[1], "blocked"
    detail = (
        f"{comm} ({tid}) waited" + (f" in {call}" if call else "") + (f" at {site}" if site else "") + f" for {what}"
    )
    return site, state, Root(kind="external_wait", detail=detail, site=site, stack=_stack(frames))


def _holders_root(ctx, subject, share: float, lost_ns: float) -> tuple[list[Hop], Root, list[Hop]]:
    """Runnable: the tasks that held the subject's CPU (preemptors); the root is CPU capacity. Also returns the
    next holders as the fork's other branches (:data:`MAX_BRANCHES`)."""
    holders, _ = ctx.holders(subject)
    holders = [h for h in holders if h.holder != "tracer"] or holders
    total = sum(h.runq_ms for h in holders)
    hops: list[Hop] = []
    if holders and total > 0:
        # a DataLoader's workers of one name are one branch, as on the blocked side (_pick): they hold the CPU in turn
        groups: dict[tuple, list] = {}
        for h in holders:
            role = _role(ctx, subject, h.pid, None) if h.holder != "self" else JOB_THREAD
            groups.setdefault(("team", h.comm) if role == WORKER else ("pid", h.pid), [role]).append(h)
        ranked = sorted(groups.values(), key=lambda g: -sum(h.runq_ms for h in g[1:]))
        for role, *hs in ranked[: 1 + MAX_BRANCHES]:
            k = share * sum(h.runq_ms for h in hs) / total
            if hops and k < MIN_BRANCH:
                break
            hops.append(
                Hop(
                    tid=None,
                    pid=hs[0].pid if len(hs) == 1 else None,
                    comm=hs[0].comm if len(hs) == 1 else f"{hs[0].comm} ({len(hs)} processes)",
                    role=role,
                    edge="cpu_held_by",
                    state="on_cpu",
                    share=round(k, 4),
                    ms=round(k * lost_ns / MS, 1),
                    site=None,
                )
            )
    who = ", ".join(f"{h.comm} {h.pid} [{h.holder}] {h.runq_ms:,.0f} ms" for h in holders[:3])
    root = Root(kind="cpu_capacity", detail="every CPU the thread could use was busy" + (f": {who}" if who else ""))
    return hops[:1], root, hops[1:]


def _other_branches(
    ctx, subject, branches: list[_Branch], team: list[_Branch], total_ns: float, share: float, lost_ns: float
) -> list[Hop]:
    """The blocked time's other ways at the first fork, besides the path's (``team``): a DataLoader's workers of one
    name as one, heaviest first, each under MIN_BRANCH of the lost time left out."""
    taken = {id(b) for b in team}
    groups: dict[tuple, list[_Branch]] = {}
    for b in branches:
        if id(b) in taken or b.key == TRACER_KEY:
            continue
        role = _role(ctx, subject, b.key[1], b.key[2]) if b.key[0] == "thread" else None
        g = ("team", _comm(ctx, b.key[1], b.key[2])) if role == WORKER else b.key
        groups.setdefault(g, []).append(b)
    out = []
    for _g, bs in sorted(groups.items(), key=lambda kv: -sum(x.ns for x in kv[1])):
        k = share * sum(x.ns for x in bs) / total_ns if total_ns else 0.0
        if k < MIN_BRANCH or len(out) >= MAX_BRANCHES:
            break
        b = bs[0]
        if b.key[0] == "thread":
            _, wpid, wtid = b.key
            comm = _comm(ctx, wpid, wtid, next((r.waker_comm for r in b.rows if r.waker_comm), None))
            hop = dict(tid=wtid if len(bs) == 1 else None, pid=wpid if len({x.key[1] for x in bs}) == 1 else None,
                       comm=comm, role=_role(ctx, subject, wpid, wtid), edge="woken_by", state="blocked")  # fmt: skip
        elif b.key[0] == "io":
            hop = dict(tid=None, pid=None, comm="disk I/O", role=KERNEL, edge="woken_by", state="io")
        elif b.key[0] == "gpu":
            hop = dict(tid=None, pid=None, comm="GPU", role=GPU, edge="gpu", state="gpu")
        else:  # an external waker ('ext', what, stack) or one not followed ('unknown', name)
            hop = dict(tid=None, pid=None, comm=str(b.key[1]), role=KERNEL, edge="woken_by", state="blocked")
        out.append(Hop(**hop, share=round(k, 4), ms=round(k * lost_ns / MS, 1), site=None))
    return out


def _sync_runq_share(ctx, subject) -> float:
    """Of the subject's time in calls that wait for the GPU, the share it was runnable and waiting for a CPU:
    the stored calls' runq_ns over their duration, else the breakdown's in-call run queue over its call time."""
    if ctx.info.has("cuda_calls", "runq_ns"):
        ops = [o.op for o in ctx.ops_of(subject.pid, lambda o: o.part in GPU_PARTS)]
        if ops:
            dur, runq = ctx.conn.execute(
                "SELECT sum(dur_ns), sum(coalesce(runq_ns, 0)) FROM cuda_calls WHERE tid = $tid "
                "AND list_contains($ops, op) AND ts_ns >= $a AND ts_ns < $b",
                {"tid": subject.tid, "ops": ops, "a": subject.start_ns, "b": subject.end_ns},
            ).fetchone()
            if dur:
                return min(float(runq or 0) / float(dur), 1.0)
    t = subject.time
    calls = t.ns(*CALL_PART_NAMES)
    return min(t.ns("call_runq") / calls, 1.0) if calls else 0.0


def sync_runq_share(ctx, subject) -> float:
    """Public, memoized :func:`_sync_runq_share`: gpu_bound and coverage ask it too."""
    key = ("waitgraph.sync_runq", subject.tid, subject.start_ns, subject.end_ns)
    if key not in ctx.memo:
        ctx.memo[key] = _sync_runq_share(ctx, subject)
    return ctx.memo[key]


def _follow(
    ctx,
    subject,
    node: _Node,
    branches: list[_Branch],
    total_ns: float,
    share: float,
    lost_ns: float,
    seen: set[int],
    depth: int,
) -> tuple[list[Hop], Root | None, str | None]:
    """Follow the heaviest of a node's blocked branches; return the hops after the node, the root and the node's
    own site (where it waited). The share whose root is found is :func:`_reach`'s, over every branch."""
    if not branches or total_ns <= 0:
        return [], None, None
    b, team = _pick(ctx, subject, branches, seen)
    k = share * sum(x.ns for x in team) / total_ns
    if b.key[0] in ("io", "ext"):
        site, _, root = _external_root(ctx, b, node.comm, node.tid)
        return [], root, site
    if b.key[0] == "gpu":
        root = Root(kind="gpu", detail=f"{node.comm} ({node.tid}) waited in a CUDA call for the GPU")
        return [], root, None
    if b.key[0] != "thread" or depth >= MAX_DEPTH:
        return [], None, None
    _, wpid, wtid = b.key
    own = _wait_site(ctx, b)
    if wtid in seen:  # a cycle: the waker is already on the path
        return [], None, own
    w = _Node(wtid, wpid, _comm(ctx, wpid, wtid, next((r.waker_comm for r in b.rows if r.waker_comm), None)))
    mix = _state_mix(ctx.times.by_tid(wtid), _blocked_rows(ctx, wtid), b.by_sec, seen)
    sums = {st: sum(v.values()) for st, v in mix.items()}
    # the team's state: what its threads did over the seconds each one ended the waits (the path goes on through
    # the heaviest of them, ``b``, whose own mix its further hops are of)
    team_sums = dict(sums)
    for x in team[1:TEAM_MIX]:
        for st, v in _state_mix(ctx.times.by_tid(x.key[2]), _blocked_rows(ctx, x.key[2]), x.by_sec, seen).items():
            team_sums[st] += sum(v.values())
    state = max(team_sums, key=lambda st: team_sums[st])
    mixed_ns = sum(x.ns for x in team[:TEAM_MIX])
    ks = k * team_sums[state] / mixed_ns if mixed_ns else 0.0
    hop = Hop(
        tid=wtid if len(team) == 1 else None,
        pid=wpid if len({x.key[1] for x in team}) == 1 else None,
        comm=w.comm,
        role=_role(ctx, subject, wpid, wtid),
        edge="woken_by",
        state=state,
        share=round(k, 4),
        ms=round(k * lost_ns / MS, 1),
        site=None,
    )
    if state == "on_cpu":
        site, root = _on_cpu_root(ctx, wtid, mix["on_cpu"])
        return [hop.model_copy(update={"site": site})], root, own
    if state == "runq":
        root = Root(kind="cpu_capacity", detail=f"{w.comm} ({wtid}) waited for a CPU while the thread waited on it")
        return [hop], root, own
    sub = _branches(ctx, w, mix["blocked"], lambda _s: 1.0, in_calls=True, path=seen)
    hops, root, site = _follow(ctx, subject, w, sub, sums[state], ks, lost_ns, seen | {wtid}, depth + 1)
    hop = hop.model_copy(update={"site": site, "state": "io" if sub and sub[0].key[0] == "io" else "blocked"})
    return [hop, *hops], root, own


def _pick(ctx, subject, branches: list[_Branch], seen: set[int]) -> tuple[_Branch, list[_Branch]]:
    """The branch the path follows and the team it stands for, heaviest first: the heaviest branch, where a
    DataLoader's workers of one name count together (they deliver the batches in turn, each one 1/n of the waits:
    the heaviest of ``tracer demo``'s re-forked workers carried 4% of them, the workers together all)."""
    teams: dict[str, list[_Branch]] = {}
    for b in branches:
        if b.key[0] == "thread" and b.key[2] not in seen and _role(ctx, subject, b.key[1], b.key[2]) == WORKER:
            teams.setdefault(_comm(ctx, b.key[1], b.key[2]), []).append(b)
    best = [branches[0]]
    for team in teams.values():
        if sum(x.ns for x in team) > sum(x.ns for x in best):
            best = team
    _load_blocked(ctx, [x.key[2] for x in best[:TEAM_MIX] if x.key[0] == "thread"])  # one query for the team
    return best[0], best


def _reach(
    ctx, branches: list[_Branch], total_ns: float, share: float, seen: set[int], depth: int, budget: list[int]
) -> float:
    """The share of the traced time in ``branches`` (of ``total_ns``, ``share`` of it all) whose root is found,
    every branch counted, not only the one the path shows: a wait that ends at once at a root (a disk, a process
    outside the job, the GPU); and at a waker of the job, its time on CPU (its lines) or waiting for one (CPU
    capacity), and what its own waits reach in turn. Each of a DataLoader's workers delivers a share of the
    batches: the heaviest alone carried 4% of the training thread's waits on ``tracer demo``, its three workers
    re-forked every epoch.

    ``budget``: threads that may still be visited (shared by the whole walk, decremented): it bounds the rows the
    walk reads on a recording of many short-lived workers; a waker past it counts as not found."""
    if total_ns <= 0:
        return 0.0
    reached = 0.0
    _load_blocked(ctx, [b.key[2] for b in branches if b.key[0] == "thread" and b.key[2] not in seen][: budget[0]])
    for b in branches:
        k = share * b.ns / total_ns
        if b.key[0] in ("io", "ext", "gpu"):
            reached += k
            continue
        if b.key[0] != "thread" or b.ns <= 0 or depth >= MAX_DEPTH or budget[0] <= 0:
            continue
        _, wpid, wtid = b.key
        if wtid in seen:
            continue
        budget[0] -= 1
        mix = _state_mix(ctx.times.by_tid(wtid), _blocked_rows(ctx, wtid), b.by_sec, seen)
        sums = {st: sum(v.values()) for st, v in mix.items()}
        # its time on CPU or waiting for one is a root (its lines; CPU capacity)
        reached += k * (sums["on_cpu"] + sums["runq"]) / b.ns
        if sums["blocked"] > 0:
            w = _Node(wtid, wpid, "")
            sub = _branches(ctx, w, mix["blocked"], lambda _s: 1.0, in_calls=True, path=seen)
            kb = k * sums["blocked"] / b.ns
            reached += _reach(ctx, sub, sum(x.ns for x in sub), kb, seen | {wtid}, depth + 1, budget)
    return reached


def _wait_site(ctx, b: _Branch) -> str | None:
    """The waiting thread's heaviest line in a branch's rows."""
    heaviest: dict[int | None, float] = {}
    for r in b.rows:
        heaviest[r.stack_id] = heaviest.get(r.stack_id, 0.0) + r.ns
    sid = max(heaviest, key=lambda k: heaviest[k]) if heaviest else None
    return site_of(_frames(ctx, [sid]).get(sid, [])) if sid is not None else None


@dataclass(frozen=True)
class Traced:
    """A traced part of a thread's time: the path, its root, and the share of that time whose root was found
    (0..1; more than the path's last hop when other waits of the thread end at a root at once)."""

    path: list[Hop]
    root: Root | None
    found: float
    ns: float  # the traced parts' time
    # the share of it that the tracer's own process ended (0..1): the recorder releasing the job it started, a
    # dump reading it; the tracer's cost, as its CPU (runq_tracer) is, not the job's lost time
    tracer: float = 0.0
    # the other ways the lost time went at the path's first fork (MAX_BRANCHES), heaviest first
    branches: list[Hop] = field(default_factory=list)


def trace_path(
    ctx, subject, parts: str | Iterable[str], kinds: Iterable[str] | None = None
) -> tuple[list[Hop], Root | None]:
    """Follow ``parts`` of ``subject``'s time to their root: (hops, root) of :func:`trace`."""
    t = trace(ctx, subject, parts, kinds)
    return t.path, t.root


def trace(ctx, subject, parts: str | Iterable[str], kinds: Iterable[str] | None = None) -> Traced:
    """Follow ``parts`` of ``subject``'s time (breakdown part names: blocked, runq_*, sync, copy, cpu...) to their
    root. Returns the hops (the first is the subject itself, edge 'start') and the root, or ([], None) when the
    parts hold no time. With several kinds of parts, the path follows the kind that holds the most time: its
    first hop's share is that kind's share of the parts. ``kinds``: of the blocked time, follow only the waits
    of those kinds (a lock chain's lock waits: ``{"lock"}``); shares stay of the parts' time."""
    parts = (parts,) if isinstance(parts, str) else tuple(parts)
    t = subject.time
    lost = float(t.ns(*parts))
    if lost <= 0:
        return Traced([], None, 0.0, 0.0)
    groups = {
        "blocked": [p for p in parts if p in BLOCKED_PARTS],
        "runq": [p for p in parts if p in RUNQ_PART_NAMES],
        "gpu": [p for p in parts if p in GPU_PARTS],
        "cpu": [p for p in parts if p in CPU_PARTS],
    }
    sizes = {g: float(t.ns(*ps)) if ps else 0.0 for g, ps in groups.items()}
    group = max(sizes, key=lambda g: sizes[g])
    share = sizes[group] / lost
    me = _Node(subject.tid, subject.pid, t.comm)
    role = _role(ctx, subject, subject.pid, subject.tid)

    def start(state: str, site: str | None = None, k: float = share) -> Hop:
        return Hop(
            tid=subject.tid,
            pid=subject.pid,
            comm=t.comm,
            role=role,
            edge="start",
            state=state,
            share=round(k, 4),
            ms=round(k * lost / MS, 1),
            site=site,
        )

    if group == "runq":
        hops, root, more = _holders_root(ctx, subject, share, lost)
        return Traced([start("runq"), *hops], root, share, lost, branches=more)
    if group == "gpu":
        runq = sync_runq_share(ctx, subject)
        if runq >= RUNQ_IN_SYNC:
            hops, root, more = _holders_root(ctx, subject, share * runq, lost)
            root = root.model_copy(
                update={"detail": f"inside its waits for the GPU, {runq:.0%} runnable: " + root.detail}
            )
            # the rest of the waits, the GPU's own work, competes with the CPU's holders
            gpu_k = share * (1 - runq)
            if gpu_k >= MIN_BRANCH:
                gpu_hop = Hop(tid=None, pid=None, comm="GPU", role=GPU, edge="gpu", state="gpu",
                              share=round(gpu_k, 4), ms=round(gpu_k * lost / MS, 1), site=None)  # fmt: skip
                more = sorted([*more, gpu_hop], key=lambda h: -h.share)[:MAX_BRANCHES]
            return Traced([start("runq"), *hops], root, share, lost, branches=more)
        k = share * (1 - runq)
        gpu = Hop(
            tid=None,
            pid=None,
            comm="GPU",
            role=GPU,
            edge="gpu",
            state="gpu",
            share=round(k, 4),
            ms=round(k * lost / MS, 1),
            site=None,
        )
        op = next(iter(ctx.ops_of(subject.pid, lambda o: o.part in GPU_PARTS)), None)
        site = ctx.code_site(subject.pid, [op.op], subject.tid) if op else None
        root = Root(
            kind="gpu", detail="the GPU's queued work" + (f" ({op.op} at {site})" if op and site else ""), site=site
        )
        # the rest of the waits, runnable, is CPU capacity's: a root too, and a branch beside the GPU
        more: list[Hop] = []
        if share * runq >= MIN_BRANCH:
            held, _, _ = _holders_root(ctx, subject, share * runq, lost)
            more = [h.model_copy(update={"share": round(share * runq, 4), "ms": round(share * runq * lost / MS, 1)})
                    for h in held[:1]]  # fmt: skip
        return Traced([start("gpu", site), gpu], root, share, lost, branches=more)
    if group == "cpu":
        mass = {sec: float(sum(r.get(p, 0) for p in groups["cpu"])) for sec, r in t.by_sec.items()}
        site, root = _on_cpu_root(ctx, subject.tid, mass)
        return Traced([start("on_cpu", site)], root, share, lost)
    branches = _branches(ctx, me, None, ctx.in_steps(subject, "blocked"), in_calls=False)
    total = sum(b.ns for b in branches)
    first = share
    if kinds is not None:
        branches = _branches(ctx, me, None, ctx.in_steps(subject, "blocked"), in_calls=False, kinds=frozenset(kinds))
        first = share * sum(b.ns for b in branches) / total if total else 0.0
    hops, root, site = _follow(ctx, subject, me, branches, total, share, lost, {subject.tid}, 0)
    found = _reach(ctx, branches, total, share, {subject.tid}, 0, [REACH_NODES])
    state = "io" if branches and branches[0].key[0] == "io" else "blocked"
    mine = share * sum(b.ns for b in branches if b.key == TRACER_KEY) / total if total else 0.0
    more: list[Hop] = []
    if branches and total > 0:
        _, team = _pick(ctx, subject, branches, {subject.tid})
        more = _other_branches(ctx, subject, branches, team, total, share, lost)
    return Traced([start(state, site, first), *hops], root, min(found, share), lost, mine, more)
