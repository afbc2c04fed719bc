"""The rows only the end of a recording (or a live MCP snapshot) can write: totals read from the in-kernel maps
(op_stats with its histograms and launch scales, processes, threads) and the segments each live thread still has
open. (The causal chains are the record command's step after the recorder: it never imports an analysis.)

The processes and threads that left the tree while recording (proctree.ProcessTree.retire) have their final rows
written then (:func:`write_retired`); the totals write only what is still in the tree, replacing the rows its
previous call (a live snapshot) wrote and nothing else (:class:`Rewritable`).

The computations are pure functions over dumped map contents (testable without BPF); the ``write_*`` and
``close_*`` functions read the maps and hand the rows to the store.

:class:`Ending` is the recording's end, in order: stop every hold, detach, drain, write these rows and the session
row, close the DB. session.py's :class:`~tracer.recorder.session.Recorder` runs the recording and inherits it.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probes.catalog import CATALOG, OpClass
from tracer import __version__, procfs
from tracer.recorder import bpfmaps, columns, events, targets
from tracer.recorder.budget import DUTY_CYCLED, DUTY_CYCLED_IDS, Activity, DutyCycler, Window, launch_scales
from tracer.recorder.links import close_together
from tracer.recorder.proctree import ProcessTree, ProcInfo, Retired, ThreadInfo
from tracer.recorder.program import tracepoint_fds
from tracer.recorder.store import Store
from tracer.recorder.sysinfo import environment

log = logging.getLogger(__name__)

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
    full = 0  # seconds not accounted: the map was full
    for sp in open_spans(live, inflight, end_ns):
        for sec, ns in by_second(sp.start_ns, sp.end_ns, start_mono):
            k = table.Key(sp.tid, sec)
            try:
                v = table[k]
            except KeyError:
                v = table.Leaf()
                v.pid = sp.pid
            v.v[sp.field] += ns
            try:
                table[k] = v
            except Exception:  # E2BIG, the map full: a node agent's thread idle for minutes spans that many seconds
                full += 1
    if full:
        log.warning("tbreak was full: %d thread-seconds of open segments at the end were not accounted", full)


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


# --- the end of a recording ------------------------------------------------------------------------------------


CHURN_PROCESSES = 5  # fewer processes than this are a job's own, not churn (RecordSummary.ms_per_process)


@dataclass
class RecordSummary:
    db: Path
    status: str
    duration_s: float
    events_traced: int
    events_stored: int
    events_lost: int
    processes: int
    libraries: list[str]
    ops: list[columns.OpSummary]
    notes: list[str]
    startup_s: float = 0.0
    first_event_s: float | None = None
    flush_s: float = 0.0
    recording_cpu_pct: float | None = None  # the recorder's CPU while recording, % of a core (start-up, finish apart)
    recording_s: float | None = None  # while recording: from the probes being live to the final flush
    recorder_cpu_s: float = 0.0
    recorder_peak_rss_bytes: int = 0
    holds: int = 0
    held_ms: float = 0.0
    command_fate: str | None = None

    @property
    def ms_per_process(self) -> float | None:
        """The recorder's CPU while recording over the processes it traced, in ms: what process churn costs (each new
        process brings stacks, maps and ELF files to read; issue 33). None unless the job churned, forking at least
        CHURN_PROCESSES and more than one a second: over a few long-lived processes the figure is the whole
        recording's cost, split, and says nothing of them."""
        if self.recording_cpu_pct is None or not self.recording_s:
            return None
        if self.processes < CHURN_PROCESSES or self.processes <= self.recording_s:
            return None
        return self.recording_cpu_pct * 10 * self.recording_s / self.processes


def cpu_s() -> float:
    """This process's CPU seconds so far (user + system)."""
    t = os.times()
    return t.user + t.system


