"""process_churn: worker processes forked again and again (a DataLoader without persistent workers, a pool
re-created per epoch), each respawn stalling the training thread while the new workers start and deliver their
first batches.

Waves: forks of one parent more than FORK_GAP_NS apart, or after a worker of the current wave exited, start a
new wave; one wave of long-lived workers is the healthy shape.

Cost, per respawn (:func:`respawn_stalls`): the stall from the wave's first fork until the end of the thread's first
wait that a worker of the new wave ended (its first batch), less the CUDA time in it, plus the thread's reads of the
wave's other workers' first batches (the empty pipeline refilling), less the thread's usual wait per batch for each
of those batches (exact, from ``thread_wakers``, over its steps: what any batch costs it, respawn or not).

A slow loader is dataloader_starvation's: in a loop whose workers are too slow for it, a respawn costs only the fork
and the first batches' extra latency, which is what untraced timings show. The demo's loop (workers short of CPU):
5.13 s respawning against 4.82 s with persistent workers, ~6 ms a respawn; this reads ~12 ms (9 % of the traced
steps), where counting every wakeup of the first batches as a batch read 15 %, and the first version of this
detector 90 %. The bias left: what a fresh pool short of CPU does not have ready at once it has ready a few steps
later, and this counts the first batches' wait as lost though those steps win part of it back. The fixture's loop
(workers ahead of it): 0.82 s against 0.58 s, ~27 ms a respawn, 29 %; this reads 24-32 %. A recording without
wakers falls back to the thread's time outside CUDA calls in the WAVE_WINDOW_NS after each respawn above its usual
per-second rate.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from tracer.analysis.chains.applies import helper_pids, is_dataloader_worker
from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, Subject, grade
from tracer.analysis.chains.model import CausalChain, Culprit, ProcessChurnEvidence, WaveLoss
from tracer.analysis.taxonomy import CALL_PART_NAMES

CATEGORY = "process_churn"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
S = 1_000_000_000
MS = 1_000_000
# forks within 1 s of each other are one wave (a pool starts its workers together)
FORK_GAP_NS = 1 * S
# new workers import, fork and warm up for about a second before their first batch: the respawn's window
WAVE_WINDOW_NS = 2 * S

# The process that forked: the recorder writes a fork as (pid = child, ppid = parent, child = child), a
# hand-built trace as (pid = parent, child = child); both read the same way through this.
_FORK_PARENT = "(CASE WHEN {e}pid = {e}child THEN {e}ppid ELSE {e}pid END)"


def _waves(ctx: ChainContext, parent: int) -> tuple[list[list[tuple]], int]:
    """Return the fork waves of process ``parent`` and how many of their children exited (computed once per
    parent: several detectors ask). Another parent's forks never join them: a shell's helper commands are not
    the training process's workers."""
    key = ("waves", parent)
    if key not in ctx.memo:
        ctx.memo[key] = _group_waves(*_forks(ctx, parent))
    return ctx.memo[key]


def _forks(ctx: ChainContext, parent: int) -> tuple[list[tuple], dict[int, int]]:
    """Return process ``parent``'s forks (ts, parent, child, child's comm), in time order, the tracer's own
    processes left out, and {child: its exit time}. Read per parent asked about (a few subjects' processes): a
    monitoring loop's 200 K helper commands are another parent's, and reading every fork cost a tenth of the chains
    on a fork-heavy recording (issue 21)."""
    parent_of = _FORK_PARENT.format(e="e.")
    tracer = ctx.info.tracer_pids
    forks = [
        f
        for f in ctx.conn.execute(
            f"SELECT e.ts_ns, {parent_of} AS parent, e.child, p.comm FROM process_events e LEFT JOIN processes p "
            f"ON p.pid = e.child WHERE e.kind = 'fork' AND {parent_of} = $parent AND ($pid IS NULL OR "
            f"{parent_of} = $pid) ORDER BY e.ts_ns",
            {"parent": parent, "pid": ctx.pid},
        ).fetchall()
        if f[1] not in tracer and f[2] not in tracer
    ]
    # (a join, not list_contains over a list of every child: that is rows x children)
    exit_at = dict(
        ctx.conn.execute(
            f"SELECT e.pid, min(e.ts_ns) FROM process_events e SEMI JOIN (SELECT DISTINCT child FROM process_events e "
            f"WHERE kind = 'fork' AND {parent_of} = $parent) f ON f.child = e.pid WHERE e.kind = 'exit' GROUP BY e.pid",
            {"parent": parent},
        ).fetchall()
    )
    return forks, exit_at


