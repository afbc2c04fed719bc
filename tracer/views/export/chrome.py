"""Chrome trace-event JSON in the shape the PyTorch profiler (Kineto) writes: opens in ui.perfetto.dev,
chrome://tracing and Holistic Trace Analysis, and reads like a torch trace.

What goes where (the trace-event format: ph, ts and dur in µs, pid/tid tracks, args):

- Each traced process is a pid track, each thread a tid track, named with ``process_name`` / ``thread_name``
  metadata (Kineto's ``thread N (comm)``), labelled with its role, and ordered main process first. In a
  distributed job each rank's own process leads, in rank order, named ``rank R: comm on HOST``; its DataLoader
  workers are labelled with its rank.
- CUDA calls are complete events (``ph: X``) with ``cat`` ``cuda_runtime`` or ``cuda_driver`` as Kineto's, named
  by the API function; args: bytes, kind, stream, kernel, ret, off_cpu_us, runq_us, ``python`` (the innermost
  Python frame) and ``stack`` ('file:line function', outermost first).
- Off-CPU intervals are ``X`` slices named ``off-CPU <reason>`` (cat ``sched``) on the thread's track, inside
  the call they interrupted; args say who held the CPU and who woke the thread.
- A wait for a CPU inside a CUDA call is linked by a flow arrow (``ph: s`` / ``f``, ``bp: e``) to a ``held the
  CPU`` slice on the holder's track: the process that ran while the call's thread waited. Holders outside the
  traced tree get a track of their own, labelled ``not traced``.
- Fork, exec, exit, rename and OOM kills are process-scoped instants (``ph: i``, ``s: p``); causal chains are
  global instants (``s: g``) at their start, with the diagnosis in args.
- Host samples and per-process page allocation are counters (``ph: C``), one series per name, on a ``host``
  track and the processes' tracks.
- On-CPU samples (``cpu_samples``, counted per second): for each second a thread was sampled, an instant on its
  track (``ph: i``, ``s: t``, cat ``cpu_samples``) named ``on-CPU <its heaviest line>`` with its samples and top
  lines in args, and a counter of its CPU time (``on-CPU thread N``, ms/s) on its process (see :func:`_samples`).

Timestamps are µs since the session start with three decimals, so nanoseconds survive; the session's wall-clock
start is ``baseTimeNanoseconds``, as Kineto writes it. Events are streamed, one per line, never held in memory.

One rank's file (``tracer export --per-rank``, :func:`tracer.views.export.export_ranks`) holds the processes of
that rank (its own and its DataLoader workers) with their threads, calls, off-CPU slices, samples and events, the
chains that name one of them, and the host's counters; its ``distributedInfo`` leads the file (see :func:`write`).
"""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache
from typing import Any, TextIO

import duckdb

from tracer.analysis.recording import RecordingInfo, load_recording
from tracer.views.export import rows
from tracer.vocabulary import waker_name

# Synthetic pids and tids: the kernel's pid_max is at most 2**22 (PID_MAX_LIMIT), so ids from 2**22 up can never
# be a real process or thread. The host's counters get their own process; "held the CPU" slices get one thread
# per lane (overlapping holds by one process on several CPUs need parallel lanes to nest).
PID_LIMIT = 1 << 22
HOST_PID = PID_LIMIT
NOT_TRACED = "not traced: took the CPU from traced threads"
IN_OTHER_FILE = "traced, in another rank's file: took the CPU from this rank's threads"


def _us(ns: int) -> str:
    """Return ns as µs with exactly three decimals, from integers (no float rounding)."""
    sign = "-" if ns < 0 else ""
    ns = abs(int(ns))
    return f"{sign}{ns // 1000}.{ns % 1000:03d}"


@lru_cache(maxsize=8192)
def _str(s: str) -> str:
    return json.dumps(s)


_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode


def _args(d: dict[str, Any], tail: str = "") -> str:
    """Return ``d`` without its None values as a JSON object, with ``tail`` (pre-encoded members) appended."""
    body = _ENCODE({k: v for k, v in d.items() if v is not None})
    if not tail:
        return body
    return "{" + tail + "}" if body == "{}" else body[:-1] + "," + tail + "}"


class _Out:
    """Writes events to the traceEvents array, one per line, and counts them by kind."""

    def __init__(self, fh: TextIO) -> None:
        self.fh = fh
        self.counts: Counter[str] = Counter()
        self._first = True

    def event(
        self,
        kind: str,
        ph: str,
        name: str,
        pid: int,
        tid: int,
        ts_ns: int,
        *,
        cat: str | None = None,
        dur_ns: int | None = None,
        args: dict[str, Any] | None = None,
        args_tail: str = "",
        extra: str = "",
    ) -> None:
        head = f'{{"ph":"{ph}","name":{_str(name)},'
        if cat is not None:
            head += f'"cat":{_str(cat)},'
        head += f'"pid":{pid},"tid":{tid},"ts":{_us(ts_ns)}'
        if dur_ns is not None:
            head += f',"dur":{_us(max(dur_ns, 0))}'
        if extra:
            head += "," + extra
        if args or args_tail:
            head += ',"args":' + _args(args or {}, args_tail)
        self.fh.write(("\n" if self._first else ",\n") + head + "}")
        self._first = False
        self.counts[kind] += 1

    def meta(self, name: str, pid: int, tid: int, args: dict[str, Any]) -> None:
        self.event("metadata", "M", name, pid, tid, 0, args=args)


def write(
    conn: duckdb.DuckDBPyConnection,
    fh: TextIO,
    sel: rows.Selection,
    *,
    distributed: dict[str, Any] | None = None,
    chains: list[Any] | None = None,
) -> dict[str, int]:
    """Stream the selection as a Kineto-shaped JSON object to ``fh``; return the events written by kind.

    Args:
        distributed: a rank's file: its ``distributedInfo`` (``rank`` first, then scalars only), written before
            ``traceEvents``. Holistic Trace Analysis finds a file's rank by a regex over the file's first lines,
            ``rank_re = re.compile(r'"rank":\\s+(\\d+)')`` (hta 0.5, hta/common/trace_file.py:45,
            create_rank_to_trace_dict), reading line by line until one matches: so ``"rank": R`` with a space,
            on a line before any event; its metadata parser (parse_metadata_ijson, trace_parser.py) stops at
            ``traceEvents`` and skips nested maps or arrays inside ``distributedInfo``.
        chains: the recording's chains (:func:`tracer.analysis.chains.compute_chains`), computed once for every
            rank's file; None computes them.
    """
    cols = rows.Columns(conn)
    duration_ns, base_ns = rows.session_span(conn)
    session = rows.session_info(conn)
    fh.write('{\n"schemaVersion": 1,\n"deviceProperties": [],\n')
    if distributed is not None:
        fh.write(f'"distributedInfo": {{"rank": {int(distributed["rank"])}')
        for k, v in distributed.items():
            if k != "rank" and v is not None:
                fh.write(f", {_str(k)}: {json.dumps(v, default=str)}")
        fh.write("},\n")
    fh.write('"traceEvents": [')
    out = _Out(fh)
    info = load_recording(conn)
    procs = rows.processes(conn, cols, sel)
    known = _tracks(conn, cols, sel, out, procs, info)
    _calls(conn, cols, sel, out)
    _off_cpu(conn, cols, sel, out)
    _samples(conn, cols, sel, out)
    traced = {int(p["pid"]) for p in procs}  # type: ignore[arg-type]
    # a rank's file: the job's other processes that took this rank's CPU are traced, in their own rank's file
    elsewhere = set(info.target_pids()) - traced if sel.pids is not None else set()
    _holders(conn, cols, sel, out, known, traced, len(procs), elsewhere)
    _lifecycle(conn, sel, out)
    _chains(conn, sel, out, chains)
    _counters(conn, cols, sel, out)
    for note in sel.notes:
        out.event(
            "note", "i", "export note", HOST_PID, 0, sel.start_ns, cat="export", extra='"s":"g"', args={"note": note}
        )
    fh.write("\n],\n")
    info = {
        "session": session,
        "window_s": [sel.start_ns / 1e9, min(sel.end_ns, max(duration_ns, sel.start_ns)) / 1e9],
        "calls_in_window": sel.calls_in_window,
        "calls_written": sel.calls_kept,
        "off_cpu_in_window": sel.off_cpu_in_window,
        "off_cpu_written": sel.off_cpu_kept,
        "notes": sel.notes,
    }
    fh.write('"traceName": "cuda-host-tracer",\n"displayTimeUnit": "ms",\n')
    if base_ns is not None:
        fh.write(f'"baseTimeNanoseconds": {base_ns},\n')
    fh.write('"cudaHostTracer": ' + json.dumps(info, default=str) + "\n}\n")
    return dict(out.counts)


