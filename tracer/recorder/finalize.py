"""The rows only the end of a recording (or a live MCP snapshot) can write: totals read from the in-kernel maps
(op_stats with its histograms and launch scales, processes, threads) and the segments each live thread still has
open. (The causal chains are the record command's step after the recorder: it never imports an analysis.)

The processes and threads that left the tree while recording (proctree.ProcessTree.retire) have their final rows
written then (:func:`write_retired`); the totals write only what is still in the tree, replacing the rows its
previous call (a live snapshot) wrote and nothing else (:class:`Rewritable`).

The computations are pure functions over dumped map contents (testable without BPF); the ``write_*`` and
``close_*`` functions read the maps and hand the rows to the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from probes.catalog import CATALOG, OpClass
from tracer.recorder import bpfmaps, columns, events
from tracer.recorder.budget import DUTY_CYCLED, DUTY_CYCLED_IDS, Activity, DutyCycler, Window, launch_scales
from tracer.recorder.proctree import ProcessTree, ProcInfo, Retired, ThreadInfo
from tracer.recorder.store import Store

S = 1_000_000_000


@dataclass(frozen=True)
class Span:
    """A stretch of a thread's time that the kernel has not accounted yet: [start_ns, end_ns) of one
    thread_breakdown field (events.C.TB_*), monotonic ns."""

    tid: int
    pid: int
    field: int
    start_ns: int
    end_ns: int


def open_spans(tstate: Iterable[tuple[int, Any]], inflight: Mapping[int, Any], end_ns: int) -> list[Span]:
    """Return each live thread's open segment, ending at ``end_ns``: in a call (the call's part), off CPU
    (blocked until it became runnable, then waiting for a CPU; a recorder that cannot tell who holds it counts
    it as other), or on CPU.

    Args:
        tstate: (tid, state) of each live thread, as accounting.h keeps it (tgid, in_call, off_cpu, mark,
            ts_runnable).
        inflight: tid -> its call in progress (op, ts_ns).
    """
    out = []
    for tid, st in tstate:
        pid = int(st.tgid)
        if st.in_call and tid in inflight:
            f = inflight[tid]
            op = int(f.op)
            part = int(CATALOG[op].part) if op < len(CATALOG) else int(OpClass.OTHER)
            out.append(Span(tid, pid, events.C.TB_CALL + part, int(f.ts_ns), end_ns))
        elif st.off_cpu:
            runnable = int(st.ts_runnable) or end_ns
            out.append(Span(tid, pid, events.C.TB_BLOCKED, int(st.mark), runnable))
            out.append(Span(tid, pid, events.C.TB_RUNQ_OTHER, runnable, end_ns))
        else:
            out.append(Span(tid, pid, events.C.TB_CPU, int(st.mark), end_ns))
    return out


def by_second(start_ns: int, end_ns: int, start_mono: int) -> Iterator[tuple[int, int]]:
    """Yield (second since ``start_mono``, ns) of [start_ns, end_ns) split at second boundaries, as the kernel
    splits an interval; nothing before ``start_mono`` is counted."""
    a = max(start_ns, start_mono)
    while a < end_ns:
        sec = (a - start_mono) // S
        piece_end = min(end_ns, start_mono + (sec + 1) * S)
        yield int(sec), piece_end - a
        a = piece_end


def close_open_segments(bpf: Any, tree: ProcessTree, start_mono: int, end_ns: int) -> None:
    """Account each live thread's segment still open at ``end_ns`` into ``tbreak`` (accounting.h closes one only
    at the thread's next event), so its parts add up to its span; and note its span in ``tree``."""
    inflight = {int(k.value): v for k, v in bpf["inflight"].items()}
    live = [(int(k.value), st) for k, st in bpf["tstate"].items()]
    for tid, st in live:
        tree.note_live_thread(int(st.tgid), tid, max(0, int(st.first) - start_mono), end_ns - start_mono)
    table = bpf["tbreak"]
    for sp in open_spans(live, inflight, end_ns):
        for sec, ns in by_second(sp.start_ns, sp.end_ns, start_mono):
            k = table.Key(sp.tid, sec)
            try:
                v = table[k]
            except KeyError:
                v = table.Leaf()
                v.pid = sp.pid
            v.v[sp.field] += ns
            table[k] = v


def running_threads(bpf: Any, tree: ProcessTree, start_mono: int, end_ns: int) -> list[ThreadInfo]:
    """Return the threads still running that ``tree`` has not ended, their span ending at ``end_ns`` (a live
    snapshot's view; nothing is changed)."""
    out = []
    for k, st in bpf["tstate"].items():
        tid = int(k.value)
        if tid not in tree.threads:
            first = max(0, int(st.first) - start_mono)
            out.append(ThreadInfo(int(st.tgid), tid, "", first, end_ns - start_mono))
    return out


