"""Causal chains: why CUDA calls were slow, each diagnosis backed by measured per-call evidence.

Contract: a detector is ``detector(ctx: ChainContext) -> list[CausalChain]``; :data:`DETECTORS` lists them
all, and
:func:`compute_chains` runs every one and ranks the result worst first. A detector must cite what the slow
calls'
own threads measured (``cuda_calls.off_cpu_ns`` / ``runq_ns``, the ``sched`` intervals inside the calls and
who
preempted them, ``process_events`` timing, ``host_samples`` in the calls' time range), never window counts
alone,
and write recommendations for this trace (the PID, the op, the Python file:line, the worker count). A slow
tail
that its own evidence does not explain (the thread was on CPU, or blocked rather than runnable) is not blamed
on
the CPU.

Categories: cpu_contention, sync_stall, gpu_bound, process_churn, memory_pressure, allocation_churn.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.stats import DATALOADER_COMM, main_pid, percentile_ns

S = 1_000_000_000
MS = 1_000_000
SEVERITIES = ("HIGH", "MEDIUM", "LOW")

# A call is "slow" when it takes >= SLOW_FACTOR x its op's median and at least SLOW_FLOOR_NS: 5x keeps
# ordinary
# jitter (launches vary 2x) out, and the 1 ms floor keeps µs-scale ops, whose tails are scheduler noise too
# small
# to matter for a training step, out.
SLOW_FACTOR = 5.0
SLOW_FLOOR_NS = 1 * MS
# cpu_contention needs the slow calls to have spent >= 30 % of their time runnable but without a CPU: then a
# free
# CPU would have made them >= 30 % faster. >= 50 % with >= 20 slow calls and a 10x tail is HIGH.
RUNQ_SHARE_MIN = 0.30
RUNQ_SHARE_HIGH = 0.50
MIN_SLOW_CALLS = 5
# sync_stall: the thread spends >= 20 % of the session blocked in syncs (>= 35 %: HIGH), issued at >= 100/s,
# i.e.
# several per training step (a step is typically 10-100 ms): the host serialises on the GPU many times per
# step.
SYNC_SHARE_MIN = 0.20
SYNC_SHARE_HIGH = 0.35
SYNC_RATE_MIN = 100.0
# gpu_bound: few syncs but >= 50 % of the session waiting in them: the GPU is the bottleneck (LOW: nothing on
# the
# host to fix).
GPU_BOUND_SHARE = 0.50
# process_churn: forks more than FORK_GAP_NS apart start a new wave; a stall counts when a slow call starts
# within WAVE_WINDOW_NS after a wave began (new workers import, fork and warm up for ~1 s).
FORK_GAP_NS = 1 * S
WAVE_WINDOW_NS = 2 * S
CHURN_STALL_HIGH_MS = 100.0  # average stall per respawn wave that makes churn HIGH
# memory_pressure: MemAvailable under 10 % of RAM (5 %: severe), or page allocation >= 4x its median and
# >= 512 MiB/s, or swap growing; slow calls inside those seconds at >= 3x the rate outside.
MEM_LOW_FRAC = 0.10
MEM_SEVERE_FRAC = 0.05
PAGE_ALLOC_SURGE = 4.0
PAGE_ALLOC_FLOOR = 512 << 20
MEM_RATE_RATIO = 3.0
# ... or, without slow calls, pauses >= 100 ms between a thread's CUDA calls inside the pressure while the
# traced tree itself allocated >= PAGE_ALLOC_FLOOR of pages.
MEM_GAP_NS = 100 * MS
# allocation_churn: >= 1000 alloc/free calls at >= 20/s, or >= 2 % of the session inside them; >= 10 %: HIGH.
ALLOC_OPS = (
    "cudaMalloc",
    "cudaFree",
    "cudaMallocHost",
    "cudaFreeHost",
    "cudaHostAlloc",
    "cudaMallocManaged",
    "cuMemAlloc",
    "cuMemAlloc_v2",
    "cuMemFree",
    "cuMemFree_v2",
    "cuMemAllocHost",
    "cuMemFreeHost",
)
ALLOC_MIN_CALLS = 1000
ALLOC_RATE_MIN = 20.0
ALLOC_SHARE_MEDIUM = 0.02
ALLOC_SHARE_HIGH = 0.10
# Shares and rates of a pid are over its CUDA-active span, but at least 1 s (a handful of calls in a few ms
# is no rate).
ACTIVE_FLOOR_NS = 1 * S


class CausalChain(Record):
    """One diagnosis: what was slow, when, why (measured), and what to change."""

    id: Annotated[str, Field(description="stable id: category, pid, op and time range hashed")]
    severity: Annotated[str, Field(description="HIGH | MEDIUM | LOW")]
    category: Annotated[
        str,
        Field(
            description="cpu_contention | sync_stall | gpu_bound | process_churn | memory_pressure | allocation_churn"
        ),
    ]
    start_ns: Annotated[int, Field(description="start of the affected range, ns since session start")]
    end_ns: Annotated[int, Field(description="end of the affected range, ns since session start")]
    pids: Annotated[list[int], Field(description="affected processes")]
    op: Annotated[str, Field(description="affected CUDA op: call get_stacks(op) for its code paths")]
    op_p50_us: Annotated[float, Field(description="the op's median latency in the affected pid, µs")]
    op_p99_us: Annotated[float, Field(description="its 99th percentile, µs")]
    impact_ms: Annotated[float, Field(description="time the problem cost the affected threads, ms (ranking key)")]
    summary: Annotated[str, Field(description="one-sentence diagnosis")]
    evidence: Annotated[dict[str, Any], Field(description="the measured numbers behind it")]
    recommendations: Annotated[list[str], Field(description="fixes for this trace, most effective first")]


class ChainsResult(Record):
    """Causal chains, worst first (severity, then impact)."""

    chains: list[CausalChain]
    total: Annotated[int, Field(description="chains found before the limit")]
    by_severity: Annotated[dict[str, int], Field(description="chains found, by severity (before the limit)")]


@dataclass
class ChainContext:
    """What every detector needs: the connection, the pid filter, and per-(pid, op) latency from op_stats."""

    conn: duckdb.DuckDBPyConnection
    pid: int | None = None
    duration_ns: int = 0
    cpu_cores: int = 0
    mem_bytes: int = 0
    main_pid: int | None = None
    comms: dict[int, str] = field(default_factory=dict)
    # (pid, op) -> (layer, calls, total_ns, p50_ns, p99_ns)
    ops: dict[tuple[int, str], tuple[str, int, int, float, float]] = field(default_factory=dict)
    # pid -> (its first CUDA call, its exit or the session end): the span the pid was doing CUDA work
    active: dict[int, tuple[int, int]] = field(default_factory=dict)
    _frames: dict[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, conn: duckdb.DuckDBPyConnection, pid: int | None = None) -> ChainContext:
        s = conn.execute("SELECT duration_s, cpu_cores, mem_bytes FROM session LIMIT 1").fetchone() or (
            0,
            0,
            0,
        )
        ctx = cls(
            conn=conn,
            pid=pid,
            duration_ns=int((s[0] or 0) * S),
            cpu_cores=int(s[1] or 0),
            mem_bytes=int(s[2] or 0),
            main_pid=main_pid(conn),
        )
        ctx.comms = dict(conn.execute("SELECT pid, comm FROM processes").fetchall())
        for p, op, layer, calls, total, mn, mx, hist in conn.execute(
            "SELECT pid, op, layer, calls, total_ns, min_ns, max_ns, hist FROM op_stats "
            "WHERE ($pid IS NULL OR pid = $pid)",
            {"pid": pid},
        ).fetchall():
            b = sorted((h["lo_ns"], h["hi_ns"], h["count"]) for h in hist or [])
            ctx.ops[(p, op)] = (
                layer or "",
                int(calls or 0),
                int(total or 0),
                percentile_ns(b, 0.5, mn or 0, mx or 0),
                percentile_ns(b, 0.99, mn or 0, mx or 0),
            )
        if ctx.duration_ns <= 0:
            end = conn.execute("SELECT max(ts_ns + dur_ns) FROM cuda_calls").fetchone()
            ctx.duration_ns = int(end[0] or 0) if end else 0
        for p, t0, t1 in conn.execute(
            "SELECT c.pid, min(c.ts_ns), greatest(max(c.ts_ns + c.dur_ns), any_value(coalesce(p.exit_ns, ?))) "
            "FROM cuda_calls c LEFT JOIN processes p ON p.pid = c.pid GROUP BY c.pid",
            [ctx.duration_ns],
        ).fetchall():
            ctx.active[p] = (int(t0), int(t1) if t1 else ctx.duration_ns)
        return ctx

    def active_ns(self, pid: int) -> int:
        """Return how long pid was doing CUDA work (first call to exit/session end), at least ACTIVE_FLOOR_NS.

        Shares and rates are of this span, not of the session: a session also holds the time before the
        target's first CUDA call (attach, imports, data loading) and after its last, in which no sync or
        allocation could have happened, and a short job in a long recording would never reach a share."""
        span = self.active.get(pid)
        if not span or self.duration_ns <= 0:
            return self.duration_ns
        return min(self.duration_ns, max(span[1] - span[0], ACTIVE_FLOOR_NS))

    def slow_threshold_ns(self, pid: int, op: str) -> int:
        p50 = self.ops.get((pid, op), ("", 0, 0, 0.0, 0.0))[3]
        return int(max(SLOW_FLOOR_NS, SLOW_FACTOR * p50))

    def comm(self, pid: int | None) -> str:
        return self.comms.get(pid, "?") if pid is not None else "?"

    def code_site(self, pid: int, op: str) -> str | None:
        """Return 'file:line function' of the innermost Python frame of the op's most frequent stack in pid."""  # noqa: E501
        r = self.conn.execute(
            "SELECT stack_id FROM cuda_calls WHERE pid = ? AND op = ? AND stack_id IS NOT NULL "
            "GROUP BY stack_id ORDER BY count(*) DESC LIMIT 1",
            [pid, op],
        ).fetchone()
        return self.frame_of(r[0]) if r else None

    def frame_of(self, stack_id: int) -> str | None:
        """Return 'file:line function' of the stack's innermost Python frame in the user's own code.

        Library frames (site-packages, the stdlib) are skipped. When no library frame sits above the C call,
        the innermost file is the binding that made it (a ctypes wrapper such as FakeCuda.call): if a caller
        in another file exists, that caller is the code site, not the wrapper."""
        if stack_id not in self._frames:
            frames = self.conn.execute(
                "SELECT file, line, function FROM stacks WHERE stack_id = ? AND kind = 'python' ORDER BY depth DESC",
                [stack_id],
            ).fetchall()
            user = [f for f in frames if not _is_library(f[0])] or frames
            if user and frames and user[0][0] == frames[0][0]:
                callers = [f for f in user if f[0] != user[0][0]]
                user = callers or user
            f = user[0] if user else None
            self._frames[stack_id] = f"{f[0]}:{f[1]} {f[2]}" if f else ""
        return self._frames[stack_id] or None


