"""gc_pause: the training thread's time inside CPython's cyclic garbage collector (issue 28: the interpreter's own time
is a root of its own).

Every collection is recorded (gc_collections: the interpreter's USDT probes, or the collector's function), with its
generation, duration and the thread's stack as it started, whose innermost line of the user's code is the allocation
that crossed the collector's threshold. The cost is the thread's CPU time in collections that started in its steps:
their duration less the thread's time off CPU inside them (a wait for a CPU there is cpu_contention's; a recording
made before off_cpu_ns existed counts the whole duration). A full collection walks every tracked object alive: a
large heap of small containers (a dataset index, a growing log) costs each full collection hundreds of ms, and the
collector runs one whenever the objects that survived since the last reach a quarter of the heap.

The time is the thread's own CPU, so other chains see it as something else: host_python names the allocating line,
sync_stall the host work its syncs do not overlap, memory_pressure the pages a growing heap faults in.
:func:`explained_by_gc` gives the collector's part of their time to this chain: each keeps the rest, graded on
it, and yields when nothing gradable is left.
"""

from __future__ import annotations

from collections import defaultdict

from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, grade
from tracer.analysis.chains.model import SEVERITIES, CausalChain, Culprit, GcPauseEvidence, Hop, LineTime, Root
from tracer.analysis.code_site import is_library

CATEGORY = "gc_pause"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
MIN_COLLECTIONS = 1
# chains of these categories about the same thread give the collector's part of the time they blame to gc_pause
# (explained_by_gc)
YIELDS = ("memory_pressure", "sync_stall", "host_python")
STACK_FRAMES = 4  # frames of the root's stack shown


def _trigger_site(ctx: ChainContext, stack_id: int | None) -> tuple[str | None, list[str]]:
    """The innermost Python line of the user's code on a collection's stack (the allocation that triggered it),
    and the stack's Python frames, innermost first."""
    if stack_id is None:
        return None, []
    key = ("gc_site", stack_id)
    if key not in ctx.memo:
        frames = ctx.conn.execute(
            "SELECT file, line, function FROM stacks WHERE stack_id = ? AND kind = 'python' ORDER BY depth DESC",
            [stack_id],
        ).fetchall()
        user = [f for f in frames if not is_library(f[0])] or frames
        site = f"{user[0][0]}:{user[0][1]} {user[0][2]}" if user else None
        ctx.memo[key] = (site, [f"{f[0]}:{f[1]} {f[2]}" for f in frames[:STACK_FRAMES]])
    return ctx.memo[key]


def _off_cpu(ctx: ChainContext) -> str:
    """The SQL of a collection's off-CPU time, where the recording has it (0 before it did)."""
    return "coalesce(off_cpu_ns, 0)" if ctx.info.has("gc_collections", "off_cpu_ns") else "0"


def gc_ns_by_sec(ctx: ChainContext, tid: int) -> dict[int, int]:
    """The thread's CPU time inside the collector per second of the session; empty for a recording without
    gc_collections.

    A collection that crosses a second is spread over the seconds it spans by its overlap with each: booked whole to
    its start's second, a 458 ms full collection starting late in one gave that second more collector time than the
    thread had CPU, and memory_pressure's baseline (CPU outside the collector) went negative (a share of 4.0)."""
    key = ("gc_ns_by_sec", tid)
    if key not in ctx.memo:
        got: dict[int, int] = {}
        if ctx.info.has("gc_collections"):
            got = {
                int(sec): int(ns)
                for sec, ns in ctx.conn.execute(
                    f"""
                    WITH g AS (
                        SELECT ts_ns AS lo, ts_ns + greatest(dur_ns, 1) AS hi,
                               greatest(dur_ns - {_off_cpu(ctx)}, 0) AS cpu
                        FROM gc_collections WHERE tid = ?
                    ), s AS (
                        SELECT lo, hi, cpu, unnest(range(lo // 1000000000, (hi - 1) // 1000000000 + 1)) AS sec FROM g
                    )
                    SELECT sec, sum(cpu * (least(hi, (sec + 1) * 1000000000) - greatest(lo, sec * 1000000000))
                                    / (hi - lo))
                    FROM s GROUP BY sec
                    """,
                    [tid],
                ).fetchall()
            }
        ctx.memo[key] = got
    return ctx.memo[key]


