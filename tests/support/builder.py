"""Build small trace DBs by hand from :mod:`tracer.schema`: rows in, a recording with every aggregate out.

Analysis tests need DBs whose every number is known. :class:`TraceBuilder` collects rows the way the recorder
would write them (calls, off-CPU intervals with who held the CPU and who woke the thread, page faults per thread,
process events, host samples, on-CPU samples by stack) and derives every aggregate from them exactly, as the kernel
side would count it: ``op_stats`` with its log-linear histogram (:mod:`tracer.hist`), ``sched_stats``,
``preemptors`` per waiting thread, ``threads``, ``thread_breakdown`` (each thread's wall time per second split into
parts that add up) and ``thread_wakers``. A test can recompute any expected value from the builder itself.

Breakdown rules (those of the recorder): the time inside a CUDA call goes to the call's part (its catalog class;
a synchronous copy is ``sync``), a call nested in another (the driver call inside a runtime call) to the outer
one; outside calls, an off-CPU interval is ``blocked`` until the thread was woken and then waits in the run queue
(``runq_ns``, at its end) behind its holder: ``runq_self`` (own process), ``runq_tree`` (another traced process),
``runq_tracer`` (a process with role tracer) or ``runq_other``; the rest is ``cpu``. Off-CPU time inside a call
is ``call_off_cpu_ns`` / ``call_runq_ns`` (from the call rows), booked in the second the call started.

The scenarios built with it are in :mod:`tests.support.scenarios`; :mod:`tests.support.schema_v1` turns a
written DB into one shaped like a recording from before schema v2.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tracer import procfs
from tracer.analysis.taxonomy import PART_NAMES, part_name
from tracer.hist import bucket_of
from tracer.schema import APP_ID, SCHEMA_VERSION, TABLE_BY_NAME, TABLES

MS = 1_000_000
US = 1_000
S = 1_000_000_000
MAIN_PID = 1000
TRACER_PID = 900
HOG_PID = 4242
GIB = 1 << 30
MIB = 1 << 20


@dataclass
class TraceBuilder:
    duration_s: float = 60.0
    target: str = "python train.py"
    status: str = "complete"
    mem_bytes: int = 64 * GIB
    cpu_cores: int = 16
    # write threads / thread_breakdown / thread_wakers (False: a v2 DB whose recorder did no time accounting)
    accounting: bool = True
    session: dict[str, Any] = field(default_factory=dict)
    processes: list[dict[str, Any]] = field(default_factory=list)
    threads: list[dict[str, Any]] = field(default_factory=list)
    cuda_calls: list[dict[str, Any]] = field(default_factory=list)
    unstored: list[dict[str, Any]] = field(default_factory=list)
    sched: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    process_events: list[dict[str, Any]] = field(default_factory=list)
    host_samples: list[dict[str, Any]] = field(default_factory=list)
    stacks: list[dict[str, Any]] = field(default_factory=list)
    cpu_samples: list[dict[str, Any]] = field(default_factory=list)
    # placement and limits (issue 28): written only when given, as an older recording has none of them
    process_placement: list[dict[str, Any]] = field(default_factory=list)
    cgroup_cpu: list[dict[str, Any]] = field(default_factory=list)
    cpu_idle: list[dict[str, Any]] = field(default_factory=list)
    gc_collections: list[dict[str, Any]] = field(default_factory=list)
    sampled_fraction: float = 1.0
    _stack_ids: dict[tuple[tuple[Any, ...], ...], int] = field(default_factory=dict)

    # -- rows -------------------------------------------------------------------------------------------------
    def process(
        self,
        pid: int,
        comm: str,
        ppid: int = 1,
        first_ns: int = 0,
        exit_ns: int | None = None,
        exit_code: int | None = None,
        cmdline: str = "",
        role: str = "target",
    ) -> None:
        self.processes.append(
            dict(
                pid=pid,
                ppid=ppid,
                comm=comm,
                cmdline=cmdline or comm,
                first_ns=first_ns,
                exit_ns=exit_ns,
                exit_code=exit_code,
                role=role,
            )
        )

    def thread(self, pid: int, tid: int, comm: str, first_ns: int | None = None, end_ns: int | None = None) -> None:
        """Declare a thread (its name, and its span when not its process's)."""
        self.threads.append(dict(pid=pid, tid=tid, comm=comm, first_ns=first_ns, end_ns=end_ns))

    def call(
        self,
        ts_ns: int,
        dur_ns: int,
        op: str,
        pid: int = MAIN_PID,
        tid: int | None = None,
        layer: str | None = None,
        bytes: int | None = None,
        kind: str | None = None,
        stream: int | None = None,
        kernel: str | None = None,
        stack_id: int | None = None,
        off_cpu_ns: int = 0,
        runq_ns: int = 0,
        stored: bool = True,
    ) -> None:
        row = dict(
            ts_ns=int(ts_ns),
            dur_ns=int(dur_ns),
            pid=pid,
            tid=tid or pid,
            op=op,
            layer=layer or ("driver" if op.startswith("cu") and not op.startswith("cuda") else "runtime"),
            bytes=bytes,
            kind=kind,
            stream=stream,
            kernel=kernel,
            ret=0,
            stack_id=stack_id,
            off_cpu_ns=int(off_cpu_ns),
            runq_ns=int(runq_ns),
        )
        (self.cuda_calls if stored else self.unstored).append(row)

    def off_cpu(
        self,
        ts_ns: int,
        dur_ns: int,
        pid: int = MAIN_PID,
        tid: int | None = None,
        comm: str = "python3",
        reason: str = "sleep",
        runq_ns: int = 0,
        by_pid: int | None = None,
        by_comm: str | None = None,
        cpu: int = 0,
        waker_pid: int | None = None,
        waker_tid: int | None = None,
        waker_comm: str | None = None,
    ) -> None:
        """An off-CPU interval: blocked from ts (unless preempted), then ``runq_ns`` runnable at its end behind
        ``by_pid``; ``waker_*`` woke it (blocked intervals)."""
        self.sched.append(
            dict(
                ts_ns=int(ts_ns),
                dur_ns=int(dur_ns),
                pid=pid,
                tid=tid or pid,
                comm=comm,
                cpu=cpu,
                reason=reason,
                runq_ns=int(runq_ns),
                preempted_by_pid=by_pid,
                preempted_by_comm=by_comm,
                waker_pid=waker_pid,
                waker_tid=waker_tid if waker_tid is not None else waker_pid,
                waker_comm=waker_comm,
            )
        )

    def faults(
        self, ts_ns: int, tid: int, pid: int = MAIN_PID, faults: int = 0, page_alloc_bytes: int = 0, reclaim_ns: int = 0
    ) -> None:
        """Page faults, page allocation and direct reclaim of a thread, booked in the second of ``ts_ns``."""
        self.memory.append(
            dict(
                ts_ns=int(ts_ns), pid=pid, tid=tid, faults=faults, page_alloc_bytes=page_alloc_bytes, reclaim=reclaim_ns
            )
        )

    def event(
        self,
        ts_ns: int,
        kind: str,
        pid: int,
        comm: str,
        ppid: int | None = None,
        child: int | None = None,
        filename: str | None = None,
        exit_code: int | None = None,
    ) -> None:
        self.process_events.append(
            dict(
                ts_ns=int(ts_ns),
                kind=kind,
                pid=pid,
                ppid=ppid,
                child=child,
                comm=comm,
                filename=filename,
                exit_code=exit_code,
            )
        )

    def host(
        self,
        sec: int,
        load1: float = 2.0,
        cpu_busy_pct: float = 20.0,
        runnable: int = 2,
        mem_available_bytes: int = 48 * GIB,
        swap_used_bytes: int = 0,
        page_alloc_bytes: int = 50 << 20,
        target_page_alloc_bytes: int = 20 << 20,
        page_faults: int = 100,
        ctx_switches: int = 5000,
        tracer_cpu_ms: float = 12.5,
    ) -> None:
        self.host_samples.append(
            dict(
                ts_ns=sec * S,
                load1=load1,
                cpu_busy_pct=cpu_busy_pct,
                runnable=runnable,
                mem_available_bytes=mem_available_bytes,
                swap_used_bytes=swap_used_bytes,
                page_alloc_bytes=page_alloc_bytes,
                target_page_alloc_bytes=target_page_alloc_bytes,
                page_faults=page_faults,
                ctx_switches=ctx_switches,
                tracer_cpu_ms=tracer_cpu_ms,
            )
        )

    def placement(
        self,
        pid: int,
        cpus: str,
        *,
        ts_ns: int = 0,
        cgroup: str = "/",
        cpuset: str | None = None,
        limit_cgroup: str | None = None,
        quota_us: int | None = None,
        period_us: int | None = None,
        exec_from: str | None = None,
        env: str | None = None,
    ) -> None:
        """A process_placement row: ``pid`` may run on ``cpus`` (a CPU list), its cgroup and quota."""
        n = len(procfs.parse_cpu_list(cpus))
        self.process_placement.append(
            dict(
                ts_ns=ts_ns,
                pid=pid,
                cpus_allowed=cpus,
                cpus=n,
                cgroup=cgroup,
                cpuset_cpus=cpuset,
                limit_cgroup=limit_cgroup,
                quota_us=quota_us,
                period_us=period_us,
                exec_from=exec_from,
                env=env,
            )
        )

    def idle_cpus(self, idle_share: dict[int, float], seconds: int | None = None) -> None:
        """cpu_idle rows every second (ending half-way into the next, as the recorder's tick): each CPU's idle
        share of it."""
        for sec in range(seconds if seconds is not None else int(self.duration_s)):
            for cpu, share in idle_share.items():
                idle = round(share * S)
                self.cpu_idle.append(dict(ts_ns=sec * S + S // 2, cpu=cpu, idle_ns=idle, busy_ns=S - idle))

    def throttling(self, cgroup: str, quota_us: int, period_us: int, throttled_per_s_ns: int) -> None:
        """cgroup_cpu rows every second: ``cgroup`` throttled ``throttled_per_s_ns`` (summed over CPUs) a second."""
        for sec in range(int(self.duration_s) + 1):
            self.cgroup_cpu.append(
                dict(
                    ts_ns=sec * S + S // 2,
                    cgroup=cgroup,
                    quota_us=quota_us,
                    period_us=period_us,
                    nr_periods=sec * S // (period_us * US),
                    nr_throttled=sec * S // (period_us * US) // 2,
                    throttled_ns=sec * throttled_per_s_ns,
                )
            )

    def stack(self, frames: Sequence[tuple[str, str, str, str | None, int | None]]) -> int:
        """Intern a stack given outermost first as (kind, module, function, file, line); return its stack_id."""
        key = tuple(tuple(f) for f in frames)
        if key not in self._stack_ids:
            sid = len(self._stack_ids) + 1
            self._stack_ids[key] = sid
            for depth, (kind, module, function, file, line) in enumerate(frames):
                self.stacks.append(
                    dict(
                        stack_id=sid,
                        depth=depth,
                        kind=kind,
                        module=module,
                        function=function,
                        file=file,
                        line=line,
                        line_approx=False,
                    )
                )
        return self._stack_ids[key]

    def samples(
        self,
        sec: int,
        stack_id: int | None,
        samples: int,
        pid: int = MAIN_PID,
        tid: int | None = None,
        in_call: bool = False,
        kernel: bool = False,
        hz: int = 99,
    ) -> None:
        """On-CPU samples of a thread in one second and stack (a ``cpu_samples`` row; cpu_ns as the recorder
        counts it at ``hz`` samples per second of CPU)."""
        self.cpu_samples.append(
            dict(
                sec=sec,
                pid=pid,
                tid=tid or pid,
                stack_id=stack_id,
                in_call=in_call,
                kernel=kernel,
                samples=samples,
                cpu_ns=samples * S // hz,
            )
        )

    def gc(
        self,
        ts_ns: int,
        dur_ns: int,
        generation: int | None,
        stack_id: int | None = None,
        pid: int = MAIN_PID,
        tid: int | None = None,
        collected: int | None = 0,
        off_cpu_ns: int = 0,
        runq_ns: int = 0,
    ) -> None:
        """One collection of CPython's garbage collector (a ``gc_collections`` row)."""
        self.gc_collections.append(
            dict(
                ts_ns=ts_ns,
                dur_ns=dur_ns,
                off_cpu_ns=off_cpu_ns,
                runq_ns=runq_ns,
                pid=pid,
                tid=tid or pid,
                generation=generation,
                collected=collected,
                stack_id=stack_id,
            )
        )

    # -- derived aggregates -----------------------------------------------------------------------------------
    @property
    def end_ns(self) -> int:
        return int(self.duration_s * S)

    def tracer_pids(self) -> set[int]:
        return {p["pid"] for p in self.processes if p.get("role") == "tracer"}

    def holder_class(self, pid: int, holder: int | None) -> str:
        """Return self | tree | tracer | other for a task ``holder`` that held the CPU a thread of ``pid`` wanted."""
        if holder in self.tracer_pids():
            return "tracer"
        if holder == pid:
            return "self"
        if holder is not None and holder in {p["pid"] for p in self.processes}:
            return "tree"
        return "other"

    def op_stats_rows(self) -> list[dict[str, Any]]:
        groups: dict[tuple[int, str, str], list[dict[str, Any]]] = defaultdict(list)
        for r in self.cuda_calls + self.unstored:
            groups[(r["pid"], r["op"], r["layer"])].append(r)
        out = []
        for (pid, op, layer), rows in sorted(groups.items()):
            durs = sorted(r["dur_ns"] for r in rows)
            buckets: dict[tuple[int, int], int] = defaultdict(int)
            for d in durs:
                buckets[bucket_of(d)] += 1
            hist = [dict(lo_ns=lo, hi_ns=hi, count=c) for (lo, hi), c in sorted(buckets.items())]

            def q(p: float, durs: list[int] = durs) -> int:
                return durs[min(len(durs) - 1, int(p * len(durs)))]

            out.append(
                dict(
                    pid=pid,
                    op=op,
                    layer=layer,
                    calls=len(durs),
                    total_ns=sum(durs),
                    min_ns=durs[0],
                    max_ns=durs[-1],
                    p50_ns=q(0.5),
                    p95_ns=q(0.95),
                    p99_ns=q(0.99),
                    bytes=sum(r["bytes"] or 0 for r in rows),
                    sampled_fraction=self.sampled_fraction,
                    error_pct=0.0,
                    hist=hist,
                )
            )
        return out

    def sched_stats_rows(self) -> list[dict[str, Any]]:
        agg: dict[tuple[int, int, int], dict[str, int]] = {}
        for r in self.sched:
            k = (r["ts_ns"] // S, r["pid"], r["tid"])
            a = agg.setdefault(k, dict(switches=0, preemptions=0, off_cpu_ns=0, runq_ns=0, max_off_cpu_ns=0))
            a["switches"] += 1
            a["preemptions"] += r["reason"] == "preempted"
            a["off_cpu_ns"] += r["dur_ns"]
            a["runq_ns"] += r["runq_ns"]
            a["max_off_cpu_ns"] = max(a["max_off_cpu_ns"], r["dur_ns"])
        return [dict(sec=k[0], pid=k[1], tid=k[2], **v) for k, v in sorted(agg.items())]

    def preemptor_rows(self) -> list[dict[str, Any]]:
        pids = {p["pid"] for p in self.processes}
        tracer = self.tracer_pids()
        agg: dict[tuple[int, int, int, str], list[int]] = {}
        for r in self.sched:
            if r["preempted_by_pid"] is None:
                continue
            k = (r["ts_ns"] // S, r["tid"], r["preempted_by_pid"], r["preempted_by_comm"])
            a = agg.setdefault(k, [0, 0])
            a[0] += 1
            a[1] += r["runq_ns"]
        return [
            dict(
                sec=k[0],
                tid=k[1],
                pid=k[2],
                comm=k[3],
                is_target=k[2] in pids and k[2] not in tracer,
                is_tracer=k[2] in tracer,
                preemptions=v[0],
                runq_ns=v[1],
            )
            for k, v in sorted(agg.items())
        ]

    def _outer_calls(self) -> dict[int, list[tuple[int, int, str, dict[str, Any]]]]:
        """Per tid, the calls not nested in another call: (start, end, part, row), in time order."""
        by_tid: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in self.cuda_calls + self.unstored:
            by_tid[r["tid"]].append(r)
        out: dict[int, list[tuple[int, int, str, dict[str, Any]]]] = {}
        for tid, rows in by_tid.items():
            rows.sort(key=lambda r: (r["ts_ns"], -r["dur_ns"]))
            kept: list[tuple[int, int, str, dict[str, Any]]] = []
            for r in rows:
                a, b = r["ts_ns"], r["ts_ns"] + r["dur_ns"]
                if kept and a < kept[-1][1]:
                    outer = kept[-1][3]
                    if b > kept[-1][1] or not (r["layer"] == "driver" and outer["layer"] == "runtime"):
                        raise ValueError(f"inconsistent scenario: {r['op']} at {a} overlaps {outer['op']} on tid {tid}")
                    continue  # the driver call inside a runtime call: the outer call's time
                kept.append((a, b, part_name(r["op"]), r))
            out[tid] = kept
        return out

    def thread_spans(self) -> dict[int, dict[str, Any]]:
        """Return tid -> (pid, comm, first_ns, end_ns, exited) for every thread the accounting saw."""
        procs = {p["pid"]: p for p in self.processes}
        declared = {t["tid"]: t for t in self.threads}
        seen: dict[int, tuple[int, str | None]] = {}
        for r in self.cuda_calls + self.unstored:
            seen.setdefault(r["tid"], (r["pid"], None))
        for r in self.sched:
            if r["tid"] not in seen or seen[r["tid"]][1] is None:
                seen[r["tid"]] = (r["pid"], r["comm"])
        for r in self.memory:
            seen.setdefault(r["tid"], (r["pid"], None))
        for t in self.threads:
            seen.setdefault(t["tid"], (t["pid"], t["comm"]))
        out = {}
        for tid, (pid, comm) in sorted(seen.items()):
            p = procs.get(pid, {})
            d = declared.get(tid, {})
            first = d.get("first_ns")
            end = d.get("end_ns")
            first = p.get("first_ns") or 0 if first is None else first
            exit_ns = p.get("exit_ns")
            end = (exit_ns if exit_ns is not None else self.end_ns) if end is None else end
            out[tid] = dict(
                pid=pid,
                comm=d.get("comm") or comm or p.get("comm") or "?",
                first_ns=int(first),
                end_ns=int(end),
                exited=end < self.end_ns,
            )
        return out

    def thread_rows(self) -> list[dict[str, Any]]:
        calls: dict[int, int] = defaultdict(int)
        for r in self.cuda_calls + self.unstored:
            calls[r["tid"]] += 1
        return [dict(tid=tid, cuda_calls=calls.get(tid, 0), **s) for tid, s in self.thread_spans().items()]

    def breakdown_rows(self) -> list[dict[str, Any]]:
        """Return thread_breakdown: per (second, thread) the parts of its wall time, exactly (module docstring)."""
        spans = self.thread_spans()
        outer = self._outer_calls()
        rows: dict[tuple[int, int], dict[str, Any]] = {}

        def row(sec: int, tid: int) -> dict[str, Any]:
            r = rows.get((sec, tid))
            if r is None:
                r = rows[(sec, tid)] = {f"{p}_ns": 0 for p in PART_NAMES}
                r.update(
                    sec=sec,
                    pid=spans[tid]["pid"],
                    tid=tid,
                    wall_ns=0,
                    io_ns=0,
                    call_off_cpu_ns=0,
                    call_runq_ns=0,
                    faults=0,
                    page_alloc_bytes=0,
                    reclaim_ns=0,
                    launch_sampled=1.0,
                )
            return r

        def spread(tid: int, col: str, a: int, b: int) -> None:
            while a < b:
                sec = a // S
                e = min(b, (sec + 1) * S)
                row(sec, tid)[col] += e - a
                a = e

        for tid, sp in spans.items():
            spread(tid, "wall_ns", sp["first_ns"], sp["end_ns"])
            calls = outer.get(tid, [])
            starts = [c[0] for c in calls]
            for a, b, part, r in calls:
                a, b = max(a, sp["first_ns"]), min(b, sp["end_ns"])
                spread(tid, f"{part}_ns", a, b)
                rr = row(r["ts_ns"] // S, tid)
                rr["call_off_cpu_ns"] += r["off_cpu_ns"]
                rr["call_runq_ns"] += r["runq_ns"]

            for s in (x for x in self.sched if x["tid"] == tid):
                a, end = s["ts_ns"], s["ts_ns"] + s["dur_ns"]
                pieces = _outside(calls, starts, a, end)
                if pieces and pieces != [(a, end)]:
                    raise ValueError(f"inconsistent scenario: off-CPU interval at {a} on tid {tid} crosses a call")
                woke = end - s["runq_ns"]
                holder = self.holder_class(sp["pid"], s["preempted_by_pid"])
                for lo, hi in _outside(calls, starts, max(a, sp["first_ns"]), min(woke, sp["end_ns"])):
                    spread(tid, "blocked_ns", lo, hi)
                    if s["reason"] == "io":
                        spread(tid, "io_ns", lo, hi)
                for lo, hi in _outside(calls, starts, max(woke, sp["first_ns"]), min(end, sp["end_ns"])):
                    spread(tid, f"runq_{holder}_ns", lo, hi)
        for m in self.memory:
            r = row(m["ts_ns"] // S, m["tid"])
            r["faults"] += m["faults"]
            r["page_alloc_bytes"] += m["page_alloc_bytes"]
            r["reclaim_ns"] += m["reclaim"]
        for r in rows.values():
            taken = sum(r[f"{p}_ns"] for p in PART_NAMES if p != "cpu")
            r["cpu_ns"] = r["wall_ns"] - taken
            if r["cpu_ns"] < 0:
                raise ValueError(
                    f"inconsistent scenario: tid {r['tid']} second {r['sec']} has {taken} ns of parts "
                    f"in {r['wall_ns']} ns (overlapping off-CPU intervals?)"
                )
        return [rows[k] for k in sorted(rows)]

    def waker_rows(self) -> list[dict[str, Any]]:
        outer = self._outer_calls()
        agg: dict[tuple, list[int]] = {}
        for s in self.sched:
            if s.get("waker_pid") is None:
                continue
            end = s["ts_ns"] + s["dur_ns"]
            in_call = self.in_call(outer, s["tid"], s["ts_ns"])
            k = (end // S, s["pid"], s["tid"], in_call, s["waker_pid"], s["waker_tid"], s["waker_comm"])
            a = agg.setdefault(k, [0, 0])
            a[0] += 1
            a[1] += s["dur_ns"] - s["runq_ns"]
        return [
            dict(
                sec=k[0],
                pid=k[1],
                tid=k[2],
                in_call=k[3],
                waker_pid=k[4],
                waker_tid=k[5],
                waker_comm=k[6],
                wakeups=v[0],
                blocked_ns=v[1],
            )
            for k, v in sorted(agg.items(), key=lambda kv: tuple(str(x) for x in kv[0]))
        ]

    @staticmethod
    def in_call(outer: dict[int, list[tuple[int, int, str, dict[str, Any]]]], tid: int, ts: int) -> bool:
        calls = outer.get(tid, [])
        i = bisect.bisect_right([c[0] for c in calls], ts) - 1
        return i >= 0 and calls[i][0] <= ts < calls[i][1]

    def sched_rows(self) -> list[dict[str, Any]]:
        outer = self._outer_calls()
        return [dict(r, in_call=self.in_call(outer, r["tid"], r["ts_ns"])) for r in self.sched]

    # -- output -----------------------------------------------------------------------------------------------
    def write(self, path: str | Path) -> Path:
        path = Path(path)
        if path.exists():
            path.unlink()
        n_traced = len(self.cuda_calls) + len(self.unstored)
        session = dict(
            session_id=1,
            started_at=datetime(2026, 5, 4, 12, 0, 0, tzinfo=timezone.utc),
            start_mono_ns=123 * S,
            duration_s=self.duration_s,
            status=self.status,
            host="gpu-box-1",
            kernel="6.8.0-45-generic",
            cpu_model="Intel Xeon Platinum 8358 @ 2.60GHz",
            cpu_cores=self.cpu_cores,
            mem_bytes=self.mem_bytes,
            gpus="NVIDIA A10",
            driver="570.148",
            python_version="3.11.9",
            tracer_version="0.1.0",
            target=self.target,
            libraries="/usr/lib/libcudart.so.12",
            events_traced=n_traced,
            events_stored=len(self.cuda_calls),
            events_lost=0,
            overhead_pct=0.8,
            notes="",
            # recorder_pid stays NULL: set with a pid, readers check whether that recorder still runs
            # (tracer.analysis.db); the tracer's process is known by its role
            recorder_cpu_s=round(sum(h["tracer_cpu_ms"] or 0 for h in self.host_samples) / 1000 + 0.25, 3),
            recorder_peak_rss_bytes=180 * MIB,
            holds=0,
            held_ms=0.0,
        )
        session.update(self.session)
        tables: dict[str, list[dict[str, Any]]] = {
            "session": [session],
            "processes": self.processes,
            "cuda_calls": self.cuda_calls,
            "op_stats": self.op_stats_rows(),
            "sched": self.sched_rows(),
            "sched_stats": self.sched_stats_rows(),
            "preemptors": self.preemptor_rows(),
            "process_events": self.process_events,
            "host_samples": self.host_samples,
            "stacks": self.stacks,
            "cpu_samples": self.cpu_samples,
            "gc_collections": self.gc_collections,
        }
        for name in ("process_placement", "cgroup_cpu", "cpu_idle"):
            if getattr(self, name):
                tables[name] = getattr(self, name)
        if self.accounting:
            tables.update(
                threads=self.thread_rows(), thread_breakdown=self.breakdown_rows(), thread_wakers=self.waker_rows()
            )
        con = duckdb.connect(str(path))
        placed = self.process_placement or self.cgroup_cpu or self.cpu_idle
        try:
            for t in TABLES:
                if placed or t.name not in ("process_placement", "cgroup_cpu", "cpu_idle"):
                    con.execute(t.ddl())
            con.execute("INSERT INTO meta VALUES ('app', ?), ('schema_version', ?)", [APP_ID, str(SCHEMA_VERSION)])
            for name, rows in tables.items():
                insert_rows(con, name, rows)
        finally:
            con.close()
        return path


def _outside(calls: list[tuple[int, int, str, Any]], starts: list[int], a: int, b: int) -> list[tuple[int, int]]:
    """Return the pieces of [a, b) not inside one of ``calls`` (sorted, non-overlapping; ``starts`` their starts)."""
    pieces, i = [], max(bisect.bisect_right(starts, a) - 1, 0)
    while a < b and i < len(calls):
        ca, cb = calls[i][0], calls[i][1]
        if cb <= a:
            i += 1
            continue
        if ca >= b:
            break
        if ca > a:
            pieces.append((a, ca))
        a = max(a, cb)
        i += 1
    if a < b:
        pieces.append((a, b))
    return pieces


def insert_rows(con: duckdb.DuckDBPyConnection, table: str, rows: list[dict[str, Any]]) -> None:
    """Append dict rows to ``table`` through one Arrow batch (executemany is ~1000x slower)."""
    if not rows:
        return
    cols = TABLE_BY_NAME[table].column_names
    batch = pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in rows])
    con.register("_batch", batch)
    con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _batch")
    con.unregister("_batch")


def parts_total(rows: list[dict[str, Any]], tid: int, *names: str) -> int:
    """Return the sum of ``names`` (part names, e.g. 'sync') over breakdown ``rows`` of ``tid``, in ns."""
    return sum(r[f"{n}_ns"] for r in rows if r["tid"] == tid for n in names)
