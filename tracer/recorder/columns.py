"""Column builders: decoded ring-buffer records and drained BPF aggregates -> the columns of each table.

Pure functions of numpy arrays and plain records, so every table's rows can be tested without root; the recorder
(recorder/session.py) only reads the BPF side and hands the results to recorder/store.py. Times are converted to ns
since the session start (``ts - start``), the store's contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from probes.catalog import CATALOG, MEMCPY_KIND_NAMES, NO_ARG, OP_COUNT_MAX, OpClass
from tracer.hist import percentile, slot_bounds
from tracer.recorder import events, rankenv
from tracer.recorder.proctree import ProcInfo, ThreadInfo
from tracer.vocabulary import TRACER_ROLE, UNSEEN_WAKER, WAKER_KINDS, waker_name

Columns = dict[str, Any]

# Per-op lookup tables, so cuda_calls columns need no per-row Python work.
_OP_DICT = pa.array([s.op for s in CATALOG])
_LAYER_DICT = pa.array(["runtime", "driver"])
_LAYER_OF = np.array([int(s.layer) for s in CATALOG], dtype=np.int32)
_HAS_BYTES = np.array([s.bytes_arg != NO_ARG for s in CATALOG])
_HAS_STREAM = np.array([s.stream_arg != NO_ARG for s in CATALOG])
IS_LAUNCH = np.array([s.op_class == OpClass.LAUNCH for s in CATALOG] + [False] * (OP_COUNT_MAX - len(CATALOG)))
_KIND_NAMES = [MEMCPY_KIND_NAMES[k] for k in sorted(MEMCPY_KIND_NAMES)]
_KIND_DICT = pa.array(_KIND_NAMES)
_REASONS = np.array(events.SCHED_REASONS, dtype=object)


def rel(ts: np.ndarray, start: int) -> np.ndarray:
    """ns since the session start, from bpf_ktime_get_ns() values."""
    return ts.astype(np.int64) - start


def _dict_col(idx: np.ndarray, dictionary: pa.Array, mask: np.ndarray | None = None) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(idx.astype(np.int32), mask=mask), dictionary)


def _strings(v: pa.Array | Sequence[str | None]) -> pa.Array:
    return v if isinstance(v, pa.Array) else pa.array(list(v), type=pa.string())


def call_columns(
    ev: np.ndarray,
    start: int,
    kernels: pa.Array | Sequence[str | None],
    kernel_notes: pa.Array | Sequence[str | None],
    stack_ids: Sequence[int | None],
) -> Columns:
    """cuda_calls columns of a batch of call events (events.CALL_DTYPE), with the launches' kernel names (and why
    a name is missing) and the calls' stack ids resolved by the caller, one per event. Dictionary-encoded string
    columns go to DuckDB as they are: it stores them as VARCHAR without Arrow materialising every string."""
    ops = ev["op"].astype(np.int32)
    kinds = ev["kind"]
    return {
        "ts_ns": rel(ev["ts_ns"], start),
        "dur_ns": ev["dur_ns"].astype(np.int64),
        "pid": ev["pid"].astype(np.int32),
        "tid": ev["tid"].astype(np.int32),
        "op": _dict_col(ops, _OP_DICT),
        "layer": _dict_col(_LAYER_OF[ops], _LAYER_DICT),
        "bytes": pa.array(ev["bytes"].astype(np.int64), mask=~_HAS_BYTES[ops]),
        "kind": _dict_col(np.minimum(kinds, len(_KIND_NAMES) - 1), _KIND_DICT, mask=kinds >= len(_KIND_NAMES)),
        "stream": pa.array(ev["stream"], mask=~_HAS_STREAM[ops]),
        "kernel": _strings(kernels),
        "ret": ev["ret"],
        "stack_id": pa.array(stack_ids, type=pa.int64()),
        "off_cpu_ns": ev["off_cpu_ns"].astype(np.int64),
        "runq_ns": ev["runq_ns"].astype(np.int64),
        "kernel_note": _strings(kernel_notes),
    }


def _pid_col(a: np.ndarray) -> pa.Array:
    """A pid column where 0 means "none" (NULL)."""
    return pa.array(a.astype(np.int32), mask=a == 0)


def _str_or_null(a: np.ndarray) -> list[str | None]:
    return [c or None for c in events.cstr(a)]


def sched_columns(ev: np.ndarray, start: int) -> Columns:
    """sched columns of a batch of off-CPU intervals (events.SCHED_DTYPE)."""
    return {
        "ts_ns": rel(ev["ts_ns"], start),
        "dur_ns": ev["dur_ns"].astype(np.int64),
        "pid": ev["pid"].astype(np.int32),
        "tid": ev["tid"].astype(np.int32),
        "comm": events.cstr(ev["comm"]),
        "cpu": ev["cpu"].astype(np.int32),
        "reason": _REASONS[np.minimum(ev["reason"], len(_REASONS) - 1)].tolist(),
        "runq_ns": ev["runq_ns"].astype(np.int64),
        "preempted_by_pid": _pid_col(ev["by_pid"]),
        "preempted_by_comm": _str_or_null(ev["by_comm"]),
        # no waker seen: NULL; an interrupt handler: pid 0 (its name says which kind), tid NULL
        "waker_pid": pa.array(ev["waker_pid"].astype(np.int32), mask=ev["waker_comm"] == b""),
        "waker_tid": _pid_col(ev["waker_tid"]),
        # a blocked interval whose wakeup the probes did not see: named as thread_wakers names it
        "waker_comm": [
            c or (UNSEEN_WAKER if r else None)
            for c, r in zip(events.cstr(ev["waker_comm"]), ev["reason"].tolist(), strict=True)
        ],
        "in_call": ev["in_call"].astype(bool),
    }


def gc_columns(ev: np.ndarray, start: int, stack_ids: list[int | None]) -> Columns:
    """gc_collections columns of a batch of collections (events.GC_DTYPE), with their stacks' ids."""
    return {
        "ts_ns": rel(ev["ts_ns"], start),
        "dur_ns": ev["dur_ns"].astype(np.int64),
        "off_cpu_ns": np.minimum(ev["off_cpu_ns"], ev["dur_ns"]).astype(np.int64),
        "runq_ns": np.minimum(ev["runq_ns"], ev["dur_ns"]).astype(np.int64),
        "pid": ev["pid"].astype(np.int32),
        "tid": ev["tid"].astype(np.int32),
        "generation": pa.array(ev["generation"].astype(np.int32), mask=ev["generation"] < 0),
        "collected": pa.array(ev["collected"].astype(np.int64), mask=ev["collected"] < 0),
        "stack_id": pa.array(stack_ids, type=pa.int64()),
    }