def _p99(durs: list[int]) -> int:
    s = sorted(durs)
    return s[min(len(s) - 1, int(0.99 * len(s)))] if s else 0


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject thread whose collections took a gradable share of its steps: from the probed
    collections, or for a process with none recorded (an interpreter with neither USDT probes nor the collector's
    symbol, a recording made before the table) from its on-CPU samples (:func:`_from_samples`)."""
    out = []
    probed = (
        {int(p) for (p,) in ctx.conn.execute("SELECT DISTINCT pid FROM gc_collections").fetchall()}
        if ctx.info.has("gc_collections")
        else set()
    )
    for s in ctx.subjects:
        if s.pid not in probed:
            ch = _from_samples(ctx, s)
            if ch is not None:
                out.append(ch)
            continue
        rows = ctx.conn.execute(
            f"SELECT ts_ns, greatest(least(dur_ns, ? - ts_ns) - {_off_cpu(ctx)}, 0), generation, "
            "coalesce(collected, 0), stack_id FROM gc_collections "
            "WHERE tid = ? AND pid = ? AND ts_ns >= ? AND ts_ns < ? ORDER BY ts_ns",
            [s.end_ns, s.tid, s.pid, s.start_ns, s.end_ns],
        ).fetchall()
        if len(rows) < MIN_COLLECTIONS:
            continue
        cost = sum(r[1] for r in rows)
        sev = grade(s.share(cost), HIGH, MEDIUM, LOW)
        if sev is None:
            continue
        by_gen: dict[str, int] = defaultdict(int)
        ms_by_gen: dict[str, float] = defaultdict(float)
        by_site: dict[str | None, float] = defaultdict(float)
        stack_of: dict[str | None, list[str]] = {}
        for _ts, dur, gen, _n, sid in rows:
            g = str(gen) if gen is not None else "unknown"
            by_gen[g] += 1
            ms_by_gen[g] += dur / MS
            site, stack = _trigger_site(ctx, sid)
            by_site[site] += dur
            stack_of.setdefault(site, stack)
        sites = sorted(by_site.items(), key=lambda kv: -kv[1])
        top_site = next((k for k, _ in sites if k), None)
        triggers = [LineTime(site=k, ms=round(v / MS, 1), share=round(v / cost, 3)) for k, v in sites[:3]]
        durs = [r[1] for r in rows]
        full = by_gen.get("2", 0)
        oldest = max((g for g in by_gen if g != "unknown"), default="unknown")
        steps = _steps(ctx, s)
        top_share = by_site[top_site] / cost if top_site and cost else 0.0
        where = f"; {top_share:.0%} of it triggered by the allocations at {top_site}" if top_site else ""
        unknown = by_gen.get("unknown", 0)
        # CPython 3.13 picks an automatic collection's generation inside the collector, after the function's entry:
        # only its USDT gc__start says which (gcprobe.py); without it the generation is unknown, not "not full"
        fulls = (
            f"{full} of them full (generation 2)"
            if not unknown
            else f"{full} known full (generation 2), {unknown} of unknown generation (this interpreter has no USDT "
            "gc__start probe to say which)"
        )
        summary = (
            f"Thread {s.tid} (pid {s.pid}) spent {cost / MS:,.0f} ms ({s.share(cost):.0%} of its steps' time) inside "
            f"CPython's garbage collector: {len(rows)} collections, {fulls}, "
            f"p99 {_p99(durs) / MS:,.1f} ms, longest {max(durs) / MS:,.1f} ms{where}."
        )
        interval = (
            f"every {max(1, round(steps / full))} steps"
            if full and steps and not unknown
            else "every few hundred steps"
        )
        recs = [
            "Call gc.freeze() once the long-lived structures are built (the dataset index, caches, the model), just "
            "before the training loop: the objects alive then leave the collector's generations, so its full "
            "collections stop walking them" + (f" ({full} full collections walked them here)." if not unknown else "."),
            "Or take automatic collection off for the loop (gc.disable()) and call gc.collect() yourself every N "
            f"steps (now a full collection runs about {interval}), at the same step on every rank, so the ranks "
            "pause together instead of waiting for each other's collections.",
        ]
        if top_site:
            recs.append(
                f"Allocate fewer container objects at {top_site} (records kept as tuples or columns of arrays rather "
                "than a dict per item): each survivor counts towards the next full collection."
            )
        gens = ", ".join(f"{by_gen[g]} of generation {g}" for g in sorted(by_gen))
        root_detail = f"CPython's cyclic garbage collector: {len(rows)} collections ({gens}), {cost / MS:,.0f} ms"
        chain = ctx.chain(
            s,
            category=CATEGORY,
            severity=sev,
            cost_ns=cost,
            culprit=Culprit(
                kind="code", pid=s.pid, tid=s.tid, comm=s.time.comm, relation="own_thread", code_site=top_site
            ),
            summary=summary,
            evidence=GcPauseEvidence(
                gc_ms=round(cost / MS, 1),
                collections=len(rows),
                by_generation=dict(by_gen),
                ms_by_generation={g: round(v, 1) for g, v in ms_by_gen.items()},
                p50_ms=round(sorted(durs)[len(durs) // 2] / MS, 2),
                p99_ms=round(_p99(durs) / MS, 2),
                max_ms=round(max(durs) / MS, 2),
                oldest_generation=oldest,
                collected=sum(r[3] for r in rows),
                steps=steps,
                steps_share=round(s.share(cost), 4),
                triggered_at=triggers,
            ),
            recommendations=recs,
        )
        out.append(
            chain.model_copy(
                update={
                    "path": [
                        Hop(
                            tid=s.tid,
                            pid=s.pid,
                            comm=s.time.comm,
                            role="training" if s.training else "job_thread",
                            edge="start",
                            state="on_cpu",
                            share=1.0,
                            ms=round(cost / MS, 1),
                            site=top_site,
                        )
                    ],
                    "root": Root(
                        kind="interpreter", detail=root_detail, site=top_site, stack=stack_of.get(top_site, [])
                    ),
                }
            )
        )
    return out


# The collector's functions in CPython's own code, 3.8-3.14 (Modules/gcmodule.c, Python/gc.c): the entry points
# (collect, gc_collect_main, the 3.14 incremental ones) and the walks under them, which a stack unwound without
# frame pointers may show alone. A sample with any of them on its native stack is the collector's time.
COLLECTOR_FUNCTIONS = frozenset(
    {
        "collect",  # 3.8-3.9
        "collect_with_callback",
        "gc_collect_main",  # 3.10-3.13
        "gc_collect_with_callback",
        "gc_collect_region",  # 3.14
        "gc_collect_full",
        "gc_collect_young",
        "gc_collect_increment",
        "deduce_unreachable",
        "move_unreachable",
        "update_refs",
        "subtract_refs",
        "visit_decref",
        "visit_reachable",
        "move_legacy_finalizers",
        "handle_legacy_finalizers",
        "finalize_garbage",
        "delete_garbage",
    }
)


def _in_collector(frames: list) -> bool:
    """True when a sampled stack is inside the collector: a native frame of the interpreter (libpython or the python
    executable) in COLLECTOR_FUNCTIONS."""
    return any(
        kind == "native" and function in COLLECTOR_FUNCTIONS and "python" in (module or "").lower()
        for kind, module, function, _file, _line in frames
    )


def _from_samples(ctx: ChainContext, s) -> CausalChain | None:  # noqa: ANN001 - a Subject
    """The collector's time from the thread's on-CPU samples outside calls, for a process whose collections were not
    probed: the samples whose native stack is inside the collector (COLLECTOR_FUNCTIONS) and the Python line under
    them, the allocation that triggered the collection. No count, duration or generation: the samples do not say
    where one collection ends and the next begins."""
    if not ctx.info.has("cpu_samples"):
        return None
    from tracer.analysis.code_site import site_of
    from tracer.analysis.stack_time import sampled_stacks

    stacks = sampled_stacks(ctx.conn, [s.tid], ctx.in_steps(s, "cpu"), outside_calls=True).get(s.tid, [])
    total = sum(x.ns for x in stacks)
    mine = [x for x in stacks if _in_collector(x.frames)]
    sampled = sum(x.ns for x in mine)
    if not mine or total <= 0:
        return None
    # the samples' share of the thread's CPU outside calls, over that CPU time: a sample's cpu_ns is its interval's
    cost = s.time.ns("cpu") * sampled / total
    sev = grade(s.share(cost), HIGH, MEDIUM, LOW)
    if sev is None:
        return None
    by_site: dict[str | None, float] = defaultdict(float)
    stack_of: dict[str | None, list[str]] = {}
    for x in mine:
        site = site_of(x.frames)
        by_site[site] += x.ns
        py = [f for f in reversed(x.frames) if f[0] == "python"]
        stack_of.setdefault(site, [f"{f[3]}:{f[4]} {f[2]}" for f in py[:STACK_FRAMES]])
    sites = sorted(by_site.items(), key=lambda kv: -kv[1])
    top_site = next((k for k, _ in sites if k), None)
    triggers = [
        LineTime(site=k, ms=round(cost * v / sampled / MS, 1), share=round(v / sampled, 3)) for k, v in sites[:3]
    ]
    where = f"; {by_site[top_site] / sampled:.0%} of it under the allocations at {top_site}" if top_site else ""
    summary = (
        f"Thread {s.tid} (pid {s.pid}) spent about {cost / MS:,.0f} ms ({s.share(cost):.0%} of its steps' time) "
        f"inside CPython's garbage collector, from its on-CPU samples (this interpreter's collections were not "
        f"probed: no count or generation){where}."
    )
    recs = [
        "Call gc.freeze() once the long-lived structures are built (the dataset index, caches, the model), just "
        "before the training loop: the objects alive then leave the collector's generations, so its full "
        "collections stop walking them.",
        "Or take automatic collection off for the loop (gc.disable()) and call gc.collect() yourself every N steps, "
        "at the same step on every rank, so the ranks pause together instead of waiting for each other's "
        "collections.",
    ]
    if top_site:
        recs.append(
            f"Allocate fewer container objects at {top_site} (records kept as tuples or columns of arrays rather "
            "than a dict per item): each survivor counts towards the next full collection."
        )
    chain = ctx.chain(
        s,
        category=CATEGORY,
        severity=sev,
        cost_ns=cost,
        culprit=Culprit(kind="code", pid=s.pid, tid=s.tid, comm=s.time.comm, relation="own_thread", code_site=top_site),
        summary=summary,
        evidence=GcPauseEvidence(
            gc_ms=round(cost / MS, 1),
            collections=0,
            by_generation={},
            ms_by_generation={},
            p50_ms=0.0,
            p99_ms=0.0,
            max_ms=0.0,
            oldest_generation="unknown",
            collected=0,
            steps=_steps(ctx, s),
            steps_share=round(s.share(cost), 4),
            triggered_at=triggers,
            source="samples",
        ),
        recommendations=recs,
    )
    hop = Hop(
        tid=s.tid,
        pid=s.pid,
        comm=s.time.comm,
        role="training" if s.training else "job_thread",
        edge="start",
        state="on_cpu",
        share=1.0,
        ms=round(cost / MS, 1),
        site=top_site,
    )
    root = Root(
        kind="interpreter",
        detail=f"CPython's cyclic garbage collector: about {cost / MS:,.0f} ms from the on-CPU samples",
        site=top_site,
        stack=stack_of.get(top_site, []),
    )
    return chain.model_copy(update={"path": [hop], "root": root})


def _steps(ctx: ChainContext, s) -> int:  # noqa: ANN001 - a Subject
    """The subject's steps: its waits for the GPU (one a step), else 0."""
    r = ctx.conn.execute(
        "SELECT count(*) FROM cuda_calls WHERE tid = ? AND ts_ns >= ? AND ts_ns < ? AND op LIKE '%ynchronize%'",
        [s.tid, s.start_ns, s.end_ns],
    ).fetchone()
    return int(r[0]) if r else 0


