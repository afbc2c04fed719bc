"""A recording session: start the probes, run the drain loop, write the DB, flush on every way out.

The pieces (one module each): the BPF program and its links (program.py, links.py), the attached libraries and
holds (attach.py), the process tree (proctree.py), the event-fed process maps (procmaps.py), stack and kernel-name
resolution (stack_resolver.py), the overhead budget (budget.py), the guardian (guardian.py), a launched command
(command.py), the column builders (columns.py), the end of the recording and its session row (finalize.py) and the
store (store.py). This module only orders them in time: set-up, the drain loop, the per-second tick.

The loop: every DRAIN_S the ring buffers are drained in dependency order (mappings, lifecycle, code objects,
kernel names, stacks, calls, off-CPU intervals) and the batches go to the store's writer thread. Every second:
a host sample, the finished seconds of the per-second aggregates, the sampling and overhead budgets, and the
status line. The run ends on Ctrl-C, ``--duration``, or when the whole target tree has exited; each path ends in
:meth:`Recorder.finish` (finalize.Ending), which writes the exact aggregates and the session row and closes the DB.
"""

from __future__ import annotations

import ctypes as ct
import logging
import os
import select
import shutil
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from probes.catalog import CATALOG
from tracer import procfs
from tracer.errors import EnvironmentProblem, StoreError, TargetError, UsageError
from tracer.newfile import check_new_file
from tracer.recorder import bpfmaps, columns, events, finalize, guardian, profile_columns, sampler, targets
from tracer.recorder.attach import Attacher, runtime_launch_op_ids
from tracer.recorder.budget import (
    DUTY_CYCLED,
    DutyCycler,
    OverheadEstimator,
    calls_by_pid_op,
    trap_cost,
)
from tracer.recorder.clocks import read_start_clocks
from tracer.recorder.command import LaunchedCommand
from tracer.recorder.cpython.gcprobe import GcProbes
from tracer.recorder.finalize import Ending, RecordSummary, cpu_s
from tracer.recorder.placement import PlacementWatch
from tracer.recorder.preflight import check_environment
from tracer.recorder.procmaps import MapCache, Mapping, kernel_dev
from tracer.recorder.proctree import ProcessTree
from tracer.recorder.program import (
    ProbeSet,
    ProgramOptions,
    configure_ops,
    mark_links_closed,
    prepare_program,
    sample_every,
    set_sample_every,
)
from tracer.recorder.ringbuf import DirectRing
from tracer.recorder.stack_resolver import StackResolver
from tracer.recorder.store import Store
from tracer.recorder.sysinfo import ProcSampler

log = logging.getLogger(__name__)

DRAIN_S = 0.2  # ring buffers are drained on this timer (bulk events do not wake the recorder, BPF_RB_NO_WAKEUP)
# ...or this one while the node agent (no target given) traces no process: nothing is traced, so no ring fills, and
# a process that loads CUDA wakes the loop at once (its hold); 5 empty drains a second took the idle agent from
# 0.73% of a core to 1.04% (issue 32, bench/agent_idle.py)
IDLE_DRAIN_S = 1.0
IDLE_SNAPSHOT_NS = 1_000_000_000  # a thread off CPU this long is snapshotted again (issue 29: "not run for a second")
# Off-CPU intervals: always keep >= 1 ms and those inside a call; store 1 in N of the rest.
SCHED_KEEP_NS = 1_000_000
SCHED_SAMPLE_EVERY = 16
# An exited process (or thread) leaves the tree, its caches dropped and its row written, this long after its exit:
# by then its last calls, stacks and per-second aggregates (drained up to the second before last) are handled.
RETIRE_AFTER_NS = 5_000_000_000
_RUNTIME_LAUNCH_OPS = np.array(sorted(runtime_launch_op_ids()))
_CACHE_DIR = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "cuda-host-tracer"
)


@dataclass
class RecordOptions:
    db: Path
    pid: int | None = None
    command: list[str] | None = None
    duration: float | None = None
    libs: list[str] = field(default_factory=list)
    force: bool = False
    max_events_per_s: int = 20_000  # stored cuda_calls rows per second before sampling kicks in
    python_stacks: bool = True
    overhead_budget: float = 2.0  # percent of one CPU the probes may cost the target; launches duty-cycled above it
    launch_probes: str = "auto"  # auto | driver | both (tracer/recorder/attach.py)
    sched_sample_every: int = SCHED_SAMPLE_EVERY
    keep_command: bool = False  # at --duration, leave a launched command running instead of stopping it
    mcp_http: str | None = None  # serve the recording in progress over MCP at [HOST]:PORT (tracer/live.py)
    mcp_token_file: Path | None = None
    sample_hz: int = sampler.DEFAULT_HZ  # on-CPU samples per second of CPU (cpu_samples); 0: no sampling
    offcpu_stacks: bool = True  # capture where target threads block (offcpu_stacks)
    max_db_bytes: int | None = None  # --max-db-size: thin the oldest detail rows to keep the file under it
    metrics_listen: tuple[str, int] | None = None  # --metrics: serve Prometheus metrics at (HOST, PORT) (metrics.py)
    metrics_token: str | None = None  # the bearer token a scrape must send (a non-loopback --metrics)
    chains_every_s: float = 60.0  # --chains-every: least seconds between tracer_chain_active's computations; 0: off