_LIBRARY_PARTS = ("site-packages", "dist-packages", "<frozen", "/lib/python3")


def _is_library(path: str | None) -> bool:
    return not path or any(p in path for p in _LIBRARY_PARTS)


def _chain(
    ctx: ChainContext,
    *,
    category: str,
    severity: str,
    pid: int,
    op: str,
    start_ns: int,
    end_ns: int,
    impact_ns: float,
    summary: str,
    evidence: dict[str, Any],
    recommendations: list[str],
    pids: Sequence[int] | None = None,
) -> CausalChain:
    _, _, _, p50, p99 = ctx.ops.get((pid, op), ("", 0, 0, 0.0, 0.0))
    key = f"{category}|{pid}|{op}|{start_ns // S}|{end_ns // S}"
    return CausalChain(
        id=f"{category}-{hashlib.sha1(key.encode()).hexdigest()[:10]}",
        severity=severity,
        category=category,
        start_ns=int(start_ns),
        end_ns=int(end_ns),
        pids=sorted(set(pids or [pid])),
        op=op,
        op_p50_us=round(p50 / 1e3, 1),
        op_p99_us=round(p99 / 1e3, 1),
        impact_ms=round(impact_ns / 1e6, 1),
        summary=summary,
        evidence=evidence,
        recommendations=recommendations,
    )


