"""A recording session: attach to the target tree, poll the ring buffers, write the DB, flush on every way out.

The loop (every POLL_MS): drain the four ring buffers (lifecycle first, so processes exist before their calls),
decode them in batches (tracer/events.py), resolve stacks, queue Arrow batches to the store's writer thread. Every
second: host sample, finished per-second scheduling aggregates, the sampling budget, newly mapped libraries, and
the status line. The run ends on Ctrl-C, ``--duration``, or when the whole target tree has exited; each path
ends in :meth:`Recorder.finish`, which writes the exact aggregates and the session row and closes the DB.
"""

from __future__ import annotations

import ctypes as ct
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from probes.catalog import CATALOG, DRIVER_COVERED, MEMCPY_KIND_NAMES, NO_ARG, OP_IDS, OP_NAMES, OpClass
from tracer import __version__, events, targets
from tracer.budget import MIN_FRACTION, DutyCycler, Probe, TrapCost, calibrate, required_fraction
from tracer.errors import EnvironmentProblem, TargetError, UsageError
from tracer.hist import percentile, slot_bounds
from tracer.program import ProgramOptions, attach_library, compile_program, detach_in_background
from tracer.store import Store, check_db_path
from tracer.sysinfo import ProcSampler, environment

log = logging.getLogger(__name__)

POLL_MS = 100
# Default slow thresholds (ns) per op class: calls this slow are always stored, with a stack. A launch that
# takes 200 us is already 20-50x its normal cost; a sync, copy or allocation past 1 ms is a visible stall.
SLOW_NS = {
    OpClass.LAUNCH: 200_000,
    OpClass.SYNC: 1_000_000,
    OpClass.ALLOC: 1_000_000,
    OpClass.FREE: 1_000_000,
    OpClass.COPY: 1_000_000,
    OpClass.OTHER: 1_000_000,
}
# Stack for 1 stored call in N: launches are the hot path, everything else is rare and diagnostic.
STACK_EVERY = {OpClass.LAUNCH: 64}
# Off-CPU intervals: always keep >= 1 ms and those inside a call; store 1 in N of the rest.
SCHED_KEEP_NS = 1_000_000
SCHED_SAMPLE_EVERY = 16
# Copy the user stack (16 KiB) for 1 in N captured stacks, besides every stack with new Python code: enough to
# see each call path's full native frames without the bandwidth of copying every one.
USTACK_EVERY = 32


PYS_STOPPED = 0x8000  # common.h: the stack's process waits for SIGCONT

# Per-op lookup tables for building cuda_calls columns without per-row Python work.
_OP_DICT = pa.array(OP_NAMES)
_LAYER_DICT = pa.array(["runtime", "driver"])
_LAYER_OF = np.array([int(s.layer) for s in CATALOG], dtype=np.int32)
_HAS_BYTES = np.array([s.bytes_arg != NO_ARG for s in CATALOG])
_HAS_STREAM = np.array([s.stream_arg != NO_ARG for s in CATALOG])
_IS_LAUNCH = np.array([s.op_class == OpClass.LAUNCH for s in CATALOG])
_KIND_NAMES = [MEMCPY_KIND_NAMES[k] for k in sorted(MEMCPY_KIND_NAMES)]
_KIND_DICT = pa.array(_KIND_NAMES)


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
    launch_probes: str = "driver"  # "driver": one trap per launch; "both": also probe the runtime's launch calls
    sched_sample_every: int = SCHED_SAMPLE_EVERY
    status: bool = True


@dataclass
class ProcInfo:
    pid: int
    ppid: int
    comm: str
    cmdline: str
    first_ns: int
    exit_ns: int | None = None
    exit_code: int | None = None


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
    ops: list[OpSummary]
    notes: list[str]


def check_environment() -> None:
    """Raise EnvironmentProblem unless this process can load BPF programs; mount tracefs/debugfs if needed."""
    if os.geteuid() != 0:
        raise EnvironmentProblem("recording needs root (BPF and uprobes)", "run it with sudo: sudo tracer record ...")
    try:
        import bcc  # noqa: F401
    except ImportError:
        raise EnvironmentProblem(
            "bcc (python3-bpfcc) is not importable",
            "run ./setup.sh, which installs it and the kernel headers",
        ) from None
    if not os.path.exists(f"/lib/modules/{os.uname().release}/build"):
        raise EnvironmentProblem(
            f"no kernel headers for {os.uname().release} (bcc compiles against them)",
            "run ./setup.sh: it installs them, or the newest Debian headers where none match",
        )
    for fs, where in (("tracefs", "/sys/kernel/tracing"), ("debugfs", "/sys/kernel/debug")):
        if not os.path.ismount(where):
            # bcc reads tracepoint formats from here; a fresh VM may not mount them at boot
            subprocess.run(["mount", "-t", fs, fs, where], capture_output=True)


def _pyruntime_available() -> bool:
    try:
        from tracer import pyruntime  # noqa: F401
    except ImportError:
        return False
    return (Path(__file__).resolve().parent.parent / "probes" / "pyframes.h").exists()