class Recorder(Ending):
    """One recording into one DB. ``run()`` returns the summary; every exit path goes through ``finish()``.

    Args:
        on_status: called with a one-line status about once a second, and with messages worth showing.
    """

    def __init__(self, opts: RecordOptions, on_status: Callable[[str], None] | None = None) -> None:
        self.opts = opts
        self.on_status = on_status
        self.notes: list[str] = []
        self.stop_reason: str | None = None
        self.command: LaunchedCommand | None = None
        self._interrupted = False
        self._checked = False
        self._since_start0 = procfs.seconds_since_start()  # process start -> now, at construction
        self._mono0 = time.monotonic()
        self.phases: dict[str, float] = {}
        self.first_event_ns: int | None = None
        self.py_version: str | None = None
        self.pyrt: Any = None
        self.gc_probes: GcProbes | None = None  # CPython's collector, on each interpreter file (with Python stacks)
        self._py_pending: dict[int, int] = {}  # pid -> configure attempts while its interpreter is not found
        self.stored_per_op = np.zeros(len(CATALOG), dtype=np.int64)
        self._last_hits = np.zeros(len(CATALOG), dtype=np.int64)
        self._last_tick = time.monotonic()
        self._last_cpu = cpu_s()
        self._launch_tally = [0, 0]  # runtime launch events, of which nested (for --launch-probes auto)
        self._calls_by_tid: dict[int, int] = {}  # tid -> CUDA calls, of threads that made any (threads.cuda_calls)
        self._rewritable = finalize.Rewritable()  # processes/threads rows a live snapshot wrote (finalize.py)
        self._lost_proc_seen = 0  # lifecycle events lost, as of the last look for exits they hid
        self._sampled_at = time.monotonic()
        self._session_written = False
        self.live: Any = None
        self._live_failed = False
        self.metrics: Any = None  # (MetricsState, MetricsServer) with --metrics
        self.chains: Any = None  # the ChainWatch behind tracer_chain_active (--metrics, --chains-every > 0)
        self._dumper: Any = None
        self._snapped: dict[int, int] = {}  # tid -> its exec clock at its last snapshot: one per time it stops
        self._last_ran: dict[int, int | None] = {}  # tid -> its exec clock at the last tick's look

    @property
    def all_cuda(self) -> bool:
        """The node agent: no --pid and no command, so every process that maps a CUDA library is traced, from
        the /proc scan at start or from its first open of one (libload.bpf.c, CFG_ALL_CUDA)."""
        return self.opts.pid is None and not self.opts.command

    def _elapsed(self) -> float:
        """Seconds since the `tracer record` process started."""
        return self._since_start0 + (time.monotonic() - self._mono0)

    # --- set-up -------------------------------------------------------------------------------------------

    def _validate(self) -> None:
        o = self.opts
        if o.pid is not None and o.command:
            raise UsageError(
                "give either --pid PID or a command after --, not both", "e.g. sudo tracer record --pid 1234"
            )
        if o.duration is not None and o.duration <= 0:
            raise UsageError("--duration must be positive")
        if o.overhead_budget <= 0:
            raise UsageError("--overhead-budget must be a positive percentage", "e.g. --overhead-budget 2")
        if not 0 <= o.sample_hz <= sampler.MAX_HZ:
            raise UsageError(f"--sample-hz must be 0..{sampler.MAX_HZ}", f"e.g. --sample-hz {sampler.DEFAULT_HZ}")
        if o.launch_probes not in ("auto", "driver", "both"):
            raise UsageError(f"unknown --launch-probes {o.launch_probes!r}", "use auto, driver or both")
        check_new_file(o.db, o.force, "--db", StoreError)
        if o.pid is not None:
            targets.check_pid(o.pid)
        elif o.command:
            if shutil.which(o.command[0]) is None:
                raise TargetError(f"command not found: {o.command[0]}")
        self.lib_args = [targets.check_library_arg(p) for p in o.libs]

    def _configure_bpf(self) -> None:
        b = self.bpf
        configure_ops(b)
        cfg = b["cfg"]
        for idx, val in (
            (events.C.CFG_START_NS, self.start_mono),
            (events.C.CFG_SCHED_KEEP_NS, SCHED_KEEP_NS),
            (events.C.CFG_SCHED_EVERY, self.opts.sched_sample_every),
            (events.C.CFG_LIBGATE, 1),
            (events.C.CFG_OFFCPU_STACKS, int(self.opts.offcpu_stacks)),
            (events.C.CFG_ALL_CUDA, int(self.all_cuda)),
        ):
            cfg[ct.c_int(idx)] = ct.c_uint64(val)

    def _links_closed(self, at_ns: int, sets: Iterable[ProbeSet]) -> None:
        """The links of ``sets`` finished closing at ``at_ns``: their calls in flight since before missed their
        return (cuda.bpf.c ``missed_return``)."""
        mark_links_closed(self.bpf, [op for ps in sets for op in ps.cookies], at_ns)

    def _set_gate(self, on: bool) -> None:
        self.bpf["cfg"][ct.c_int(events.C.CFG_LIBGATE)] = ct.c_uint64(int(on))

    def _add_tracer_pid(self, pid: int) -> None:
        self.bpf["tracer_pids"][ct.c_uint32(pid)] = ct.c_uint8(1)

    def _add_target(self, pid: int, ppid: int | None = None, first_ns: int = 0, python: bool = True) -> None:
        """A process joins the traced tree. ``python``: configure its Python walker now (not for the launched
        command's fork, which is a copy of the recorder until it execs)."""
        self.bpf["targets"][ct.c_uint32(pid)] = ct.c_uint8(1)
        try:  # a launched command is forked by the recorder, so the kernel made it a tracer process at first
            del self.bpf["tracer_pids"][ct.c_uint32(pid)]
        except KeyError:
            pass
        self.tree.add_target(pid, ppid, first_ns)
        self.placement.note(pid, first_ns)
        self.maps.attach(pid)
        if self.pyrt is not None and python:
            self._pyrt_configure(pid)

    def _pyrt_configure(self, pid: int) -> None:
        target = None
        try:
            target = self.pyrt.configure(pid)
        except Exception as e:  # a process we cannot walk still gets its calls traced
            log.debug("python frames unavailable for %d: %s", pid, e)
        # Right after exec a shared libpython is not mapped yet: try again when it is (its map event) or every
        # second, a few times at most.
        tries = self._py_pending.pop(pid, 0)
        if target is None and tries < 10:
            self._py_pending[pid] = tries + 1

    # --- the run -------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Refuse bad options, a DB path that cannot be written and a machine that cannot trace (TracerError), before
        anything is attached or written: a caller may say "recording into …" only after this. Done once."""
        if not self._checked:
            self._validate()
            check_environment()
            self._checked = True

    def run(self) -> RecordSummary:
        """Record until stopped; return the summary. Raises TracerError before anything is written."""
        self.check()
        if self.opts.metrics_listen is not None:
            self._start_metrics()  # a port in use is refused before anything is written
        # both clocks read back to back: the realtime one lines this recording up with other hosts' (a job)
        clocks = read_start_clocks()
        self.start_mono = clocks.mono_ns
        self.realtime_at_start_ns, self.clock_read_ns = clocks.realtime_ns, clocks.read_ns
        self.started_at = datetime.fromtimestamp(clocks.realtime_ns // 1000 / 1e6, timezone.utc)
        use_py = self.opts.python_stacks
        try:
            prepared = prepare_program(ProgramOptions(with_pyframes=use_py))
            self.bpf, self.progs = prepared.bpf, prepared.progs
        except Exception as e:
            raise EnvironmentProblem(f"the BPF program failed to load: {e}", "run `tracer doctor`") from None
        # the compile's (or cache load's) own time, most of it overlapping the imports when prewarmed
        self.phases["compile_s"] = prepared.seconds
        self._configure_bpf()
        # The guardian first: from here on the probes may stop a process, and nothing may leave one stopped.
        self.guardian = guardian.spawn(
            self.bpf["held"].map_fd,
            self.bpf["cfg"].map_fd,
            events.C.CFG_LIBGATE,
            keep_fds=list(self.bpf.tracepoint_fds.values()),  # their slow detach becomes the guardian's
        )
        self.tree = ProcessTree(self.start_mono)
        for pid, comm in ((os.getpid(), "tracer"), (self.guardian.pid, "tracer-guardian")):
            self._add_tracer_pid(pid)
            self.tree.add_tracer(pid, comm)
        if use_py:
            from tracer.recorder.pyruntime import PyRuntimeManager

            self.pyrt = PyRuntimeManager(self.bpf)
            self.gc_probes = GcProbes(self.progs.gc, notes=self.notes)
            self.pyrt.on_interpreter = self.gc_probes.attach
        self.maps = MapCache()
        native = self.bpf["native_stacks"]
        self.resolver = StackResolver(
            self.maps,
            self.pyrt,
            native_walk=lambda sid: [int(a) for a in native.walk(sid)],
            put_stack=lambda sid, frames: self.store.put("stacks", columns.stack_columns(sid, frames)),
            parent_of=lambda pid: self.tree.procs[pid].ppid if pid in self.tree.procs else None,
            more_codes=self._drain_codes,
        )
        self.cycler = DutyCycler(count_calls=lambda: calls_by_pid_op(self.bpf), on_closed=self._links_closed)
        self.attacher = Attacher(
            self.bpf, self.progs, self.maps.resolver, self.cycler, self.opts.launch_probes, self.notes
        )
        self._open_rings()
        self.sampler = ProcSampler()
        self.placement = PlacementWatch()
        self.store = Store(
            self.opts.db, force=self.opts.force, start_mono_ns=self.start_mono, max_bytes=self.opts.max_db_bytes
        )
        # From here on every way out (Ctrl-C, the target exiting, an error) goes through finish().
        old_int = signal.signal(signal.SIGINT, self._on_signal)
        old_term = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            self._write_session_row("recording")
            if self.opts.mcp_http is not None:
                self._start_live()
            if self.metrics is not None and self.opts.chains_every_s > 0:
                self._start_chains()
            t = time.monotonic()
            self._attach_targets()
            self._start_sampler()
            self.phases["attach_s"] = time.monotonic() - t
            self._read_host_counters()
            self.phases["startup_s"] = self._elapsed()
            self.phases["startup_cpu_s"] = cpu_s()
            self._live_since = (time.monotonic(), cpu_s())  # the steady recording's clock and CPU start here
            if self.command is not None:
                self.command.release()
            self.trap, measured = trap_cost(_load_uprobe(self.bpf, "calib_probe"), _CACHE_DIR)
            if measured:
                log.info("trap cost %.1f us (+%.1f us return)", self.trap.entry_ns / 1e3, self.trap.return_ns / 1e3)
            self.estimator = OverheadEstimator(self.trap, self.opts.overhead_budget)
            self._loop()
        finally:
            # Ctrl-C from here on must not cut the flush short: the DB is written in full first.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                summary = self.finish(self.stop_reason or "failed")
            finally:
                signal.signal(signal.SIGINT, old_int)
                signal.signal(signal.SIGTERM, old_term)
        return summary

    def _start_live(self) -> None:
        """The MCP server over snapshots of this recording (tracer/live.py)."""
        from tracer.live import LiveServer

        self.live = LiveServer(self.opts.mcp_http or "", self.opts.mcp_token_file, self._snapshot_db)
        self.live.start()
        if self.live.proc is not None:  # the server's own watch of this process is a backstop's second line
            self.guardian.also_end(self.live.proc.pid, self.live.dir)
        self._status(f"serving this recording over MCP at http://{self.opts.mcp_http}/mcp (snapshots on demand)")

    def _snapshot_db(self, path: Path, on_done: Callable[[], None] | None = None) -> None:
        """Queue a snapshot of the recording so far at ``path`` (the live MCP server's and the chain watch's)."""
        self._write_totals(time.monotonic_ns(), live=True)  # op_stats, processes, threads as of now
        self._write_session_row("recording")  # flushed_ns: how far the snapshot goes
        self.store.snapshot(path, on_done)

    def _start_chains(self) -> None:
        """tracer_chain_active: the causal chains over snapshots of the recording, computed by a child process at
        most every --chains-every (tracer/live.py ChainWatch)."""
        from tracer.live import ChainWatch

        self.chains = ChainWatch(self.opts.chains_every_s, self._snapshot_db, self.metrics[0].set_chains)
        self.chains.start()
        if self.chains.proc is not None:  # ended by the guardian too if this process is killed
            self.guardian.also_end(self.chains.proc.pid, self.chains.dir)

    def _start_metrics(self) -> None:
        """The Prometheus endpoint (recorder/metrics.py), fed by the tick."""
        from tracer.recorder.metrics import MetricsServer, MetricsState

        host, port = self.opts.metrics_listen or ("127.0.0.1", 0)
        state = MetricsState()
        try:
            server = MetricsServer(host, port, state, self.opts.metrics_token)
        except OSError as e:
            raise UsageError(f"cannot serve --metrics on {host}:{port}: {e.strerror}", "pick a free port") from None
        server.start()
        self.metrics = (state, server)
        self._status(f"serving Prometheus metrics at http://{host}:{server.port}/metrics")

    def _start_sampler(self) -> None:
        """The on-CPU sampler (recorder/sampler.py); a kernel that refuses it leaves the recording without samples."""
        self.sampler_events = sampler.Sampler(self.bpf, self.opts.sample_hz)
        if not self.opts.sample_hz:
            return
        try:
            self.sampler_events.start()
        except Exception as e:
            self.sampler_events.hz = 0
            self.notes.append(f"no on-CPU samples: the kernel refused a cpu-clock perf event ({e})")

    def _open_rings(self) -> None:
        """Ring buffers, each into a buffer drained by the loop (the callbacks only copy bytes)."""
        self.rb_maps = events.RawBuffer(events.MAP_DTYPE)
        self.rb_proc = events.RawBuffer(events.PROC_DTYPE)
        self.rb_codes = events.TailBuffer(events.CODE_DTYPE, head=events.CODE_EVENT_HEAD)
        self.rb_knames = events.RawBuffer(events.KNAME_DTYPE)
        self.rb_comms = events.RawBuffer(events.COMM_DTYPE)
        self.rb_gc = events.RawBuffer(events.GC_DTYPE)
        # the two high-volume rings are read straight from their memory (tracer/recorder/ringbuf.py), the others by bcc
        self.rb_calls = DirectRing(self.bpf["calls"], events.CALL_DTYPE)
        self.rb_sched = DirectRing(self.bpf["sched_rb"], events.SCHED_DTYPE)
        self.rb_stacks: list[bytes] = []
        self.rb_ustacks: list[bytes] = []
        b = self.bpf
        b["maps_rb"].open_ring_buffer(self.rb_maps.callback)
        b["proc_rb"].open_ring_buffer(self.rb_proc.callback)
        b["knames_rb"].open_ring_buffer(self.rb_knames.callback)
        b["comms_rb"].open_ring_buffer(self.rb_comms.callback)
        b["gc_rb"].open_ring_buffer(self.rb_gc.callback)
        # stacks before their user-stack copies: a copy that comes a drain early waits for its stack
        b["stacks_rb"].open_ring_buffer(lambda _c, d, n: self.rb_stacks.append(ct.string_at(d, n)))
        b["ustack_rb"].open_ring_buffer(lambda _c, d, n: self.rb_ustacks.append(ct.string_at(d, n)))
        if self.pyrt is not None:
            b["codes_rb"].open_ring_buffer(self.rb_codes.callback)
        # woken only by a forced wakeup: a hold (maps_rb) or a burst filling a ring (calls, codes); else DRAIN_S passes
        self._wake = select.epoll()
        fds = [b["maps_rb"].map_fd, self.rb_calls.fileno(), self.rb_sched.fileno()]
        if self.pyrt is not None:
            fds.append(b["codes_rb"].map_fd)  # a burst of new code objects (pycode.h codes_wakeup)
        for fd in fds:
            self._wake.register(fd, select.EPOLLIN | select.EPOLLET)

    def _attach_targets(self) -> None:
        if self.all_cuda:
            self.root = 0
            for pid in targets.cuda_processes(exclude=self.tree.procs.keys()):
                self._add_target(pid)
        elif self.opts.pid is not None:
            for pid in targets.descendants(self.opts.pid):
                self._add_target(pid)
            self.root = self.opts.pid
        else:
            exe = shutil.which(self.opts.command[0]) if self.opts.command else None
            if self.pyrt is not None and exe:
                self.pyrt.register(os.path.realpath(exe))  # a python command then needs no hold at its exec
            self.command = LaunchedCommand(self.opts.command or [])
            self.root = self.command.start()
            self._add_target(self.root, ppid=os.getpid(), python=False)
        found = list(self.lib_args)
        for pid in self.tree.alive():
            libs, span = targets.mapped_cuda(pid)
            found += libs
            if span:  # where libcudart's text sits: driver launches from there are runtime launches
                self.bpf["rt_ranges"][ct.c_uint32(pid)] = self.bpf["rt_ranges"].Leaf(*span)
        for d in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
            found += targets.resolve_libraries([str(p) for p in Path(d).glob("libcud*.so*")])
        found += targets.resolve_libraries(targets.usual_library_paths())
        self.attacher.attach(found)
        if self.opts.pid is not None:
            # children forked between the /proc scan and the fork tracepoint's first hit
            for pid in targets.descendants(self.opts.pid):
                if pid not in self.tree.procs:
                    self._add_target(pid, first_ns=time.monotonic_ns() - self.start_mono)
        if self.all_cuda:
            n = len(self.tree.alive())
            self._status(
                f"tracing every CUDA process ({n} now); waiting for new ones, each from its first CUDA library load"
            )
        elif not any(targets.libraries_mapped(pid) for pid in self.tree.alive()):
            self._status("no CUDA library loaded by the target yet; waiting for one to be loaded...")
        self._snapshot("attach")

    def _loop(self) -> None:
        self.cycler.start()
        deadline = time.monotonic() + self.opts.duration if self.opts.duration else None
        next_tick = time.monotonic() + 1.0
        pending = [self.bpf["calls_pending"]] + ([self.bpf["codes_pending"]] if self.pyrt is not None else [])
        while not self._interrupted:
            # returns early only on a forced wakeup: a hold, or a burst filling the calls ring
            idle = self.all_cuda and not self.tree.alive()  # the agent, tracing nothing: wake for the tick only
            self._wake.poll(max(0.0, min(IDLE_DRAIN_S, next_tick - time.monotonic())) if idle else DRAIN_S)
            for table in pending:
                table[ct.c_int(0)] = ct.c_uint64(0)
            self._drain()
            self._apply_sampling_budget()
            now = time.monotonic()
            ticked = now >= next_tick
            if ticked:
                next_tick = now + 1.0
                self._tick()
            if deadline and now >= deadline:
                self.stop_reason = "complete"
                return
            if self._tree_exited(check_proc=ticked):
                self.stop_reason = "target_exited"
                return
        self.stop_reason = "interrupted"

    def _on_signal(self, _sig: int, _frame: Any) -> None:
        self._interrupted = True

    def _status(self, msg: str) -> None:
        if self.on_status:
            self.on_status(msg)

    def _tree_exited(self, check_proc: bool = True) -> bool:
        """Return True once every process of the traced tree has exited (a launched command is reaped here);
        never for the node agent, which runs until stopped.

        ``check_proc``: also ask /proc about the processes whose exit event has not arrived (a lost event). Once a
        second (the tick) is enough for that safety net: read at every drain it was ~0.5% of a core (issue 33);
        the exit events end the recording at the next drain."""
        if self.all_cuda:
            return False
        if self.command is not None and (status := self.command.reap()) is not None:
            p = self.tree.procs.get(self.root)
            if p and p.exit_code is None:
                p.exit_code = status
        alive = self.tree.alive()
        if not alive:
            return True
        return check_proc and not any(targets.is_alive(pid) for pid in alive)

    # --- draining ------------------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Everything the ring buffers hold, in dependency order: lifecycle first (an exec'd process gets its
        Python walker before the library open that holds it is released), then mappings.

        The calls and off-CPU rings are read first, the others after: a call's stack, its code objects and the
        mapping of its library were submitted before the call was, so reading them later finds every one of them
        (read the other way round, a call submitted between the two reads would point at a stack not yet seen).
        """
        calls = self.rb_calls.drain()
        sched = self.rb_sched.drain()
        self.bpf.ring_buffer_consume()
        self._handle_proc(self.rb_proc.drain())
        self._handle_maps(self.rb_maps.drain())
        # a full maps ring dropped mappings (it does not say whose): every process re-reads /proc at its next miss
        self.maps.note_lost(self._lost(events.C.LOST_MAPS))
        self._drain_codes()
        kn = self.rb_knames.drain()
        if len(kn):
            found = self.resolver.add_knames(kn)
            self.store.put(
                "kernel_names",
                {"pid": [r[0] for r in found], "func": [r[1] for r in found], "name": [r[2] for r in found]},
            )
        comms = self.rb_comms.drain()
        if len(comms):
            self.store.put("nccl_comms", columns.comm_columns(comms, self.start_mono))
        ustacks, self.rb_ustacks = self.rb_ustacks, []
        stacks, self.rb_stacks = self.rb_stacks, []
        if len(stacks) > 100:  # a first sight of many code paths: resolving them takes a moment
            self._status(f"resolving {len(stacks)} new call stacks…")
        self.resolver.add_ustacks(ustacks)
        self.resolver.add_stacks(stacks)
        self._handle_calls(calls)
        gcs = self.rb_gc.drain()
        if len(gcs):
            ids = self.resolver.plain_stack_ids(gcs["stack_ref"])
            self.store.put("gc_collections", columns.gc_columns(gcs, self.start_mono, ids))
        if len(sched):
            self.store.put("sched", columns.sched_columns(sched, self.start_mono))

    def _handle_maps(self, ev: np.ndarray) -> None:
        if len(ev) == 0:
            return
        opens = ev[ev["kind"] == events.C.MAP_LIB_OPEN]
        for e in opens[(opens["flags"] & events.C.MAPF_NEW_TARGET) != 0]:
            self._join(int(e["pid"]))
        for e in ev[ev["kind"] != events.C.MAP_LIB_OPEN]:
            pid, dev, ino = int(e["pid"]), kernel_dev(int(e["dev"])), int(e["ino"])
            names = events.map_names(e["names"], int(e["depth"]))
            path = self.maps.resolver.resolve(dev, ino, names, pid) or ""
            start, length, offset = int(e["start"]), int(e["len"]), int(e["pgoff"])
            if int(e["kind"]) == events.C.MAP_EXE:
                # a new image; its text was mapped by the kernel at start_code, which holds the file's first
                # executable PT_LOAD
                self.maps.on_exec(pid)
                elf = self.resolver.symbolizer.elves.get(path) if path else None
                offset = elf.text[0] if elf is not None and elf.text is not None else 0
            shown = path.split(f"/proc/{pid}/root", 1)[-1] if path else "/" + "/".join(names)
            self.maps.add(pid, Mapping(start, start + length, offset, shown, path, dev, ino))
            is_exe = int(e["kind"]) == events.C.MAP_EXE
            if self.pyrt is not None and self.pyrt.note_mapped(pid, dev, ino, start, int(e["pgoff"]), is_exe):
                self._py_pending.pop(pid, None)  # configured in kernel, from its registered binary
            if int(e["flags"]) & events.C.MAPF_HELD_PYTHON:
                # an interpreter seen for the first time: held at exec (or at its libpython's mmap) until its layout
                # is registered for the kernel, which configures every later process that maps it by itself
                if self.pyrt is not None and path:
                    self.pyrt.register(path, pid)
                    self._pyrt_configure(pid)
                self.attacher.release(pid)
            elif self.pyrt is not None and pid in self._py_pending and "python" in os.path.basename(shown):
                self._pyrt_configure(pid)  # its interpreter is mapped now
        if len(opens):
            self.attacher.handle_opens(opens, on_continue=self._before_continue)

    def _join(self, pid: int) -> None:
        """The node agent: ``pid`` opened a CUDA library and joined ``targets`` in kernel (held there, so its
        maps and Python layout are read before it runs on); its children forked before that join too."""
        now_ns = time.monotonic_ns() - self.start_mono
        for p in targets.descendants(pid):
            self.tree.release_exited(p)  # a pid reused before its exited process retired
            if p not in self.tree.procs:
                if p != pid:
                    self.bpf["targets"][ct.c_uint32(p)] = ct.c_uint8(1)
                self._add_target(p, first_ns=now_ns)

    def _lost_join(self, pid: int) -> None:
        """A held process whose library open event was lost (attach.release_stale, before it runs on): if it
        joined the traced set in kernel (the node agent, libload.bpf.c) it is registered as the event would have
        (its maps, Python layout, placement and container), and its Python walker configured."""
        if self.all_cuda and pid not in self.tree.procs and self.bpf["targets"].get(ct.c_uint32(pid)) is not None:
            self._join(pid)
        self._before_continue(pid)

    def _before_continue(self, pid: int) -> None:
        """A held process is about to run on: configure its Python walker while it cannot race us."""
        if self.pyrt is not None and pid in self._py_pending:
            self._pyrt_configure(pid)

    def _drain_codes(self) -> None:
        """Take the Python code objects BPF read (the names of the stacks' frames)."""
        if self.pyrt is not None:
            codes = self.rb_codes.drain()
            if len(codes):
                self.pyrt.add_code_events(codes)

    def _handle_proc(self, ev: np.ndarray) -> None:
        if len(ev) == 0:
            return
        ch = self.tree.apply(ev)
        # execs first: a process that exec'd and then forked in this batch passes its new layout on
        now_ns = time.monotonic_ns() - self.start_mono
        for pid in ch.execs:
            self.placement.note(pid, now_ns, exec_from=ch.exec_from.get(pid))
            if self.pyrt is not None:
                # a new image: the old layout and code objects are gone (BPF dropped its pycfg and reads its code
                # objects again: pyframes.h exec_gen)
                self.pyrt.forget(pid)
                self._py_pending.pop(pid, None)
                self._pyrt_configure(pid)
        for parent, child in ch.forks:
            self.maps.on_fork(parent, child)
            if self.pyrt is not None:
                self.pyrt.note_fork(parent, child)
        for pid in ch.exits:
            self._py_pending.pop(pid, None)  # nothing left to configure; retried, it re-reads /proc every second
        cols = columns.proc_event_columns(ev, self.start_mono)
        if len(cols["pid"]):
            self.store.put("process_events", cols)

    def _handle_calls(self, ev: np.ndarray) -> None:
        if len(ev) == 0:
            return
        if self.first_event_ns is None:
            self.first_event_ns = int(ev["ts_ns"].min())
        ops = ev["op"].astype(np.int64)
        self.stored_per_op += np.bincount(ops, minlength=len(CATALOG))[: len(CATALOG)]
        rt = np.isin(ops, _RUNTIME_LAUNCH_OPS)
        if rt.any():
            self._launch_tally[0] += int(rt.sum())
            self._launch_tally[1] += int((rt & ((ev["flags"] & events.C.CALL_F_NESTED) != 0)).sum())
        kernels, notes = self.resolver.kernels(ev)
        stack_ids = self.resolver.stack_ids(ev["stack_ref"], ops)
        if self.metrics is not None:
            self.metrics[0].add_waits(ev["pid"], ev["tid"], ops, stack_ids)
        self.store.put("cuda_calls", columns.call_columns(ev, self.start_mono, kernels, notes, stack_ids))

    # --- every second --------------------------------------------------------------------------------------

    def _read_host_counters(self) -> np.ndarray:
        hc = self.bpf["host_counters"]
        vals = np.array([sum(hc[ct.c_int(i)]) for i in range(events.C.HC_COUNT)], dtype=np.int64)
        delta = vals - getattr(self, "_last_counters", vals)
        self._last_counters = vals
        return delta

    def _snapshot(self, reason: str) -> None:
        """Store what the target threads are doing now (tracer.snapshot, no process stopped): all of them at attach
        and at the end; at "idle" (each tick) only those that have not run for IDLE_SNAPSHOT_NS and have not been
        read since they last ran. A failure costs the snapshot, never the recording."""
        try:
            from tracer.snapshot import kernel
            from tracer.snapshot.dump import Dumper, snapshot_columns

            if self._dumper is None:
                self._dumper = Dumper(runtime=self.pyrt) if self.pyrt is not None else Dumper()
            ts = time.monotonic_ns() - self.start_mono
            rows = []
            with kernel.SchedClock() as clock:
                for pid in self.tree.alive():
                    only = None
                    if reason == "idle":
                        only = set()
                        for tid in kernel.tids(pid):
                            # Its exec clock first, with no clock of its CPU to read (that moves this thread there:
                            # most of this look's cost, 0.7% of a core in the demo): a thread that ran since the
                            # last tick has not been off CPU for a tick's second, and one read since it last ran is
                            # done; only the rest are timed.
                            seen = kernel.off_cpu(pid, tid, None)
                            if seen is None or seen.state == "R":
                                continue
                            before, self._last_ran[tid] = self._last_ran.get(tid), seen.last_ran
                            if seen.last_ran is not None and (
                                seen.last_ran == self._snapped.get(tid) or before not in (None, seen.last_ran)
                            ):
                                continue
                            k = kernel.off_cpu(pid, tid, clock)
                            if k is None or k.idle_ns is None or k.idle_ns < IDLE_SNAPSHOT_NS:
                                continue
                            if self._snapped.get(tid) != k.last_ran:
                                only.add(tid)
                                self._snapped[tid] = k.last_ran
                        if not only:
                            continue
                    rows += self._dumper.process(pid, clock, only)
            if rows:
                self.store.put("thread_snapshots", snapshot_columns(rows, ts, reason))
        except Exception as e:  # noqa: BLE001 - a snapshot is a bonus, the recording goes on without it
            log.debug("thread snapshot (%s) failed: %s", reason, e)

    def _tick(self) -> None:
        self._snapshot("idle")
        now = time.monotonic()
        ts = time.monotonic_ns() - self.start_mono
        s = self.sampler.sample()
        d = self._read_host_counters()
        cpu = cpu_s()
        tracer_ms = (cpu - self._last_cpu) * 1e3
        self._last_cpu = cpu
        self.store.put(
            "host_samples",
            {
                "ts_ns": [ts],
                "load1": [s.load1],
                "cpu_busy_pct": [s.cpu_busy_pct],
                "runnable": [s.runnable],
                "mem_available_bytes": [s.mem_available_bytes],
                "swap_used_bytes": [s.swap_used_bytes],
                "page_alloc_bytes": [int(d[events.C.HC_PAGE_ALLOC])],
                "target_page_alloc_bytes": [int(d[events.C.HC_TARGET_PAGE_ALLOC])],
                "page_faults": [int(d[events.C.HC_TARGET_FAULTS])],
                "ctx_switches": [int(d[events.C.HC_SWITCHES])],
                "tracer_cpu_ms": [tracer_ms],
            },
        )
        self._write_placement(ts)
        self._drain_aggregates(before_sec=ts // 1_000_000_000 - 1)
        self._apply_overhead_budget(now - self._last_tick)
        self._last_tick = now
        self.attacher.release_stale(older_than_ns=2_000_000_000, on_lost=self._lost_join)
        if self.chains is not None:
            self.chains.tick(self.store.rows_written.get("cuda_calls", 0))
        if self.metrics is not None:
            self.metrics[0].refresh(self.bpf, self.tree.procs, self.tree.alive())
        if self.live is not None:
            self.live.refresh()
            why = self.live.failure()
            if why and not self._live_failed:
                self._live_failed = True
                self.notes.append(f"the live MCP server stopped: {why}")
                self._status(f"the live MCP server stopped: {why}")
        self.attacher.note_runtime_launches(*self._launch_tally, on_closed=self._links_closed)
        self._launch_tally = [0, 0]
        for pid in list(self._py_pending):
            self._pyrt_configure(pid)
        self._retire(ts)
        stored = self.store.rows_written.get("cuda_calls", 0)
        frac = self.cycler.fraction
        self._status(
            f"{ts / 1e9:4.0f}s  calls stored {stored:,}  lost {self._lost():,}  processes {len(self.tree.alive())}  "
            f"holds {self.attacher.holds.count}  overhead ~{self.estimator.overhead_pct:.1f}%"
            + (f" (launches sampled {frac:.0%})" if frac < 1 else "")
        )

    def _write_placement(self, ts: int | None) -> None:
        """This second's throttling and per-CPU idle samples (none when ``ts`` is None), and the placement rows
        read since the last call (recorder/placement.py)."""
        if ts is not None:
            throttling, idle = self.placement.sample(ts)
            if throttling["ts_ns"]:
                self.store.put("cgroup_cpu", throttling)
            if idle["ts_ns"]:
                self.store.put("cpu_idle", idle)
        rows = self.placement.take_rows()
        if rows["pid"]:
            self.store.put("process_placement", rows)

    def _retire(self, now_ns: int) -> None:
        """Write the final rows of the processes and threads that exited RETIRE_AFTER_NS ago and drop everything
        kept for them (issue 21: memory bounded by the live processes, not by every process the job forked)."""
        lost = self._lost(events.C.LOST_PROC)
        if lost > self._lost_proc_seen:  # some exits may be among them: a process never seen to exit never retires
            self._lost_proc_seen = lost
            self.tree.note_unseen_exits(now_ns, targets.is_alive)
        gone = self.tree.retire(now_ns - RETIRE_AFTER_NS)
        if not gone.procs and not gone.threads:
            return
        finalize.write_retired(self.store, gone, self._calls_by_tid, self._rewritable)
        for t in gone.threads:  # the idle look's per-thread clocks (a reused tid is only read once more)
            self._snapped.pop(t.tid, None)
            self._last_ran.pop(t.tid, None)
        for p in gone.procs:
            if p.pid in self.tree.procs:
                continue  # its pid was reused (ProcessTree.apply): the caches under it are the new process's
            self.maps.forget(p.pid)
            self.placement.forget(p.pid)
            self.resolver.forget(p.pid)
            self._py_pending.pop(p.pid, None)
            if self.pyrt is not None:
                self.pyrt.forget(p.pid)

    def _launch_sampled(self, sec: int) -> float:
        t0 = self.start_mono + sec * 1_000_000_000
        return self.cycler.live_share(t0, t0 + 1_000_000_000)

    def _drain_aggregates(self, before_sec: int | None) -> None:
        """Move the finished seconds of the per-second BPF aggregates to the DB (all of them when None)."""

        def take(name: str, kdt: np.dtype, vdt: np.dtype) -> columns.Aggregates:
            table = self.bpf[name]
            keys, vals = bpfmaps.dump(table, kdt, vdt)
            if before_sec is not None:
                done = keys["sec"] <= before_sec
                keys, vals = keys[done], vals[done]
            bpfmaps.delete(table, keys)
            return columns.Aggregates(keys, vals)

        tb = take("tbreak", events.TB_KEY_DTYPE, events.TB_VAL_DTYPE)
        if len(tb):
            bd = columns.breakdown_columns(tb, self._launch_sampled)
            self.store.put("thread_breakdown", bd)
            if self.metrics is not None:
                self.metrics[0].add_breakdown(bd, tb.vals["v"][:, events.C.TB_CALLS])
            self.store.put("sched_stats", columns.sched_stats_columns(tb))
            for tid, n in zip(tb.keys["tid"].tolist(), tb.vals["v"][:, events.C.TB_CALLS].tolist(), strict=True):
                if n:  # most threads of a job make no CUDA call: no entry (threads.cuda_calls reads 0)
                    self._calls_by_tid[tid] = self._calls_by_tid.get(tid, 0) + int(n)
        wk = take("wake_aggs", events.WAKE_KEY_DTYPE, events.WAKE_VAL_DTYPE)
        if len(wk):
            self.store.put("thread_wakers", columns.waker_columns(wk))
        pr = take("preempt_aggs", events.PREEMPT_KEY_DTYPE, events.PREEMPT_VAL_DTYPE)
        if len(pr):
            self.store.put("preemptors", columns.preemptor_columns(pr))
        # their stacks were sent when first seen, so the drain that ran before this one resolved them
        off = take("offcpu_aggs", events.OFFCPU_KEY_DTYPE, events.OFFCPU_VAL_DTYPE)
        if len(off):
            ids = self.resolver.plain_stack_ids(off.keys["stack_ref"])
            self.store.put("offcpu_stacks", profile_columns.offcpu_stack_columns(off, ids))
        smp = take("sample_aggs", events.SAMPLE_KEY_DTYPE, events.SAMPLE_VAL_DTYPE)
        if len(smp):
            ids = self.resolver.plain_stack_ids(smp.keys["stack_ref"])
            period = self.sampler_events.period_ns if hasattr(self, "sampler_events") else 0
            self.store.put("cpu_samples", profile_columns.cpu_sample_columns(smp, ids, period))

    def _apply_sampling_budget(self) -> None:
        """Keep stored call rows under max_events_per_s by storing the busiest ops 1 in N (counts stay exact in
        op_stats; slow calls are always kept). Checked at every drain, so a burst is sampled within a drain."""
        now = time.monotonic()
        elapsed = now - self._sampled_at
        if elapsed < DRAIN_S / 2 and self.stored_per_op.sum() < self.opts.max_events_per_s * DRAIN_S:
            return
        rate = self.stored_per_op / max(elapsed, 1e-3)
        self.stored_per_op[:] = 0
        self._sampled_at = now
        total = float(rate.sum())
        if total <= self.opts.max_events_per_s:
            return
        for op in np.argsort(-rate):
            if rate[op] == 0 or total <= self.opts.max_events_per_s:
                break
            set_sample_every(self.bpf, int(op), max(1, sample_every(self.bpf, int(op))) * 2)
            total -= rate[op] / 2

    def _apply_overhead_budget(self, seconds: float) -> None:
        """Estimate the probes' cost from this interval's hits and set the launch probes' duty cycle."""
        hc = self.bpf["op_hits"]
        hits = np.array([sum(hc[ct.c_int(i)]) for i in range(len(CATALOG))], dtype=np.int64)
        delta, self._last_hits = hits - self._last_hits, hits
        now = time.monotonic_ns()
        share = self.cycler.live_share(now - int(seconds * 1e9), now)
        self.cycler.fraction = self.estimator.update(
            int(delta[DUTY_CYCLED].sum()), int(delta[~DUTY_CYCLED].sum()), share, seconds
        )

    def _lost(self, kind: int | None = None) -> int:
        """Ring-buffer drops: of one kind (events.C.LOST_*) or all."""
        lost = self.bpf["lost"]
        kinds = range(events.C.LOST_COUNT) if kind is None else (kind,)
        return int(sum(lost[ct.c_int(i)].value for i in kinds))


def _load_uprobe(bpf: Any, name: str) -> int:
    from bcc import BPF

    from tracer.recorder.links import UPROBE_MULTI

    return int(bpf.load_func(name, BPF.KPROBE, attach_type=UPROBE_MULTI).fd)
