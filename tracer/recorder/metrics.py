"""The Prometheus endpoint of a recording in progress (``tracer record --metrics [HOST]:PORT``): the metric families
(their names are a contract: deploy/'s dashboard and alert rules use them, tests/test_deploy.py checks that), the
snapshot the recorder's per-second tick builds from what it already reads, and the HTTP server that renders it.

A scrape never touches the BPF maps nor waits for the recorder: the tick (session.py, once a second) publishes an
immutable :class:`Snapshot` by one attribute assignment, and the server thread renders whichever snapshot is
current (prometheus_client's text exposition writer), adding the recorder's own CPU and memory read at the scrape.

What the tick reads for it: the two exact in-kernel maps ``op_totals`` and ``op_hist`` (one batch dump each, as the
duty cycler's window counts already do), the ``lost`` counters, and the thread_breakdown seconds it drains anyway
(:meth:`MetricsState.add_breakdown`).

Cardinality is bounded by the processes alive plus those that exited in the last :data:`RETAIN_S`: an exited
process's series stay that long, so a scrape every 15 s still reads its final counts, then go.
"""

from __future__ import annotations

import ctypes as ct
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from probes.catalog import CATALOG, NO_ARG, OpClass
from tracer import containers, procfs, steprule
from tracer.bearer import authorized
from tracer.hist import slot_bounds
from tracer.recorder import bpfmaps, events

log = logging.getLogger(__name__)

RETAIN_S = 60.0  # an exited process's series stay this long (>= 30 s: two scrapes at the usual 15 s), then go

# The histogram's upper bounds, in ns: powers of two from 256 ns to ~17 s. Each is a bucket edge of the in-kernel
# histogram (tracer/hist.py: every power of two >= 16 ns is one), so every cumulative count is exact, not
# interpolated; x2 steps keep a series at 28 buckets.
BUCKETS_NS: tuple[int, ...] = tuple(1 << k for k in range(8, 35))

# container: the short id its cgroup names (tracer/containers.py), '' outside one
OP_LABELS = ("op", "layer", "pid", "comm", "rank", "container")
PROC_LABELS = ("pid", "comm", "rank", "container")
LOST_KINDS: dict[str, int] = {
    "calls": events.C.LOST_CALLS,
    "stacks": events.C.LOST_STACKS,
    "sched": events.C.LOST_SCHED,
    "proc": events.C.LOST_PROC,
    "codes": events.C.LOST_CODES,
    "maps": events.C.LOST_MAPS,
    "aggs": events.C.LOST_AGGS,
}
# thread_breakdown's parts (events.TB_PARTS, which add up to a thread's wall time), named without their unit
PARTS: tuple[str, ...] = tuple(p.removesuffix("_ns") for p in events.TB_PARTS)


@dataclass(frozen=True)
class Family:
    """One metric family: its name as exposed (a counter's with ``_total``), type, help and labels."""

    name: str
    type: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()

    def samples(self) -> tuple[str, ...]:
        """The sample names a scrape holds for this family (what PromQL can select)."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


CALL_DURATION = Family(
    "tracer_cuda_call_duration_seconds",
    "histogram",
    "Duration of CUDA calls, from the exact in-kernel histograms: _count is every call made (a duty-cycled launch "
    "op counts the calls its probes saw).",
    OP_LABELS,
)
COPY_BYTES = Family(
    "tracer_cuda_copy_bytes_total", "counter", "Bytes moved by CUDA copy calls (every call).", OP_LABELS
)
THREAD_TIME = Family(
    "tracer_thread_time_seconds_total",
    "counter",
    "Time of each process's training thread (its thread that made the most CUDA calls), by part: on CPU, in a "
    "CUDA call by class, waiting for a CPU (behind itself, its job, others, the tracer) or blocked. The parts add "
    "up to its wall time; finished seconds only (about 2 s behind).",
    (*PROC_LABELS, "part"),
)
EVENTS_LOST = Family(
    "tracer_events_lost_total",
    "counter",
    "Ring-buffer records lost to a full buffer, by kind; the call counts and histograms stay exact.",
    ("kind",),
)
CPU_SECONDS = Family("tracer_cpu_seconds_total", "counter", "CPU time the recorder process used (user + system).")
RESIDENT = Family("tracer_resident_memory_bytes", "gauge", "Resident memory of the recorder process.")
STEPS = Family(
    "tracer_steps_total",
    "counter",
    "Training steps each process completed: its thread with the most waits for the GPU, one step per period of "
    "its wait sequence (the analyses' step rule, tracer/steprule.py). Served once the period is settled (48 "
    "waits) or the process has exited.",
    PROC_LABELS,
)
CHAIN_ACTIVE = Family(
    "tracer_chain_active",
    "gauge",
    "1 while a causal chain of this category and severity (HIGH or MEDIUM) is active on the node: found by the "
    "analyses (`tracer chains`) over the recording, its affected range ending in the last few minutes; 0 once none "
    "is. Computed at most once a --chains-every, and only when new calls were stored.",
    ("category", "severity"),
)
PROCESSES = Family(
    "tracer_processes", "gauge", "Traced processes alive, and exited ones still reported (state=exited).", ("state",)
)

FAMILIES: tuple[Family, ...] = (
    CALL_DURATION,
    COPY_BYTES,
    THREAD_TIME,
    STEPS,
    CHAIN_ACTIVE,
    EVENTS_LOST,
    CPU_SECONDS,
    RESIDENT,
    PROCESSES,
)
# waits a thread's step period is settled on: the period is looked for up to MAX_PER_STEP, in three repeats
SETTLE_WAITS = 3 * steprule.MAX_PER_STEP


def served_names() -> frozenset[str]:
    """Every sample name the endpoint can serve: the names a dashboard or alert rule may use."""
    return frozenset(s for f in FAMILIES for s in f.samples())


# --- the snapshot ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSeries:
    """One (pid, op)'s call durations and bytes, as of the snapshot."""

    labels: tuple[str, ...]  # OP_LABELS' values
    cumulative: tuple[int, ...]  # calls <= each of BUCKETS_NS, then all of them (+Inf)
    sum_s: float
    copy_bytes: int | None  # a copy op's bytes; None for the others


