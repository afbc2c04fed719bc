"""memory_pressure: memory stalled the thread. Three triggers, the first that applies per subject:

- oom_kill: the kernel's OOM killer killed a process of the job. Always HIGH: the job lost a process.
- fault_storm: a thread of the job (often one with no CUDA call: a data cache filling up) faults in fresh pages
  at >= STORM_BYTES_PER_S. Cost to the training thread: its waits on the locks the storm thread held (the GIL,
  the mmap lock: blocked time in the storm's seconds not ended by a batch or the tracer, above its usual rate;
  a GIL wait ends by the holder's hand-over or by a timer, so counting only the holder's wakeups undercounts
  it), its run-queue time behind its own process (the storm thread's share of the process's other
  CPU time), and its uninterruptible waits and direct reclaim in the storm's seconds. When the training thread
  is the one faulting, its CPU time in those seconds above its usual rate (a fault runs on the faulting
  thread's CPU time).
- host_pressure: MemAvailable under MEM_LOW_FRAC of RAM, swap growing, or the job allocating pages at
  >= HOST_ALLOC_FLOOR per second. Cost: the thread's off-CPU time outside CUDA calls (blocked, waiting for a CPU)
  in those seconds above its usual rate, plus its direct reclaim.
"""

from __future__ import annotations

import statistics

from tracer.analysis.breakdown.holders import holder_class
from tracer.analysis.breakdown.thread_time import ThreadTime
from tracer.analysis.chains.applies import has_dataloader
from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, Subject, grade
from tracer.analysis.chains.gc_pause import gc_ns_by_sec
from tracer.analysis.chains.model import CausalChain, Culprit, MemoryPressureEvidence, StormThread
from tracer.analysis.stack_time import blocked_seconds

CATEGORY = "memory_pressure"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
S = 1_000_000_000
MS = 1_000_000
GIB = 1 << 30
# A thread that allocates >= 64 MiB of fresh pages per second of its life, and >= 256 MiB in all, is filling
# memory, not running a training step: a step touches the same buffers again (no new pages after warm-up).
STORM_BYTES_PER_S = 64 << 20
STORM_MIN_BYTES = 256 << 20
# a second counts as part of the storm when the storm thread allocated a quarter of its threshold rate in it
STORM_SECOND_FRAC = 0.25
# host pressure: MemAvailable under 10 % of RAM, or the job allocating >= 512 MiB of pages per second
MEM_LOW_FRAC = 0.10
HOST_ALLOC_FLOOR = 512 << 20
# time lost outside the GPU waits: a sync that sleeps waiting for the GPU is off CPU too, and is not memory's
OFF_CPU_PARTS = ("runq_self", "runq_tree", "runq_other", "blocked")


def _page_cache_bytes(ctx: ChainContext) -> dict[int, int]:
    """Return tid -> bytes the thread added to the page cache (file writes and reads), where recorded."""
    got = ctx.memo.get(("page_cache_bytes",))
    if got is None:
        got = {}
        if ctx.info.has("thread_breakdown", "page_cache_bytes"):
            got = dict(
                ctx.conn.execute(
                    "SELECT tid, sum(page_cache_bytes)::BIGINT FROM thread_breakdown GROUP BY tid "
                    "HAVING sum(page_cache_bytes) > 0"
                ).fetchall()
            )
        ctx.memo[("page_cache_bytes",)] = got
    return got