def comm_columns(ev: np.ndarray, start: int) -> Columns:
    """nccl_comms columns of a batch of communicator set-ups (events.COMM_DTYPE)."""
    return {
        "ts_ns": rel(ev["ts_ns"], start),
        "dur_ns": ev["dur_ns"].astype(np.int64),
        "pid": ev["pid"].astype(np.int32),
        "tid": ev["tid"].astype(np.int32),
        "comm": ev["comm"].astype(np.uint64),
        "id_hash": ev["id_hash"].astype(np.uint64),
        "nranks": ev["nranks"].astype(np.int32),
        "rank": ev["rank"].astype(np.int32),
        "ret": ev["ret"].astype(np.int32),
    }


def coll_columns(keys: np.ndarray, vals: np.ndarray, start: int) -> Columns:
    """nccl_progress columns from the dumped ``coll_counts`` map (events.COLL_KEY_DTYPE -> COLL_COUNT_DTYPE)."""
    names = np.array([CATALOG[i].op if i < len(CATALOG) else f"op{i}" for i in range(OP_COUNT_MAX)], dtype=object)
    return {
        "pid": keys["pid"].astype(np.int32),
        "op": names[keys["op"].astype(np.int64)].tolist() if len(keys) else [],
        "comm": keys["comm"].astype(np.uint64),
        "calls": vals["calls"].astype(np.int64),
        "first_ns": rel(vals["first_ns"], start),
        "last_ns": rel(vals["last_ns"], start),
    }