class Recorder:
    """One recording into one DB. ``run()`` returns the summary; every exit path goes through ``finish()``."""

    def __init__(self, opts: RecordOptions, on_status: Callable[[str], None] | None = None) -> None:
        self.opts = opts
        self.on_status = on_status
        self.notes: list[str] = []
        self.procs: dict[int, ProcInfo] = {}
        self.attached: dict[tuple[int, int], targets.LibraryFile] = {}
        self.stack_ids: dict[Any, int] = {}  # dedup key -> stack_id
        self.ref_frames: dict[int, tuple[Any, ...]] = {}  # BPF stack_ref -> frames, until its call arrives
        self.kernel_names: dict[tuple[int, int], str | None] = {}  # (pid, func) -> name, cache
        self.handle_names: dict[tuple[int, int], str] = {}  # (pid, CUfunction/CUkernel) -> name, from probes
        self.stored_per_op = np.zeros(len(CATALOG), dtype=np.int64)
        self.stop_reason: str | None = None
        self.child: int | None = None
        self._last_counters = np.zeros(4, dtype=np.int64)
        self._interrupted = False
        self.pyrt: Any = None
        self._py_pending: dict[int, int] = {}  # pid -> configure attempts, while its interpreter is not found
        self._unwind_tables: Any = None
        self.py_version: str | None = None
        self._overhead_samples: list[float] = []
        self.overhead_pct = 0.0
        self.symbolizer: Any = None

    # --- set-up -------------------------------------------------------------------------------------------

    def _validate(self) -> None:
        o = self.opts
        if (o.pid is None) == (not o.command):
            raise UsageError("give either --pid PID or a command after --", "e.g. sudo tracer record --pid 1234")
        if o.duration is not None and o.duration <= 0:
            raise UsageError("--duration must be positive")
        if o.overhead_budget <= 0:
            raise UsageError("--overhead-budget must be a positive percentage", "e.g. --overhead-budget 2")
        if o.launch_probes not in ("driver", "both"):
            raise UsageError(f"unknown --launch-probes {o.launch_probes!r}", "use driver or both")
        check_db_path(o.db, o.force)
        if o.pid is not None:
            targets.check_pid(o.pid)
        else:
            assert o.command
            if shutil.which(o.command[0]) is None:
                raise TargetError(f"command not found: {o.command[0]}")
        self.lib_args = [targets.check_library_arg(p) for p in o.libs]

    def _start_command(self) -> int:
        """Fork the command held before exec until the probes are attached; return its pid."""
        assert self.opts.command
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: wait for the go, then exec
            try:
                os.close(w)
                os.read(r, 1)
                os.close(r)
                os.execvp(self.opts.command[0], self.opts.command)
            except BaseException as e:
                os.write(2, f"error: cannot run {self.opts.command[0]}: {e}\n".encode())
            os._exit(127)
        os.close(r)
        self._go_fd = w
        return pid

    def _release_command(self) -> None:
        fd = getattr(self, "_go_fd", None)
        if fd is not None:
            os.write(fd, b"g")
            os.close(fd)
            self._go_fd = None

    def _configure_maps(self) -> None:
        b = self.bpf
        for i, spec in enumerate(CATALOG):
            b["cfg_sample_every"][ct.c_int(i)] = ct.c_uint32(1)
            b["cfg_slow_ns"][ct.c_int(i)] = ct.c_uint64(SLOW_NS[spec.op_class])
            b["cfg_stack_every"][ct.c_int(i)] = ct.c_uint32(STACK_EVERY.get(spec.op_class, 1))
        b["cfg_sched"][ct.c_int(0)] = ct.c_uint64(self.start_mono)
        b["cfg_sched"][ct.c_int(1)] = ct.c_uint64(SCHED_KEEP_NS)
        b["cfg_sched"][ct.c_int(2)] = ct.c_uint64(self.opts.sched_sample_every)
        b["cfg_libgate"][ct.c_int(0)] = ct.c_uint32(1)
        if self.pyrt is not None:  # cfg_hold exists only with the Python walker
            b["cfg_hold"][ct.c_int(0)] = ct.c_uint32(1)
        b["cfg_ustack_every"][ct.c_int(0)] = ct.c_uint32(USTACK_EVERY)

    def _add_target(self, pid: int, ppid: int | None = None, first_ns: int = 0) -> None:
        st = targets.proc_stat(pid)
        self.bpf["targets"][ct.c_uint32(pid)] = ct.c_uint8(1)
        if pid not in self.procs:
            self.procs[pid] = ProcInfo(
                pid,
                ppid if ppid is not None else (st[1] if st else 0),
                st[0] if st else "",
                targets.proc_cmdline(pid),
                first_ns,
            )
        if self.pyrt is not None:
            self._pyrt_configure(pid)

    def _pyrt_configure(self, pid: int) -> None:
        target = None
        try:
            target = self.pyrt.configure(pid)
            if target is not None and not self.py_version:
                self.py_version = ".".join(str(x) for x in target.version)
        except Exception as e:  # a process we cannot walk still gets its calls traced
            log.debug("python frames unavailable for %d: %s", pid, e)
        # Right after exec a shared libpython is not mapped yet: try again later (at its CUDA library load, which
        # stops the process, and every second) until it is, a few times at most.
        tries = self._py_pending.pop(pid, 0)
        if target is None and tries < 10:
            self._py_pending[pid] = tries + 1

    def _scan_libraries(self) -> None:
        found: list[targets.LibraryFile] = list(self.lib_args)
        for pid, p in list(self.procs.items()):
            if p.exit_ns is None:
                libs, span = targets.mapped_cuda(pid)
                found += libs
                if span:  # where libcudart sits: driver launches from there are runtime launches
                    self.bpf["rt_ranges"][ct.c_uint32(pid)] = self.bpf["rt_ranges"].Leaf(*span)
        if not self._scanned_usual:
            self._scanned_usual = True
            extra = []
            env_dirs = os.environ.get("LD_LIBRARY_PATH", "")
            for d in filter(None, env_dirs.split(":")):
                extra += [str(p) for p in Path(d).glob("libcud*.so*")]
            found += targets.resolve_libraries(targets.usual_library_paths() + extra)
        self._attach(found)

    def _attach(self, found: list[targets.LibraryFile]) -> None:
        """Attach to each new library file; driver files first, and a runtime's driver along with it."""
        new = [lib for lib in found if (lib.dev, lib.ino) not in self.attached]
        for lib in [x for x in new if x.kind == "cudart"]:
            # libcudart dlopens libcuda.so.1 at CUDA init: attach it now, so the runtime's launches are seen
            # (and relabelled) by the driver probes alone
            new += targets.driver_for(lib.path)
        new.sort(key=lambda x: x.kind != "cuda")
        for lib in new:
            key = (lib.dev, lib.ino)
            if key in self.attached:
                continue
            skip: frozenset[str] = frozenset()
            if lib.kind == "cudart" and self.opts.launch_probes == "driver" and self._driver_attached:
                skip = DRIVER_COVERED
            try:
                res = attach_library(self.bpf, lib.path, lib.kind, skip=skip)
            except Exception as e:
                self.notes.append(f"could not attach to {lib.path}: {e}")
                continue
            self.attached[key] = lib
            if lib.kind == "cuda" and "cuLaunchKernel" in res.attached:
                self._driver_attached = True
            for sym, op in res.probes:
                if CATALOG[OP_IDS[op]].op_class == OpClass.LAUNCH:
                    self.cycler.add(Probe(lib.path, sym, op))
            if res.skipped:
                self.notes.append(f"{os.path.basename(lib.path)}: not exported, skipped: {', '.join(res.skipped)}")
            log.info("attached %d ops to %s", len(res.attached), lib.path)

    # --- the loop ------------------------------------------------------------------------------------------

    def run(self) -> RecordSummary:
        """Record until stopped; return the summary. Raises TracerError before anything is written."""
        self._validate()
        check_environment()
        self.start_mono = time.monotonic_ns()
        self.started_at = datetime.now(timezone.utc)
        use_py = self.opts.python_stacks and _pyruntime_available()
        try:
            self.bpf = compile_program(ProgramOptions(with_pyframes=use_py))
        except Exception as e:
            raise EnvironmentProblem(f"the BPF program failed to load: {e}", "run `tracer doctor`") from None
        if use_py:
            from tracer.pyruntime import PyRuntimeManager

            self.pyrt = PyRuntimeManager(self.bpf)
        try:
            from tracer.symbolize import Symbolizer
            from tracer.unwind import UnwindTables

            self.symbolizer = Symbolizer()
            self._unwind_tables = UnwindTables()
        except ImportError:
            self.symbolizer = None
        log.info("BPF program loaded after %.2f s", (time.monotonic_ns() - self.start_mono) / 1e9)
        self._configure_maps()
        try:
            self.trap = calibrate(self.bpf)
        except Exception as e:  # no libc labs to time: assume this VM's typical cost
            log.warning("trap cost calibration failed (%s); assuming 12 us", e)
            self.trap = TrapCost(12_000.0, 1_000.0)
        log.info("trap cost %.1f us (+%.1f us return)", self.trap.entry_ns / 1e3, self.trap.return_ns / 1e3)
        self.cycler = DutyCycler(self.bpf)
        self._last_hits = np.zeros(len(CATALOG), dtype=np.int64)
        self._hot_pct = 0.0
        self.calls = events.RawBuffer(events.CALL_DTYPE)
        self.sched = events.RawBuffer(events.SCHED_DTYPE)
        self.proc = events.RawBuffer(events.PROC_DTYPE)
        self.knames = events.RawBuffer(events.KNAME_DTYPE)
        self.stacks = events.StackBuffer(on_record=self._prefetch_stack)
        self.lib_opens: list[tuple[int, str]] = []
        self.bpf["calls"].open_ring_buffer(self.calls.callback)
        self.bpf["sched_rb"].open_ring_buffer(self.sched.callback)
        self.bpf["proc_rb"].open_ring_buffer(self.proc.callback)
        self.bpf["stacks_rb"].open_ring_buffer(self.stacks.callback)
        self.bpf["libload_rb"].open_ring_buffer(self._on_lib_open)
        self.bpf["knames_rb"].open_ring_buffer(self.knames.callback)
        self.ustack_chunks: list[bytes] = []
        self.ustacks: dict[int, Any] = {}  # stack_ref -> UstackEvent, until its stack record is handled
        self.bpf["ustack_rb"].open_ring_buffer(self._on_ustack)
        self.sampler = ProcSampler()
        self._scanned_usual = False
        self._driver_attached = False

        self.store = Store(self.opts.db, force=self.opts.force)
        # From here on every way out (Ctrl-C, the target exiting, an error) goes through finish().
        old_int = signal.signal(signal.SIGINT, self._on_sigint)
        old_term = signal.signal(signal.SIGTERM, self._on_sigint)
        try:
            self._write_session_row("recording")
            self._attach_targets()
            self._read_host_counters()
            self._release_command()
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

    def _attach_targets(self) -> None:
        if self.opts.pid is not None:
            for pid in targets.descendants(self.opts.pid):
                self._add_target(pid)
            self.root = self.opts.pid
        else:
            self.child = self._start_command()
            self.root = self.child
            self._add_target(self.child, ppid=os.getpid())
        self._scan_libraries()
        if not any(targets.libraries_mapped(pid) for pid in self.procs):
            self._status("no CUDA library loaded by the target yet; waiting for one to be loaded...")

    def _loop(self) -> None:
        self._loop_start = time.monotonic()
        self.cycler.start(self._loop_start)
        deadline = time.monotonic() + self.opts.duration if self.opts.duration else None
        next_tick = time.monotonic() + 1.0
        while not self._interrupted:
            self.bpf.ring_buffer_poll(POLL_MS)
            self._drain()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + 1.0
                self._tick()
            if deadline and now >= deadline:
                self.stop_reason = "complete"
                return
            if self._tree_exited():
                self.stop_reason = "target_exited"
                log.info("target tree exited after %.2f s", (time.monotonic_ns() - self.start_mono) / 1e9)
                return
        self.stop_reason = "interrupted"

    def _on_sigint(self, _sig: int, _frame: Any) -> None:
        self._interrupted = True

    def _status(self, msg: str) -> None:
        if self.on_status:
            self.on_status(msg)

    def _tree_exited(self) -> bool:
        if self.child is not None:
            try:
                pid, status = os.waitpid(self.child, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.child, 0
            if pid == self.child:
                p = self.procs.get(self.child)
                if p and p.exit_code is None:
                    p.exit_code = status
                self.child = None
        return not any(targets.is_alive(pid) for pid, p in self.procs.items() if p.exit_ns is None)

    def _rel(self, ts: np.ndarray) -> np.ndarray:
        return ts.astype(np.int64) - self.start_mono

    def _on_lib_open(self, _ctx: int, data: int, _size: int) -> None:
        pid = ct.cast(data, ct.POINTER(ct.c_uint32))[0]
        path = ct.string_at(data + 8).decode(errors="replace")
        self.lib_opens.append((pid, path))

    def _handle_lib_opens(self) -> None:
        """Attach to CUDA libraries a target just opened (libload.bpf.c stopped it), then let it run on."""
        opens, self.lib_opens = self.lib_opens, []
        for pid, path in opens:
            if pid in self._py_pending and self.pyrt is not None:
                self._pyrt_configure(pid)  # stopped here, with its interpreter mapped by now
            try:
                if not path.startswith("/"):
                    path = os.path.join(os.readlink(f"/proc/{pid}/cwd"), path)
                rooted = f"/proc/{pid}/root{path}"
                lib = targets.resolve_libraries([rooted if os.path.exists(rooted) else path])
                self._attach(lib)
            except OSError as e:
                log.debug("library open by %d (%s) not resolved: %s", pid, path, e)
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def _on_ustack(self, _ctx: int, data: int, size: int) -> None:
        self.ustack_chunks.append(ct.string_at(data, size))

    def _drain(self) -> None:
        if self.ustack_chunks and self.symbolizer is not None:
            from tracer.unwind import decode_ustack_event

            chunks, self.ustack_chunks = self.ustack_chunks, []
            for c in chunks:
                ev = decode_ustack_event(c)
                self.ustacks[ev.stack_ref] = ev
        self._handle_proc(self.proc.drain())  # first: an exec'd process is configured before it runs on
        self._handle_lib_opens()
        self._handle_knames(self.knames.drain())
        for rec in self.stacks.drain():
            self._handle_stack(rec)
        self._handle_calls(self.calls.drain())
        self._handle_sched(self.sched.drain())

    def _handle_proc(self, ev: np.ndarray) -> None:
        if len(ev) == 0:
            return
        for e in ev:
            kind, pid, ts = int(e["kind"]), int(e["pid"]), int(e["ts_ns"]) - self.start_mono
            comm = events.cstr1(e["comm"])
            if kind == 0:  # fork
                parent = self.procs.get(int(e["ppid"]))
                cmd = targets.proc_cmdline(pid) or (parent.cmdline if parent else "")
                self.procs.setdefault(pid, ProcInfo(pid, int(e["ppid"]), comm, cmd, ts))
                if self.pyrt is not None and hasattr(self.pyrt, "note_fork"):
                    self.pyrt.note_fork(int(e["ppid"]), pid)
            elif pid in self.procs:
                p = self.procs[pid]
                if kind == 1:  # exec
                    p.comm = comm
                    p.cmdline = targets.proc_cmdline(pid) or events.cstr1(e["filename"])
                    if self.pyrt is not None:
                        self._pyrt_configure(pid)
                elif kind == 2:
                    p.exit_ns = ts
                    p.exit_code = int(e["exit_code"]) if int(e["exit_code"]) >= 0 else p.exit_code
                elif kind == 3:
                    p.comm = comm
        self.store.put(
            "process_events",
            {
                "ts_ns": self._rel(ev["ts_ns"]),
                "kind": [events.PROC_KINDS[k] for k in ev["kind"].tolist()],
                "pid": ev["pid"].astype(np.int32),
                "ppid": [
                    int(p) if k == 0 else None for k, p in zip(ev["kind"].tolist(), ev["ppid"].tolist(), strict=True)
                ],
                "child": [
                    int(c) if k == 0 else None for k, c in zip(ev["kind"].tolist(), ev["child"].tolist(), strict=True)
                ],
                "comm": events.cstr(ev["comm"]),
                "filename": [f or None for f in events.cstr(ev["filename"])],
                "exit_code": [
                    int(x) if k == 2 and x >= 0 else None
                    for k, x in zip(ev["kind"].tolist(), ev["exit_code"].tolist(), strict=True)
                ],
            },
        )

    def _prefetch_stack(self, rec: events.StackRecord) -> None:
        """Read a new stack's code objects at once, while the process (and its <module> code) still exists; the
        BPF side stopped the process if any of them is new (PYS_STOPPED), so let it go on afterwards."""
        try:
            if self.pyrt is not None and rec.frames:
                self.pyrt.prefetch(rec.pid, list(rec.frames))
        except Exception as e:
            log.debug("prefetch for %d failed: %s", rec.pid, e)
        finally:
            if rec.py_status & PYS_STOPPED:
                try:
                    os.kill(rec.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def _handle_stack(self, rec: events.StackRecord) -> None:
        # frames are (kind, module, function, file, line), outermost first
        native: list[tuple[str, str, str | None, str | None, int | None]] = []
        ustack = self.ustacks.pop(rec.stack_ref, None)
        if ustack is not None:
            native = self._unwind_native(ustack)
        if not native and rec.native_id >= 0:
            try:
                addrs = [a for a in self.bpf["native_stacks"].walk(rec.native_id)]
            except Exception:
                addrs = []
            native = self._symbolize_native(rec.pid, addrs)
        py: list[tuple[str, str, str | None, str | None, int | None]] = []
        if rec.frames and self.pyrt is not None:
            try:
                infos = self.pyrt.resolve(rec.pid, list(rec.frames))
            except Exception as e:
                log.debug("python frames of %d unresolved: %s", rec.pid, e)
                infos = []
            for fi in reversed(infos):  # outermost first
                py.append(("python", fi.filename, fi.qualname, fi.filename, fi.line))
        self.ref_frames[rec.stack_ref] = tuple(_merge_stacks(py, native))

    def _stack_id(self, ref: int, op: int) -> int | None:
        """Return the stack_id of a captured stack plus its CUDA entry point, writing the stack on first sight."""
        frames = self.ref_frames.pop(ref, None)
        if frames is None:
            return None
        spec = CATALOG[op]
        frames = frames + (("cuda", f"lib{spec.library}", spec.op, None, None),)
        sid = self.stack_ids.get(frames)
        if sid is None:
            sid = len(self.stack_ids) + 1
            self.stack_ids[frames] = sid
            self.store.put(
                "stacks",
                {
                    "stack_id": [sid] * len(frames),
                    "depth": list(range(len(frames))),
                    "kind": [f[0] for f in frames],
                    "module": [f[1] for f in frames],
                    "function": [f[2] for f in frames],
                    "file": [f[3] for f in frames],
                    "line": [f[4] for f in frames],
                },
            )
        return sid

    def _unwind_native(self, ev: Any) -> list[tuple[str, str, str | None, str | None, int | None]]:
        """Unwind a copied user stack with .eh_frame; return symbolized frames outermost first ([] on failure)."""
        from tracer.unwind import unwind_event

        try:
            maps = self.symbolizer.snapshot(ev.pid)
            if maps is None:
                return []
            addrs = unwind_event(ev, maps, tables=self._unwind_tables)
        except Exception as e:
            log.debug("unwind for %d failed: %s", ev.pid, e)
            return []
        return self._symbolize_native(ev.pid, addrs)

    def _symbolize_native(
        self, pid: int, addrs: list[int]
    ) -> list[tuple[str, str, str | None, str | None, int | None]]:
        """Return native frames outermost first."""
        out = []
        if self.symbolizer is not None:
            try:
                for f in self.symbolizer.symbolize(pid, addrs):
                    if f.module:  # an FP walk through a library without frame pointers ends in a stack address
                        out.append(("native", os.path.basename(f.module), f.function, f.file, f.line))
            except Exception as e:
                log.debug("symbolize failed: %s", e)
                out = []
        if not out:
            out = [("native", "?", f"0x{a:x}", None, None) for a in addrs]
        out.reverse()
        return out

    def _handle_knames(self, ev: np.ndarray) -> None:
        """Remember launch handles named by cuModuleGetFunction / cuLibraryGetKernel."""
        if len(ev) == 0:
            return
        from tracer.symbolize import demangle

        pids, handles = ev["pid"].tolist(), ev["handle"].tolist()
        names = [demangle(n) for n in events.cstr(ev["name"])]
        for pid, handle, name in zip(pids, handles, names, strict=True):
            self.handle_names[(pid, handle)] = name
            self.kernel_names.pop((pid, handle), None)
        self.store.put("kernel_names", {"pid": pids, "func": handles, "name": names})

    def _kernel_name(self, pid: int, func: int) -> str | None:
        """Name of a launch target: a named driver handle (here or in an ancestor, for forked workers), else the
        host stub symbol the runtime was given."""
        key = (pid, func)
        if key not in self.kernel_names:
            name = None
            p: int | None = pid
            while p and name is None:
                name = self.handle_names.get((p, func))
                p = self.procs[p].ppid if p in self.procs else None
            if name is None and self.symbolizer is not None and func:
                try:
                    name = self.symbolizer.kernel_name(pid, func)
                except Exception:
                    name = None
            self.kernel_names[key] = name
        return self.kernel_names[key]

    def _handle_calls(self, ev: np.ndarray) -> None:
        """Turn a batch of call events into one cuda_calls batch: column-wise, with per-row Python work only for
        the (few) distinct launch targets and the (sampled) stacks."""
        n = len(ev)
        if n == 0:
            return
        ops = ev["op"].astype(np.int32)
        self.stored_per_op += np.bincount(ops, minlength=len(CATALOG))[: len(CATALOG)]
        kinds = ev["kind"]
        kernel = np.full(n, None, dtype=object)
        sel = np.nonzero(_IS_LAUNCH[ops] & (ev["func"] != 0))[0]
        if len(sel):
            pairs = np.stack([ev["pid"][sel].astype(np.uint64), ev["func"][sel]], axis=1)
            uniq, inverse = np.unique(pairs, axis=0, return_inverse=True)
            names = np.array([self._kernel_name(int(p), int(f)) for p, f in uniq.tolist()], dtype=object)
            kernel[sel] = names[inverse.reshape(-1)]
        stack_id = np.full(n, None, dtype=object)
        refs = ev["stack_ref"]
        for i in np.nonzero(refs)[0].tolist():
            stack_id[i] = self._stack_id(int(refs[i]), int(ops[i]))
        self.store.put(
            "cuda_calls",
            {
                "ts_ns": self._rel(ev["ts_ns"]),
                "dur_ns": ev["dur_ns"].astype(np.int64),
                "pid": ev["pid"].astype(np.int32),
                "tid": ev["tid"].astype(np.int32),
                "op": pa.DictionaryArray.from_arrays(pa.array(ops), _OP_DICT).cast(pa.string()),
                "layer": pa.DictionaryArray.from_arrays(pa.array(_LAYER_OF[ops]), _LAYER_DICT).cast(pa.string()),
                "bytes": pa.array(ev["bytes"].astype(np.int64), mask=~_HAS_BYTES[ops]),
                "kind": pa.DictionaryArray.from_arrays(
                    pa.array(np.minimum(kinds, len(_KIND_NAMES) - 1).astype(np.int32), mask=kinds >= len(_KIND_NAMES)),
                    _KIND_DICT,
                ).cast(pa.string()),
                "stream": pa.array(ev["stream"], mask=~_HAS_STREAM[ops]),
                "kernel": pa.array(kernel, type=pa.string()),
                "ret": ev["ret"],
                "stack_id": pa.array(stack_id, type=pa.int64()),
                "off_cpu_ns": ev["off_cpu_ns"].astype(np.int64),
                "runq_ns": ev["runq_ns"].astype(np.int64),
            },
        )

    def _handle_sched(self, ev: np.ndarray) -> None:
        if len(ev) == 0:
            return
        by = ev["by_pid"]
        self.store.put(
            "sched",
            {
                "ts_ns": self._rel(ev["ts_ns"]),
                "dur_ns": ev["dur_ns"].astype(np.int64),
                "pid": ev["pid"].astype(np.int32),
                "tid": ev["tid"].astype(np.int32),
                "comm": events.cstr(ev["comm"]),
                "cpu": ev["cpu"].astype(np.int32),
                "reason": [events.SCHED_REASONS[r] for r in ev["reason"].tolist()],
                "runq_ns": ev["runq_ns"].astype(np.int64),
                "preempted_by_pid": pa.array(by.astype(np.int32), mask=by == 0),
                "preempted_by_comm": [c or None for c in events.cstr(ev["by_comm"])],
            },
        )

    # --- every second --------------------------------------------------------------------------------------

    def _read_host_counters(self) -> np.ndarray:
        hc = self.bpf["host_counters"]
        vals = np.array([sum(hc[ct.c_int(i)]) for i in range(4)], dtype=np.int64)
        delta = vals - self._last_counters
        self._last_counters = vals
        return delta

    def _tick(self) -> None:
        ts = time.monotonic_ns() - self.start_mono
        s = self.sampler.sample()
        d = self._read_host_counters()
        self.store.put(
            "host_samples",
            {
                "ts_ns": [ts],
                "load1": [s.load1],
                "cpu_busy_pct": [s.cpu_busy_pct],
                "runnable": [s.runnable],
                "mem_available_bytes": [s.mem_available_bytes],
                "swap_used_bytes": [s.swap_used_bytes],
                "page_alloc_bytes": [int(d[0])],
                "target_page_alloc_bytes": [int(d[1])],
                "page_faults": [int(d[2])],
                "ctx_switches": [int(d[3])],
            },
        )
        self._drain_sched_aggs(before_sec=ts // 1_000_000_000 - 1)
        self._apply_budget()
        self._apply_overhead_budget()
        self._scan_libraries()
        self._scan_new_children()
        for pid in list(self._py_pending):
            self._pyrt_configure(pid)
        alive = sum(1 for p in self.procs.values() if p.exit_ns is None)
        stored = self.store.rows_written.get("cuda_calls", 0)
        self._status(
            f"{ts / 1e9:6.0f}s  stored {stored:,} calls  lost {self._lost():,}  processes {alive}  "
            f"libraries {len(self.attached)}  overhead ~{self.overhead_pct:.1f}%"
            + (f" (launches sampled {self.cycler.fraction:.0%})" if self.cycler.fraction < 1 else "")
        )

    def _scan_new_children(self) -> None:
        """Catch children the fork tracepoint could not (forked before their parent joined the tree)."""
        if self.opts.pid is None:
            return
        for pid in targets.descendants(self.root):
            if pid not in self.procs:
                self._add_target(pid, first_ns=time.monotonic_ns() - self.start_mono)

    def _take_finished(self, name: str, before_sec: int | None) -> list[tuple[Any, Any]]:
        """Remove and return the (key, value) entries of a per-second BPF aggregate up to ``before_sec`` (all when
        None): seconds still being counted stay in the kernel."""
        tbl = self.bpf[name]
        done = [(k, v) for k, v in tbl.items() if before_sec is None or k.sec <= before_sec]
        for k, _ in done:
            del tbl[k]
        return done

    def _drain_sched_aggs(self, before_sec: int | None) -> None:
        aggs = self._take_finished("sched_aggs", before_sec)
        self.store.put(
            "sched_stats",
            {
                "sec": [int(k.sec) for k, _ in aggs],
                "pid": [int(v.pid) for _, v in aggs],
                "tid": [int(k.tid) for k, _ in aggs],
                "switches": [int(v.switches) for _, v in aggs],
                "preemptions": [int(v.preemptions) for _, v in aggs],
                "off_cpu_ns": [int(v.off_cpu_ns) for _, v in aggs],
                "runq_ns": [int(v.runq_ns) for _, v in aggs],
                "max_off_cpu_ns": [int(v.max_off_ns) for _, v in aggs],
            },
        )
        pre = self._take_finished("preempt_aggs", before_sec)
        self.store.put(
            "preemptors",
            {
                "sec": [int(k.sec) for k, _ in pre],
                "pid": [int(k.pid) for k, _ in pre],
                "comm": [events.cstr1(k.comm) for k, _ in pre],
                "is_target": [bool(v.is_target) for _, v in pre],
                "preemptions": [int(v.preemptions) for _, v in pre],
                "runq_ns": [int(v.runq_ns) for _, v in pre],
            },
        )

    def _apply_budget(self) -> None:
        """Keep stored call events under max_events_per_s by sampling the busiest ops 1 in N (counts stay exact
        in op_stats; slow calls are always kept)."""
        rate = self.stored_per_op.copy()
        self.stored_per_op[:] = 0
        total = int(rate.sum())
        if total <= self.opts.max_events_per_s:
            return
        tbl = self.bpf["cfg_sample_every"]
        for op in np.argsort(-rate):
            if rate[op] == 0 or total <= self.opts.max_events_per_s:
                break
            cur = max(1, tbl[ct.c_int(int(op))].value)
            tbl[ct.c_int(int(op))] = ct.c_uint32(cur * 2)
            total -= int(rate[op]) // 2

    def _apply_overhead_budget(self) -> None:
        """Estimate the probes' cost from this second's hits and set the launch probes' duty cycle."""
        hc = self.bpf["op_hits"]
        hits = np.array([sum(hc[ct.c_int(i)]) for i in range(len(CATALOG))], dtype=np.int64)
        delta, self._last_hits = hits - self._last_hits, hits
        per_hit = self.trap.entry_ns + self.trap.return_ns
        hot = _IS_LAUNCH
        frac = max(self.cycler.fraction, MIN_FRACTION)
        # hits seen while duty-cycled are a sample: scale back up to the full rate before deciding
        hot_pct = 100.0 * delta[hot].sum() * per_hit / 1e9 / frac
        rare_pct = 100.0 * delta[~hot].sum() * per_hit / 1e9
        self._hot_pct = 0.5 * self._hot_pct + 0.5 * hot_pct if self._overhead_samples else hot_pct
        self.cycler.fraction = required_fraction(self._hot_pct, rare_pct, self.opts.overhead_budget)
        self.overhead_pct = self._hot_pct * self.cycler.fraction + rare_pct
        self._overhead_samples.append(self.overhead_pct)

    def _lost(self, kind: int | None = None) -> int:
        """Ring-buffer drops: of one kind (0 calls, 1 stacks, 2 sched, 3 lifecycle; maps.h LOST_*) or all."""
        lost = self.bpf["lost"]
        kinds = range(4) if kind is None else (kind,)
        return int(sum(lost[ct.c_int(i)].value for i in kinds))

    # --- the end -------------------------------------------------------------------------------------------

    def finish(self, status: str) -> RecordSummary:
        """Drain, write exact aggregates, processes and the session row, close the DB; return the summary."""
        if self.child is not None and status == "interrupted":
            # a launched command is ours to stop; an attached --pid job is never touched
            try:
                os.kill(self.child, signal.SIGINT)
            except ProcessLookupError:
                pass
        self._release_command()
        self.launch_fraction = self.cycler.stop() if hasattr(self, "_loop_start") else 1.0
        if self.launch_fraction < 1.0:
            self.notes.append(
                f"launch probes were duty-cycled to stay under --overhead-budget {self.opts.overhead_budget}%: launch "
                f"counts are scaled from {self.launch_fraction:.0%} of the time"
            )
        self.bpf.ring_buffer_consume()
        self._drain()
        # nothing of ours may stay stopped (a library-load or first-sight stop whose record was not read)
        for p in self.procs.values():
            if p.exit_ns is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass
        self._drain_sched_aggs(before_sec=None)
        ops = self._write_op_stats()
        for p in self.procs.values():
            if p.exit_ns is None and not targets.is_alive(p.pid) and status != "interrupted":
                p.exit_ns = time.monotonic_ns() - self.start_mono
        procs = sorted(self.procs.values(), key=lambda p: (p.first_ns, p.pid))
        self.store.put(
            "processes",
            {
                "pid": [p.pid for p in procs],
                "ppid": [p.ppid for p in procs],
                "comm": [p.comm for p in procs],
                "cmdline": [p.cmdline for p in procs],
                "first_ns": [p.first_ns for p in procs],
                "exit_ns": [p.exit_ns for p in procs],
                "exit_code": [p.exit_code for p in procs],
            },
        )
        duration = (time.monotonic_ns() - self.start_mono) / 1e9
        self.store.sync()
        traced = sum(o.calls for o in ops)
        stored = self.store.rows_written.get("cuda_calls", 0)
        lost = self._lost(0)  # session.events_lost counts call events, the unit of events_traced/stored
        for kind, what in ((0, "call events"), (1, "stacks"), (2, "off-CPU intervals"), (3, "lifecycle events")):
            n = self._lost(kind)
            if n:
                self.notes.append(
                    f"{n} {what} lost to a full ring buffer (a burst faster than the recorder drains); "
                    "counts in op_stats and sched_stats are still exact, only rows are missing"
                )
        self._write_session_row(status, duration, traced, stored, lost)
        self._write_chains()
        self.store.close()
        detach_in_background(self.bpf)
        if self.store.error:
            self.notes.append(f"write error: {self.store.error}")
        return RecordSummary(
            self.opts.db,
            status,
            duration,
            traced,
            stored,
            lost,
            len(self.procs),
            [lib.path for lib in self.attached.values()],
            ops,
            self.notes,
        )

    def _write_op_stats(self) -> list[OpSummary]:
        hist: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for k, v in self.bpf["op_hist"].items():
            lo, hi = slot_bounds(k.slot)
            hist.setdefault((k.pid, k.op), []).append((lo, hi, int(v.value)))
        rows: dict[str, list[Any]] = {
            k: []
            for k in (
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
                "hist",
            )
        }
        per_op: dict[int, list[tuple[int, int, int]]] = {}
        per_op_calls: dict[int, int] = {}
        per_op_max: dict[int, int] = {}
        for k, v in self.bpf["op_totals"].items():
            spec = CATALOG[k.op]
            h = sorted(hist.get((k.pid, k.op), []))
            # duty-cycled launch probes saw a share of the calls: scale counts and sums by it, and say so
            frac = self.launch_fraction if spec.op_class == OpClass.LAUNCH else 1.0
            calls = round(int(v.calls) / frac)
            rows["pid"].append(int(k.pid))
            rows["op"].append(spec.op)
            rows["layer"].append(spec.layer_name)
            rows["calls"].append(calls)
            rows["total_ns"].append(round(int(v.total_ns) / frac))
            rows["min_ns"].append(int(v.min_ns))
            rows["max_ns"].append(int(v.max_ns))
            for q, name in ((0.5, "p50_ns"), (0.95, "p95_ns"), (0.99, "p99_ns")):
                rows[name].append(percentile(h, q))
            rows["bytes"].append(round(int(v.bytes) / frac) if spec.bytes_arg != NO_ARG else None)
            rows["sampled_fraction"].append(frac)
            rows["hist"].append([{"lo_ns": lo, "hi_ns": hi, "count": c} for lo, hi, c in h])
            per_op.setdefault(k.op, []).extend(h)
            per_op_calls[k.op] = per_op_calls.get(k.op, 0) + calls
            per_op_max[k.op] = max(per_op_max.get(k.op, 0), int(v.max_ns))
        self.store.put("op_stats", rows)
        out = [
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
        return sorted(out, key=lambda o: -o.calls)

    def _write_session_row(
        self, status: str, duration: float = 0.0, traced: int = 0, stored: int = 0, lost: int = 0
    ) -> None:
        env = environment() if not hasattr(self, "_env") else self._env
        self._env = env
        target = f"pid {self.opts.pid}" if self.opts.pid is not None else " ".join(self.opts.command or [])
        libs = ", ".join(lib.path for lib in self.attached.values())
        pyver = self.py_version or ""
        overhead = round(float(np.mean(self._overhead_samples)), 3) if self._overhead_samples else None
        self.store.execute("DELETE FROM session")
        self.store.execute(
            "INSERT INTO session VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                self.started_at,
                self.start_mono,
                duration,
                status,
                env.host,
                env.kernel,
                env.cpu_model,
                env.cpu_cores,
                env.mem_bytes,
                env.gpus,
                env.driver,
                pyver,
                __version__,
                target,
                libs,
                traced,
                stored,
                lost,
                overhead,
                "\n".join(self.notes),
            ],
        )

    def _write_chains(self) -> None:
        try:
            from tracer.analysis import chains
        except ImportError:
            return
        self.store.sync()
        try:
            found = chains.compute_chains(self.store.conn, limit=100)
            chains.write_chains(self.store.conn, found.chains)
        except Exception as e:  # the recording stays valid without its diagnosis
            log.warning("causal chain analysis failed: %s", e)
            self.notes.append(f"causal chain analysis failed: {e}")


def _merge_stacks(py: list[Any], native: list[Any]) -> list[Any]:
    """Merge Python frames into a native stack (both outermost first) where the interpreter's eval loop is."""
    if not py:
        return native
    eval_idx = [i for i, f in enumerate(native) if f[2] and "EvalFrame" in str(f[2])]
    if not eval_idx:
        return py + native
    return native[: eval_idx[0]] + py + native[eval_idx[-1] + 1 :]