def storm_threads(ctx: ChainContext, pid: int) -> list[StormThread]:
    """Return the threads of ``pid`` faulting in fresh memory at storm rate, most pages first. Pages a thread
    added to the page cache (a checkpoint's write()) are the file's, not fresh memory: left out (issue 18)."""
    out = []
    cached = _page_cache_bytes(ctx)
    for t in ctx.threads_of(pid):
        b = max(t.ns("page_alloc_bytes") - cached.get(t.tid, 0), 0)
        secs = t.span_ns / S
        rate = b / secs if secs > 0 else 0.0
        if b >= STORM_MIN_BYTES and rate >= STORM_BYTES_PER_S:
            out.append(
                StormThread(
                    pid=t.pid,
                    tid=t.tid,
                    comm=t.comm,
                    faults=t.ns("faults"),
                    page_alloc_bytes=b,
                    page_alloc_bytes_per_s=round(rate),
                    reclaim_ms=round(t.ns("reclaim") / MS, 1),
                    cpu_ms=round(t.ns("cpu") / MS, 1),
                )
            )
    return sorted(out, key=lambda x: -x.page_alloc_bytes)


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return at most one memory chain per subject (OOM kill, else fault storm, else host pressure)."""
    out = []
    oom = _oom_kills(ctx)
    host = _host_pressure(ctx)
    for s in ctx.subjects:
        if oom:
            out.append(_oom_chain(ctx, s, oom, host))
            continue
        storms = storm_threads(ctx, s.pid)
        chain = _storm_chain(ctx, s, storms, host) if storms else None
        chain = chain or _host_chain(ctx, s, host, storms)
        if chain:
            out.append(chain)
    return out


def _oom_kills(ctx: ChainContext) -> list[int]:
    rows = ctx.conn.execute(
        "SELECT DISTINCT pid FROM process_events WHERE kind = 'oom_kill' AND ($pid IS NULL OR pid = $pid) ORDER BY 1",
        {"pid": ctx.pid},
    ).fetchall()
    return [r[0] for r in rows if ctx.info.in_tree(r[0]) or r[0] not in ctx.info.procs]


class _Host:
    """Host samples in the pressured seconds."""

    def __init__(self) -> None:
        self.secs: set[int] = set()
        self.min_avail: int | None = None
        self.max_swap: int | None = None
        self.peak_rate: float | None = None


def _host_pressure(ctx: ChainContext) -> _Host:
    h = _Host()
    rows = ctx.conn.execute(
        "SELECT ts_ns, mem_available_bytes, swap_used_bytes, page_alloc_bytes, target_page_alloc_bytes, "
        "ts_ns - lag(ts_ns) OVER (ORDER BY ts_ns) FROM host_samples ORDER BY ts_ns"
    ).fetchall()
    mem = ctx.info.mem_bytes
    prev_swap = None
    for ts, avail, swap, alloc, talloc, dt in rows:
        dt = dt if dt and dt > 0 else S
        low = bool(mem) and avail is not None and avail < MEM_LOW_FRAC * mem
        surge = (talloc or 0) * S / dt >= HOST_ALLOC_FLOOR
        swapping = prev_swap is not None and swap is not None and swap > prev_swap
        prev_swap = swap
        if low or surge or swapping:
            # a sample covers the interval before it: the second it closes and the one it was taken in
            h.secs |= {max(ts - dt, 0) // S, ts // S}
            if avail is not None:
                h.min_avail = avail if h.min_avail is None else min(h.min_avail, avail)
            if swap is not None:
                h.max_swap = swap if h.max_swap is None else max(h.max_swap, swap)
            rate = (alloc or 0) * S / dt
            h.peak_rate = rate if h.peak_rate is None else max(h.peak_rate, rate)
    return h


def _off_cpu(row: dict[str, int]) -> int:
    return sum(row.get(k, 0) for k in OFF_CPU_PARTS)


def _excess(s: Subject, secs: set[int]) -> float:
    """Return the subject's off-CPU time in ``secs`` above its usual per-ns rate in the other seconds."""
    t = s.time
    inside = [(r["wall"], _off_cpu(r)) for sec, r in t.by_sec.items() if sec in secs and r["wall"]]
    rest = [_off_cpu(r) / r["wall"] for sec, r in t.by_sec.items() if sec not in secs and r["wall"]]
    base = statistics.median(rest) if rest else 0.0
    return sum(max(off - base * wall, 0.0) for wall, off in inside)


# who ends a wait for a lock the storm thread holds: the thread itself handing the GIL over, a timer (the GIL's
# 5 ms timed wait; a wakeup from an interrupt may be booked to whichever task was running), another thread of
# the process; not its own workers (a batch) nor the tracer
LOCK_WAKERS = ("self", "interrupt", "other")


def _lock_waits(ctx: ChainContext, s: Subject, secs: set[int]) -> float:
    """Return the subject's blocked time outside calls in the storm's seconds ``secs`` that no batch or tracer
    ended, above its usual rate in the other seconds: its waits on locks the storm thread held."""
    if not ctx.info.has_wakers:
        return 0.0
    flag = False if ctx.info.has("preemptors", "is_tracer") else None
    per: dict[int, float] = {}
    for sec, wp, comm, ns in ctx.conn.execute(
        "SELECT sec, waker_pid, any_value(waker_comm), sum(blocked_ns) FROM thread_wakers WHERE tid = ? "
        "AND NOT in_call GROUP BY sec, waker_pid",
        [s.tid],
    ).fetchall():
        if holder_class(ctx.info, s.pid, wp, comm, None, flag) in LOCK_WAKERS and int(sec) in s.time.by_sec:
            per[int(sec)] = per.get(int(sec), 0.0) + float(ns or 0)
    rows = s.time.by_sec
    rest = [per.get(sec, 0.0) / r["wall"] for sec, r in rows.items() if sec not in secs and r["wall"]]
    base = statistics.median(rest) if rest else 0.0
    # a per-second total, capped by the blocked time the thread has in the second's part inside its steps
    return sum(
        max(min(per.get(sec, 0.0), rows[sec]["blocked"]) - base * rows[sec]["wall"], 0.0) for sec in secs if sec in rows
    )