def proc_event_columns(ev: np.ndarray, start: int) -> Columns:
    """process_events columns of a batch of lifecycle events (events.PROC_DTYPE); thread ends excluded (they go
    to the threads table)."""
    ev = ev[ev["kind"] != events.C.PROC_THREAD_END]
    kinds = ev["kind"].tolist()
    fork = ev["kind"] == events.C.PROC_FORK
    exits = (ev["kind"] == events.C.PROC_EXIT) & (ev["exit_code"] >= 0)
    return {
        "ts_ns": rel(ev["ts_ns"], start),
        "kind": [events.PROC_KINDS[k] for k in kinds],
        "pid": ev["pid"].astype(np.int32),
        "ppid": pa.array(ev["ppid"].astype(np.int32), mask=~fork),
        "child": pa.array(ev["child"].astype(np.int32), mask=~fork),
        "comm": events.cstr(ev["comm"]),
        "filename": _str_or_null(ev["filename"]),
        "exit_code": pa.array(ev["exit_code"].astype(np.int32), mask=~exits),
    }


@dataclass(frozen=True)
class Aggregates:
    """One drain of a per-second BPF aggregate: keys and values as structured arrays (tracer/recorder/bpfmaps.py)."""

    keys: np.ndarray
    vals: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    def where(self, mask: np.ndarray) -> Aggregates:
        return Aggregates(self.keys[mask], self.vals[mask])


def breakdown_columns(tb: Aggregates, launch_sampled: Callable[[int], float]) -> Columns:
    """thread_breakdown columns of drained (tid, sec) rows (events.TB_KEY_DTYPE / TB_VAL_DTYPE).

    ``launch_sampled(sec)`` is the share of that second the launch probes were live (recorder/budget.py). Launches
    made while they were off were seen as CPU time: launch_ns is scaled up by that share and the excess moved out
    of cpu_ns (never below 0), so the parts still add up to wall_ns."""
    v = tb.vals["v"].astype(np.int64)
    cols: Columns = {name: v[:, idx].copy() for name, idx in events.TB_COLUMNS.items()}
    secs = tb.keys["sec"].astype(np.int64)
    frac = np.array([launch_sampled(int(s)) for s in secs.tolist()], dtype=np.float64) if len(secs) else np.ones(0)
    seen = cols["launch_ns"]
    est = np.where(frac > 0, np.round(seen / np.maximum(frac, 1e-9)), seen).astype(np.int64)
    moved = np.minimum(est - seen, cols["cpu_ns"])
    cols["launch_ns"] = seen + moved
    cols["cpu_ns"] = cols["cpu_ns"] - moved
    wall = np.zeros(len(tb), dtype=np.int64)
    for part in events.TB_PARTS:
        wall += cols[part]
    return {
        "sec": secs,
        "pid": tb.vals["pid"].astype(np.int32),
        "tid": tb.keys["tid"].astype(np.int32),
        "wall_ns": wall,
        **cols,
        "launch_sampled": frac,
    }


def sched_stats_columns(tb: Aggregates) -> Columns:
    """sched_stats columns (switches, off-CPU and run-queue totals) from the same drained (tid, sec) rows."""
    v = tb.vals["v"].astype(np.int64)
    C = events.C
    runq = v[:, C.TB_CALL_RUNQ] + v[:, C.TB_RUNQ_SELF] + v[:, C.TB_RUNQ_TREE]
    runq += v[:, C.TB_RUNQ_OTHER] + v[:, C.TB_RUNQ_TRACER]
    off = runq - v[:, C.TB_CALL_RUNQ] + v[:, C.TB_BLOCKED] + v[:, C.TB_CALL_OFF]
    return {
        "sec": tb.keys["sec"].astype(np.int64),
        "pid": tb.vals["pid"].astype(np.int32),
        "tid": tb.keys["tid"].astype(np.int32),
        "switches": v[:, C.TB_SWITCHES],
        "preemptions": v[:, C.TB_PREEMPTIONS],
        "off_cpu_ns": off,
        "runq_ns": runq,
        "max_off_cpu_ns": v[:, C.TB_MAX_OFF],
    }


def waker_columns(w: Aggregates) -> Columns:
    """thread_wakers columns of drained (tid, sec, waker) rows."""
    return {
        "sec": w.keys["sec"].astype(np.int64),
        "pid": w.vals["pid"].astype(np.int32),
        "tid": w.keys["tid"].astype(np.int32),
        "in_call": w.keys["in_call"].astype(bool),
        "waker_pid": w.vals["waker_pid"].astype(np.int32),
        "waker_tid": w.keys["waker_tid"].astype(np.int32),
        "waker_comm": _waker_names(w.keys["waker_irq"], w.vals["waker_pid"], w.vals["waker_comm"]),
        "wakeups": w.vals["wakeups"].astype(np.int64),
        "blocked_ns": w.vals["blocked_ns"].astype(np.int64),
    }