# Perfetto shows a process's labels as they are: the roles of RecordingInfo.process_role, spelled for people
ROLE_LABELS = {
    "main": "main",
    "rank": "rank",
    "launcher": "launcher",
    "dataloader_worker": "DataLoader worker",
    "child": "child",
    "tracer": "tracer",
}


def _tracks(
    conn: duckdb.DuckDBPyConnection,
    cols: rows.Columns,
    sel: rows.Selection,
    out: _Out,
    procs: list[dict[str, Any]],
    info: RecordingInfo,
) -> set[tuple[int, int]]:
    """Name and order every process and thread track; return the (pid, tid) pairs named."""
    main = info.main_pid
    ranks = info.rank_pids  # each rank's own process: its track leads, in rank order, named with rank and host
    host = rows.session_info(conn).get("host")

    def key(p: dict[str, Any]) -> tuple:
        pid = int(p["pid"])
        return (pid not in ranks, ranks.get(pid, 0), pid != main, info.process_role(pid) == "tracer")

    comm = {}
    for index, p in enumerate(sorted(procs, key=key)):
        pid = int(p["pid"])
        comm[pid] = p["comm"] or str(pid)
        name = comm[pid] if pid not in ranks else f"rank {ranks[pid]}: {comm[pid]}" + (f" on {host}" if host else "")
        labels = ROLE_LABELS[info.process_role(pid)]
        if pid not in ranks and info.procs.get(pid) is not None and info.procs[pid].rank is not None:
            labels += f", of rank {info.procs[pid].rank}"  # a rank's DataLoader worker
        out.meta("process_name", pid, 0, {"name": name})
        out.meta("process_labels", pid, 0, {"labels": labels})
        out.meta("process_sort_index", pid, 0, {"sort_index": index})
    named: set[tuple[int, int]] = set()
    for t in rows.threads(conn, cols, sel):
        pid, tid = int(t["pid"]), int(t["tid"])
        name = t["comm"] or comm.get(pid) or "thread"
        out.meta("thread_name", pid, tid, {"name": f"thread {tid} ({name})"})
        # the main thread first, then by tid (Kineto sorts by tid)
        out.meta("thread_sort_index", pid, tid, {"sort_index": 0 if tid == pid else tid})
        named.add((pid, tid))
    out.meta("process_name", HOST_PID, 0, {"name": "host"})
    out.meta("process_labels", HOST_PID, 0, {"labels": "about 1 Hz samples, whole machine"})
    out.meta("process_sort_index", HOST_PID, 0, {"sort_index": PID_LIMIT})
    return named