def _group_waves(forks: list[tuple], exit_at: dict[int, int]) -> tuple[list[list[tuple]], int]:
    """Group one parent's forks into waves: a fork more than FORK_GAP_NS after the last, or after a worker of
    the current wave exited (short epochs re-fork the workers right after shutting the last ones down)."""
    waves: list[list[tuple]] = []
    first_exit = None  # the earliest exit of a worker of the current wave: a respawn once a fork comes after it
    for f in forks:
        respawn = first_exit is not None and first_exit <= f[0]
        if waves and f[0] - waves[-1][-1][0] <= FORK_GAP_NS and not respawn:
            waves[-1].append(f)
        else:
            waves.append([f])
            first_exit = None
        gone = exit_at.get(f[2])
        if gone is not None and (first_exit is None or gone < first_exit):
            first_exit = gone
    return waves, sum(1 for f in forks if f[2] in exit_at)


def _resumed_ns(ctx: ChainContext, tid: int, start: int) -> int | None:
    """Return the end of the second in which thread ``tid`` issued its first CUDA call at or after ``start``:
    when it got back to work after the respawn (from the stored calls: any recording has them)."""
    r = ctx.conn.execute("SELECT min(ts_ns) FROM cuda_calls WHERE tid = ? AND ts_ns >= ?", [tid, start]).fetchone()
    return (int(r[0]) // S + 1) * S if r and r[0] is not None else None


def wave_windows(ctx: ChainContext, tid: int, waves: list[list[tuple]]) -> list[tuple[int, int, list[int]]]:
    """Return (start, end, worker pids) per respawn wave: from its first fork for WAVE_WINDOW_NS, or until
    thread ``tid`` issued CUDA work again when that came later (a slow start is the respawn's too)."""
    out = []
    for w in waves[1:]:
        start = w[0][0]
        out.append((start, max(start + WAVE_WINDOW_NS, _resumed_ns(ctx, tid, start) or 0), [f[2] for f in w if f[2]]))
    return out


def respawn_windows(ctx: ChainContext, s: Subject) -> dict[int, tuple[int, int]]:
    """Return {worker pid: its wave's window} for the workers of every respawn wave of the subject's process:
    the time in which its thread waiting for them is the respawn's cost (the fallback without wakers)."""
    waves, n_exits = _waves(ctx, s.pid)
    if len(waves) < 2 or n_exits == 0:
        return {}
    return {p: (a, b) for a, b, pids in wave_windows(ctx, s.tid, waves) for p in pids}


@dataclass(frozen=True)
class Stall:
    """What one respawn wave cost a thread: from the wave's first fork until each of its workers delivered a first
    batch."""

    start_ns: int  # the wave's first fork
    end_ns: int  # the end of the thread's last wait ended by a first batch of a worker of the wave
    workers: int
    batch_wait_ns: int  # those waits, blocked (outside calls): what dataloader_starvation leaves to this detector
    cost_ns: float  # the stall less its CUDA time and less the thread's usual wait per batch


def respawn_stalls(ctx: ChainContext, s: Subject) -> list[Stall] | None:
    """Return the stall of each respawn wave within subject ``s``'s steps (see the module docstring); None when
    the recording has no wakers to tell when a wave's first batch arrived."""
    key = ("respawn_stalls", s.tid)
    if key in ctx.memo:
        return ctx.memo[key]
    out = None
    waves, n_exits = _waves(ctx, s.pid)
    if not ctx.info.has_wakers or not ctx.info.has("sched", "waker_pid"):
        pass
    elif len(waves) < 2 or n_exits == 0:
        out = []
    else:
        out = _stalls(ctx, s, waves)
    ctx.memo[key] = out
    return out


@dataclass
class _Read:
    """The thread's waits for one batch from one worker: the wakeups that worker gave it within one step (a batch
    is read in chunks, a header and then the payload, each a wait of its own when the worker is slow)."""

    waker: int
    end_ns: int  # the end of the first wait
    first_ns: int  # the first wait's blocked time
    blocked_ns: int  # every wait's blocked time (outside calls)
    last_end_ns: int


@dataclass
class _FirstBatches:
    """The reads of a wave's workers' first batches, in time order."""

    end_ns: int  # the end of the first read's first wait: the stall up to there is counted whole (the forks are in it)
    blocked_ns: list[int]  # each read's blocked time
    later_ns: int  # the blocked time after that first wait: the rest of its read and the later reads
    last_end_ns: int


def _step_ends(ctx: ChainContext, s: Subject) -> np.ndarray:
    """The ends of the subject's steps within its span, in time order."""
    ends = ctx.step_ends(s.tid)
    return ends[np.searchsorted(ends, s.start_ns, "right") : np.searchsorted(ends, s.end_ns, "right")]


def _reads(ctx: ChainContext, s: Subject, pids: list[int], ends: np.ndarray) -> list[_Read]:
    """Return the thread's reads from workers ``pids`` (outside calls), in time order: its wakeups by one worker
    within one step (``ends``: the subject's step ends) are one read (sched keeps every off-CPU interval >= 1 ms,
    and a first batch takes longer than that). A thread with fewer than three steps has each wakeup for a read."""
    by_step = len(ends) >= 3
    out: list[_Read] = []
    prev = None
    for ts, dur, runq, waker in ctx.conn.execute(
        # a semi join on the workers, not list_contains: that compares every row with every worker
        "SELECT ts_ns, dur_ns, runq_ns, waker_pid FROM sched SEMI JOIN (SELECT unnest($pids) AS w) ON waker_pid = w "
        "WHERE tid = $tid AND NOT coalesce(in_call, false) ORDER BY ts_ns",
        {"tid": s.tid, "pids": pids},
    ).fetchall():
        end, blocked = int(ts + dur), int(dur - (runq or 0))
        key = (waker, int(np.searchsorted(ends, end))) if by_step else None
        if key is not None and key == prev:
            out[-1].blocked_ns += blocked
            out[-1].last_end_ns = end
        else:
            out.append(_Read(waker, end, blocked, blocked, end))
        prev = key
    return out


def _stalls(ctx: ChainContext, s: Subject, waves: list[list[tuple]]) -> list[Stall]:
    # a child the thread only waited for to finish (a start-up shell command) delivers no first batch: a wave
    # of them is no respawn
    helpers = helper_pids(ctx, s.tid)
    respawned = {f[2]: i for i, w in enumerate(waves[1:]) for f in w if f[2] and f[2] not in helpers}
    # The reads of the wave's workers' first batches. Not only the wave's first: a new pool starts empty, so the
    # thread waits for the second and third workers' first batches too, where persistent workers had them ready
    # (the fixture's untraced loop: 15, 6.5 and 0.8 ms for batches 0-2 of an epoch against 0.2 ms once the
    # pipeline is full; counting only the first read 17 % for a 29 % truth). A loader hands batches over in its
    # workers' order (torch's round robin), so the first batches are the reads whose workers follow the fork
    # order; a worker read again, or one out of order, is a later batch: a steady one.
    order = {f[2]: k for w in waves for k, f in enumerate(w)}
    firsts: dict[int, _FirstBatches] = {}
    closed: set[int] = set()
    last: dict[int, int] = {}  # wave -> fork order of the last worker whose first batch was counted
    ends = _step_ends(ctx, s)
    for r in _reads(ctx, s, list(respawned), ends):
        i = respawned[r.waker]
        start = waves[i + 1][0][0]
        nxt = waves[i + 2][0][0] if i + 2 < len(waves) else None
        if i in closed or not (start <= r.end_ns and (nxt is None or r.end_ns <= nxt)):
            continue
        if order[r.waker] <= last.get(i, -1):
            closed.add(i)
            continue
        last[i] = order[r.waker]
        got = firsts.get(i)
        if got is None:
            firsts[i] = _FirstBatches(r.end_ns, [r.blocked_ns], r.blocked_ns - r.first_ns, r.last_end_ns)
        else:
            got.blocked_ns.append(r.blocked_ns)
            got.later_ns += r.blocked_ns
            got.last_end_ns = r.last_end_ns
    usual = _usual_batch_wait(ctx, s, [b for f in firsts.values() for b in f.blocked_ns], len(ends))
    kept = [(i, w) for i, w in enumerate(waves[1:]) if i in firsts and s.start_ns <= w[0][0] < s.end_ns]
    busy = _in_calls(ctx, s.tid, [(w[0][0], firsts[i].end_ns) for i, w in kept])
    out = []
    for (i, w), in_calls in zip(kept, busy, strict=True):
        f = firsts[i]
        stall = f.end_ns - w[0][0] - in_calls + f.later_ns
        cost = max(stall - usual * len(f.blocked_ns), 0.0)
        out.append(Stall(w[0][0], f.last_end_ns, len(w), sum(f.blocked_ns), cost))
    return out


def _usual_batch_wait(ctx: ChainContext, s: Subject, first_reads: list[int], steps: int) -> float:
    """Return the thread's mean blocked time per batch from a data worker (outside calls, within its steps), the
    respawns' first batches (``first_reads``, blocked ns each) left out: what a batch costs it anyway.

    Per batch, not per wakeup: a batch is read in chunks (a header, then the payload), and a loader short of CPU
    wakes the thread several times a batch, so per wakeup the usual wait read a third of a batch's (2.6 against
    ~8 ms in the demo) and each respawn's first batches looked ~15 ms dearer than steady ones, where untraced the
    demo's respawns cost ~6 ms each: its workers are CPU-bound, and what a fresh pool does not have ready at once it
    has ready a few steps later. A training loop reads a batch a step, so the batches are the steps (the one step
    definition, ``steps`` of them in the subject's span); a thread with fewer than three steps is counted per
    wakeup."""
    trainers = {x.pid for x in ctx.subjects if x.launches}
    helpers = helper_pids(ctx, s.tid)
    workers = [w for w in ctx.wakers(s) if w.holder == "tree" and w.pid not in trainers and w.pid not in helpers]
    n = (steps if steps >= 3 else sum(w.wakeups for w in workers)) - len(first_reads)
    blocked = sum((w.blocked_ms - w.in_call_ms) * MS for w in workers) - sum(first_reads)
    return max(blocked, 0.0) / n if n > 0 else 0.0


def _in_calls(ctx: ChainContext, tid: int, spans: list[tuple[int, int]]) -> list[int]:
    """Return the time thread ``tid`` spent in CUDA calls within each [a, b) of ``spans`` (outermost calls:
    runtime ones when it made any there, else driver ones).

    One read of the thread's calls, then prefix sums: a query per respawn was seconds on a loader that respawned
    hundreds of times, and a range join in DuckDB no better. A thread's calls of one layer do not overlap, so
    sorted by start their ends are sorted too, and the time inside [a, b) is the whole calls between the first
    ending after a and the last starting before b, less the parts of those two outside the window."""
    if not spans:
        return []
    layers: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    # One read of both layers, sorted here: the rows are stored about in time order, and DuckDB's ORDER BY of a
    # training thread's 5 M calls was most of this (issue 21). Only the calls that can overlap a span: those that
    # start in a span's seconds or the second before, and the few that last a second or more (a call that started
    # earlier and is still running at a span's start). A subset of sorted, non-overlapping calls stays so, and an
    # hour's loop reads the seconds of its respawns instead of every call (0.16 -> 0.04 s at 720 respawns).
    secs = sorted({sec for a, b in spans for sec in range(a // S - 1, (b - 1) // S + 1)})
    cols = ctx.conn.execute(
        "SELECT ts_ns, dur_ns, layer = 'runtime' AS rt FROM cuda_calls "
        "WHERE tid = $tid AND layer IN ('runtime', 'driver') AND (dur_ns >= $s OR ts_ns // $s IN "
        "(SELECT unnest($secs)))",
        {"tid": tid, "s": S, "secs": secs},
    ).fetchnumpy()
    ts, dur, rt = (np.asarray(cols[c]) for c in ("ts_ns", "dur_ns", "rt"))
    for layer, mask in (("runtime", rt), ("driver", ~rt)):
        starts, durs = ts[mask].astype(np.int64), dur[mask].astype(np.int64)
        if len(starts) > 1 and (np.diff(starts) < 0).any():
            order = np.argsort(starts, kind="stable")
            starts, durs = starts[order], durs[order]
        layers[layer] = (starts, starts + durs, np.concatenate(([0], np.cumsum(durs))))
    out = []
    for a, b in spans:
        got = {layer: _overlap(*arrays, a, b) for layer, arrays in layers.items()}
        out.append(min(got["runtime"] or got["driver"], b - a))
    return out


def _overlap(starts: np.ndarray, ends: np.ndarray, prefix: np.ndarray, a: int, b: int) -> int:
    """Return the time of the calls (sorted, non-overlapping) inside [a, b)."""
    lo = int(np.searchsorted(ends, a, side="right"))
    hi = int(np.searchsorted(starts, b, side="left"))
    if hi <= lo:
        return 0
    total = int(prefix[hi] - prefix[lo])
    total -= max(a - int(starts[lo]), 0)  # the first call began before the window
    total -= max(int(ends[hi - 1]) - b, 0)  # the last one ended after it
    return max(total, 0)


def _non_cuda(row: dict[str, int]) -> int:
    return row["wall"] - sum(row[p] for p in CALL_PART_NAMES)


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject whose process forked its workers in two waves or more, some exiting: the
    respawns. Waves of children that never fed the subject (no wait of its thread ended with a wave's first
    batch: start-up helpers, a monitoring script's commands) are no churn; without wakers to tell, only
    DataLoader workers are taken for the subject's workers."""
    out = []
    for s in ctx.subjects:
        waves, n_exits = _waves(ctx, s.pid)
        if len(waves) < 2 or n_exits == 0:
            continue  # one wave of long-lived workers is the healthy shape
        forks = [f for w in waves for f in w]
        stalls = respawn_stalls(ctx, s)
        if stalls is None and not any(is_dataloader_worker(ctx, f[2]) for f in forks):
            continue
        if stalls is not None and not any(st.cost_ns > 0 for st in stalls):
            continue
        out.append(_chain(ctx, s, s.pid, waves, forks, n_exits))
    return out


def _baseline(s: Subject, waves: list[list[tuple]], windows: list[tuple[int, int, int]]) -> float:
    """Return the thread's usual share of time outside CUDA calls in its steady seconds, 0 when it has none.

    Steady: whole seconds of its steps outside every wave's window, the first wave's included (workers starting
    for the first time are not the loop's steady state). Edge seconds are left out because the subject's time
    is pro-rated there, so their share is that of the whole second (imports, the first fork) and would hide
    every respawn of a loop that lasts only a few seconds."""
    first = (waves[0][0][0], waves[0][0][0] + WAVE_WINDOW_NS)
    busy = {sec for a, b, *_ in [first, *windows] for sec in range(a // S, (b - 1) // S + 1)}
    whole = range(-(-s.start_ns // S), s.end_ns // S)
    rest = [r for sec, r in s.time.by_sec.items() if sec in whole and sec not in busy and r["wall"]]
    wall = sum(r["wall"] for r in rest)
    return sum(_non_cuda(r) for r in rest) / wall if wall else 0.0


def _window_losses(ctx: ChainContext, s: Subject, waves: list[list[tuple]]) -> tuple[list[WaveLoss], int]:
    """The fallback without wakers: per respawn, the thread's time outside CUDA calls in the wave's window above
    its usual per-second rate; return the losses and the end of the last window."""
    t = s.time
    windows = [(a, b, len(pids)) for a, b, pids in wave_windows(ctx, s.tid, waves)]
    base = _baseline(s, waves, windows)
    losses = []
    seen: set[int] = set()
    for a, b, n in windows:
        lost = 0.0
        for sec in range(a // S, (b - 1) // S + 1):
            r = t.by_sec.get(sec)
            if r is None or sec in seen or not r["wall"]:
                continue
            seen.add(sec)  # a second shared by two windows counts once
            lost += max(_non_cuda(r) - base * r["wall"], 0.0)
        losses.append(WaveLoss(start_s=round(a / S, 2), workers=n, lost_ms=round(lost / MS, 1)))
    return losses, max(waves[-1][-1][0] + WAVE_WINDOW_NS, windows[-1][1])


def _chain(
    ctx: ChainContext, s: Subject, parent: int, waves: list[list[tuple]], forks: list[tuple], n_exits: int
) -> CausalChain:
    stalls = respawn_stalls(ctx, s)
    if stalls is None:
        losses, end_ns = _window_losses(ctx, s, waves)
    else:
        losses = [
            WaveLoss(start_s=round(st.start_ns / S, 2), workers=st.workers, lost_ms=round(st.cost_ns / MS, 1))
            for st in stalls
        ]
        end_ns = max((st.end_ns for st in stalls), default=waves[-1][0][0])
    cost = sum(w.lost_ms for w in losses) * MS
    respawns = len(waves) - 1
    per_wave = sorted(len(w) for w in waves)[len(waves) // 2]
    # the respawned children's usual name (the first fork may be a start-up helper: ctypes' `sh -c ldconfig`)
    names = Counter(f[3] for w in waves[1:] for f in w if f[3])
    comm = names.most_common(1)[0][0] if names else "worker"
    avg = cost / MS / respawns
    sev = grade(s.share(cost), HIGH, MEDIUM, LOW) or "LOW"
    # the role, from the one definition (RecordingInfo.process_role), not the name compared here
    is_dl = any(is_dataloader_worker(ctx, f[2]) for w in waves[1:] for f in w if f[3] == comm)
    recs = [
        (
            f"Keep the {per_wave} DataLoader workers alive across epochs: DataLoader(..., num_workers={per_wave}, "
            "persistent_workers=True)"
            if is_dl
            else f"Reuse the {per_wave} {comm} worker processes instead of forking new ones every wave"
        )
        + f"; pid {parent} re-forked them {respawns} times.",
        f"Each respawn cost thread {s.tid} ~{avg:,.0f} ms: "
        + (
            "with persistent workers the next epoch starts from already-prefetched batches (prefetch_factor=2 or more)."
            if is_dl
            else "a long-lived pool (multiprocessing.Pool, concurrent.futures) pays the start-up once."
        ),
    ]
    return ctx.chain(
        s,
        category=CATEGORY,
        severity=sev,
        cost_ns=cost,
        # the workers come and go: the culprit is the respawning, named by the process that forks them
        culprit=Culprit(kind="workers", pid=parent, tid=None, comm=comm, relation="own_workers", code_site=None),
        start_ns=waves[1][0][0],
        end_ns=end_ns,
        pids=[parent] + [f[2] for f in forks if f[2] is not None][:16],
        summary=(
            f"pid {parent} forked {per_wave} {comm} workers {len(waves)} times ({n_exits} exited); the respawns "
            f"cost thread {s.tid} {cost / MS:,.0f} ms ({s.share(cost):.0%} of its steps' time), ~{avg:,.0f} ms each."
        ),
        evidence=ProcessChurnEvidence(
            fork_waves=len(waves),
            respawn_waves=respawns,
            workers_per_wave=per_wave,
            worker_comm=comm,
            forks=len(forks),
            exits=n_exits,
            wave_times_s=[round(w[0][0] / S, 2) for w in waves],
            lost_ms=round(cost / MS, 1),
            avg_lost_ms_per_respawn=round(avg, 1),
            waves=losses,
        ),
        recommendations=recs,
    )