def _waker_names(irq: np.ndarray, pid: np.ndarray, comm: np.ndarray) -> list[str]:
    """A waker's name in the one vocabulary the readers use (tracer/vocabulary.py): an interrupt handler
    (waker_irq, IRQ_* of sched.bpf.c) by its kind, anything else as :func:`waker_name` shows it, so the table
    holds the name every reader prints (a task with no name read is "?", not "")."""
    return [
        WAKER_KINDS.get(k, c) if k else waker_name(p, c)
        for k, p, c in zip(irq.tolist(), pid.tolist(), events.cstr(comm), strict=True)
    ]


def preemptor_columns(p: Aggregates) -> Columns:
    """preemptors columns of drained (holder, waiting thread, sec) rows."""
    return {
        "sec": p.keys["sec"].astype(np.int64),
        "tid": p.keys["tid"].astype(np.int32),
        "pid": p.keys["pid"].astype(np.int32),
        "comm": events.cstr(p.keys["comm"]),
        "is_target": p.vals["is_target"].astype(bool),
        "is_tracer": p.vals["is_tracer"].astype(bool),
        "preemptions": p.vals["preemptions"].astype(np.int64),
        "runq_ns": p.vals["runq_ns"].astype(np.int64),
    }


@dataclass(frozen=True)
class LaunchScale:
    """How a process's launch counts are scaled: observed calls x 1/fraction, with an error bound in percent."""

    fraction: float = 1.0
    error_pct: float = 0.0


@dataclass
class OpSummary:
    op: str
    layer: str
    calls: int
    p50_ns: int
    p99_ns: int
    max_ns: int

    @property
    def tail_ratio(self) -> float:
        return self.p99_ns / self.p50_ns if self.p50_ns else 0.0


def op_stats_columns(
    totals: Aggregates, hist: Aggregates, scales: dict[int, LaunchScale]
) -> tuple[Columns, list[OpSummary]]:
    """op_stats columns from the exact in-kernel totals and histograms, launches scaled per process; and the
    per-op summary (all processes) the recorder prints."""
    buckets: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for pid, op, slot, count in zip(
        hist.keys["pid"].tolist(), hist.keys["op"].tolist(), hist.keys["slot"].tolist(), hist.vals.tolist(), strict=True
    ):
        lo, hi = slot_bounds(slot)
        buckets.setdefault((pid, op), []).append((lo, hi, int(count)))
    names = (
        "pid",
        "op",
        "layer",
        "calls",
        "total_ns",
        "min_ns",
        "max_ns",
        "p50_ns",
        "p95_ns",
        "p99_ns",
        "bytes",
        "sampled_fraction",
        "error_pct",
        "hist",
    )
    rows: Columns = {k: [] for k in names}
    per_op: dict[int, list[tuple[int, int, int]]] = {}
    per_op_calls: dict[int, int] = {}
    per_op_max: dict[int, int] = {}
    t = totals.vals
    for i, (pid, op) in enumerate(zip(totals.keys["pid"].tolist(), totals.keys["op"].tolist(), strict=True)):
        if op >= len(CATALOG):
            continue
        spec = CATALOG[op]
        h = sorted(buckets.get((pid, op), []))
        scale = scales.get(pid, LaunchScale()) if spec.duty_cycled else LaunchScale()
        frac = scale.fraction
        calls = round(int(t["calls"][i]) / frac)
        rows["pid"].append(pid)
        rows["op"].append(spec.op)
        rows["layer"].append(spec.layer_name)
        rows["calls"].append(calls)
        rows["total_ns"].append(round(int(t["total_ns"][i]) / frac))
        rows["min_ns"].append(int(t["min_ns"][i]))
        rows["max_ns"].append(int(t["max_ns"][i]))
        for q, name in ((0.5, "p50_ns"), (0.95, "p95_ns"), (0.99, "p99_ns")):
            rows[name].append(percentile(h, q))
        rows["bytes"].append(round(int(t["bytes"][i]) / frac) if spec.bytes_arg != NO_ARG else None)
        rows["sampled_fraction"].append(frac)
        rows["error_pct"].append(scale.error_pct)
        rows["hist"].append([{"lo_ns": lo, "hi_ns": hi, "count": c} for lo, hi, c in h])
        per_op.setdefault(op, []).extend(h)
        per_op_calls[op] = per_op_calls.get(op, 0) + calls
        per_op_max[op] = max(per_op_max.get(op, 0), int(t["max_ns"][i]))
    summary = [
        OpSummary(
            CATALOG[op].op,
            CATALOG[op].layer_name,
            per_op_calls[op],
            percentile(h, 0.5),
            percentile(h, 0.99),
            per_op_max[op],
        )
        for op, h in per_op.items()
    ]
    return rows, sorted(summary, key=lambda o: -o.calls)