def _calls(conn: duckdb.DuckDBPyConnection, cols: rows.Columns, sel: rows.Selection, out: _Out) -> None:
    # a stack's args are encoded once: thousands of calls share a few stacks
    stacks = {
        sid: ("" if label is None else f'"python":{_ENCODE(label)},') + f'"stack":{_ENCODE(frames)}'
        for sid, (frames, label) in rows.stacks(conn, sel).items()
    }
    for batch in rows.calls(conn, cols, sel):
        for c in batch:
            out.event(
                "cuda_call",
                "X",
                c["op"],
                c["pid"],
                c["tid"],
                c["ts_ns"],
                cat="cuda_driver" if c["layer"] == "driver" else "cuda_runtime",
                dur_ns=c["dur_ns"],
                args={
                    "op": c["op"],
                    "bytes": c["bytes"],
                    "kind": c["kind"],
                    "stream": c["stream"],
                    "kernel": c["kernel"],
                    "kernel_note": c["kernel_note"],
                    "ret": c["ret"],
                    "off_cpu_us": c["off_cpu_ns"] / 1e3 if c["off_cpu_ns"] else None,
                    "runq_us": c["runq_ns"] / 1e3 if c["runq_ns"] else None,
                },
                args_tail=stacks.get(c["stack_id"], "") if c["stack_id"] is not None else "",
            )


def _woken_by(pid: int | None, tid: int | None, comm: str | None) -> str | None:
    """Who woke the thread, as every view names it: a task as comm (pid/tid), an interrupt by its kind."""
    if pid is None:
        return None
    return f"{waker_name(pid, comm)} ({pid}/{tid})" if pid else waker_name(pid, comm)


def _off_cpu(conn: duckdb.DuckDBPyConnection, cols: rows.Columns, sel: rows.Selection, out: _Out) -> None:
    for batch in rows.off_cpu(conn, cols, sel):
        for s in batch:
            holder = s["preempted_by_pid"]
            waker = s["waker_pid"]
            out.event(
                "off_cpu",
                "X",
                f"off-CPU {s['reason'] or '?'}",
                s["pid"],
                s["tid"],
                s["ts_ns"],
                cat="sched",
                dur_ns=s["dur_ns"],
                args={
                    "reason": s["reason"],
                    "cpu": s["cpu"],
                    "runq_us": s["runq_ns"] / 1e3 if s["runq_ns"] else None,
                    "held_cpu": f"{s['preempted_by_comm'] or '?'} ({holder})" if holder is not None else None,
                    "held_cpu_pid": holder,
                    "woken_by": _woken_by(waker, s["waker_tid"], s["waker_comm"]),
                    "woken_by_pid": waker,
                    "in_call": s["in_call"],
                },
            )


# Lines listed per thread-second: a thread runs a handful of lines a second, and the rest are in tracer flame
SAMPLE_LINES = 3


def _samples(conn: duckdb.DuckDBPyConnection, cols: rows.Columns, sel: rows.Selection, out: _Out) -> None:
    """Write the on-CPU samples: per sampled thread-second, an instant on the thread's track named by the line it
    ran most, and a point of its CPU-time counter on its process.

    Why instants and counters, not slices: ``cpu_samples`` counts per second, so when in the second a line ran
    is not known. A slice (``X``) per second would have to nest with the calls and off-CPU slices of the same
    track, which cross second boundaries (Perfetto drops or misnests slices that overlap without nesting), and a
    slice per line would invent where in the second it ran. A thread-scoped instant (``s: t``; Perfetto makes it a
    zero-length slice of the thread's track) nests inside anything; one per thread-second, not per line, since
    instants at one timestamp overlap into one clickable mark: the top ``SAMPLE_LINES`` lines go in its args.
    How much CPU the thread used is a counter (``C``), the format's way to draw a quantity per interval; counters
    belong to a process in both viewers, so each thread's is on its process, named by its tid, and falls to 0 in
    the first second the thread was not sampled. Two events per thread-second at most: bounded by the recording's
    length times its threads, whatever its call rate.
    """
    last: tuple[int, int, int] | None = None  # (pid, tid, sec) of the last second written

    def close(pid: int, tid: int, sec: int) -> None:
        # the thread was not sampled in the second after `sec`: its counter falls to 0 there
        if (sec + 1) * 1_000_000_000 < sel.end_ns:
            out.event("counter", "C", f"on-CPU thread {tid}", pid, tid, (sec + 1) * 1_000_000_000, args={"ms/s": 0})

    def second(g: list[rows.Row]) -> None:
        nonlocal last
        r = g[0]
        pid, tid, sec = int(r["pid"]), int(r["tid"]), int(r["sec"])
        if last is not None and (last[:2] != (pid, tid) or last[2] + 1 < sec):
            close(*last)
        last = (pid, tid, sec)
        ts = sec * 1_000_000_000
        cpu_ms = round(int(r["total_cpu_ns"]) / 1e6, 3)
        out.event("counter", "C", f"on-CPU thread {tid}", pid, tid, ts, args={"ms/s": cpu_ms})
        out.event(
            "cpu_samples",
            "i",
            f"on-CPU {r['line']}",
            pid,
            tid,
            ts,
            cat="cpu_samples",
            extra='"s":"t"',
            args={
                "samples": r["total_samples"],
                "cpu_ms": cpu_ms,
                "in_call_samples": r["in_call_samples"] or None,
                "kernel_samples": r["kernel_samples"] or None,
                "lines": [
                    {"line": x["line"], "samples": x["samples"], "cpu_ms": round(int(x["cpu_ns"]) / 1e6, 3)} for x in g
                ],
                "more_lines": int(r["lines"]) - len(g) or None,
            },
        )

    group: list[rows.Row] = []
    for batch in rows.sample_lines(conn, cols, sel, SAMPLE_LINES):
        for r in batch:
            if group and r["rank"] == 1:
                second(group)
                group = []
            group.append(r)
    if group:
        second(group)
    if last is not None:
        close(*last)


