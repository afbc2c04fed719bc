"""What every detector reads, loaded once per ``compute_chains``: the recording, each thread's time breakdown,
the subjects (the threads whose time the chains explain), exact per-op latency, and code sites.

A *subject* is a process's driver thread (its CUDA thread with the most launch + sync time; see
:mod:`tracer.analysis.breakdown`), its time clipped to its *steps*: from its first launch or sync to the end of
its last, so the set-up before the loop (imports, forking the loader, the first batch) does not count as loss.
A subject in a process that never launches a kernel (a data worker pinning memory) is not training the model:
its chains are capped at MEDIUM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb
import numpy as np

from tracer.analysis.breakdown.holders import (
    Holder,
    Waker,
    holder_class,
    holders_of,
    in_call_runq_by_class,
    wakers_of,
)
from tracer.analysis.breakdown.load import load_thread_times
from tracer.analysis.breakdown.thread_time import FIELDS, SecondRows, ThreadTime, ThreadTimes, window_shares
from tracer.analysis.chains.model import CausalChain, Culprit, Evidence
from tracer.analysis.code_site import code_site
from tracer.analysis.gcpause import gc_paused
from tracer.analysis.recording import RecordingInfo, load_recording
from tracer.analysis.steps import SPAN_PARTS, step_markers, step_spans
from tracer.analysis.taxonomy import CALL_PART_NAMES, RUNQ_PART_NAMES, part_name
from tracer.hist import OpHistogram

S = 1_000_000_000
MS = 1_000_000
# Severity is the share of the affected thread's (steps') wall time a cause cost (issue 10). Detectors use these
# unless they name their own at their top.
HIGH_SHARE = 0.20
MEDIUM_SHARE = 0.05
# below this a cause is noise, not a chain: 2% of a step is within run-to-run jitter of a training loop
LOW_SHARE = 0.02
# Shares are of at least a second of steps: in a loop that ran for 0.1 s, a few ms of scheduling noise would
# otherwise be a HIGH cause (the severities are about a training job, not its first step).
MIN_STEPS_NS = 1_000_000_000
# a second is part of a cause's time range when the cause took >= 10 % of it
HOT_SECOND_FRAC = 0.10
# Besides the training thread and each rank's thread, the chains judge this many other processes' CUDA threads,
# those with the most launch + sync time (drivers are best first). A fork-heavy job has a CUDA thread in each
# of 10 K short-lived children; judging each cost every detector a query per child (a recording of 10 K
# processes took minutes to diagnose, issue 21), and a child's own lost milliseconds are not the job's.
MAX_OTHER_SUBJECTS = 16


def grade(share: float, high: float = HIGH_SHARE, medium: float = MEDIUM_SHARE, low: float = LOW_SHARE) -> str | None:
    """Return HIGH / MEDIUM / LOW for a cost ``share`` of the thread's time, or None below ``low``."""
    if share >= high:
        return "HIGH"
    if share >= medium:
        return "MEDIUM"
    return "LOW" if share >= low else None


@dataclass(frozen=True)
class OpLatency:
    """One (pid, op) from op_stats: exact calls, time and percentiles."""

    pid: int
    op: str
    layer: str
    calls: int
    total_ns: int
    p50_ns: float
    p99_ns: float
    bytes: int

    @property
    def part(self) -> str:
        return part_name(self.op)


@dataclass
class Subject:
    """A thread whose time the chains explain, clipped to its steps."""

    time: ThreadTime
    training: bool  # the recording's training thread
    launches: bool  # its process launches kernels, or is a rank (it trains); else chains are capped at MEDIUM
    start_ns: int
    end_ns: int

    @property
    def pid(self) -> int:
        return self.time.pid

    @property
    def tid(self) -> int:
        return self.time.tid

    def share(self, ns: float) -> float:
        """Return ``ns`` as a share of the subject's steps, counted as at least MIN_STEPS_NS long."""
        wall = max(self.time.wall, MIN_STEPS_NS)
        return ns / wall if wall > 0 else 0.0

    def cap(self, severity: str) -> str:
        """Return ``severity`` capped at MEDIUM for a subject that does not train the model."""
        if self.launches or severity != "HIGH":
            return severity
        return "MEDIUM"