def _gil_waits_behind(
    ctx: ChainContext, s: Subject, storms: list[ThreadTime], others: list[ThreadTime], secs: set[int]
) -> float:
    """Return the subject's GIL waits (its off-CPU stacks in the interpreter's lock take) in the storm's seconds,
    each second's in the share of the CPU time of ``others`` (the process's other threads) the storm threads had:
    a thread faulting in a chunk's pages inside one bytecode holds the GIL all that time, and the waiter's 5 ms
    timed waits end by a timer, so neither the holder's wakeups nor a rate above the other seconds (the storm fills
    every second) counts them (issue 18's storm2 read 21 ms of lock waits against 539 ms of GIL waits behind it)."""
    if not ctx.info.has("offcpu_stacks"):
        return 0.0
    gil = blocked_seconds(ctx.conn, s.tid, "gil")
    weight = ctx.in_steps(s, "blocked")
    total = 0.0
    for sec in secs & gil.keys():
        cpu = sum(t.by_sec[sec]["cpu"] for t in others if sec in t.by_sec)
        mine = sum(t.by_sec[sec]["cpu"] for t in storms if sec in t.by_sec)
        if cpu > 0:
            total += gil[sec] * weight(sec) * mine / cpu
    return total


def explained_by_storms(chains: list[CausalChain]) -> list[CausalChain]:
    """Return ``chains`` with each gil_contention chain whose culprit is a fault storm's thread marked as explained
    by that memory_pressure chain: the thread holds the GIL while the kernel faults its pages in, so the storm is
    the cause and the lock its way of stalling the training thread (the storm chain counts those waits)."""
    storms = {
        (c.tid, c.culprit.tid): c
        for c in chains
        if c.category == CATEGORY and c.culprit is not None and c.evidence.trigger == "fault_storm"
    }
    out = []
    for c in chains:
        by = storms.get((c.tid, c.culprit.tid)) if c.category == "gil_contention" and c.culprit else None
        if by is not None:
            c = c.explained(
                by, f"It holds the lock while the kernel faults its fresh pages in ({by.id}): not a cause of its own."
            )
        out.append(c)
    return out