def _holders(
    conn: duckdb.DuckDBPyConnection,
    cols: rows.Columns,
    sel: rows.Selection,
    out: _Out,
    named: set[tuple[int, int]],
    traced: set[int],
    n_procs: int,
    elsewhere: set[int] | frozenset[int] = frozenset(),
) -> None:
    """Write a 'held the CPU' slice on each holder's track and a flow arrow to it from the waiting thread.

    A holder outside ``traced`` gets a track labelled not traced, or, in ``elsewhere`` (a rank's file: another
    rank's or the launcher's process), as traced in another file."""
    lanes: dict[int, list[int]] = {}  # holder pid -> end ns of the last hold in each lane
    untraced: dict[int, str] = {}
    flow = 0
    for batch in rows.held_cpu(conn, cols, sel):
        for h in batch:
            pid, start, end = int(h["holder_pid"]), int(h["hold_ns"]), int(h["ts_ns"]) + int(h["dur_ns"])
            ends = lanes.setdefault(pid, [])
            lane = next((i for i, e in enumerate(ends) if e <= start), len(ends))
            if lane == len(ends):
                ends.append(end)
            else:
                ends[lane] = end
            tid = PID_LIMIT * (lane + 1) + pid
            if (pid, tid) not in named:
                named.add((pid, tid))
                lane_name = "held the CPU while traced threads waited" + (f" #{lane + 1}" if lane else "")
                out.meta("thread_name", pid, tid, {"name": lane_name})
                out.meta("thread_sort_index", pid, tid, {"sort_index": PID_LIMIT + lane})
            if pid not in traced:
                untraced.setdefault(pid, h["holder_comm"] or str(pid))
            out.event(
                "held_cpu",
                "X",
                "held the CPU",
                pid,
                tid,
                start,
                cat="sched",
                dur_ns=end - start,
                args={
                    "waiting": f"{h['comm'] or '?'} ({h['pid']}/{h['tid']})",
                    "waiting_pid": h["pid"],
                    "waiting_tid": h["tid"],
                    "cpu": h["cpu"],
                    "runq_us": h["runq_ns"] / 1e3,
                },
            )
            flow += 1
            # start inside the waiting thread's off-CPU slice (itself inside the call), end inside the hold
            mid_wait = int(h["ts_ns"]) + int(h["dur_ns"]) // 2
            out.event("flow", "s", "waited for", h["pid"], h["tid"], mid_wait, cat="preemption", extra=f'"id":{flow}')
            out.event(
                "flow",
                "f",
                "waited for",
                pid,
                tid,
                start + (end - start) // 2,
                cat="preemption",
                extra=f'"id":{flow},"bp":"e"',
            )
    for rank, (pid, name) in enumerate(sorted(untraced.items()), start=n_procs):
        out.meta("process_name", pid, 0, {"name": name})
        out.meta("process_labels", pid, 0, {"labels": IN_OTHER_FILE if pid in elsewhere else NOT_TRACED})
        out.meta("process_sort_index", pid, 0, {"sort_index": rank})