@dataclass
class ChainContext:
    """Shared, typed inputs of the detectors (see the module docstring)."""

    conn: duckdb.DuckDBPyConnection
    info: RecordingInfo
    pid: int | None
    times: ThreadTimes
    subjects: list[Subject]
    ops: dict[tuple[int, str], OpLatency]
    _frames: dict[int, str] = field(default_factory=dict)
    # results detectors share, computed once (e.g. dataloader_starvation.loader_wait, read by cpu_contention)
    memo: dict[tuple, Any] = field(default_factory=dict)

    @classmethod
    @gc_paused()
    def load(cls, conn: duckdb.DuckDBPyConnection, pid: int | None = None) -> ChainContext:
        info = load_recording(conn)
        times = load_thread_times(conn, info, pid)
        ops: dict[tuple[int, str], OpLatency] = {}
        for p, op, layer, calls, total, mn, mx, by, hist in conn.execute(
            "SELECT pid, op, layer, calls, total_ns, min_ns, max_ns, bytes, hist FROM op_stats "
            "WHERE ($pid IS NULL OR pid = $pid)",
            {"pid": pid},
        ).fetchall():
            latency = OpHistogram.of([(hist, mn, mx)])
            ops[(p, op)] = OpLatency(
                pid=p,
                op=op,
                layer=layer or "",
                calls=int(calls or 0),
                total_ns=int(total or 0),
                p50_ns=latency.quantile(0.5),
                p99_ns=latency.quantile(0.99),
                bytes=int(by or 0),
            )
        ctx = cls(conn=conn, info=info, pid=pid, times=times, subjects=[], ops=ops)
        ctx.subjects = ctx._subjects()
        return ctx

    # -- subjects
    def _subjects(self) -> list[Subject]:
        training = self.times.training
        # In a distributed job every rank trains: each rank's thread (its driver thread, else its main thread: a
        # gloo job on the CPU makes no CUDA call) is a training thread, and its chains are not capped.
        ranks = [t for pid in sorted(self.info.rank_pids) if (t := self.times.rank_thread(pid)) is not None]
        rank_tids = {t.tid for t in ranks}
        drivers = self.times.drivers
        out = []
        driver_tids = {t.tid for t in drivers}
        others = [t for t in drivers if t is not training and t.tid not in rank_tids][:MAX_OTHER_SUBJECTS]
        judged = {t.tid for t in others} | rank_tids | ({training.tid} if training else set())
        drivers = [t for t in drivers if t.tid in judged]
        for t in [*drivers, *(r for r in ranks if r.tid not in driver_tids)]:
            if t.wall <= 0:
                continue
            launches = any(o.part == "launch" and o.calls for o in self.ops_of(t.pid)) or t.ns("launch") > 0
            a, b = self._steps(t)
            is_rank = t.tid in rank_tids
            time = clip(t, a, b, self._calls_outside(t, a, b))
            out.append(Subject(time, t is training or is_rank, launches or is_rank, a, b))
        return out

    def _steps(self, t: ThreadTime) -> tuple[int, int]:
        """The thread's step span (steps.step_spans), within its life; a thread without launches or waits for the
        GPU: the span of its other calls, else its life."""
        ops = [o.op for o in self.ops_of(t.pid) if o.part in SPAN_PARTS] or [o.op for o in self.ops_of(t.pid)]
        a, b = step_spans(self.conn, [t.tid], ops).get(t.tid, (t.first_ns, t.end_ns)) if ops else (t.first_ns, t.end_ns)
        return max(a, t.first_ns), min(b, t.end_ns) if t.end_ns > a else b

    def _calls_outside(self, t: ThreadTime, a: int, b: int) -> CallsOutside:
        """Return second -> part -> ns of the thread's stored calls in its first and last second of steps that lie
        outside [a, b) (the set-up calls before the first launch, the last ones after it): what clip takes out of
        those seconds' call parts. Counted once per call, as the breakdown does: the ops of ops_of."""
        ops = [o.op for o in self.ops_of(t.pid)]
        if not ops or b <= a:
            return {}
        out: CallsOutside = {}
        for lo, hi in ((max(a // S * S, t.first_ns), a), (b, min((b - 1) // S * S + S, t.end_ns))):
            if hi <= lo:
                continue
            rows = self.conn.execute(
                "SELECT op, sum(least(ts_ns + dur_ns, $hi) - greatest(ts_ns, $lo)) FROM cuda_calls "
                "WHERE tid = $tid AND ts_ns < $hi AND ts_ns + dur_ns > $lo AND list_contains($ops, op) GROUP BY op",
                {"tid": t.tid, "lo": lo, "hi": hi, "ops": ops},
            ).fetchall()
            sec = lo // S
            for op, ns in rows:
                part = part_name(op)
                out.setdefault(sec, {})[part] = out.get(sec, {}).get(part, 0) + int(ns or 0)
        return out

    @property
    def training(self) -> Subject | None:
        return next((s for s in self.subjects if s.training), None)

    def hot_range(
        self, s: Subject, value: Callable[[dict[str, int]], float], frac: float = HOT_SECOND_FRAC
    ) -> tuple[int, int]:
        """Return [start, end) of the seconds in which ``value(row)`` took >= ``frac`` of the subject's time: when
        a cause was at work (the subject's steps when it never reached that)."""
        hot = [sec for sec, r in s.time.by_sec.items() if r["wall"] and value(r) >= frac * r["wall"]]
        if not hot:
            return s.start_ns, s.end_ns
        return max(min(hot) * S, s.start_ns), min((max(hot) + 1) * S, s.end_ns)

    # -- ops
    def ops_of(self, pid: int, pred: Callable[[OpLatency], bool] | None = None) -> list[OpLatency]:
        """Return the pid's ops (matching ``pred``), counting a runtime call and the driver call inside it once:
        per part, the runtime layer when it has calls, else the driver layer."""
        mine = [o for (p, _), o in self.ops.items() if p == pid and o.calls]
        runtime_parts = {o.part for o in mine if o.layer == "runtime"}
        kept = [o for o in mine if o.layer == "runtime" or o.part not in runtime_parts]
        kept = [o for o in kept if pred is None or pred(o)]
        return sorted(kept, key=lambda o: (-o.total_ns, o.op))

    def op_latency(self, pid: int, op: str) -> tuple[float, float]:
        o = self.ops.get((pid, op))
        return (o.p50_ns, o.p99_ns) if o else (0.0, 0.0)

    # -- who
    def holders(self, s: Subject) -> tuple[list[Holder], str]:
        """Return who held the CPU while the subject waited, within its steps. Read once per subject:
        cpu_contention and the wait graph (each chain's path, the coverage) ask, and each read was a tenth of a
        second on an hour-long recording (issue 28)."""
        key = ("holders", s.tid, s.start_ns, s.end_ns)
        if key not in self.memo:
            self.memo[key] = holders_of(self.conn, self.info, s.time, limit=20, scale=self._in_steps(s, RUNQ_WAIT))
        holders, basis = self.memo[key]
        return list(holders), basis

    def in_call_runq(self, s: Subject) -> dict[str, float]:
        """Return the subject's run-queue wait inside CUDA calls, within its steps, per holder class (ns): each
        class's holders' whole wait less its wait outside calls (:func:`in_call_runq_by_class`). Read once per
        subject: cpu_contention and cpu_placement ask."""
        key = ("in_call_runq", s.tid, s.start_ns, s.end_ns)
        if key not in self.memo:
            every, _ = holders_of(self.conn, self.info, s.time, limit=None, scale=self._in_steps(s, RUNQ_WAIT))
            self.memo[key] = in_call_runq_by_class(s.time, every)
        return dict(self.memo[key])

    def other_holders(self, threads: list[ThreadTime]) -> list[Holder]:
        """Return the other tenants' processes that held the CPU while any of ``threads`` waited, each thread
        within its own span, summed per holder: one query for all of them (a loader that respawns its workers
        has hundreds of threads, and a query each was seconds on a fork-heavy recording)."""
        acc: dict[int, list] = {}  # holder pid -> [comm, preemptions, runq ns]

        def add(hp: int, comm: str | None, n: float, runq: float) -> None:
            a = acc.setdefault(hp, [comm, 0.0, 0.0])
            a[0] = min(a[0] or "", comm or "") or None  # one name per pid (pid 0 is swapper/N by CPU)
            a[1] += n or 0
            a[2] += runq or 0

        if not self.info.has("preemptors", "tid"):  # an old recording: per thread, as holders_of reads it
            for t in threads:
                for h in holders_of(self.conn, self.info, t, limit=10**9)[0]:
                    if h.holder == "other":
                        add(h.pid, h.comm, h.preemptions, h.runq_ms * MS)
        elif threads:
            spans = {t.tid: (t.first_ns // S, max(t.end_ns - 1, t.first_ns) // S, t.pid) for t in threads}
            flag = "bool_or(is_tracer)" if self.info.has("preemptors", "is_tracer") else "NULL"
            for tid, hp, sec, comm, is_target, is_tracer, n, runq in self.conn.execute(
                f"SELECT tid, pid, sec, min(comm), bool_or(is_target), {flag}, sum(preemptions), sum(runq_ns) "
                "FROM preemptors SEMI JOIN (SELECT unnest($tids) AS t) ON tid = t GROUP BY tid, pid, sec",
                {"tids": list(spans)},
            ).fetchall():
                a, b, pid = spans[tid]
                if a <= sec <= b and holder_class(self.info, pid, hp, comm, is_target, is_tracer) == "other":
                    add(hp, comm, n, runq)
        out = [
            Holder(pid=hp, comm=comm or "?", holder="other", preemptions=round(n), runq_ms=round(runq / MS, 3))
            for hp, (comm, n, runq) in acc.items()
            if runq > 0 or n >= 0.5
        ]
        return sorted(out, key=lambda h: (-h.runq_ms, h.pid))

    def step_ends(self, tid: int) -> np.ndarray:
        """Return the end of each of thread ``tid``'s steps (:func:`tracer.analysis.steps.step_markers`, the one step
        definition), in time order. Read once per thread: process_churn and hang ask, and each read is a scan of the
        thread's waits for the GPU. Callers must not change the array."""
        key = ("step_ends", tid)
        if key not in self.memo:
            self.memo[key] = step_markers(self.conn, tid).ends
        return self.memo[key]

    def wakers(self, s: Subject, limit: int | None = None) -> list[Waker]:
        """Return who woke the subject, within its steps: every waker unless ``limit`` (detectors sum them; a
        loader that respawns its workers each epoch has hundreds, and a top 50 lost most of its waits). Read once
        per subject and limit: three detectors ask, and an hour of a loader's wakers is 16 K rows."""
        key = ("wakers", s.tid, s.start_ns, s.end_ns, limit)
        if key not in self.memo:
            self.memo[key] = wakers_of(self.conn, self.info, s.time, limit=limit, scale=self._in_steps(s, OFF_CPU_WAIT))
        return list(self.memo[key])

    def in_steps(self, s: Subject, part: str | tuple[str, ...] = "wall") -> Callable[[int], float]:
        """Return sec -> the share of that second inside the subject's steps (per-second rows are weighted by it).

        ``part``: the share of that part's time, for rows that belong to it (on-CPU samples: "cpu"; off-CPU
        stacks: "blocked"): an edge second's outside time leaves the parts unevenly (see :func:`clip`), so a
        second with start-up imports keeps less of its CPU samples than of its wall."""
        return self._in_steps(s, part)

    def _in_steps(self, s: Subject, part: str | tuple[str, ...] = "wall") -> Callable[[int], float]:
        """Return sec -> the share of that second's ``part`` time (the sum of several) that lies in the subject's
        steps: per-second rows (preemptors, wakers) are weighted by it, as the thread's own seconds are by
        :func:`clip`."""
        full = self.times.by_tid(s.tid)
        whole = full.by_sec if full else {}
        parts = (part,) if isinstance(part, str) else part

        memo: dict[int, float] = {}  # per-second rows come several to a second (a waker each)

        def k(sec: int) -> float:
            got = memo.get(sec)
            if got is not None:
                return got
            mine, all_ = s.time.by_sec.get(sec), whole.get(sec)
            have = sum(all_.get(p, 0) for p in parts) if mine and all_ else 0
            got = memo[sec] = min(sum(mine.get(p, 0) for p in parts) / have, 1.0) if have and mine else 0.0
            return got

        return k

    def threads_of(self, pid: int) -> list[ThreadTime]:
        """Return process ``pid``'s threads (detectors ask per worker, and a loader that respawns its workers has
        hundreds: indexed once, not a scan per call; a third of `tracer stats` on a fork-heavy recording)."""
        return self.times.of_pid(pid)

    # -- code sites
    def code_site(self, pid: int, ops: Iterable[str], tid: int | None = None) -> str | None:
        """Return 'file:line function' of the Python code behind the most call time of ``ops`` in pid (tid)."""
        sites = self.top_sites(pid, ops, tid, limit=1)
        return sites[0][0] if sites else None

    def top_sites(
        self, pid: int, ops: Iterable[str], tid: int | None = None, limit: int = 3
    ) -> list[tuple[str | None, int, int, int]]:
        """Return [(site, stored calls, total ns, bytes)] of ``ops`` in pid, most call time first."""
        rows = self.conn.execute(
            "SELECT stack_id, count(*), sum(dur_ns), coalesce(sum(bytes), 0) FROM cuda_calls WHERE pid = $pid "
            "AND list_contains($ops, op) AND stack_id IS NOT NULL AND ($tid IS NULL OR tid = $tid) "
            "GROUP BY stack_id ORDER BY 3 DESC, 1 LIMIT $limit",
            {"pid": pid, "ops": list(ops), "tid": tid, "limit": limit},
        ).fetchall()
        return [(self.frame_of(sid), int(n), int(ns or 0), int(b)) for sid, n, ns, b in rows]

    def frame_of(self, stack_id: int) -> str | None:
        """Return 'file:line function' of the stack's innermost Python frame in the user's own code
        (:func:`tracer.analysis.code_site.code_site`), once per stack."""
        if stack_id not in self._frames:
            self._frames[stack_id] = code_site(self.conn, stack_id) or ""
        return self._frames[stack_id] or None

    # -- building a chain
    def chain(
        self,
        s: Subject,
        *,
        category: str,
        severity: str,
        cost_ns: float,
        summary: str,
        evidence: Evidence,
        recommendations: list[str],
        culprit: Culprit | None = None,
        op: str = "",
        start_ns: int | None = None,
        end_ns: int | None = None,
        pids: Iterable[int] = (),
    ) -> CausalChain:
        """Return a chain about subject ``s`` that cost it ``cost_ns`` (its share is the ranking key)."""
        a = s.start_ns if start_ns is None else start_ns
        b = s.end_ns if end_ns is None else end_ns
        p50, p99 = self.op_latency(s.pid, op) if op else (0.0, 0.0)
        who = f"{culprit.pid}/{culprit.tid}/{culprit.comm}" if culprit else ""
        key = f"{category}|{s.pid}|{s.tid}|{op}|{who}|{a // S}|{b // S}"
        return CausalChain(
            id=f"{category}-{hashlib.sha1(key.encode()).hexdigest()[:10]}",
            severity=s.cap(severity),
            category=category,
            start_ns=int(a),
            end_ns=int(b),
            pids=sorted({s.pid, *pids}),
            tid=s.tid,
            thread_comm=s.time.comm,
            share=round(s.share(cost_ns), 4),
            impact_ms=round(cost_ns / MS, 1),
            basis=self.times.basis,
            culprit=culprit,
            op=op,
            op_p50_us=round(p50 / 1e3, 1),
            op_p99_us=round(p99 / 1e3, 1),
            summary=summary,
            evidence=evidence,
            recommendations=recommendations,
        )


# The parts of a thread's time that are not CUDA calls: an edge second's time outside the steps comes out of them
# first (see clip); their extras follow them
NON_CALL_PARTS = ("cpu", *RUNQ_PART_NAMES, "blocked")
# the thread's waits for a CPU and its blocked time, inside calls or not: what holders' and wakers' rows weigh
RUNQ_WAIT = (*RUNQ_PART_NAMES, "call_runq")
OFF_CPU_WAIT = ("blocked", "call_off_cpu")
_FOLLOWS = {"io": ("blocked",), "call_off_cpu": CALL_PART_NAMES, "call_runq": CALL_PART_NAMES}

# calls outside the steps: second -> part -> ns of the thread's calls in that second outside [start, end)
CallsOutside = dict[int, dict[str, int]]


def clip(t: ThreadTime, start_ns: int, end_ns: int, calls_outside: CallsOutside | None = None) -> ThreadTime:
    """Return ``t`` restricted to [start_ns, end_ns): whole seconds inside; an edge second loses its time outside.

    An edge second's time outside the steps is start-up or shutdown: imports, the tracer's launch and library
    holds, the first batch, teardown. It is not a slice of the second's mix: a second with 85 ms of imports and
    620 ms of a cudaMalloc loop had ~60% of its on-CPU time in those 85 ms. So the outside time leaves the call
    parts by the thread's calls there (``calls_outside``, from its stored calls), and the rest leaves the parts
    outside calls (CPU, run queue, blocked) in proportion to them; extras and counts follow their parts (a count,
    the wall). Where the calls' rows are missing (duty cycle) more comes out of the parts outside calls; what they
    cannot give comes out of the call parts in proportion."""
    span = t.by_sec.sec_range() if isinstance(t.by_sec, SecondRows) else None
    if span is not None and span[0] * S >= start_ns and (span[1] + 1) * S <= end_ns:
        # every second inside: the thread as loaded (its total is its rows' sum), read-only, not a copy row by
        # row (a loader that respawns its workers every 10 s has 1,441 of them in an hour's steps, issue 21)
        return replace(t, first_ns=max(t.first_ns, start_ns), end_ns=min(t.end_ns, end_ns), total=dict(t.total))
    out = ThreadTime(
        pid=t.pid,
        tid=t.tid,
        comm=t.comm,
        first_ns=max(t.first_ns, start_ns),
        end_ns=min(t.end_ns, end_ns),
        exited=t.exited,
        cuda_calls=t.cuda_calls,
        total=dict.fromkeys(FIELDS, 0),
    )
    for sec, k in window_shares(t, start_ns, end_ns).items():
        row = t.by_sec[sec]
        r = _without(row, row.get("wall", 0) * (1 - k), (calls_outside or {}).get(sec, {})) if k < 1 else dict(row)
        out.by_sec[sec] = r
        for f, v in r.items():
            out.total[f] = out.total.get(f, 0) + v
    return out


def _without(row: dict[str, int], outside: float, calls: dict[str, int]) -> dict[str, int]:
    """Return ``row`` less ``outside`` ns of its wall: the calls' ns per part first, then the parts outside calls
    in proportion, then (what is left) the call parts in proportion (see :func:`clip`)."""
    keep = {f: float(v) for f, v in row.items()}
    left = outside

    def take(parts: Iterable[str], amount: float) -> float:
        """Remove ``amount`` from ``parts`` in proportion to them (at most all of them); return what was taken."""
        parts = list(parts)
        have = sum(keep[p] for p in parts)
        if have <= 0 or amount <= 0:
            return 0.0
        got = min(amount, have)
        for p in parts:
            keep[p] -= keep[p] * got / have
        return got

    for part in CALL_PART_NAMES:
        left -= take([part], min(calls.get(part, 0), left))
    left -= take(NON_CALL_PARTS, left)
    take(CALL_PART_NAMES, left)
    wall = row.get("wall", 0)
    keep["wall"] = max(wall - outside, 0.0)
    for extra, parts in _FOLLOWS.items():
        before = sum(row.get(p, 0) for p in parts)
        if extra in keep:
            keep[extra] = row[extra] * (sum(keep[p] for p in parts) / before) if before else 0.0
    k = keep["wall"] / wall if wall else 0.0
    for f in ("reclaim", "faults", "page_alloc_bytes"):
        if f in keep:
            keep[f] = row[f] * k
    return {f: int(round(v)) for f, v in keep.items()}