@dataclass(frozen=True)
class Snapshot:
    """What one tick publishes; never changed after (the server thread reads it while the next one is built)."""

    ops: tuple[OpSeries, ...] = ()
    thread_time: tuple[tuple[tuple[str, ...], float], ...] = ()  # (PROC_LABELS + part, seconds)
    lost: tuple[tuple[str, int], ...] = ()
    steps: tuple[tuple[tuple[str, ...], int], ...] = ()  # (PROC_LABELS, steps)
    alive: int = 0
    exited: int = 0
    chains: tuple[tuple[tuple[str, str], int], ...] = ()  # ((category, severity), 1 active | 0 no longer)


_MAX_SLOT = 1024  # slots of a u64 latency: (63 - 3) * 16 + 15 = 975
_SLOT_HI = np.array([slot_bounds(s)[1] for s in range(_MAX_SLOT)], dtype=np.float64)
_BUCKETS = np.array(BUCKETS_NS, dtype=np.float64)
_IS_COPY = np.array([s.op_class == OpClass.COPY and s.bytes_arg != NO_ARG for s in CATALOG])


def bucket_counts(slots: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Return the cumulative counts over BUCKETS_NS then +Inf of one series' in-kernel (slot, count) entries: a
    slot is under a bound when its upper edge is (the bounds are slot edges, so none is split)."""
    idx = np.searchsorted(_BUCKETS, _SLOT_HI[np.minimum(slots.astype(np.int64), _MAX_SLOT - 1)], side="left")
    per = np.bincount(idx, weights=counts.astype(np.float64), minlength=len(BUCKETS_NS) + 1)
    return np.cumsum(per).astype(np.int64)


@dataclass
class _Proc:
    labels: tuple[str, str, str, str]  # PROC_LABELS' values
    frozen: bool = False  # labels fixed: it made a CUDA call (so past its exec), and its series keep them
    gone_at: float | None = None  # monotonic s when first seen exited


@dataclass
class _Waits:
    """One thread's waits for the GPU: counts, and the first SETTLE_WAITS (op, stack id) keys, of each layer."""

    runtime: int = 0
    driver: int = 0
    keys_rt: list[tuple[int, int]] = field(default_factory=list)
    keys_drv: list[tuple[int, int]] = field(default_factory=list)

    def add(self, op: int, stack_id: int) -> None:
        if op in steprule.RUNTIME_OP_IDS:
            self.runtime += 1
            keys = self.keys_rt
        else:
            self.driver += 1
            keys = self.keys_drv
        if len(keys) < SETTLE_WAITS:
            keys.append((op, stack_id))

    def steps(self, final: bool) -> int | None:
        """Steps completed (each one's last wait seen); None while the period may still change (a counter must not
        go down), unless ``final`` (the process exited)."""
        n, keys = (self.runtime, self.keys_rt) if self.runtime else (self.driver, self.keys_drv)
        if len(keys) < SETTLE_WAITS and not final:
            return None
        return n // (steprule.markers_per_step(keys) if len(keys) >= 3 else 1)


@dataclass
class MetricsState:
    """The recorder-side state behind the snapshots: touched by the recorder's thread only."""

    procs: dict[int, _Proc] = field(default_factory=dict)
    # (pid, tid) -> [calls, part ns...]: the thread_breakdown seconds drained so far, of threads in retained processes
    threads: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    trainer: dict[int, int] = field(default_factory=dict)  # pid -> its training thread's tid, once it made a call
    dropped: set[int] = field(default_factory=set)  # pids whose series went (their in-kernel totals stay)
    waits: dict[tuple[int, int], _Waits] = field(default_factory=dict)  # (pid, tid) -> its waits for the GPU
    failures: int = 0  # snapshots that failed (logged once)
    snapshot: Snapshot = field(default_factory=Snapshot)
    # (category, severity) -> 1 while active, 0 after: a series once served stays, at 0, so an alert on it resolves
    # on a sample rather than on the series' staleness; bounded by the categories x 2 severities
    chain_active: dict[tuple[str, str], int] = field(default_factory=dict)

    def set_chains(self, active: Iterable[tuple[str, str]]) -> None:
        """The (category, severity) of the chains active now (from the chain watch, tracer/live.py); every other
        series served before goes to 0. Published at the next tick."""
        now = set(active)
        for key in self.chain_active:
            self.chain_active[key] = 0
        for key in now:
            self.chain_active[key] = 1

    def add_breakdown(self, bd: Mapping[str, Any], calls: np.ndarray) -> None:
        """Add drained thread_breakdown rows (columns.breakdown_columns' columns; ``calls``: each row's CUDA calls)."""
        try:
            self._add_breakdown(bd, calls)
        except Exception as e:  # a bug here must not end a recording
            self._failed(e)

    def _add_breakdown(self, bd: Mapping[str, Any], calls: np.ndarray) -> None:
        parts = np.stack([np.asarray(bd[p], dtype=np.int64) for p in events.TB_PARTS], axis=1)
        rows = np.concatenate([np.asarray(calls, dtype=np.int64)[:, None], parts], axis=1)
        for pid, tid, row in zip(bd["pid"].tolist(), bd["tid"].tolist(), rows, strict=True):
            if pid in self.dropped:
                continue
            acc = self.threads.get((pid, tid))
            if acc is None:
                self.threads[(pid, tid)] = row.copy()
            else:
                acc += row

    def add_waits(self, pids: np.ndarray, tids: np.ndarray, ops: np.ndarray, stack_ids: list[int | None]) -> None:
        """Drained calls (every wait for the GPU is one: they are never sampled), for the step counts."""
        try:
            for pid, tid, op, sid in zip(pids.tolist(), tids.tolist(), ops.tolist(), stack_ids, strict=True):
                if op in steprule.WAIT_OP_IDS and pid not in self.dropped:
                    self.waits.setdefault((pid, tid), _Waits()).add(op, sid or 0)
        except Exception as e:  # a bug here must not end a recording
            self._failed(e)

    def _trainer_of(self, pid: int, tids: Iterable[int]) -> int | None:
        """The process's thread with the most CUDA calls; the one chosen stays until another has twice its calls,
        so its counters do not jump between threads."""
        best = max(tids, key=lambda t: self.threads[(pid, t)][0], default=None)
        if best is None or self.threads[(pid, best)][0] == 0:
            return self.trainer.get(pid)
        cur = self.trainer.get(pid)
        if (
            cur is None
            or (pid, cur) not in self.threads
            or self.threads[(pid, best)][0] > 2 * self.threads[(pid, cur)][0]
        ):
            self.trainer[pid] = best
        return self.trainer[pid]

    def refresh(self, bpf: Any, procs: Mapping[int, Any], alive: Iterable[int], now: float | None = None) -> None:
        """Build and publish the snapshot from the in-kernel maps. ``procs``: the tree's ProcInfo by pid (for the
        labels); ``alive``: the pids not known to have exited. A failure keeps the last snapshot: the metrics are
        never a reason for the recording to stop."""
        now = time.monotonic() if now is None else now
        try:
            keys, vals = bpfmaps.dump(bpf["op_totals"], events.OP_KEY_DTYPE, events.OP_TOTAL_DTYPE)
            hkeys, hvals = bpfmaps.dump(bpf["op_hist"], events.HIST_KEY_DTYPE, events.COUNT_DTYPE)
            lost = bpf["lost"]
            lost_n = tuple((name, int(lost[ct.c_int(i)].value)) for name, i in LOST_KINDS.items())
            self.publish(keys, vals, hkeys, hvals, procs, set(alive), now, lost_n)
        except Exception as e:  # a bug here must not end a recording
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        if not self.failures:
            log.warning("the metrics snapshot failed (the last one is served): %s", e, exc_info=True)
        self.failures += 1

    def publish(
        self,
        keys: np.ndarray,
        vals: np.ndarray,
        hkeys: np.ndarray,
        hvals: np.ndarray,
        procs: Mapping[int, Any],
        alive: set[int],
        now: float,
        lost: tuple[tuple[str, int], ...] = (),
    ) -> None:
        """Build the snapshot from dumped ``op_totals`` (keys, vals) and ``op_hist`` (hkeys, hvals): the pure part
        of :meth:`refresh`."""
        called = set(keys["pid"].tolist())
        for pid in called | {p for p, _ in self.threads}:
            p = self.procs.get(pid)
            if (p is not None and p.frozen) or (p is None and pid in self.dropped and pid not in alive):
                continue
            self.dropped.discard(pid)
            info = procs.get(pid)
            if info is None and p is not None:  # left the tree: it keeps the name it had there
                p.frozen = p.frozen or pid in called
                continue
            rank = info.dist.rank if info is not None and info.dist is not None else None
            st = procfs.stat(pid) if info is None else None
            comm = info.comm if info is not None else st.comm if st is not None else ""
            box = info.container if info is not None else ident.container if (ident := containers.read(pid)) else ""
            # until its first CUDA call a process may still exec (a launched command is first a fork of ours)
            self.procs[pid] = _Proc(
                (str(pid), comm, "" if rank is None else str(rank), box),
                pid in called,
                p.gone_at if p is not None else None,
            )
        for pid, p in list(self.procs.items()):  # an exited process's series stay RETAIN_S
            if pid in alive:
                p.gone_at = None
            elif p.gone_at is None:
                p.gone_at = now
            elif now - p.gone_at > RETAIN_S:
                self._forget(pid)
        hist = _group_hist(hkeys, hvals)
        ops: list[OpSeries] = []
        for i, (pid, op) in enumerate(zip(keys["pid"].tolist(), keys["op"].tolist(), strict=True)):
            if op >= len(CATALOG) or pid not in self.procs:
                continue
            spec = CATALOG[op]
            slots, counts = hist.get((pid, op), (np.zeros(0, np.int64), np.zeros(0, np.int64)))
            cum = bucket_counts(slots, counts)
            ops.append(
                OpSeries(
                    (spec.op, spec.layer_name, *self.procs[pid].labels),
                    tuple(cum.tolist()),
                    int(vals["total_ns"][i]) / 1e9,
                    int(vals["bytes"][i]) if _IS_COPY[op] else None,
                )
            )
        tt: list[tuple[tuple[str, ...], float]] = []
        by_pid: dict[int, list[int]] = {}
        for pid, tid in self.threads:
            by_pid.setdefault(pid, []).append(tid)
        for pid, tids in by_pid.items():
            if pid not in self.procs:
                continue
            tid = self._trainer_of(pid, tids)
            if tid is None:
                continue  # a process that made no CUDA call has no training thread
            row = self.threads[(pid, tid)]
            tt += [((*self.procs[pid].labels, part), int(row[1 + j]) / 1e9) for j, part in enumerate(PARTS)]
        most: dict[int, int] = {}  # pid -> steps of its thread with the most (each thread's count only grows)
        for (pid, _tid), w in self.waits.items():
            n = w.steps(final=pid not in alive)
            if n is not None and pid in self.procs:
                most[pid] = max(n, most.get(pid, 0))
        steps = tuple((self.procs[pid].labels, n) for pid, n in most.items())
        gone = sum(p.gone_at is not None for p in self.procs.values())
        chains = tuple(sorted(self.chain_active.items()))
        self.snapshot = Snapshot(tuple(ops), tuple(tt), lost, steps, len(self.procs) - gone, gone, chains)

    def _forget(self, pid: int) -> None:
        del self.procs[pid]
        self.dropped.add(pid)
        self.trainer.pop(pid, None)
        for key in [k for k in self.threads if k[0] == pid]:
            del self.threads[key]
        for key in [k for k in self.waits if k[0] == pid]:
            del self.waits[key]


def _group_hist(hkeys: np.ndarray, hvals: np.ndarray) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """op_hist's entries grouped by (pid, op): (slots, counts) of each."""
    if len(hkeys) == 0:
        return {}
    pid = hkeys["pid"].astype(np.int64)
    op = hkeys["op"].astype(np.int64)
    order = np.lexsort((op, pid))
    pid, op, slot, cnt = pid[order], op[order], hkeys["slot"][order], np.asarray(hvals)[order]
    cut = np.flatnonzero((np.diff(pid) != 0) | (np.diff(op) != 0)) + 1
    out = {}
    for a, b in zip(np.r_[0, cut].tolist(), np.r_[cut, len(pid)].tolist(), strict=True):
        out[(int(pid[a]), int(op[a]))] = (slot[a:b], cnt[a:b])
    return out


# --- rendering ---------------------------------------------------------------------------------------------------


def _le(ns: int) -> str:
    return repr(ns / 1e9)


_LE = tuple(_le(b) for b in BUCKETS_NS) + ("+Inf",)


def families(snap: Snapshot, cpu_s: float, rss_bytes: int | None) -> Iterator[Metric]:
    """The metric families of ``snap``, with the recorder's CPU and memory as read at the scrape."""
    h = HistogramMetricFamily(CALL_DURATION.name, CALL_DURATION.help, labels=list(OP_LABELS))
    c = CounterMetricFamily(COPY_BYTES.name, COPY_BYTES.help, labels=list(OP_LABELS))
    for s in snap.ops:
        h.add_metric(list(s.labels), list(zip(_LE, s.cumulative, strict=True)), s.sum_s)
        if s.copy_bytes is not None:
            c.add_metric(list(s.labels), s.copy_bytes)
    yield h
    yield c
    t = CounterMetricFamily(THREAD_TIME.name, THREAD_TIME.help, labels=list(THREAD_TIME.labels))
    for labels, seconds in snap.thread_time:
        t.add_metric(list(labels), seconds)
    yield t
    st = CounterMetricFamily(STEPS.name, STEPS.help, labels=list(STEPS.labels))
    for labels, n in snap.steps:
        st.add_metric(list(labels), n)
    yield st
    ch = GaugeMetricFamily(CHAIN_ACTIVE.name, CHAIN_ACTIVE.help, labels=list(CHAIN_ACTIVE.labels))
    for (category, severity), v in snap.chains:
        ch.add_metric([category, severity], v)
    yield ch
    lost = CounterMetricFamily(EVENTS_LOST.name, EVENTS_LOST.help, labels=["kind"])
    for kind, n in snap.lost:
        lost.add_metric([kind], n)
    yield lost
    yield CounterMetricFamily(CPU_SECONDS.name, CPU_SECONDS.help, value=cpu_s)
    if rss_bytes is not None:
        yield GaugeMetricFamily(RESIDENT.name, RESIDENT.help, value=rss_bytes)
    p = GaugeMetricFamily(PROCESSES.name, PROCESSES.help, labels=["state"])
    p.add_metric(["alive"], snap.alive)
    p.add_metric(["exited"], snap.exited)
    yield p


def render(snap: Snapshot) -> bytes:
    """The text exposition of ``snap`` (what GET /metrics answers)."""
    t = os.times()

    class _One(Collector):
        def collect(self) -> Iterable[Metric]:
            return families(snap, t.user + t.system, procfs.resident_bytes())

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_One())
    return generate_latest(reg)