class Ending:
    """The end of a recording and its session row: the part of the :class:`~tracer.recorder.session.Recorder` that
    runs once the recording stops (and, for the row, at its start and at each live snapshot).

    It reads the recorder's state, set by session.py (declared here for the reader), and calls back into its drain
    (``_drain``, ``_drain_aggregates``), its hold switch (``_set_gate``), its snapshots and its lost counters.
    """

    opts: Any  # session.RecordOptions
    store: Store
    bpf: Any
    tree: ProcessTree
    cycler: DutyCycler
    start_mono: int
    notes: list[str]
    phases: dict[str, float]
    command: Any  # command.LaunchedCommand | None
    attacher: Any  # attach.Attacher
    resolver: Any  # stack_resolver.StackResolver
    guardian: Any  # guardian.Guardian
    metrics: Any
    chains: Any  # live.ChainWatch | None
    live: Any
    gc_probes: Any
    pyrt: Any
    py_version: str | None
    first_event_ns: int | None
    _calls_by_tid: dict[int, int]
    _rewritable: Rewritable
    _session_written: bool

    @property
    def command_fate(self) -> str | None:
        """What became of a launched command (tracer/recorder/command.py), None for --pid."""
        return self.command.fate if self.command is not None else None

    def finish(self, status: str) -> RecordSummary:
        """Stop holds and duty cycling, end a launched command, drain, write the exact aggregates, processes and
        the session row, close the DB; return the summary.

        Whatever fails on the way (a full disk: the store then refuses every write), nobody is left stopped, the
        probes are detached and the guardian dismissed before the error goes up.

        Raises:
            StoreError: a write failed; what was written before it stays readable.
        """
        t_flush = time.monotonic()
        self._recording_cpu_pct = self._cpu_pct_since_live(t_flush)
        since = getattr(self, "_live_since", None)
        self._recording_s = t_flush - since[0] if since is not None else None
        if hasattr(self, "placement"):  # before a launched command is ended: a changed placement, read once more
            self.placement.recheck(
                self.tree.alive(),
                time.monotonic_ns() - self.start_mono,
                lambda pid: self.tree.procs[pid].ppid if pid in self.tree.procs else None,
            )
        if self.command is not None:
            self.command.release()
        self._set_gate(False)  # from now on nobody is stopped
        if hasattr(self, "sampler_events"):
            self.sampler_events.stop()
        self.attacher.release_all()
        self.cycler.stop()
        # before a launched command is ended: its threads as they are at the end (a hung loop, still blocked),
        # not the exit the recorder's SIGTERM causes
        self._snapshot("end")
        if self.command is not None:
            self.command.end(status, keep_running=self.opts.keep_command)
        if self.metrics is not None:
            self.metrics[1].stop()
        if self.chains is not None:
            self.chains.stop()
        if self.live is not None:
            self.live.stop()  # the final DB is served by `tracer mcp serve` once the recorder is done
        try:
            self.attacher.close()  # no CUDA call is traced from here on; the rings stay readable for the flush
            self._close_gc_probes()
            summary = self._flush(status, t_flush)
            self.resolver.save_caches()  # for the next recording: off this one's clock
        finally:
            self.store.close()
            self.attacher.close()
            self._close_gc_probes()
            self._drop_tracepoints()
            self.guardian.finish()
        return summary

    def _close_gc_probes(self) -> None:
        """Detach the collector's probes (idempotent): their semaphores drop back in every process."""
        if self.gc_probes is not None:
            close_together(self.gc_probes.closers())

    def _cpu_pct_since_live(self, now: float) -> float | None:
        """Return the recorder's CPU from the probes being live to ``now`` as % of one core (None before that):
        the steady recording's cost, apart from the start-up's compile and the finish's writes (issue 21)."""
        since = getattr(self, "_live_since", None)
        if since is None or now <= since[0]:
            return None
        return round(100 * (cpu_s() - since[1]) / (now - since[0]), 2)

    def _recording_span(self, live: bool) -> float | None:
        """Seconds from the probes being live to now (a live snapshot) or to the final flush: recording_cpu_pct's
        span, stored so that its CPU seconds are not re-derived from two other origins (duration_s counts from the
        session's start, startup_s from the command's)."""
        since = getattr(self, "_live_since", None)
        if not live:
            span = getattr(self, "_recording_s", None)
            return round(span, 3) if span is not None else None
        return round(time.monotonic() - since[0], 3) if since is not None else None

    def _drop_tracepoints(self) -> None:
        """Empty the target list, so the tracepoint programs do nothing more for the job, and close this process's
        fds of the tracepoints: the guardian holds them too, so their detach (0.8 s of grace periods, one after
        another) happens at its exit, after this process has returned the terminal (guardian.py)."""
        try:
            self.bpf["targets"].clear()
        except Exception as e:  # the detach below matters more
            log.debug("emptying the target list failed: %s", e)
        for fd in tracepoint_fds(self.bpf):
            os.close(fd)

    def _flush(self, status: str, t_flush: float) -> RecordSummary:
        """The final drain and the rows only the end can write."""
        self._status("finishing: draining the last events and writing the exact aggregates…")
        self._drain()
        end_ns = time.monotonic_ns()
        close_open_segments(self.bpf, self.tree, self.start_mono, end_ns)
        self._drain_aggregates(before_sec=None)
        for p in self.tree.targets():
            if p.exit_ns is None and not targets.is_alive(p.pid) and status != "interrupted":
                p.exit_ns = end_ns - self.start_mono
        self._write_placement(end_ns - self.start_mono)
        summary_ops = self._write_totals(end_ns, live=False)
        self.store.sync()
        traced = sum(o.calls for o in summary_ops)
        stored = self.store.rows_written.get("cuda_calls", 0)
        lost = self._lost(events.C.LOST_CALLS)  # session.events_lost counts call events, the unit of traced/stored
        for kind, what in (
            (events.C.LOST_CALLS, "call events"),
            (events.C.LOST_STACKS, "stacks"),
            (events.C.LOST_SCHED, "off-CPU intervals"),
            (events.C.LOST_PROC, "lifecycle events"),
            (events.C.LOST_CODES, "Python code objects (read again at the next new stack that shows them)"),
            (events.C.LOST_MAPS, "file mappings"),
            (events.C.LOST_AGGS, "per-second aggregate entries (a map was full)"),
            (events.C.LOST_GC, "garbage collections"),
        ):
            n = self._lost(kind)
            if n:
                self.notes.append(
                    f"{n} {what} lost to a full buffer (a burst faster than the recorder drains); counts in op_stats "
                    "are still exact, only rows are missing"
                )
        if self.store.thinner is not None and (thinned := self.store.thinner.note()):
            self.notes.append(thinned)
        over = self.estimator.over_budget_note() if hasattr(self, "estimator") else None
        if self.cycler.cycled:
            aim = "for" if over else "to stay under"  # over it, the next note says why
            self.notes.append(
                f"launch probes were duty-cycled {aim} --overhead-budget {self.opts.overhead_budget}%: launch "
                "counts are scaled per process (op_stats.sampled_fraction, error_pct)"
            )
        if over:
            self.notes.append(over)
        self.duration = (end_ns - self.start_mono) / 1e9
        self.flush_s = time.monotonic() - t_flush
        self._write_session_row(status, traced, stored, lost)
        self.store.sync()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return RecordSummary(
            self.opts.db,
            status,
            self.duration,
            traced,
            stored,
            lost,
            self.tree.target_count(),
            [lib.path for lib in self.attacher.attached.values()],
            summary_ops,
            self.notes,
            startup_s=self.phases.get("startup_s", 0.0),
            first_event_s=self._first_event_s(),
            flush_s=self.flush_s,
            recording_cpu_pct=getattr(self, "_recording_cpu_pct", None),
            recording_s=getattr(self, "_recording_s", None),
            recorder_cpu_s=cpu_s(),
            recorder_peak_rss_bytes=usage.ru_maxrss * 1024,
            holds=self.attacher.holds.count,
            held_ms=self.attacher.holds.held_ms,
            command_fate=self.command_fate,
        )

    def _write_totals(self, end_ns: int, live: bool) -> list[columns.OpSummary]:
        """op_stats, processes and threads as of ``end_ns`` (finalize.write_totals); return the per-op summary."""
        return write_totals(
            self.store,
            self.bpf,
            self.tree,
            self.cycler,
            self._calls_by_tid,
            self.start_mono,
            end_ns,
            live,
            self._rewritable,
        )

    def _first_event_s(self) -> float | None:
        """Seconds from the start of `tracer record` to the first recorded CUDA call."""
        if self.first_event_ns is None:
            return None
        return self._since_start0 + (self.first_event_ns / 1e9 - self._mono0)

    def _write_session_row(self, status: str, traced: int = 0, stored: int = 0, lost: int = 0) -> None:
        env = environment() if not hasattr(self, "_env") else self._env
        self._env = env
        if self.pyrt is not None and self.pyrt.versions:
            self.py_version = ".".join(map(str, max(self.pyrt.versions, key=self.pyrt.versions.__getitem__)))
        target = (
            "every CUDA process"
            if self.all_cuda
            else f"pid {self.opts.pid}"
            if self.opts.pid is not None
            else " ".join(self.opts.command or [])
        )
        libs = ", ".join(lib.path for lib in self.attacher.attached.values()) if hasattr(self, "attacher") else ""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        live = status == "recording"
        first = self._first_event_s()
        now_ns = time.monotonic_ns() - self.start_mono
        values: dict[str, Any] = {
            "session_id": 1,
            "started_at": self.started_at,
            "start_mono_ns": self.start_mono,
            "realtime_at_start_ns": self.realtime_at_start_ns,
            "clock_read_ns": self.clock_read_ns,
            "duration_s": getattr(self, "duration", 0.0),
            "status": status,
            "host": env.host,
            "kernel": env.kernel,
            "cpu_model": env.cpu_model,
            "cpu_cores": env.cpu_cores,
            "mem_bytes": env.mem_bytes,
            "gpus": env.gpus,
            "driver": env.driver,
            "python_version": self.py_version or "",
            "tracer_version": __version__,
            "target": target,
            "libraries": libs,
            "events_traced": traced,
            "events_stored": stored,
            "events_lost": lost,
            "overhead_pct": None if live else self.estimator.mean_pct if hasattr(self, "estimator") else None,
            "notes": "\n".join(self.notes),
            "recorder_pid": os.getpid(),
            "recorder_start_ticks": procfs.process_start_ticks(os.getpid()),
            "boot_id": procfs.boot_id(),
            "recorder_cpu_s": None if live else round(cpu_s(), 3),
            "recorder_peak_rss_bytes": None if live else usage.ru_maxrss * 1024,
            "startup_s": self.phases.get("startup_s"),
            "compile_s": self.phases.get("compile_s"),
            "attach_s": self.phases.get("attach_s"),
            "startup_cpu_s": self.phases.get("startup_cpu_s"),
            "first_event_s": round(first, 3) if first is not None else None,
            "flush_s": None if live else round(getattr(self, "flush_s", 0.0), 3),
            "recording_cpu_pct": (
                self._cpu_pct_since_live(time.monotonic()) if live else getattr(self, "_recording_cpu_pct", None)
            ),
            "recording_s": self._recording_span(live),
            "holds": self.attacher.holds.count if hasattr(self, "attacher") else 0,
            "held_ms": round(self.attacher.holds.held_ms, 3) if hasattr(self, "attacher") else 0.0,
            "command_fate": self.command_fate,
            "flushed_ns": now_ns,  # written after a sync: every row is in
            "summaries_flushed_ns": now_ns,
            "sample_hz": self.sampler_events.hz if hasattr(self, "sampler_events") else 0,
            "offcpu_stacks": self.opts.offcpu_stacks,
            "max_db_bytes": self.opts.max_db_bytes,
        }
        names = list(values)
        if not self._session_written:
            self.store.execute(
                f"INSERT INTO session ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                [values[n] for n in names],
            )
            self._session_written = True
        else:  # one statement: a full disk cannot leave the file without its session row
            self.store.execute(
                f"UPDATE session SET {', '.join(f'{n} = ?' for n in names)} WHERE session_id = 1",
                [values[n] for n in names],
            )