def _storm_chain(ctx: ChainContext, s: Subject, storms: list[StormThread], host: _Host) -> CausalChain | None:
    culprit_t = next((x for x in storms if x.tid != s.tid), storms[0])
    storm = ctx.times.by_tid(culprit_t.tid)
    if storm is None:
        return None
    floor = STORM_BYTES_PER_S * STORM_SECOND_FRAC
    secs = {sec for sec, r in storm.by_sec.items() if r["page_alloc_bytes"] >= floor * r["wall"] / S}
    rows = [r for sec, r in s.time.by_sec.items() if sec in secs]
    io = sum(r["io"] for r in rows)
    reclaim = sum(r["reclaim"] for r in rows)
    woken = runq = faulting = by_storm = 0.0
    if culprit_t.tid == s.tid:
        # the training thread faults memory in itself: its CPU time in the storm's seconds above its usual rate
        # (a page fault runs in the faulting thread's own CPU time). Its time inside CPython's garbage collector
        # is not faulting: a growing heap of small objects faults pages in and makes the collector walk it, and
        # the walk is most of that CPU (issue 28: gc_pause's)
        # (the collector's time is the whole second's, the row may be an edge second's part inside the steps: it
        # takes at most the row's CPU, so no second's CPU outside it is negative)
        in_gc = gc_ns_by_sec(ctx, s.tid)

        def outside_gc(sec: int, r: dict[str, int]) -> float:
            return r["cpu"] - min(in_gc.get(sec, 0), r["cpu"])

        rest = [outside_gc(sec, r) / r["wall"] for sec, r in s.time.by_sec.items() if sec not in secs and r["wall"]]
        base = statistics.median(rest) if rest else 0.0
        faulting = sum(
            max(outside_gc(sec, r) - base * r["wall"], 0.0) for sec, r in s.time.by_sec.items() if sec in secs
        )
    else:
        by_storm = sum(w.blocked_ms * MS - w.in_call_ms * MS for w in ctx.wakers(s) if w.tid == culprit_t.tid)
        others = [t for t in ctx.threads_of(s.pid) if t.tid != s.tid]
        stormers = [t for x in storms if x.tid != s.tid and (t := ctx.times.by_tid(x.tid)) is not None]
        woken = max(_lock_waits(ctx, s, secs), by_storm, _gil_waits_behind(ctx, s, stormers, others, secs))
        cpu = sum(t.ns("cpu") for t in others)
        k = storm.ns("cpu") / cpu if cpu else 0.0
        runq = sum(r["runq_self"] for r in rows) * k
    cost = woken + runq + faulting + io + reclaim
    sev = grade(s.share(cost), HIGH, MEDIUM, LOW)
    if sev is None:
        return None
    self_storm = culprit_t.tid == s.tid
    gib = culprit_t.page_alloc_bytes / GIB
    culprit = Culprit(
        kind="thread",
        pid=culprit_t.pid,
        tid=culprit_t.tid,
        comm=culprit_t.comm,
        relation="own_thread",
        code_site=None,
    )
    recs = [
        (
            f"Thread {culprit_t.tid} ({culprit_t.comm}) of pid {culprit_t.pid} faulted in {gib:.1f} GiB of fresh "
            f"memory ({culprit_t.page_alloc_bytes_per_s / (1 << 20):,.0f} MiB/s)"
            + ("" if self_storm else f" while training thread {s.tid} waited on it")
            + ": allocate its buffers once and reuse them (a preallocated array or a bounded cache) instead of "
            "new bytearrays / mmaps per item."
        ),
        "If it is a cache, cap it (LRU with a byte limit) and fill it in a separate process"
        + (" (a DataLoader worker)" if has_dataloader(ctx) else "")
        + " so its page faults and the GIL it holds do not stall the training thread.",
    ]
    if reclaim:
        recs.append(
            f"The kernel reclaimed memory synchronously ({reclaim / MS:,.0f} ms in the training thread): leave "
            "headroom (smaller caches, fewer workers) so allocations do not hit direct reclaim."
        )
    return ctx.chain(
        s,
        category=CATEGORY,
        severity=sev,
        cost_ns=cost,
        culprit=culprit,
        start_ns=min(secs) * S if secs else s.start_ns,
        end_ns=(max(secs) + 1) * S if secs else s.end_ns,
        summary=(
            f"Thread {culprit_t.tid} ({culprit_t.comm}) of pid {culprit_t.pid} faulted in {gib:.1f} GiB of fresh "
            f"pages; it cost training thread {s.tid} {cost / MS:,.0f} ms ({s.share(cost):.0%} of its steps' time)"
            + (
                f": {woken / MS:,.0f} ms blocked on locks it held (the GIL, the mmap lock), {runq / MS:,.0f} ms "
                "waiting for the CPU it held."
                if not self_storm
                else f": {faulting / MS:,.0f} ms faulting pages in above its usual CPU time, plus I/O and reclaim."
            )
        ),
        evidence=MemoryPressureEvidence(
            trigger="fault_storm",
            storm_threads=storms[:5],
            woken_by_culprit_ms=round(by_storm / MS, 1),
            lock_waits_ms=round(woken / MS, 1),
            runq_behind_culprit_ms=round(runq / MS, 1),
            faulting_cpu_ms=round(faulting / MS, 1),
            io_ms=round(io / MS, 1),
            reclaim_ms=round(reclaim / MS, 1),
            excess_off_cpu_ms=0.0,
            pressure_seconds=len(secs),
            min_mem_available_bytes=host.min_avail,
            max_swap_used_bytes=host.max_swap,
            peak_page_alloc_bytes_per_s=host.peak_rate,
            oom_kills=[],
        ),
        recommendations=recs,
    )