def _pid_ops(ctx: ChainContext, pred: Callable[[str], bool]) -> list[tuple[int, str]]:
    return sorted((p, op) for (p, op) in ctx.ops if pred(op))


def _slow_calls(ctx: ChainContext, pid: int, op: str) -> tuple | None:
    thr = ctx.slow_threshold_ns(pid, op)
    r = ctx.conn.execute(
        "SELECT count(*), sum(dur_ns), sum(off_cpu_ns), sum(runq_ns), min(ts_ns), max(ts_ns + dur_ns), "
        "max(dur_ns) FROM cuda_calls WHERE pid = ? AND op = ? AND dur_ns >= ?",
        [pid, op, thr],
    ).fetchone()
    return (thr, *r) if r and r[0] else None


def cpu_contention(ctx: ChainContext) -> list[CausalChain]:
    """Slow calls whose threads waited for a CPU (runq) inside the call, and who took the CPU from them."""
    out = []
    for pid, op in _pid_ops(ctx, lambda op: True):
        s = _slow_calls(ctx, pid, op)
        if not s:
            continue
        thr, n, dur, off, runq, t0, t1, worst = s
        share = (runq or 0) / dur if dur else 0.0
        if n < MIN_SLOW_CALLS or share < RUNQ_SHARE_MIN:
            continue  # the tail is not explained by waiting for a CPU: not this detector's to claim
        pre = ctx.conn.execute(
            """
            WITH slow AS (SELECT tid, ts_ns, ts_ns + dur_ns AS end_ns FROM cuda_calls
                          WHERE pid = ? AND op = ? AND dur_ns >= ?)
            SELECT s.preempted_by_pid, any_value(s.preempted_by_comm), count(*), sum(s.runq_ns)
            FROM slow c JOIN sched s ON s.tid = c.tid AND s.ts_ns < c.end_ns AND s.ts_ns + s.dur_ns > c.ts_ns
            WHERE s.preempted_by_pid IS NOT NULL GROUP BY 1 ORDER BY 4 DESC LIMIT 5""",
            [pid, op, thr],
        ).fetchall()
        source = "sched intervals inside the slow calls"
        if not pre:
            pre = ctx.conn.execute(
                "SELECT pid, any_value(comm), sum(preemptions), sum(runq_ns) FROM preemptors "
                "WHERE sec BETWEEN ? AND ? GROUP BY 1 ORDER BY 4 DESC LIMIT 5",
                [t0 // S, t1 // S],
            ).fetchall()
            source = "per-second preemptor totals over the slow calls' time range"
        preemptors = [
            dict(pid=p, comm=c or "?", own=p in ctx.comms, preemptions=int(k), runq_ms=round(q / 1e6, 1))
            for p, c, k, q in pre
        ]
        host = ctx.conn.execute(
            "SELECT max(load1), max(cpu_busy_pct) FROM host_samples WHERE ts_ns BETWEEN ? AND ?",
            [t0 - S, t1 + S],
        ).fetchone() or (None, None)
        _, _, _, p50, p99 = ctx.ops[(pid, op)]
        tail = p99 / p50 if p50 else 0.0
        sev = "HIGH" if share >= RUNQ_SHARE_HIGH and n >= 20 and tail >= 10 else "MEDIUM" if n >= 20 else "LOW"
        top = preemptors[0] if preemptors else None
        who = (
            f"{'its own' if top['own'] else 'another'} process {top['comm']} (pid {top['pid']})"
            if top
            else "other tasks (no preemptor recorded)"
        )
        site = ctx.code_site(pid, op)
        recs = []
        foreign = [p for p in preemptors if not p["own"]]
        own = [p for p in preemptors if p["own"]]
        if foreign:
            f = foreign[0]
            recs.append(
                f"{f['comm']} (pid {f['pid']}) took the CPU from pid {pid} {f['preemptions']} times during "
                f"slow {op} calls ({f['runq_ms']} ms of waiting): stop it, move it to other cores "
                f"(taskset -cp <other cores> {f['pid']}) or lower its priority (renice -n 19 -p {f['pid']})."
            )
        recs.append(
            f"Pin the training process to cores nothing else uses: taskset -cp <cores> {pid}"
            + (f" (this host has {ctx.cpu_cores} CPUs)." if ctx.cpu_cores else ".")
        )
        if own:
            workers = sum(1 for c in ctx.comms.values() if c == DATALOADER_COMM)
            names = ", ".join(f"{o['comm']} {o['pid']}" for o in own[:3])
            recs.append(
                f"Its own processes ({names}) also took the "
                f"CPU: lower DataLoader num_workers (now {workers}) to leave a core for the main thread."
            )
        if site:
            recs.append(
                f"The affected {op} calls come from {site}: fewer host syncs there make the job less "
                f"sensitive to preemption."
            )
        out.append(
            _chain(
                ctx,
                category="cpu_contention",
                severity=sev,
                pid=pid,
                op=op,
                start_ns=t0,
                end_ns=t1,
                impact_ns=runq or 0,
                summary=(
                    f"{n} slow {op} calls in pid {pid} ({ctx.comm(pid)}) spent {share:.0%} of their time waiting for "  # noqa: E501
                    f"a CPU; {who} took it."
                ),
                evidence=dict(
                    slow_calls=int(n),
                    slow_threshold_us=round(thr / 1e3, 1),
                    slow_calls_total_ms=round(dur / 1e6, 1),
                    runq_ms=round((runq or 0) / 1e6, 1),
                    off_cpu_ms=round((off or 0) / 1e6, 1),
                    runq_share=round(share, 3),
                    worst_call_ms=round(worst / 1e6, 2),
                    tail_ratio=round(tail, 1),
                    preemptors=preemptors,
                    preemptor_source=source,
                    max_load1=host[0],
                    max_cpu_busy_pct=host[1],
                    code_site=site,
                ),
                recommendations=recs,
            )
        )
    return out


def _is_sync(op: str) -> bool:
    return "Synchronize" in op


def sync_stall(ctx: ChainContext) -> list[CausalChain]:
    """Many host syncs per step, each blocking the thread: the host serialises on the GPU (or waits on a busy GPU)."""  # noqa: E501
    out = []
    dur_s = ctx.duration_ns / S if ctx.duration_ns else 0.0
    if dur_s <= 0:
        return out
    by_pid: dict[int, list[str]] = {}
    for pid, op in _pid_ops(ctx, _is_sync):
        layer = ctx.ops[(pid, op)][0]
        if layer == "driver" and any(p == pid and _is_sync(o) and ctx.ops[(p, o)][0] == "runtime" for p, o in ctx.ops):
            continue  # the driver sync under a runtime sync is the same wait: count it once
        by_pid.setdefault(pid, []).append(op)
    for pid, sync_ops in by_pid.items():
        # The thread blocks in every kind of sync alike (stream, device, event): judge the pid on all of them
        # together, and name the op it waited in longest.
        op = max(sync_ops, key=lambda o: ctx.ops[(pid, o)][2])
        _, _, _, p50, p99 = ctx.ops[(pid, op)]
        calls = sum(ctx.ops[(pid, o)][1] for o in sync_ops)
        total = sum(ctx.ops[(pid, o)][2] for o in sync_ops)
        active = ctx.active_ns(pid)
        share = total / active
        rate = calls / (active / S)
        r = ctx.conn.execute(
            "SELECT count(*), sum(dur_ns), sum(off_cpu_ns), sum(runq_ns), min(ts_ns), max(ts_ns + dur_ns) "
            f"FROM cuda_calls WHERE pid = ? AND op IN ({', '.join('?' * len(sync_ops))})",
            [pid, *sync_ops],
        ).fetchone()
        if not r or not r[0] or not r[1]:
            continue
        n, sdur, soff, srunq, t0, t1 = r
        sleep_share = ((soff or 0) - (srunq or 0)) / sdur
        site = ctx.code_site(pid, op)
        ev = dict(
            calls=calls,
            calls_per_s=round(rate, 1),
            time_in_syncs_s=round(total / S, 2),
            share_of_session=round(share, 3),
            active_s=round(active / S, 2),
            blocked_share_of_sync_time=round(sleep_share, 3),
            runq_share_of_sync_time=round((srunq or 0) / sdur, 3),
            stored_calls=int(n),
            per_op={
                o: dict(calls=ctx.ops[(pid, o)][1], total_ms=round(ctx.ops[(pid, o)][2] / 1e6, 1)) for o in sync_ops
            },
            code_site=site,
        )
        where = f" at {site}" if site else ""
        if share >= SYNC_SHARE_MIN and rate >= SYNC_RATE_MIN and sleep_share >= 0.5:
            sev = "HIGH" if share >= SYNC_SHARE_HIGH else "MEDIUM"
            out.append(
                _chain(
                    ctx,
                    category="sync_stall",
                    severity=sev,
                    pid=pid,
                    op=op,
                    start_ns=t0,
                    end_ns=t1,
                    impact_ns=total,
                    summary=(
                        f"pid {pid} ({ctx.comm(pid)}) calls {op} {rate:.0f} times/s{where} and spends {share:.0%} of "  # noqa: E501
                        f"its CUDA-active time blocked in it (median {p50 / 1e3:.0f} µs each)."
                    ),
                    evidence=ev,
                    recommendations=[
                        f"Remove per-step host syncs{where}: .item(), .cpu(), .tolist(), print(tensor) and "
                        f"torch.cuda.synchronize() each block until the GPU drains ({rate:.0f}/s here).",
                        "Accumulate metrics on the GPU and read them once every N steps; use non_blocking=True copies "  # noqa: E501
                        "with pinned memory instead of synchronous ones.",
                        f"Expected gain: up to {total / S:.1f} s of the {active / S:.0f} s of CUDA work the thread now spends "  # noqa: E501
                        f"waiting in {op}.",
                    ],
                )
            )
        elif share >= GPU_BOUND_SHARE and rate < SYNC_RATE_MIN and sleep_share >= 0.5:
            out.append(
                _chain(
                    ctx,
                    category="gpu_bound",
                    severity="LOW",
                    pid=pid,
                    op=op,
                    start_ns=t0,
                    end_ns=t1,
                    impact_ns=0,
                    summary=(
                        f"pid {pid} waits for the GPU in {op} {share:.0%} of its CUDA-active time: the GPU is the "
                        f"bottleneck, not the host."
                    ),
                    evidence=ev,
                    recommendations=[
                        "Nothing to fix on the host; to go faster, make the GPU work cheaper (mixed "
                        "precision, larger kernels, torch.compile) or check GPU utilisation."
                    ],
                )
            )
    return out


# The process that forked: the recorder writes a fork as (pid = child, ppid = parent, child = child), a
# hand-built trace as (pid = parent, child = child); both read the same way through this.
_FORK_PARENT = "(CASE WHEN {e}pid = {e}child THEN {e}ppid ELSE {e}pid END)"


def process_churn(ctx: ChainContext) -> list[CausalChain]:
    """Worker processes forked and killed repeatedly (DataLoader without persistent workers), with stalls at each wave."""  # noqa: E501
    parent_of = _FORK_PARENT.format(e="e.")
    forks = ctx.conn.execute(
        f"SELECT e.ts_ns, {parent_of}, e.child, p.comm FROM process_events e LEFT JOIN processes p "
        f"ON p.pid = e.child WHERE e.kind = 'fork' AND ($pid IS NULL OR {parent_of} = $pid) ORDER BY e.ts_ns",
        {"pid": ctx.pid},
    ).fetchall()
    if not forks:
        return []
    # child pid -> its exit time: a fork after a worker of the current wave exited starts a new wave even
    # within FORK_GAP_NS (short epochs re-fork the workers right after shutting the last ones down)
    exit_at = dict(
        ctx.conn.execute(
            "SELECT pid, min(ts_ns) FROM process_events WHERE kind = 'exit' AND pid IN (SELECT child FROM "
            f"process_events WHERE kind = 'fork' AND ($pid IS NULL OR {_FORK_PARENT.format(e='')} = $pid)) "
            "GROUP BY pid",
            {"pid": ctx.pid},
        ).fetchall()
    )
    waves: list[list[tuple]] = []
    for f in forks:
        respawn = waves and any(exit_at.get(w[2], f[0] + 1) <= f[0] for w in waves[-1])
        if waves and f[0] - waves[-1][-1][0] <= FORK_GAP_NS and not respawn:
            waves[-1].append(f)
        else:
            waves.append([f])
    exits = ctx.conn.execute(
        "SELECT count(*) FROM process_events WHERE kind = 'exit' AND pid IN (SELECT child FROM process_events "  # noqa: E501
        f"WHERE kind = 'fork' AND ($pid IS NULL OR {_FORK_PARENT.format(e='')} = $pid))",
        {"pid": ctx.pid},
    ).fetchone()
    n_exits = int(exits[0]) if exits else 0
    if len(waves) < 2 or n_exits == 0:
        return []  # one wave of long-lived workers is the healthy shape
    parent = max({f[1] for f in forks}, key=lambda p: sum(1 for f in forks if f[1] == p))
    per_wave = sorted(len(w) for w in waves)[len(waves) // 2]
    comm = next((f[3] for f in forks if f[3]), "worker")
    # per-call evidence: slow calls of the parent that begin within WAVE_WINDOW_NS after a wave (epoch
    # boundary)
    stalls = []
    stall_ns = 0
    worst: tuple[str, int] = ("", 0)
    for w in waves[1:]:
        t = w[0][0]
        for op in {o for (p, o) in ctx.ops if p == parent}:
            r = ctx.conn.execute(
                "SELECT count(*), sum(dur_ns), max(dur_ns) FROM cuda_calls WHERE pid = ? AND op = ? AND "
                "dur_ns >= ? AND ts_ns BETWEEN ? AND ?",
                [parent, op, ctx.slow_threshold_ns(parent, op), t, t + WAVE_WINDOW_NS],
            ).fetchone()
            if r and r[0]:
                stall_ns += r[1]
                stalls.append(dict(wave_s=round(t / S, 2), op=op, slow_calls=int(r[0]), total_ms=round(r[1] / 1e6, 1)))
                if r[2] > worst[1]:
                    worst = (op, int(r[2]))
    respawns = len(waves) - 1
    avg_ms = stall_ns / 1e6 / respawns
    sev = "HIGH" if avg_ms >= CHURN_STALL_HIGH_MS else "MEDIUM" if stall_ns else "LOW"
    op = worst[0] or max((o for (p, o) in ctx.ops if p == parent), key=lambda o: ctx.ops[(parent, o)][4], default="")
    site = ctx.code_site(parent, op) if op else None
    off = ctx.conn.execute(
        "SELECT max(dur_ns) FROM sched WHERE pid = ? AND " + " OR ".join(["ts_ns BETWEEN ? AND ?"] * respawns),
        [parent] + [x for w in waves[1:] for x in (w[0][0], w[0][0] + WAVE_WINDOW_NS)],
    ).fetchone()
    ev = dict(
        fork_waves=len(waves),
        respawn_waves=respawns,
        workers_per_wave=per_wave,
        worker_comm=comm,
        forks=len(forks),
        exits=n_exits,
        wave_times_s=[round(w[0][0] / S, 2) for w in waves],
        stall_ms_after_respawns=round(stall_ns / 1e6, 1),
        avg_stall_ms_per_respawn=round(avg_ms, 1),
        worst_call_ms=round(worst[1] / 1e6, 1),
        worst_off_cpu_ms_after_respawns=round((off[0] or 0) / 1e6, 1) if off else None,
        stalls=stalls[:10],
        code_site=site,
    )
    is_dl = comm == DATALOADER_COMM
    recs = [
        (
            f"Keep the {per_wave} DataLoader workers alive across epochs: DataLoader(..., num_workers={per_wave}, "  # noqa: E501
            f"persistent_workers=True)"
            if is_dl
            else f"Reuse the {per_wave} {comm} worker processes instead of forking new ones every wave"
        )
        + f"; pid {parent} re-forked them {respawns} times.",
        f"Each respawn stalled pid {parent} for ~{avg_ms:.0f} ms"
        + (f" in {op} at {site}" if site else "")
        + ": with persistent workers the next epoch starts from already-prefetched batches (prefetch_factor=2+).",  # noqa: E501
    ]
    return [
        _chain(
            ctx,
            category="process_churn",
            severity=sev,
            pid=parent,
            op=op,
            start_ns=waves[1][0][0],
            end_ns=waves[-1][-1][0] + WAVE_WINDOW_NS,
            impact_ns=stall_ns,
            pids=[parent] + [f[2] for f in forks if f[2] is not None][:16],
            summary=(
                f"pid {parent} forked {per_wave} {comm} workers {len(waves)} times ({n_exits} exited); the "
                f"first calls after each respawn stalled {avg_ms:.0f} ms on average."
            ),
            evidence=ev,
            recommendations=recs,
        )
    ]


def memory_pressure(ctx: ChainContext) -> list[CausalChain]:
    """Seconds of low MemAvailable / page-allocation surges / swap growth in which the traced calls were slow."""  # noqa: E501
    rows = ctx.conn.execute(
        "SELECT ts_ns, mem_available_bytes, page_alloc_bytes, target_page_alloc_bytes, swap_used_bytes, "
        "ts_ns - lag(ts_ns) OVER (ORDER BY ts_ns) FROM host_samples ORDER BY ts_ns"
    ).fetchall()
    if not rows:
        return []
    rates = sorted(r[2] * S / (r[5] if r[5] and r[5] > 0 else S) for r in rows if r[2] is not None)
    median = rates[len(rates) // 2] if rates else 0
    mem = ctx.mem_bytes or 0
    pressured = []
    prev_swap = None
    for ts, avail, alloc, talloc, swap, dt in rows:
        rate = (alloc or 0) * S / (dt if dt and dt > 0 else S)
        low = mem and avail is not None and avail < MEM_LOW_FRAC * mem
        trate = (talloc or 0) * S / (dt if dt and dt > 0 else S)
        # a surge over the host's usual rate, or the traced tree itself faulting in >= 512 MiB/s (a short
        # recording of a job that allocates all along has no quiet seconds to set the median)
        surge = rate >= max(PAGE_ALLOC_SURGE * median, PAGE_ALLOC_FLOOR) or trate >= PAGE_ALLOC_FLOOR
        swapping = prev_swap is not None and swap is not None and swap > prev_swap
        prev_swap = swap
        if low or surge or swapping:
            pressured.append((ts, avail, rate, talloc, swap))
    if not pressured:
        return []
    t0, t1 = pressured[0][0] - S, pressured[-1][0]
    secs = {p[0] // S for p in pressured}
    slow_in = slow_out = 0
    by_op: dict[tuple[int, str], list[float]] = {}
    for pid, op in _pid_ops(ctx, lambda o: True):
        for ts, dur, off in ctx.conn.execute(
            "SELECT ts_ns, dur_ns, off_cpu_ns FROM cuda_calls WHERE pid = ? AND op = ? AND dur_ns >= ?",
            [pid, op, ctx.slow_threshold_ns(pid, op)],
        ).fetchall():
            # a sample covers the second before it: call at ts is inside if sample second ts//S+1 or ts//S is
            # pressured
            inside = (ts // S) in secs or (ts // S + 1) in secs
            if inside:
                slow_in += 1
                a = by_op.setdefault((pid, op), [0, 0.0, 0.0])
                a[0] += 1
                a[1] += dur
                a[2] += off or 0
            else:
                slow_out += 1
    in_s = max(len(secs), 1)
    # outside = the other sampled seconds: the session may hold long unsampled stretches (attach, compile)
    out_s = max(len({r[0] // S for r in rows}) - in_s, 1)
    rate_in, rate_out = slow_in / in_s, slow_out / out_s
    if slow_in < MIN_SLOW_CALLS or rate_in < MEM_RATE_RATIO * max(rate_out, 1e-9):
        # no slow calls inside the pressure: it may still have stalled the thread between its calls
        return _memory_stalls(ctx, secs, in_s, out_s, pressured)
    (pid, op), (n, dur, off) = max(by_op.items(), key=lambda kv: kv[1][1])
    min_avail = min((p[1] for p in pressured if p[1] is not None), default=None)
    swap_grew = max((p[4] or 0 for p in pressured), default=0)
    io = ctx.conn.execute(
        "SELECT count(*), coalesce(sum(dur_ns), 0) FROM sched WHERE reason = 'io' AND pid = ? AND ts_ns BETWEEN ? AND ?",  # noqa: E501
        [pid, t0, t1 + S],
    ).fetchone() or (0, 0)
    off_share = off / dur if dur else 0.0
    severe = (mem and min_avail is not None and min_avail < MEM_SEVERE_FRAC * mem) or swap_grew > 0
    sev = "HIGH" if severe and off_share >= 0.5 else "MEDIUM"
    peak = max(p[2] for p in pressured)
    target_alloc = sum(p[3] or 0 for p in pressured)
    site = ctx.code_site(pid, op)
    gib = 1 << 30
    recs = [
        f"Reduce host memory use around {op}"
        + (f" at {site}" if site else "")
        + f": MemAvailable fell to {(min_avail or 0) / gib:.1f} GiB of {mem / gib:.0f} GiB; shrink DataLoader "  # noqa: E501
        "prefetch_factor / num_workers or the batch staged in host memory.",
        f"Reuse pinned host buffers (pin_memory=True, allocated once) instead of allocating per step: the traced "  # noqa: E501
        f"tree allocated {target_alloc / gib:.1f} GiB of pages during the pressure.",
    ]
    if swap_grew:
        recs.append(
            f"Swap grew to {swap_grew / gib:.1f} GiB: stop other memory-hungry processes on this host or "
            "add RAM; swapped-out pages stall the training threads in I/O."
        )
    return [
        _chain(
            ctx,
            category="memory_pressure",
            severity=sev,
            pid=pid,
            op=op,
            start_ns=t0,
            end_ns=t1,
            impact_ns=dur,
            summary=(
                f"During {len(secs)} s of memory pressure (MemAvailable down to {(min_avail or 0) / gib:.1f} GiB, "  # noqa: E501
                f"page allocation up to {peak / gib:.1f} GiB/s) {n} {op} calls in pid {pid} were slow, "
                f"{off_share:.0%} of their time off CPU."
            ),
            evidence=dict(
                pressure_seconds=len(secs),
                min_mem_available_bytes=min_avail,
                peak_page_alloc_bytes_per_s=round(peak),
                median_page_alloc_bytes_per_s=round(median),
                target_page_alloc_bytes=int(target_alloc),
                max_swap_used_bytes=int(swap_grew),
                slow_calls_in_pressure=slow_in,
                slow_calls_per_s_in=round(rate_in, 2),
                slow_calls_per_s_outside=round(rate_out, 3),
                op_slow_calls=int(n),
                op_slow_total_ms=round(dur / 1e6, 1),
                op_off_cpu_share=round(off_share, 3),
                io_waits=int(io[0]),
                io_wait_ms=round(io[1] / 1e6, 1),
                code_site=site,
            ),
            recommendations=recs,
        )
    ]


def _memory_stalls(
    ctx: ChainContext, secs: set[int], in_s: int, out_s: float, pressured: list[tuple]
) -> list[CausalChain]:
    """Pauses of >= MEM_GAP_NS between a thread's consecutive CUDA calls inside the pressured seconds, while
    the traced tree itself allocated the pages: the thread that feeds the GPU was busy faulting memory in."""
    target_alloc = sum(p[3] or 0 for p in pressured)
    if target_alloc < PAGE_ALLOC_FLOOR:
        return []  # someone else's pressure that did not slow any call: no measured effect on the job
    gaps = ctx.conn.execute(
        "SELECT pid, tid, prev_end, ts_ns, op FROM (SELECT pid, tid, ts_ns, op, "
        "lag(ts_ns + dur_ns) OVER (PARTITION BY tid ORDER BY ts_ns) AS prev_end FROM cuda_calls "
        "WHERE ($pid IS NULL OR pid = $pid)) WHERE ts_ns - prev_end >= $gap ORDER BY ts_ns",
        {"pid": ctx.pid, "gap": MEM_GAP_NS},
    ).fetchall()
    inside = [g for g in gaps if (g[3] // S) in secs or (g[3] // S + 1) in secs]
    gap_in = sum(g[3] - g[2] for g in inside)
    n_out = len(gaps) - len(inside)
    if not inside or gap_in < MEM_GAP_NS or len(inside) / in_s < MEM_RATE_RATIO * n_out / out_s:
        return []
    by_pid: dict[int, list[tuple]] = {}
    for g in inside:
        by_pid.setdefault(g[0], []).append(g)
    pid, mine = max(by_pid.items(), key=lambda kv: sum(g[3] - g[2] for g in kv[1]))
    ops = [g[4] for g in mine]
    op = max(set(ops), key=ops.count)
    stall = sum(g[3] - g[2] for g in mine)
    site = ctx.code_site(pid, op)
    gib = 1 << 30
    peak = max(p[2] for p in pressured)
    return [
        _chain(
            ctx,
            category="memory_pressure",
            severity="MEDIUM",
            pid=pid,
            op=op,
            start_ns=mine[0][2],
            end_ns=mine[-1][3],
            impact_ns=stall,
            summary=(
                f"pid {pid} ({ctx.comm(pid)}) stopped issuing CUDA work {len(mine)} times for {stall / 1e6:.0f} ms "
                f"in all while the traced tree allocated {target_alloc / gib:.1f} GiB of pages (up to "
                f"{peak / gib:.1f} GiB/s host-wide)."
            ),
            evidence=dict(
                pressure_seconds=len(secs),
                target_page_alloc_bytes=int(target_alloc),
                peak_page_alloc_bytes_per_s=round(peak),
                stalls_in_pressure=len(mine),
                stall_ms=round(stall / 1e6, 1),
                worst_stall_ms=round(max(g[3] - g[2] for g in mine) / 1e6, 1),
                stalls_outside_pressure=n_out,
                next_op=op,
                code_site=site,
            ),
            recommendations=[
                f"Allocate host memory once and reuse it instead of faulting in fresh pages between steps: pid {pid} "
                f"allocated {target_alloc / gib:.1f} GiB during the pressure and issued no CUDA work meanwhile"
                + (f" (next call: {op} at {site})." if site else "."),
                "Move host-side data preparation into DataLoader workers (num_workers > 0, pin_memory=True) so "
                "the training thread keeps the GPU fed.",
            ],
        )
    ]


def allocation_churn(ctx: ChainContext) -> list[CausalChain]:
    """Thousands of device/host allocations and frees: the caching allocator defeated, each call a driver round trip."""  # noqa: E501
    out = []
    dur_s = ctx.duration_ns / S if ctx.duration_ns else 0.0
    if dur_s <= 0:
        return out
    for pid in sorted({p for (p, _) in ctx.ops}):
        ops = [(op, ctx.ops[(pid, op)]) for (p, op) in ctx.ops if p == pid and op in ALLOC_OPS]
        runtime = [o for o in ops if o[1][0] == "runtime"]
        ops = runtime or ops  # driver allocs under runtime allocs are the same work: count once
        if not ops:
            continue
        calls = sum(o[1][1] for o in ops)
        total = sum(o[1][2] for o in ops)
        active = ctx.active_ns(pid)
        rate, share = calls / (active / S), total / active
        if not ((calls >= ALLOC_MIN_CALLS and rate >= ALLOC_RATE_MIN) or share >= ALLOC_SHARE_MEDIUM):
            continue
        sev = "HIGH" if share >= ALLOC_SHARE_HIGH else "MEDIUM" if share >= ALLOC_SHARE_MEDIUM or rate >= 100 else "LOW"
        main_op = max(ops, key=lambda o: o[1][2])[0]
        alloc_op = next((o for o, _ in ops if "Alloc" in o or "Malloc" in o), main_op)
        r = ctx.conn.execute(
            f"SELECT min(ts_ns), max(ts_ns + dur_ns), coalesce(sum(bytes), 0) FROM cuda_calls WHERE pid = ? AND "  # noqa: E501
            f"op IN ({', '.join('?' * len(ops))})",
            [pid, *[o for o, _ in ops]],
        ).fetchone() or (0, 0, 0)
        sites = ctx.conn.execute(
            "SELECT stack_id, count(*) AS n, sum(bytes) FROM cuda_calls WHERE pid = ? AND op = ? AND stack_id IS NOT "  # noqa: E501
            "NULL GROUP BY 1 ORDER BY n DESC LIMIT 3",
            [pid, alloc_op],
        ).fetchall()
        site_list = [dict(site=ctx.frame_of(s), calls=int(n), bytes=int(b or 0)) for s, n, b in sites]
        site = site_list[0]["site"] if site_list else None
        empty_cache = ctx.conn.execute(
            "SELECT count(*) FROM stacks WHERE (function ILIKE '%empty_cache%' OR function ILIKE '%emptyCache%') AND "  # noqa: E501
            "stack_id IN (SELECT DISTINCT stack_id FROM cuda_calls WHERE pid = ? AND op IN ('cudaFree', 'cuMemFree', "  # noqa: E501
            "'cuMemFree_v2'))",
            [pid],
        ).fetchone()
        op_bytes = sum(
            o[1][1]
            and ctx.conn.execute(
                "SELECT coalesce(sum(bytes), 0) FROM op_stats WHERE pid = ? AND op = ?", [pid, o[0]]
            ).fetchone()[0]
            for o in ops
        )
        gb = op_bytes / 1e9
        where = f" at {site}" if site else ""
        recs = [
            f"Allocate once and reuse{where}: create the largest buffer outside the loop (torch.empty(max_size, "  # noqa: E501
            f"device='cuda')) and take views of it; pid {pid} called {alloc_op} "
            f"{ctx.ops[(pid, alloc_op)][1]} times ({gb:.0f} GB)."
        ]
        if empty_cache and empty_cache[0]:
            recs.append(
                "Do not call torch.cuda.empty_cache() inside the loop: it returns the cached blocks, so every "  # noqa: E501
                "next allocation goes back to cudaMalloc."
            )
        recs.append(
            "If block sizes vary, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so the caching "
            "allocator can reuse segments instead of allocating new ones."
        )
        out.append(
            _chain(
                ctx,
                category="allocation_churn",
                severity=sev,
                pid=pid,
                op=alloc_op,
                start_ns=r[0] or 0,
                end_ns=r[1] or 0,
                impact_ns=total,
                summary=(
                    f"pid {pid} ({ctx.comm(pid)}) made {calls} allocation/free calls ({rate:.0f}/s){where}, "
                    f"{total / S:.1f} s ({share:.0%} of its CUDA-active time) inside them."
                ),
                evidence=dict(
                    calls=calls,
                    calls_per_s=round(rate, 1),
                    time_in_alloc_s=round(total / S, 2),
                    share_of_session=round(share, 3),
                    active_s=round(active / S, 2),
                    bytes=int(op_bytes),
                    per_op={
                        o: dict(calls=v[1], p50_us=round(v[3] / 1e3, 1), p99_us=round(v[4] / 1e3, 1)) for o, v in ops
                    },
                    top_sites=site_list,
                    empty_cache_in_free_stacks=bool(empty_cache and empty_cache[0]),
                ),
                recommendations=recs,
            )
        )
    return out


Detector = Callable[[ChainContext], list[CausalChain]]
DETECTORS: tuple[Detector, ...] = (
    cpu_contention,
    sync_stall,
    process_churn,
    memory_pressure,
    allocation_churn,
)


def detect_all(ctx: ChainContext) -> list[CausalChain]:
    """Run every detector; return all chains worst first (severity, then impact)."""
    chains = [c for d in DETECTORS for c in d(ctx)]
    chains.sort(key=lambda c: (SEVERITIES.index(c.severity), -c.impact_ms, c.id))
    return chains


def compute_chains(
    conn: duckdb.DuckDBPyConnection, pid: int | None = None, severity: str | None = None, limit: int = 10
) -> ChainsResult:
    """Return causal chains worst first, optionally only for ``pid`` and at one ``severity`` (high|medium|low)."""  # noqa: E501
    sev = severity.upper() if severity else None
    if sev is not None and sev not in SEVERITIES:
        raise ValueError(f"unknown severity {severity!r}; use one of high, medium, low")
    chains = detect_all(ChainContext.load(conn, pid))
    counts = {s: sum(1 for c in chains if c.severity == s) for s in SEVERITIES}
    if sev:
        chains = [c for c in chains if c.severity == sev]
    return ChainsResult(chains=chains[: max(limit, 0)], total=len(chains), by_severity=counts)


def write_chains(rw_conn: duckdb.DuckDBPyConnection, chains: Sequence[CausalChain]) -> int:
    """Append ``chains`` to ``causal_chains`` with computed_at = now; return the number written."""
    for c in chains:
        rw_conn.execute(
            "INSERT INTO causal_chains (id, computed_at, severity, category, start_ns, end_ns, pids, op, summary, "  # noqa: E501
            "evidence, recommendations) VALUES (?, now(), ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                c.id,
                c.severity,
                c.category,
                c.start_ns,
                c.end_ns,
                c.pids,
                c.op,
                c.summary,
                json.dumps(c.evidence, default=str),
                json.dumps(c.recommendations),
            ],
        )
    return len(chains)