def _claimed_ns(c: CausalChain) -> float:
    """The time a chain that may yield to gc_pause blames on its cause: the host work for host_python and
    sync_stall (the collector runs inside it), else its cost."""
    ev = c.evidence
    if ev.kind == "host_python":
        return ev.cpu_ms * MS
    if ev.kind == "sync_stall":
        return ev.host_ms * MS
    return c.impact_ms * MS


def explained_by_gc(chains: list[CausalChain]) -> list[CausalChain]:
    """Give the collector's part of memory_pressure (the thread's own fault storm), sync_stall and host_python chains
    of a thread to its gc_pause chain, following the graph rather than a cut on a share (issue 28).

    The collector runs on the thread's CPU, inside the host work those chains blame (:func:`_claimed_ns`): of that
    time, the gc_pause chain's is the part whose root is the collector. Each such chain keeps only the rest, its cost
    scaled by the rest's part of what it blames, and is graded again on it (never up). A chain with nothing
    gradable left is explained by the gc_pause chain; one with a gradable rest stays, with what it lost said. Before,
    a chain yielded whole when the collector's time was half of what it blamed, and stood whole (HIGH beside
    gc_pause) when it was 49%."""
    gcs = {c.tid: c for c in chains if c.category == CATEGORY and c.explained_by is None}
    if not gcs:
        return chains
    out = []
    for c in chains:
        g = gcs.get(c.tid)
        # a storm of another thread (a cache filling up) is not the collector's: its GIL and CPU are that thread's
        own = c.category != "memory_pressure" or (c.culprit is not None and c.culprit.tid == c.tid)
        claimed = _claimed_ns(c) if g is not None else 0.0
        if g is not None and c.category in YIELDS and c.explained_by is None and own and claimed > 0:
            gc_ns = min(g.impact_ms * MS, claimed)
            rest = (claimed - gc_ns) / claimed
            share = c.share * rest
            sev = grade(share, HIGH, MEDIUM, LOW)
            if sev is None:
                c = c.explained(
                    g,
                    f"That time is CPython's garbage collector walking the heap ({gc_ns / MS:,.0f} ms of "
                    f"{claimed / MS:,.0f} ms; chain {g.id}): fix that first.",
                )
            else:
                worst = max(SEVERITIES.index(sev), SEVERITIES.index(c.severity))
                c = c.model_copy(
                    update={
                        "severity": SEVERITIES[worst],
                        "share": round(share, 4),
                        "impact_ms": round(c.impact_ms * rest, 1),
                        "summary": f"{c.summary} Of the {claimed / MS:,.0f} ms of host work it blames, "
                        f"{gc_ns / MS:,.0f} ms is CPython's garbage collector (chain {g.id}), counted there: this "
                        f"chain's cost is the rest.",
                    }
                )
        out.append(c)
    return out