def _host_chain(ctx: ChainContext, s: Subject, host: _Host, storms: list[StormThread]) -> CausalChain | None:
    secs = {sec for sec in host.secs if sec in s.time.by_sec}
    if not secs:
        return None
    excess = _excess(s, secs)
    reclaim = sum(r["reclaim"] for sec, r in s.time.by_sec.items() if sec in secs)
    cost = excess + reclaim
    sev = grade(s.share(cost), HIGH, MEDIUM, LOW)
    if sev is None:
        return None
    mem = ctx.info.mem_bytes
    avail = host.min_avail
    dl = has_dataloader(ctx)
    recs = [
        "Reduce host memory use: "
        + (
            "shrink DataLoader prefetch_factor / num_workers or the data staged in host memory"
            if dl
            else "shrink the data staged in host memory (caches, per-step host copies)"
        )
        + (f"; MemAvailable fell to {avail / GIB:.1f} GiB of {mem / GIB:.0f} GiB." if avail and mem else "."),
        "Reuse pinned host buffers (" + ("pin_memory=True, " if dl else "") + "allocated once) instead of "
        "allocating per step.",
    ]
    if host.max_swap:
        recs.append(
            f"Swap in use ({host.max_swap / GIB:.1f} GiB): stop other memory-hungry processes on this host or add "
            "RAM; swapped-out pages stall the training thread in I/O."
        )
    return ctx.chain(
        s,
        category=CATEGORY,
        severity=sev,
        cost_ns=cost,
        culprit=Culprit(kind="host", pid=None, tid=None, comm="host memory", relation="host", code_site=None),
        start_ns=min(secs) * S,
        end_ns=(max(secs) + 1) * S,
        summary=(
            f"During {len(secs)} s of memory pressure"
            + (f" (MemAvailable down to {avail / GIB:.1f} GiB)" if avail is not None else "")
            + f" thread {s.tid} (pid {s.pid}) lost {cost / MS:,.0f} ms off CPU above its usual rate "
            f"({s.share(cost):.0%} of its steps' time)."
        ),
        evidence=MemoryPressureEvidence(
            trigger="host_pressure",
            storm_threads=storms[:5],
            woken_by_culprit_ms=0.0,
            lock_waits_ms=0.0,
            runq_behind_culprit_ms=0.0,
            faulting_cpu_ms=0.0,
            io_ms=round(sum(r["io"] for sec, r in s.time.by_sec.items() if sec in secs) / MS, 1),
            reclaim_ms=round(reclaim / MS, 1),
            excess_off_cpu_ms=round(excess / MS, 1),
            pressure_seconds=len(secs),
            min_mem_available_bytes=avail,
            max_swap_used_bytes=host.max_swap,
            peak_page_alloc_bytes_per_s=host.peak_rate,
            oom_kills=[],
        ),
        recommendations=recs,
    )


def _oom_chain(ctx: ChainContext, s: Subject, oom: list[int], host: _Host) -> CausalChain:
    names = ", ".join(f"{ctx.info.comm(p)} (pid {p})" for p in oom[:5])
    first = ctx.conn.execute("SELECT min(ts_ns) FROM process_events WHERE kind = 'oom_kill'").fetchone()
    start = int(first[0]) if first and first[0] is not None else s.start_ns
    return ctx.chain(
        s,
        category=CATEGORY,
        severity="HIGH",  # a killed process is lost work whatever its share of the time
        cost_ns=0.0,
        culprit=Culprit(kind="host", pid=oom[0], tid=None, comm=ctx.info.comm(oom[0]), relation="host", code_site=None),
        start_ns=start,
        end_ns=max(start + S, s.end_ns),
        pids=[p for p in oom if ctx.info.in_tree(p)],
        summary=f"The kernel's OOM killer killed {names}: the host ran out of memory.",
        evidence=MemoryPressureEvidence(
            trigger="oom_kill",
            storm_threads=storm_threads(ctx, s.pid)[:5],
            woken_by_culprit_ms=0.0,
            lock_waits_ms=0.0,
            runq_behind_culprit_ms=0.0,
            faulting_cpu_ms=0.0,
            io_ms=0.0,
            reclaim_ms=0.0,
            excess_off_cpu_ms=0.0,
            pressure_seconds=len(host.secs),
            min_mem_available_bytes=host.min_avail,
            max_swap_used_bytes=host.max_swap,
            peak_page_alloc_bytes_per_s=host.peak_rate,
            oom_kills=oom,
        ),
        recommendations=[
            "Lower the job's peak host memory: "
            + ("fewer DataLoader workers or a smaller prefetch_factor, " if has_dataloader(ctx) else "")
            + "smaller host-side caches, and no per-step host copies of whole tensors.",
            "Check what else on the host uses memory (other jobs) and give the job a memory limit it fits in.",
        ],
    )
