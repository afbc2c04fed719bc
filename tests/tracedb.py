"""Build small trace DBs by hand from :mod:`tracer.schema`, one per scenario the analyses must recognise.

Analysis tests need DBs whose every number is known. :class:`TraceBuilder` collects rows the way the recorder
would write them (calls, off-CPU intervals with who held the CPU and who woke the thread, page faults per thread,
process events, host samples) and derives every aggregate from them exactly, as the kernel side would count it:
``op_stats`` with its log-linear histogram (:mod:`tracer.hist`), ``sched_stats``, ``preemptors`` per waiting
thread, ``threads``, ``thread_breakdown`` (each thread's wall time per second split into parts that add up) and
``thread_wakers``. A test can recompute any expected value from the builder itself.

Breakdown rules (those of the recorder): the time inside a CUDA call goes to the call's part (its catalog class;
a synchronous copy is ``sync``), a call nested in another (the driver call inside a runtime call) to the outer
one; outside calls, an off-CPU interval is ``blocked`` until the thread was woken and then waits in the run queue
(``runq_ns``, at its end) behind its holder: ``runq_self`` (own process), ``runq_tree`` (another traced process),
``runq_tracer`` (a process with role tracer) or ``runq_other``; the rest is ``cpu``. Off-CPU time inside a call
is ``call_off_cpu_ns`` / ``call_runq_ns`` (from the call rows), booked in the second the call started.

Scenarios (``SCENARIOS``): ``healthy``, ``cpu_contention``, ``process_churn``, ``memory_pressure``,
``allocation_churn``, ``sync_stall``, ``fault_storm``, ``dataloader_starvation``, ``launch_bound``,
``gpu_bound``. ``build(name, path)`` writes one; ``downgrade_to_v1(path)`` turns a written DB into one shaped like
a recording from before schema v2; ``generate_large(path, n_calls)`` writes a synthetic DB with millions of
``cuda_calls`` rows for benchmarks (``bench/`` imports it from here).
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tracer.analysis.taxonomy import CALL_PART_NAMES, PART_NAMES, part_name
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
            # (tracer.db); the tracer's process is known by its role
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
        }
        if self.accounting:
            tables.update(
                threads=self.thread_rows(), thread_breakdown=self.breakdown_rows(), thread_wakers=self.waker_rows()
            )
        con = duckdb.connect(str(path))
        try:
            for t in TABLES:
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


# The tables and columns schema v2 added: a recording made before it has none of them.
V2_TABLES = ("threads", "thread_breakdown", "thread_wakers")
V2_COLUMNS = (
    ("processes", "role"),
    ("sched", "waker_pid"),
    ("sched", "waker_tid"),
    ("sched", "waker_comm"),
    ("sched", "in_call"),
    ("preemptors", "tid"),
    ("preemptors", "is_tracer"),
    ("cuda_calls", "kernel_note"),
    ("op_stats", "error_pct"),
    ("stacks", "line_approx"),
    ("host_samples", "tracer_cpu_ms"),
    *(
        ("session", c)
        for c in (
            "recorder_pid",
            "recorder_start_ticks",
            "boot_id",
            "recorder_cpu_s",
            "recorder_peak_rss_bytes",
            "startup_s",
            "compile_s",
            "attach_s",
            "first_event_s",
            "flush_s",
            "holds",
            "held_ms",
            "command_fate",
            "flushed_ns",
        )
    ),
)


def downgrade_to_v1(path: str | Path) -> Path:
    """Drop what schema v2 added from the DB at ``path``: it then reads like a recording from before v2."""
    con = duckdb.connect(str(path))
    try:
        for t in V2_TABLES:
            con.execute(f"DROP TABLE IF EXISTS {t}")
        for t, c in V2_COLUMNS:
            con.execute(f"ALTER TABLE {t} DROP COLUMN {c}")
        con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    finally:
        con.close()
    return Path(path)


# -- scenarios ------------------------------------------------------------------------------------------------
TRAIN_STACK = [
    ("python", "train.py", "<module>", "train.py", 140),
    ("python", "train.py", "main", "train.py", 131),
    ("python", "train.py", "train_step", "train.py", 88),
    ("native", "libtorch_cuda.so", "at::native::_local_scalar_dense_cuda", None, None),
    ("cuda", "libcudart.so.12", "cudaStreamSynchronize", None, None),
]
LAUNCH_STACK = [
    ("python", "train.py", "<module>", "train.py", 140),
    ("python", "train.py", "main", "train.py", 131),
    ("python", "train.py", "train_step", "train.py", 84),
    ("native", "libtorch_cuda.so", "at::native::gpu_kernel_impl", None, None),
    ("cuda", "libcudart.so.12", "cudaLaunchKernel", None, None),
]
ITEM_STACK = TRAIN_STACK[:2] + [
    ("python", "train.py", "train_step", "train.py", 92),
    ("native", "libtorch_cuda.so", "at::native::_local_scalar_dense_cuda", None, None),
    ("cuda", "libcudart.so.12", "cudaMemcpy", None, None),
]
ALLOC_STACK = [
    ("python", "alloc_stress.py", "<module>", "alloc_stress.py", 120),
    ("python", "alloc_stress.py", "main", "alloc_stress.py", 114),
    ("python", "alloc_stress.py", "allocate_batch", "alloc_stress.py", 74),
    ("native", "libc10_cuda.so", "c10::cuda::CUDACachingAllocator::malloc", None, None),
    ("cuda", "libcudart.so.12", "cudaMalloc", None, None),
]
FREE_STACK = ALLOC_STACK[:3] + [
    ("native", "libc10_cuda.so", "c10::cuda::CUDACachingAllocator::emptyCache", None, None),
    ("cuda", "libcudart.so.12", "cudaFree", None, None),
]

# The shared training loop: 100 ms steps. Per step, at its start: 5 launches (each with the driver launch inside
# it; 2 of 5 stored, as a sampled hot op), an async HtoD copy, then PYTHON_NS of host work (dispatching the rest
# of the step while the GPU runs), then a stream sync that waits until the GPU is done at GPU_NS, then a short
# wait for the next batch (woken by a DataLoader worker) and the next step.
STEP_NS = 100 * MS
PYTHON_NS = 20 * MS
GPU_NS = 98 * MS
BATCH_WAIT_NS = 500 * US


@dataclass
class Step:
    """What a scenario may change in one step of the loop."""

    i: int
    t0: int
    python_ns: int = PYTHON_NS
    gpu_end_ns: int = GPU_NS  # offset from t0 at which the GPU finishes the step's work
    batch_wait_ns: int = BATCH_WAIT_NS
    skip: bool = False  # no step at all (the thread is doing something else then)


def _base(
    b: TraceBuilder,
    rng: random.Random,
    *,
    workers: int = 2,
    shape: Callable[[Step], None] | None = None,
    python_gap: Callable[[Step, int, int], None] | None = None,
    sync: Callable[[Step, int, int], tuple[int, int, int, int | None]] | None = None,
) -> None:
    """The training loop every scenario shares (see STEP_NS), on a quiet host.

    Hooks: ``shape(step)`` edits a step; ``python_gap(step, a, b)`` adds off-CPU intervals inside the host-work
    gap [a, b) (and must keep the gap's end); ``sync(step, ts, wait_ns) -> (dur, off_cpu, runq, holder)`` shapes
    the sync that starts at ts and would wait ``wait_ns`` for the GPU.
    """
    b.process(MAIN_PID, "python3", ppid=1, cmdline="python train.py")
    for w in range(workers):
        pid = MAIN_PID + 1 + w
        b.process(pid, "pt_data_worker", ppid=MAIN_PID, first_ns=500 * MS)
        b.event(500 * MS, "fork", MAIN_PID, "python3", ppid=1, child=pid)
        b.event(501 * MS, "rename", pid, "pt_data_worker")
    launch = b.stack(LAUNCH_STACK)
    sync_stack = b.stack(TRAIN_STACK)
    for i in range(int(b.duration_s * S // STEP_NS)):
        st = Step(i=i, t0=i * STEP_NS)
        if shape:
            shape(st)
        if st.skip:
            continue
        t = st.t0 + 200 * US
        for k in range(5):
            d = rng.randint(6 * US, 12 * US)
            b.call(t, d, "cudaLaunchKernel", stack_id=launch, kernel=f"elementwise_kernel_{k}", stream=7, stored=k < 2)
            b.call(t + 1 * US, d - 2 * US, "cuLaunchKernel", stream=7, stored=k < 2)
            t += 40 * US
        b.call(t, rng.randint(18 * US, 25 * US), "cudaMemcpyAsync", bytes=4 << 20, kind="HtoD", stream=7)
        t += 100 * US
        if python_gap:
            python_gap(st, t, t + st.python_ns)
        t += st.python_ns
        wait = max(st.t0 + st.gpu_end_ns - t, 20 * US)
        dur, off, runq, holder = sync(st, t, wait) if sync else (wait, max(wait - 60 * US, 0), 0, None)
        b.call(t, dur, "cudaStreamSynchronize", stack_id=sync_stack, stream=7, off_cpu_ns=off, runq_ns=runq)
        if off:
            b.off_cpu(
                t + 30 * US,
                off,
                reason="sleep",
                runq_ns=runq,
                by_pid=holder,
                by_comm=_comm_of(b, holder),
            )
        t += dur
        if workers and st.batch_wait_ns:
            # the next batch is not quite ready: the main thread blocks until a worker hands it over
            w = MAIN_PID + 1 + st.i % workers
            b.off_cpu(t + 200 * US, st.batch_wait_ns, reason="sleep", waker_pid=w, waker_comm="pt_data_worker")
    for w in range(workers):
        pid = MAIN_PID + 1 + w
        for i in range(int(b.duration_s * S // STEP_NS)):
            # the workers' own blocking reads
            b.off_cpu(i * STEP_NS + 20 * MS, 5 * MS, pid=pid, comm="pt_data_worker", reason="io")
    for sec in range(int(b.duration_s)):
        b.host(sec, load1=2.0 + rng.random(), cpu_busy_pct=25 + 10 * rng.random())


def add_tracer(b: TraceBuilder) -> None:
    """Add the recorder's process (role tracer) to the scenario, as the recorder writes it."""
    b.process(TRACER_PID, "tracer", ppid=1, cmdline="tracer record -- python train.py", role="tracer")


def _comm_of(b: TraceBuilder, pid: int | None) -> str | None:
    if pid is None:
        return None
    if pid == HOG_PID:
        return "stress-ng"
    return next((p["comm"] for p in b.processes if p["pid"] == pid), "?")


def healthy(b: TraceBuilder) -> None:
    """GPU-bound and well fed: the thread waits for the GPU ~77 % of each step, its host work overlaps it."""
    _base(b, random.Random(1))


def gpu_bound(b: TraceBuilder) -> None:
    """As healthy with half the host work: ~88 % of each step waiting for the GPU."""

    def shape(st: Step) -> None:
        st.python_ns = 8 * MS

    _base(b, random.Random(11), shape=shape)


def cpu_contention(b: TraceBuilder) -> None:
    """A foreign CPU hog (stress-ng, pid 4242) takes the training thread's CPU in t = 20..40 s: 60 ms of each
    step between calls (its Python work waits in the run queue) and 8-12 ms at the end of each sync."""
    rng = random.Random(2)
    hot = range(20 * S, 40 * S)

    def gap(st: Step, a: int, end: int) -> None:
        if st.t0 in hot:
            b.off_cpu(
                a + 5 * MS, 60 * MS, reason="preempted", runq_ns=60 * MS, by_pid=HOG_PID, by_comm="stress-ng", cpu=3
            )

    def shape(st: Step) -> None:
        if st.t0 in hot:
            st.python_ns = PYTHON_NS + 60 * MS  # the same work, stretched by the wait

    def sync(st: Step, ts: int, wait: int) -> tuple[int, int, int, int | None]:
        if st.t0 in hot:  # the GPU is done early; the thread then waits for the CPU the hog holds
            runq = rng.randint(8 * MS, 12 * MS)
            return wait, wait - 60 * US, runq, HOG_PID
        return wait, max(wait - 60 * US, 0), 0, None

    _base(b, rng, shape=shape, python_gap=gap, sync=sync)
    b.target = "pid 1000"
    # a little contention from the training job's own worker, for contrast (outside calls, in the Python gap)
    for sec in range(0, 60, 5):
        b.off_cpu(
            sec * S + 5 * MS,
            300 * US,
            reason="preempted",
            runq_ns=300 * US,
            by_pid=MAIN_PID + 1,
            by_comm="pt_data_worker",
            cpu=1,
        )
    for h in b.host_samples:
        if h["ts_ns"] in hot:
            h.update(load1=24.0, cpu_busy_pct=100.0, runnable=22)


def sync_stall(b: TraceBuilder) -> None:
    """train.py:92 reads the loss every step (``loss.item()``: a 4-byte DtoH cudaMemcpy): the thread does its
    45 ms of host work first while the GPU idles, then launches and waits for the GPU in the copy."""
    rng = random.Random(6)
    b.process(MAIN_PID, "python3", ppid=1, cmdline="python train.py")
    launch = b.stack(LAUNCH_STACK)
    item = b.stack(ITEM_STACK)
    for i in range(int(b.duration_s * S // STEP_NS)):
        t = i * STEP_NS + 45 * MS  # host work first: the GPU has nothing queued meanwhile
        for k in range(5):
            d = rng.randint(6 * US, 12 * US)
            b.call(t, d, "cudaLaunchKernel", stack_id=launch, stream=7, stored=k < 2)
            t += 40 * US
        wait = 50 * MS + rng.randint(-2 * MS, 2 * MS)
        b.call(t, wait, "cudaMemcpy", bytes=4, kind="DtoH", stack_id=item, off_cpu_ns=wait - 50 * US)
        b.call(t + 2 * US, wait - 4 * US, "cuMemcpyDtoH", bytes=4, kind="DtoH")
        b.off_cpu(t + 20 * US, wait - 50 * US, reason="sleep")
    for sec in range(int(b.duration_s)):
        b.host(sec)


def allocation_churn(b: TraceBuilder) -> None:
    """alloc_stress.py:74 allocate_batch: every 10 ms step a 64 MiB cudaMalloc (the driver's cuMemAlloc inside)
    and a cudaFree through empty_cache, ~28 % of the thread's time; every 50th allocation from line 46 (ctypes);
    every 10th step a stream-ordered cudaMallocAsync/cudaFreeAsync pair."""
    rng = random.Random(5)
    b.target = "python alloc_stress.py"
    b.process(MAIN_PID, "python3", ppid=1, cmdline="python alloc_stress.py")
    add_tracer(b)
    alloc = b.stack(ALLOC_STACK)
    free = b.stack(FREE_STACK)
    launch = b.stack(LAUNCH_STACK)
    direct = b.stack(
        ALLOC_STACK[:2]
        + [
            ("python", "alloc_stress.py", "direct_alloc", "alloc_stress.py", 46),
            ("native", "libffi.so.8", "ffi_call", None, None),
            ("cuda", "libcudart.so.12", "cudaMalloc", None, None),
        ]
    )
    # the loop's first launch comes before its first allocation and a sync after its last free: the thread's
    # steps hold every allocation call whole
    b.call(5 * S - 1 * MS, 10 * US, "cudaLaunchKernel", stack_id=launch, stream=7)
    b.call(55 * S, 50 * US, "cudaStreamSynchronize", stream=7)
    for i in range(5000):
        t = 5 * S + i * 10 * MS + 1 * MS
        d = rng.randint(1500 * US, 2500 * US)
        sid = direct if i % 50 == 0 else alloc
        b.call(t, d, "cudaMalloc", bytes=64 << 20, stack_id=sid)
        b.call(t + 5 * US, d - 50 * US, "cuMemAlloc", bytes=64 << 20)
        t += d + 100 * US
        b.call(t, rng.randint(6 * US, 12 * US), "cudaLaunchKernel", stack_id=launch, stream=7)
        t += 2 * MS
        b.call(t, rng.randint(500 * US, 1000 * US), "cudaFree", stack_id=free)
        if i % 10 == 0:
            b.call(t + 1500 * US, 200 * US, "cudaMallocAsync", bytes=1 << 20, stream=7, stack_id=alloc)
            b.call(t + 2000 * US, 100 * US, "cudaFreeAsync", stream=7)
    for sec in range(int(b.duration_s)):
        b.host(sec)


def process_churn(b: TraceBuilder) -> None:
    """DataLoader workers are forked for every 10 s epoch and exit at its end; each respawn blocks the main
    thread 3.5 s (forking, importing, then waiting for the new workers' first batch)."""
    rng = random.Random(3)
    epochs = [e * 10 * S for e in range(6)]
    stall = 3500 * MS

    def shape(st: Step) -> None:
        st.batch_wait_ns = 0
        st.skip = any(e <= st.t0 < e + stall for e in epochs[1:])

    _base(b, rng, workers=0, shape=shape)
    pid = MAIN_PID + 100
    for e_i, e in enumerate(epochs):
        first = pid + 1
        for w in range(4):
            pid += 1
            fork = e + (w + 1) * MS
            end = e + 10 * S - 50 * MS if e_i < len(epochs) - 1 else None
            b.process(pid, "pt_data_worker", ppid=MAIN_PID, first_ns=fork, exit_ns=end, exit_code=0 if end else None)
            b.event(fork, "fork", MAIN_PID, "python3", ppid=1, child=pid)
            b.event(fork + 300 * US, "rename", pid, "pt_data_worker")
            if end:
                b.event(end + w * MS, "exit", pid, "pt_data_worker", exit_code=0)
            b.off_cpu(fork + 1 * MS, 120 * MS + w * 10 * MS, pid=pid, comm="pt_data_worker", reason="io")
        if e_i:
            b.off_cpu(e + 10 * MS, stall - 20 * MS, reason="sleep", waker_pid=first, waker_comm="pt_data_worker")


def memory_pressure(b: TraceBuilder) -> None:
    """MemAvailable falls to 1.5 GiB and swap grows in t = 30..50 s: each step's host work stalls 70 ms in
    page-fault I/O (uninterruptible), outside any call."""
    hot = range(30 * S, 50 * S)

    def shape(st: Step) -> None:
        if st.t0 in hot:
            st.python_ns = PYTHON_NS + 70 * MS

    def gap(st: Step, a: int, end: int) -> None:
        if st.t0 in hot:
            b.off_cpu(a + 2 * MS, 70 * MS, reason="io")

    _base(b, random.Random(4), shape=shape, python_gap=gap)
    for h in b.host_samples:
        if h["ts_ns"] in hot:
            h.update(
                page_alloc_bytes=2 * GIB,
                target_page_alloc_bytes=GIB,
                mem_available_bytes=1536 << 20,
                swap_used_bytes=int(3 * GIB + (h["ts_ns"] - 30 * S) // S * 64 * MIB),
                page_faults=250_000,
            )


STORM_TID = MAIN_PID + 50


def fault_storm(b: TraceBuilder) -> None:
    """A Python thread of the training process (tid 1050, 'cache_fill') faults in 512 MiB/s of fresh pages in
    t = 10..50 s; each step the training thread blocks 30 ms on the GIL it holds (woken by it) and waits 15 ms for
    the CPU it holds."""
    hot = range(10 * S, 50 * S)

    def shape(st: Step) -> None:
        if st.t0 in hot:
            st.python_ns = PYTHON_NS + 45 * MS

    def gap(st: Step, a: int, end: int) -> None:
        if st.t0 in hot:
            b.off_cpu(
                a + 1 * MS, 30 * MS, reason="sleep", waker_pid=MAIN_PID, waker_tid=STORM_TID, waker_comm="cache_fill"
            )
            b.off_cpu(a + 40 * MS, 15 * MS, reason="preempted", runq_ns=15 * MS, by_pid=MAIN_PID, by_comm="cache_fill")

    _base(b, random.Random(7), shape=shape, python_gap=gap)
    b.thread(MAIN_PID, STORM_TID, "cache_fill", first_ns=5 * S, end_ns=55 * S)
    for sec in range(5, 55):
        if sec * S in hot:
            for q in range(4):  # four bursts a second
                b.faults(
                    sec * S + q * 250 * MS, STORM_TID, faults=32_768, page_alloc_bytes=128 * MIB, reclaim_ns=2 * MS
                )
            b.off_cpu(sec * S + 900 * MS, 20 * MS, tid=STORM_TID, comm="cache_fill", reason="io")
        else:
            b.faults(sec * S, STORM_TID, faults=100, page_alloc_bytes=400 << 10)
            b.off_cpu(sec * S + 10 * MS, 900 * MS, tid=STORM_TID, comm="cache_fill", reason="sleep")
    b.faults(1 * S, MAIN_PID, faults=2_000, page_alloc_bytes=8 * MIB)
    for h in b.host_samples:
        if h["ts_ns"] in hot:
            h.update(page_alloc_bytes=600 * MIB, target_page_alloc_bytes=530 * MIB, page_faults=140_000)


def dataloader_starvation(b: TraceBuilder) -> None:
    """Two DataLoader workers, on CPU nearly all the time, cannot keep up: the main thread blocks 40 ms a step
    until one of them hands over the batch."""

    def shape(st: Step) -> None:
        st.batch_wait_ns = 40 * MS
        st.gpu_end_ns = GPU_NS - 40 * MS  # the step's GPU work is the same; the wait is added after it

    _base(b, random.Random(8), shape=shape)
    b.sched = [r for r in b.sched if r["pid"] == MAIN_PID]  # workers: busy, barely ever off CPU
    for w in range(2):
        for sec in range(1, int(b.duration_s)):
            b.off_cpu(sec * S + 300 * MS, 2 * MS, pid=MAIN_PID + 1 + w, comm="pt_data_worker", reason="io")


def launch_bound(b: TraceBuilder) -> None:
    """A loop of tiny kernels: 50 steps/s of 20 launches with 0.9 ms of Python each, one sync per step that finds
    the GPU idle (15 µs): the host is the limit."""
    b.duration_s = 10.0
    rng = random.Random(9)
    b.process(MAIN_PID, "python3", ppid=1, cmdline="python train.py")
    launch = b.stack(LAUNCH_STACK)
    sync = b.stack(TRAIN_STACK)
    for i in range(int(b.duration_s * 50)):
        t = i * 20 * MS + 100 * US
        for k in range(20):
            d = rng.randint(6 * US, 12 * US)
            b.call(t, d, "cudaLaunchKernel", stack_id=launch, stream=7, stored=k % 4 == 0)
            t += 950 * US
        b.call(t, 15 * US, "cudaStreamSynchronize", stack_id=sync, stream=7)
    for sec in range(int(b.duration_s)):
        b.host(sec)


SCENARIOS: dict[str, Callable[[TraceBuilder], None]] = {
    "healthy": healthy,
    "cpu_contention": cpu_contention,
    "process_churn": process_churn,
    "memory_pressure": memory_pressure,
    "allocation_churn": allocation_churn,
    "sync_stall": sync_stall,
    "fault_storm": fault_storm,
    "dataloader_starvation": dataloader_starvation,
    "launch_bound": launch_bound,
    "gpu_bound": gpu_bound,
}


def builder(name: str) -> TraceBuilder:
    b = TraceBuilder()
    SCENARIOS[name](b)
    return b


def build(name: str, path: str | Path) -> TraceBuilder:
    """Write scenario ``name`` to ``path``; return the builder (its rows are the expected values)."""
    b = builder(name)
    b.write(path)
    return b


STEP_LOOP_SYNC_OPS = {"memcpy": "cudaMemcpy", "stream": "cudaStreamSynchronize", "none": None}


def step_loop(
    b: TraceBuilder,
    seed: int,
    *,
    host_ms: float = 5.0,
    host_where: str = "before",
    kernel_ms: float = 5.0,
    launches: int = 10,
    sync: str = "memcpy",
    sync_every: int = 1,
    jitter: float = 0.1,
) -> None:
    """fixtures/workloads/step_loop.py as a scenario, with run-to-run noise: per step ``host_ms`` of Python work
    before or after ``launches`` launches that queue ``kernel_ms`` of GPU work, then every ``sync_every`` steps a
    call that waits for the GPU (``memcpy``: ``loss.item()``'s 4-byte DtoH cudaMemcpy with the driver copy inside;
    ``stream``: cudaStreamSynchronize; ``none``). Host and GPU times vary per step by +-``jitter`` (uniform, from
    ``seed``), so two seeds are two runs of one workload. The simulated GPU runs the queued work in order; keep the
    GPU work per step at or below the host's when nothing syncs (the queue has no bound)."""
    rng = random.Random(seed)
    op = STEP_LOOP_SYNC_OPS[sync]
    cmd = (
        f"python step_loop.py --host-ms {host_ms:g} --host-where {host_where} --launches {launches} "
        f"--kernel-us {kernel_ms * 1000:g} --sync {sync} --sync-every {sync_every}"
    )
    b.target = cmd
    b.process(MAIN_PID, "python3", ppid=1, cmdline=cmd)
    launch = b.stack(LAUNCH_STACK)
    wait_stack = b.stack(ITEM_STACK if sync == "memcpy" else TRAIN_STACK)
    end = b.end_ns - 50 * MS
    t, gpu_free, i = 200 * MS, 0, 0
    while t < end:
        host = int(host_ms * MS * rng.uniform(1 - jitter, 1 + jitter))
        if host_where == "before":
            t += host
        for k in range(launches):
            d = rng.randint(6 * US, 12 * US)
            b.call(t, d, "cudaLaunchKernel", stack_id=launch, stream=7, kernel=f"step_kernel_{k % 3}")
            gpu_free = max(gpu_free, t + d) + int(kernel_ms * MS / launches * rng.uniform(1 - jitter, 1 + jitter))
            t += d + 20 * US
        if host_where == "after":
            t += host
        i += 1
        if op is not None and i % sync_every == 0:
            wait = max(gpu_free - t, 0) + 30 * US
            b.call(
                t,
                wait,
                op,
                bytes=4 if sync == "memcpy" else None,
                kind="DtoH" if sync == "memcpy" else None,
                stream=None if sync == "memcpy" else 7,
                stack_id=wait_stack,
                off_cpu_ns=wait - 25 * US if wait > 100 * US else 0,
            )
            if sync == "memcpy":
                b.call(t + 2 * US, wait - 4 * US, "cuMemcpyDtoH", bytes=4, kind="DtoH")
            if wait > 100 * US:  # the thread sleeps inside the copy until the GPU is done
                b.off_cpu(t + 20 * US, wait - 25 * US, reason="sleep")
            t += wait
        t += 10 * US
    for sec in range(int(b.duration_s)):
        b.host(sec)


def generate_large(path: str | Path, n_calls: int = 1_000_000, duration_s: int = 600, accounting: bool = True) -> Path:
    """Write a synthetic DB with ``n_calls`` cuda_calls rows (and matching op_stats) in pure SQL, for
    benchmarks; return its path.

    Shape: one main process, four ops, a CPU hog preempting a slice of the syncs, a stack per op. With
    ``accounting`` (what today's recorder writes) ``threads`` and ``thread_breakdown`` hold the training thread's
    time per second, taken from the breakdown's estimate of these calls; without, the DB is one from a recorder
    that did no time accounting, and the analyses estimate it on every query.
    """
    path = Path(path)
    b = builder("cpu_contention")
    b.duration_s = duration_s
    b.cuda_calls = b.cuda_calls[:0]
    b.unstored = []
    # the calls are generated below, in SQL: no time accounting to match them (the analyses estimate it)
    b.accounting = False
    b.write(path)
    con = duckdb.connect(str(path))
    try:
        step = duration_s * S // n_calls
        con.execute(f"""
            INSERT INTO cuda_calls BY NAME
            SELECT i * {step} AS ts_ns,
                   CASE WHEN i % 4 = 3 AND i % 400 = 3 THEN 20000000 + (i * 7919) % 15000000
                        WHEN i % 4 = 3 THEN 900000 + (i * 7919) % 300000
                        ELSE 5000 + (i * 7919) % 10000 END AS dur_ns,
                   {MAIN_PID} AS pid, {MAIN_PID} AS tid,
                   ['cudaLaunchKernel', 'cuLaunchKernel', 'cudaMemcpyAsync', 'cudaStreamSynchronize'][i % 4 + 1] AS op,
                   CASE WHEN i % 4 = 1 THEN 'driver' ELSE 'runtime' END AS layer,
                   CASE WHEN i % 4 = 2 THEN 4194304 END AS bytes, 7 AS stream, 0 AS ret,
                   CASE WHEN i % 4 = 3 THEN 2 WHEN i % 4 = 0 THEN 1 END AS stack_id,
                   CASE WHEN i % 4 = 3 AND i % 400 = 3 THEN 19000000 ELSE 0 END AS off_cpu_ns,
                   CASE WHEN i % 4 = 3 AND i % 400 = 3 THEN 18000000 ELSE 0 END AS runq_ns
            FROM range({n_calls}) t(i)""")
        con.execute("DELETE FROM op_stats")
        # histogram as the probes build it: log-linear buckets, 16 per power of two (tracer.hist.bucket_of)
        con.execute("""
            INSERT INTO op_stats BY NAME
            WITH b AS (
              SELECT pid, op, layer, dur_ns, floor(log2(dur_ns))::INT AS e FROM cuda_calls),
            bb AS (
              SELECT pid, op, layer, dur_ns,
                     (1::BIGINT << e) + ((dur_ns - (1::BIGINT << e)) // ((1::BIGINT << e) // 16))
                       * ((1::BIGINT << e) // 16) AS lo, (1::BIGINT << e) // 16 AS w FROM b),
            h AS (SELECT pid, op, layer, lo, lo + w AS hi, count(*) AS n FROM bb GROUP BY ALL)
            SELECT s.pid, s.op, s.layer, s.calls, s.total_ns, s.min_ns, s.max_ns, s.p50_ns, s.p95_ns, s.p99_ns,
                   s.bytes, 1.0 AS sampled_fraction, h.hist
            FROM (SELECT pid, op, layer, count(*) AS calls, sum(dur_ns) AS total_ns, min(dur_ns) AS min_ns,
                         max(dur_ns) AS max_ns, quantile_disc(dur_ns, 0.5) AS p50_ns,
                         quantile_disc(dur_ns, 0.95) AS p95_ns, quantile_disc(dur_ns, 0.99) AS p99_ns,
                         coalesce(sum(bytes), 0) AS bytes FROM cuda_calls GROUP BY ALL) s
            JOIN (SELECT pid, op, layer,
                         list({'lo_ns': lo, 'hi_ns': hi, 'count': n} ORDER BY lo) AS hist
                  FROM h GROUP BY ALL) h USING (pid, op, layer)""")
        con.execute(
            "UPDATE session SET events_traced = ?, events_stored = ?, duration_s = ?",
            [n_calls, n_calls, float(duration_s)],
        )
        if accounting:
            _write_accounting(con)
    finally:
        con.close()
    return path


def _write_accounting(con: duckdb.DuckDBPyConnection) -> None:
    """Fill ``threads`` and ``thread_breakdown`` with the per-second time the analyses estimate from the calls,
    as the recorder's exact accounting would have written it."""
    from tracer.analysis.breakdown import COUNTS, FIELDS, load_thread_times

    times = load_thread_times(con)
    assert times.basis == "estimated", times.basis
    calls = dict(con.execute("SELECT tid, count(*) FROM cuda_calls GROUP BY tid").fetchall())
    insert_rows(
        con,
        "threads",
        [
            dict(
                pid=t.pid,
                tid=t.tid,
                comm=t.comm,
                first_ns=t.first_ns,
                end_ns=t.end_ns,
                exited=t.exited,
                cuda_calls=calls.get(t.tid, 0),
            )  # fmt: skip
            for t in times.threads
        ],
    )
    cols = {f: f if f in COUNTS else f"{f}_ns" for f in FIELDS}
    insert_rows(
        con,
        "thread_breakdown",
        [
            {"sec": sec, "pid": t.pid, "tid": t.tid, **{cols[f]: v for f, v in row.items()}}
            for t in times.threads
            for sec, row in sorted(t.by_sec.items())
        ],
    )


def parts_total(rows: list[dict[str, Any]], tid: int, *names: str) -> int:
    """Return the sum of ``names`` (part names, e.g. 'sync') over breakdown ``rows`` of ``tid``, in ns."""
    return sum(r[f"{n}_ns"] for r in rows if r["tid"] == tid for n in names)


CALL_PARTS = CALL_PART_NAMES

if __name__ == "__main__":  # python tests/tracedb.py OUTDIR: write every scenario
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for name in SCENARIOS:
        build(name, out / f"{name}.duckdb")
        print(out / f"{name}.duckdb")