def process_columns(procs: Iterable[ProcInfo]) -> Columns:
    """processes columns, in order of appearance."""
    ps = sorted(procs, key=lambda p: (p.first_ns, p.pid))
    # the recorder that launched a rank itself (`srun tracer record -- python train.py`: one recording per rank or
    # host) is its parent, not its launcher: the tracer is never part of the job
    tracer = {p.pid for p in ps if p.role == TRACER_ROLE}
    launchers = {pid: k for pid, k in rankenv.launchers(ps).items() if pid not in tracer}
    # ...and a launcher whose ranks left the tree before it was noted as such there (ProcessTree.retire)
    launchers.update({p.pid: p.launcher for p in ps if p.launcher and p.pid not in launchers and p.pid not in tracer})
    return {
        "pid": [p.pid for p in ps],
        "ppid": [p.ppid for p in ps],
        "comm": [p.comm for p in ps],
        "cmdline": [p.cmdline for p in ps],
        "first_ns": [p.first_ns for p in ps],
        "exit_ns": [p.exit_ns for p in ps],
        "exit_code": [p.exit_code for p in ps],
        "role": [p.role for p in ps],
        "rank": [p.dist.rank if p.dist else None for p in ps],
        "local_rank": [p.dist.local_rank if p.dist else None for p in ps],
        "node_rank": [p.dist.node_rank if p.dist else None for p in ps],
        "world_size": [p.dist.world_size if p.dist else None for p in ps],
        "job_id": [p.dist.job_id if p.dist else None for p in ps],
        "launcher": [launchers.get(p.pid) for p in ps],
    }


def thread_columns(threads: Iterable[ThreadInfo], calls_by_tid: dict[int, int]) -> Columns:
    """threads columns: every accounted thread with its span and its CUDA calls."""
    ts = sorted((t for t in threads if t.end_ns is not None), key=lambda t: (t.pid, t.tid))
    return {
        "pid": [t.pid for t in ts],
        "tid": [t.tid for t in ts],
        "comm": [t.comm for t in ts],
        "first_ns": [t.first_ns for t in ts],
        "end_ns": [t.end_ns for t in ts],
        "exited": [t.exited for t in ts],
        "cuda_calls": [calls_by_tid.get(t.tid, 0) for t in ts],
    }


Frame = tuple[str, str, "str | None", "str | None", "int | None", bool]  # kind, module, function, file, line, approx

# stacks.line is an INTEGER: a line decoded from a table read while its code object was being freed can be any
# 64-bit value, and one such value would abort the whole batch's INSERT (and with it the recording)
_LINE_MAX = 2**31 - 1


def _line(line: int | None) -> int | None:
    """Return ``line``, or None (unknown) when no source file has it: not a positive 32-bit value."""
    return line if line is not None and 0 < line <= _LINE_MAX else None


def stack_columns(stack_id: int, frames: Sequence[Frame]) -> Columns:
    """stacks columns of one stack, outermost frame first (depth 0)."""
    return {
        "stack_id": [stack_id] * len(frames),
        "depth": list(range(len(frames))),
        "kind": [f[0] for f in frames],
        "module": [f[1] for f in frames],
        "function": [f[2] for f in frames],
        "file": [f[3] for f in frames],
        "line": [_line(f[4]) for f in frames],
        "line_approx": [f[5] for f in frames],
    }