def _lifecycle(conn: duckdb.DuckDBPyConnection, sel: rows.Selection, out: _Out) -> None:
    for e in rows.lifecycle(conn, sel):
        out.event(
            "lifecycle",
            "i",
            e["kind"],
            e["pid"],
            e["pid"],
            e["ts_ns"],
            cat="process",
            extra='"s":"p"',
            args={
                "comm": e["comm"],
                "ppid": e["ppid"],
                "child": e["child"],
                "filename": e["filename"],
                "exit_code": e["exit_code"],
            },
        )


def _chains(conn: duckdb.DuckDBPyConnection, sel: rows.Selection, out: _Out, chains: list[Any] | None) -> None:
    """Write each chain of the window as a global instant; in a rank's file, the chains that name one of its
    processes, or none (the host's own)."""
    if chains is None:
        from tracer.analysis.chains import compute_chains

        chains = compute_chains(conn, limit=1_000_000).chains
    mine = set(sel.pids) if sel.pids is not None else None
    for c in chains:
        if not sel.start_ns <= c.start_ns < sel.end_ns:
            continue
        if mine is not None and c.pids and not mine.intersection(c.pids):
            continue
        out.event(
            "chain",
            "i",
            f"{c.severity} {c.category}",
            HOST_PID,
            0,
            c.start_ns,
            cat="causal_chain",
            extra='"s":"g"',
            args={
                "summary": c.summary,
                "op": c.op,
                "pids": c.pids,
                "end_s": c.end_ns / 1e9,
                "impact_ms": c.impact_ms,
                "id": c.id,
                "fix": c.recommendations[0] if c.recommendations else None,
            },
        )


# host_samples column -> (counter name, series key, scale to the unit, per second?)
_HOST_SERIES = (
    ("cpu_busy_pct", "CPU busy", "%", 1.0, False),
    ("load1", "load", "1 min", 1.0, False),
    ("runnable", "runnable", "tasks", 1.0, False),
    ("mem_available_bytes", "memory available", "MB", 1e-6, False),
    ("swap_used_bytes", "swap used", "MB", 1e-6, False),
    ("page_alloc_bytes", "page alloc host", "MB/s", 1e-6, True),
    ("target_page_alloc_bytes", "page alloc traced", "MB/s", 1e-6, True),
    ("page_faults", "page faults traced", "/s", 1.0, True),
    ("ctx_switches", "context switches host", "/s", 1.0, True),
    ("tracer_cpu_ms", "tracer CPU", "ms/s", 1.0, True),
)


def _counters(conn: duckdb.DuckDBPyConnection, cols: rows.Columns, sel: rows.Selection, out: _Out) -> None:
    # one series per counter name: chrome://tracing stacks the series of one name, which would add a subset
    # (the traced tree's page allocation) to its whole (the host's)
    for h in rows.host(conn, cols, sel):
        per_s = 1e9 / h["dt_ns"]
        for col, name, key, scale, rate in _HOST_SERIES:
            v = h[col]
            if v is None:
                continue
            value = round(v * scale * (per_s if rate else 1.0), 3)
            out.event("counter", "C", name, HOST_PID, 0, h["ts_ns"], args={key: value})
    for r in rows.page_alloc(conn, cols, sel):
        out.event(
            "counter",
            "C",
            "page alloc",
            r["pid"],
            0,
            int(r["sec"]) * 1_000_000_000,
            args={"MB/s": round((r["page_alloc_bytes"] or 0) / 1e6, 3)},
        )