def scaled_op_stats(
    totals: columns.Aggregates, hists: columns.Aggregates, windows: list[Window], cycled: bool
) -> tuple[columns.Columns, list[columns.OpSummary]]:
    """Return op_stats' columns and the per-op summary from the dumped ``op_totals`` and ``op_hist`` maps.

    Launch counts of a process are scaled by the share of its active time the launch probes were live (the duty
    cycler's ``windows``, when it ``cycled``). A process's activity is bounded by its first and last call of any
    op; an edge set by a launch is inexact, as the launch probes may have been off then.
    """
    tk, tv = totals.keys, totals.vals
    activity: dict[int, Activity] = {}
    counts: dict[tuple[int, int], int] = {}
    for pid, op, first, last, calls in zip(
        tk["pid"].tolist(), tk["op"].tolist(), tv["first_ns"].tolist(), tv["last_ns"].tolist(), tv["calls"].tolist(),
        strict=True,
    ):  # fmt: skip
        hot = op < len(CATALOG) and bool(DUTY_CYCLED[op])
        counts[(pid, op)] = int(calls)
        a = activity.get(pid)
        if a is None:
            activity[pid] = Activity(first, last, not hot, not hot)
        else:
            activity[pid] = Activity(
                min(a.first, first),
                max(a.last, last),
                a.first_exact if a.first <= first else not hot,
                a.last_exact if a.last >= last else not hot,
            )
    scales = {
        pid: columns.LaunchScale(frac, err)
        for pid, (frac, err) in launch_scales(windows, activity, counts, DUTY_CYCLED_IDS, cycled).items()
    }
    return columns.op_stats_columns(totals, hists, scales)


@dataclass
class Rewritable:
    """The processes and threads rows the last :func:`write_totals` wrote, by (pid or tid, first_ns): the rows its
    next call replaces, or a retirement makes final. Only the live snapshots leave any (the end writes last)."""

    procs: set[tuple[int, int]] = field(default_factory=set)
    threads: set[tuple[int, int]] = field(default_factory=set)


def _delete_rows(store: Store, table: str, id_col: str, keys: Iterable[tuple[int, int]]) -> None:
    keys = list(keys)
    if keys:
        store.execute(
            f"DELETE FROM {table} WHERE ({id_col}, first_ns) IN (SELECT unnest(?::BIGINT[]), unnest(?::BIGINT[]))",
            [[k[0] for k in keys], [k[1] for k in keys]],
        )


def _proc_key(p: ProcInfo) -> tuple[int, int]:
    return p.pid, p.first_ns


def _thread_key(t: ThreadInfo) -> tuple[int, int]:
    return t.tid, t.first_ns


def write_retired(store: Store, gone: Retired, calls_by_tid: dict[int, int], written: Rewritable) -> None:
    """Write the final rows of what left the tree (replacing a live snapshot's row of it, if one was written),
    and drop the retired threads' call counts from ``calls_by_tid``."""
    if gone.procs:
        stale = {_proc_key(p) for p in gone.procs} & written.procs
        _delete_rows(store, "processes", "pid", stale)
        written.procs -= stale
        store.put("processes", columns.process_columns(gone.procs))
    if gone.threads:
        stale = {_thread_key(t) for t in gone.threads} & written.threads
        _delete_rows(store, "threads", "tid", stale)
        written.threads -= stale
        store.put("threads", columns.thread_columns(gone.threads, calls_by_tid))
        for t in gone.threads:
            calls_by_tid.pop(t.tid, None)


def write_totals(
    store: Store,
    bpf: Any,
    tree: ProcessTree,
    cycler: DutyCycler,
    calls_by_tid: dict[int, int],
    start_mono: int,
    end_ns: int,
    live: bool,
    written: Rewritable | None = None,
) -> list[columns.OpSummary]:
    """(Re)write the tables that hold totals rather than a stream: op_stats and nccl_progress (from the in-kernel
    counts), processes and threads still in the tree; return the per-op summary. At the end, once; while recording
    (``live``), for each MCP snapshot, replacing the rows the last one wrote (``written``), with the threads still
    running ending now. The rows :func:`write_retired` wrote stay."""
    written = written if written is not None else Rewritable()
    store.execute("DELETE FROM op_stats")
    _delete_rows(store, "processes", "pid", written.procs)
    _delete_rows(store, "threads", "tid", written.threads)
    totals = columns.Aggregates(*bpfmaps.dump(bpf["op_totals"], events.OP_KEY_DTYPE, events.OP_TOTAL_DTYPE))
    hists = columns.Aggregates(*bpfmaps.dump(bpf["op_hist"], events.HIST_KEY_DTYPE, events.COUNT_DTYPE))
    cols, summary = scaled_op_stats(totals, hists, cycler.windows, cycler.cycled)
    store.put("op_stats", cols)
    store.execute("DELETE FROM nccl_progress")
    keys, vals = bpfmaps.dump(bpf["coll_counts"], events.COLL_KEY_DTYPE, events.COLL_COUNT_DTYPE)
    store.put("nccl_progress", columns.coll_columns(keys, vals, start_mono))
    procs = list(tree.procs.values())
    store.put("processes", columns.process_columns(procs))
    threads = list(tree.threads.values())
    if live:
        threads += running_threads(bpf, tree, start_mono, end_ns)
    store.put("threads", columns.thread_columns(threads, calls_by_tid))
    written.procs = {_proc_key(p) for p in procs}
    written.threads = {_thread_key(t) for t in threads if t.end_ns is not None}
    return summary