# --- the server --------------------------------------------------------------------------------------------------


class MetricsServer:
    """GET /metrics over HTTP from a thread, rendering ``state.snapshot`` as it is at the request. With ``token``,
    a request without ``Authorization: Bearer <token>`` gets 401 (the MCP server's check, tracer/bearer.py)."""

    def __init__(self, host: str, port: int, state: MetricsState, token: str | None = None) -> None:
        self.state = state
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if token and not authorized({b"authorization": self.headers.get("Authorization", "").encode()}, token):
                    self._send(
                        401,
                        b"send Authorization: Bearer <token> (--mcp-token-file or TRACER_MCP_TOKEN)\n",
                        "text/plain",
                        [("WWW-Authenticate", 'Bearer realm="metrics"')],
                    )
                    return
                if self.path.split("?", 1)[0] != "/metrics":
                    self._send(404, b"only /metrics is served\n", "text/plain")
                    return
                try:
                    body = render(server.state.snapshot)
                except Exception as e:
                    log.warning("rendering /metrics failed: %s", e, exc_info=True)
                    self._send(500, f"rendering the metrics failed: {e}\n".encode(), "text/plain")
                    return
                self._send(200, body, CONTENT_TYPE_LATEST)

            def _send(self, code: int, body: bytes, ctype: str, extra: list[tuple[str, str]] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in extra or []:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("metrics: " + format, *args)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if _is_v6(host) else socket.AF_INET

        self.httpd = Server((host, port), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _is_v6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
