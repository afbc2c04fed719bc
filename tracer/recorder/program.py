"""The BPF program: source assembly from probes/, compile flags, loading its programs, and the probes per library.

One program holds every concern, so the maps they share (probes/maps.h) are one set. The CUDA probes are two
programs (cuda_entry, cuda_return) for every op: the op is the uprobe_multi link's cookie and its settings come
from the op_cfg map (:func:`configure_ops`), so the verifier sees each program once and a library is attached
with a few links (:class:`ProbeSet`), whatever the catalog's size.
"""

from __future__ import annotations

import ctypes as ct
import logging
import os
import re
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probes.catalog import CATALOG, OP_COUNT_MAX, OP_IDS, SLOW_NS, STACK_EVERY, specs_for
from tracer.recorder import events
from tracer.recorder.links import UPROBE_MULTI, Link, attach_multi

log = logging.getLogger(__name__)

PROBES_DIR = Path(__file__).resolve().parents[2] / "probes"
# In this order: a file uses only what the files before it define (capture_stack from cuda.bpf.c in offcpu.bpf.c
# and profile.bpf.c, offcpu_count from offcpu.bpf.c in sched.bpf.c, host_count from sched.bpf.c in memory.bpf.c,
# emit_exe_map from libload.bpf.c in lifecycle.bpf.c, capture_stack and stage_prog in gc.bpf.c).
SOURCES = (
    "cuda.bpf.c",
    "offcpu.bpf.c",
    "sched.bpf.c",
    "libload.bpf.c",
    "lifecycle.bpf.c",
    "memory.bpf.c",
    "kernel_names.bpf.c",
    "nccl_comm.bpf.c",
    "profile.bpf.c",
    "gc.bpf.c",
)

# -D name: (struct, member) read from the running kernel's BTF for probes/files.h and lifecycle.bpf.c.
KERNEL_OFFSETS: dict[str, tuple[str, str]] = {
    "OFF_TASK_FILES": ("task_struct", "files"),
    "OFF_TASK_MM": ("task_struct", "mm"),
    "OFF_FILES_FDT": ("files_struct", "fdt"),
    "OFF_FDT_MAX_FDS": ("fdtable", "max_fds"),
    "OFF_FDT_FD": ("fdtable", "fd"),
    "OFF_FILE_INODE": ("file", "f_inode"),
    "OFF_FILE_PATH": ("file", "f_path"),
    "OFF_PATH_DENTRY": ("path", "dentry"),
    "OFF_INODE_INO": ("inode", "i_ino"),
    "OFF_INODE_SB": ("inode", "i_sb"),
    "OFF_SB_DEV": ("super_block", "s_dev"),
    "OFF_DENTRY_NAME": ("dentry", "d_name"),
    "OFF_QSTR_NAME": ("qstr", "name"),
    "OFF_DENTRY_PARENT": ("dentry", "d_parent"),
    "OFF_MM_EXE_FILE": ("mm_struct", "exe_file"),
    "OFF_MM_START_CODE": ("mm_struct", "start_code"),
    "OFF_MM_END_CODE": ("mm_struct", "end_code"),
    "EXIT_CODE_OFF": ("task_struct", "exit_code"),
}

_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def _inline_includes(path: Path, seen: set[str]) -> str:
    """Return ``path`` with its local ``#include "x"`` lines replaced by the files, each file once.

    bcc rewrites map methods (``m.lookup()``) and generates tracepoint argument structs only in the main text,
    not in included files, so the program must reach bcc as one text.
    """
    seen.add(path.name)

    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in seen:
            return ""
        if not (PROBES_DIR / name).exists():
            return m.group(0)  # left to the preprocessor (e.g. inside an #ifdef that is off)
        return _inline_includes(PROBES_DIR / name, seen)

    return _INCLUDE.sub(repl, path.read_text())


def program_text() -> str:
    """Return the full BPF C text: every probe source, each shared header once."""
    seen: set[str] = set()
    return "\n".join(_inline_includes(PROBES_DIR / name, seen) for name in SOURCES) + "\n"


@dataclass
class ProgramOptions:
    with_pyframes: bool = False
    max_py_frames: int = 64
    extra_cflags: list[str] = field(default_factory=list)


def cflags(opts: ProgramOptions) -> list[str]:
    """Return the compile flags: include path, sizes, and kernel struct offsets from BTF.

    Raises:
        tracer.recorder.btf.BtfError: the running kernel's BTF lacks a member the probes read.
    """
    from tracer.recorder import btf

    flags = [
        f"-I{PROBES_DIR}",
        f"-DOP_COUNT={OP_COUNT_MAX}",
        f"-DMAX_PY_FRAMES={opts.max_py_frames}",
        f"-DPAGE_BYTES={os.sysconf('SC_PAGE_SIZE')}",
        "-Wno-unused-function",
        "-Wno-macro-redefined",
    ]
    flags += [f"-D{name}={btf.member_offset(s, m)}" for name, (s, m) in KERNEL_OFFSETS.items()]
    if opts.with_pyframes:
        from tracer.recorder.cpython import pycfg

        flags += ["-DWITH_PYFRAMES", *pycfg.cflags()]
    return flags + opts.extra_cflags


@dataclass(frozen=True)
class Programs:
    """File descriptors of the loaded uprobe programs."""

    entry: int
    ret: int
    kname_entry: int
    kname_return: int
    comm_entry: int
    comm_return: int
    gc: int  # gc.bpf.c gc_probe: every probe point of CPython's collector (cpython/gcprobe.py)


def _compile(opts: ProgramOptions, cache_dir: Path | None = None) -> Any:
    """Return the loaded program: from the compile cache (tracer/recorder/bpfcache.py) when it holds this text,
    these flags and this kernel, else compiled by bcc (seconds of clang) and then cached for the next run."""
    from bcc import BPF

    from tracer.recorder import bpfcache

    text, flags = program_text(), cflags(opts)
    d = bpfcache.cache_dir() if cache_dir is None else cache_dir
    if d is None:
        return BPF(text=text, cflags=flags)
    key = bpfcache.cache_key(text, flags)
    entry = bpfcache.load(d, key)
    if entry is not None:
        try:
            return bpfcache.cached_bpf(entry)
        except Exception as e:  # a kernel that refuses what it took before: compile as without a cache
            log.warning("bpf cache: entry %s did not load (%s): compiling", key[:12], e)
    bpf = BPF(text=text, cflags=flags)
    try:
        bpfcache.store(d, key, bpfcache.snapshot(bpf))
    except bpfcache.CacheError as e:
        log.info("bpf cache: program not cacheable: %s", e)
    return bpf


@dataclass
class Prepared:
    """The loaded program, its uprobe programs, and what preparing them took (in the thread that did it)."""

    bpf: Any
    progs: Programs
    seconds: float  # wall time of the compile (or cache load) and the loads
    cpu_s: float  # that thread's CPU time over the same


def _prepare(opts: ProgramOptions) -> Prepared:
    t, c = time.monotonic(), time.thread_time()
    bpf = _compile(opts)
    progs = load_programs(bpf, opts.with_pyframes)
    return Prepared(bpf, progs, time.monotonic() - t, time.thread_time() - c)


_prewarm: tuple[ProgramOptions, Future[Prepared]] | None = None
_start_cwd: str | None = None


def start_cwd() -> str:
    """The working directory the command started in. bcc changes the process's working directory while it compiles
    (to the kernel headers) and changes it back after; with the compile running in a thread (:func:`prewarm`),
    relative paths given by the user must be resolved against this, not against os.getcwd()."""
    return _start_cwd or os.getcwd()


def prewarm(opts: ProgramOptions) -> None:
    """Start compiling and loading the program in a thread now; :func:`prepare_program` with the same options takes
    the result.

    Compiling is seconds of clang, and loading is the kernel's verifier (a few hundred ms for the uprobe programs),
    both inside ctypes calls, which release the GIL: they run on another core while the CLI imports its modules and
    the recorder sets up, so `tracer record` is live sooner.
    """
    global _prewarm, _start_cwd
    if _prewarm is None:
        _start_cwd = os.getcwd()
        pool = ThreadPoolExecutor(1, thread_name_prefix="bpf-compile")
        _prewarm = (opts, pool.submit(_prepare, opts))
        pool.shutdown(wait=False)


def prepare_program(opts: ProgramOptions) -> Prepared:
    """Compile (or take from the cache) and load the program: the ``bcc.BPF`` object (tracepoints already attached)
    and its uprobe programs (:func:`load_programs`); the prewarmed ones where :func:`prewarm` had these options."""
    global _prewarm
    if _prewarm is not None and _prewarm[0] == opts:
        future = _prewarm[1]
        _prewarm = None
        return future.result()
    return _prepare(opts)


def compile_program(opts: ProgramOptions) -> Any:
    """Compile (or take from the cache) and load the program; return the ``bcc.BPF`` object (tracepoints attached)."""
    return _compile(opts)


def tracepoint_fds(bpf: Any) -> list[int]:
    """Return the perf event fds of every tracepoint bcc attached (BPF() attaches each TRACEPOINT_PROBE) and make
    bcc forget them, so that its own cleanup does not detach them again; closing them is the caller's."""
    fds = [int(fd) for fd in bpf.tracepoint_fds.values()]
    bpf.tracepoint_fds.clear()
    return fds


# The return probe's tail-called stages (cuda.bpf.c stage_prog), by slot.
STAGES = ("call_with_stack", "py_read_codes")
# sched_switch's stages (offcpu.bpf.c offcpu_stage) and the sampler's (profile.bpf.c sample_stage), by slot.
OFFCPU_STAGES = ("offcpu_stack", "py_read_codes_tp")
SAMPLE_STAGES = ("py_read_codes_pe",)


def load_programs(bpf: Any, with_pyframes: bool) -> Programs:
    """Load the uprobe programs for uprobe_multi links, and the return probe's stages into their tail-call slots."""
    from bcc import BPF

    def load(name: str) -> int:
        return int(bpf.load_func(name, BPF.KPROBE, attach_type=UPROBE_MULTI).fd)

    progs = Programs(
        load("cuda_entry"),
        load("cuda_return"),
        load("kname_entry"),
        load("kname_return"),
        load("comm_entry"),
        load("comm_return"),
        load("gc_probe"),
    )
    table = bpf["stage_prog"]
    for slot, name in enumerate(STAGES):
        if name == "py_read_codes" and not with_pyframes:
            continue
        table[ct.c_int(slot)] = ct.c_int(load(name))
    # sched_switch's off-CPU stack capture and the sampler's code reads: tail calls of their own program types
    for table_name, prog_type, names in (
        ("offcpu_stage", BPF.TRACEPOINT, OFFCPU_STAGES),
        ("sample_stage", BPF.PERF_EVENT, SAMPLE_STAGES),
    ):
        for slot, name in enumerate(names):
            if name.startswith("py_read_codes") and not with_pyframes:
                continue
            bpf[table_name][ct.c_int(slot)] = ct.c_int(int(bpf.load_func(name, prog_type).fd))
    return progs


def mark_links_closed(bpf: Any, ops: Iterable[int], at_ns: int) -> None:
    """Say in the links_closed map that the links of ``ops`` finished closing at ``at_ns``: for each op and the
    runtime op it records from inside libcudart (a driver launch made by the runtime is recorded as the runtime's)."""
    table = bpf["links_closed"]
    for op in ops:
        for o in (op, *([OP_IDS[CATALOG[op].runtime_twin]] if CATALOG[op].runtime_twin else [])):
            table[ct.c_int(o)] = ct.c_uint64(at_ns)


def configure_ops(bpf: Any) -> None:
    """Write every catalog op's probe settings into the op_cfg map."""
    table = bpf["op_cfg"]
    for op_id, spec in enumerate(CATALOG):
        v = table.Leaf()
        v.bytes_arg, v.kind_arg, v.fixed_kind = spec.bytes_arg, spec.kind_arg, spec.fixed_kind
        v.stream_arg, v.stream_deref, v.func_arg = spec.stream_arg, spec.stream_deref, spec.func_arg
        v.rt_twin = OP_IDS[spec.runtime_twin] if spec.runtime_twin else -1
        v.dtype_arg = spec.dtype_arg
        v.comm_arg = spec.comm_arg
        v.part = int(spec.part)
        v.hot = int(spec.duty_cycled)
        v.sample_every = 1
        v.slow_ns = SLOW_NS[spec.op_class]
        v.stack_every = STACK_EVERY.get(spec.op_class, 1)
        table[ct.c_int(op_id)] = v


def set_sample_every(bpf: Any, op_id: int, every: int) -> None:
    """Store 1 call in ``every`` of op ``op_id`` from now on (slow calls are always stored)."""
    table = bpf["op_cfg"]
    v = table[ct.c_int(op_id)]
    v.sample_every = every
    table[ct.c_int(op_id)] = v


def sample_every(bpf: Any, op_id: int) -> int:
    return int(bpf["op_cfg"][ct.c_int(op_id)].sample_every)


@dataclass
class ProbeSet:
    """One entry link and its return link over a set of functions of one file; can be closed and reopened."""

    path: str
    offsets: tuple[int, ...]
    cookies: tuple[int, ...]
    entry_prog: int
    return_prog: int
    entry: Link | None = None
    ret: Link | None = None

    def open(self) -> None:
        """Attach: the return probes first, so every call that enters has its return seen."""
        self.open_returns()
        self.open_entries()

    def open_returns(self) -> None:
        if self.ret is None:
            self.ret = attach_multi(self.return_prog, self.path, self.offsets, self.cookies, retprobe=True)

    def open_entries(self) -> None:
        if self.entry is None:
            self.entry = attach_multi(self.entry_prog, self.path, self.offsets, self.cookies, retprobe=False)

    def close(self) -> None:
        """Detach: the entry probes first (their close waits for a grace period, by which time every call that
        entered has returned through its return probe), then the return probes."""
        self.close_entries()
        self.close_returns()

    def close_entries(self) -> None:
        if self.entry is not None:
            self.entry.close()
            self.entry = None

    def close_returns(self) -> None:
        if self.ret is not None:
            self.ret.close()
            self.ret = None

    @property
    def live(self) -> bool:
        return self.entry is not None


@dataclass
class AttachedLibrary:
    """The probes on one library file."""

    path: str
    kind: str  # "cudart" | "cuda" | "nccl"
    ops: list[str] = field(default_factory=list)  # op names attached
    skipped: list[str] = field(default_factory=list)  # ops whose symbols the file does not export
    probes: list[ProbeSet] = field(default_factory=list)  # always on
    hot: ProbeSet | None = None  # the launch functions: duty-cycled (tracer/recorder/budget.py)

    def probe_sets(self) -> list[ProbeSet]:
        """Every probe set on the file, the duty-cycled one included."""
        return [*self.probes, *([self.hot] if self.hot is not None else [])]


# Functions that hand out launch handles (probes/kernel_names.bpf.c): the driver's name them by the kernel's name,
# the runtime's by the host stub of a `<<<...>>>` launch.
KERNEL_NAME_SYMBOLS = {
    "cuda": ("cuModuleGetFunction", "cuLibraryGetKernel"),
    "cudart": ("__cudaGetKernel", "cudaGetKernel"),
}
# Functions that make a process a rank of an NCCL communicator (probes/nccl_comm.bpf.c), with their pncclX twins
# (the real library defines pncclX and exports ncclX as a weak alias at the same offset: probed once).
COMM_INIT_SYMBOLS = {
    "nccl": tuple(s for f in ("ncclCommInitRank", "ncclCommInitRankConfig") for s in (f, "p" + f)),
}


def attach_library(
    progs: Programs, path: str, library: str, exports: dict[str, int], skip: Iterable[str] = ()
) -> AttachedLibrary:
    """Attach the probes of every catalog op of ``library`` that the file at ``path`` exports.

    ``exports`` maps the file's exported function names to file offsets (targets.exported_offsets). A symbol the
    file does not export is skipped, not an error: real libraries differ by version. Variants (``_v2``,
    ``_ptsz``) of one op all feed the same op id. Probes belong to the file (inode), so they fire in every process
    that maps it, now or later; the in-kernel tgid filter keeps only the traced tree.

    Raises:
        tracer.recorder.links.LinkError: the kernel refused a link.
    """
    res = AttachedLibrary(path, library)
    skip = set(skip)
    rare: list[tuple[int, int]] = []
    hot: list[tuple[int, int]] = []
    for op_id, spec in specs_for(library):
        if spec.op in skip:
            continue
        found = [exports[s] for s in spec.symbols if s in exports]
        if not found:
            res.skipped.append(spec.op)
            continue
        dest = hot if spec.duty_cycled else rare
        dest += [(off, op_id) for off in dict.fromkeys(found)]  # aliases at one offset: probe it once
        res.ops.append(spec.op)
    for group, is_hot in ((rare, False), (hot, True)):
        if not group:
            continue
        ps = ProbeSet(path, tuple(o for o, _ in group), tuple(c for _, c in group), progs.entry, progs.ret)
        ps.open()
        if is_hot:
            res.hot = ps
        else:
            res.probes.append(ps)
    knames = list(dict.fromkeys(exports[s] for s in KERNEL_NAME_SYMBOLS.get(library, ()) if s in exports))
    if knames:
        cookie = events.C.KNAME_BY_NAME if library == "cuda" else events.C.KNAME_BY_STUB
        ps = ProbeSet(path, tuple(knames), (cookie,) * len(knames), progs.kname_entry, progs.kname_return)
        ps.open()
        res.probes.append(ps)
    inits = list(dict.fromkeys(exports[s] for s in COMM_INIT_SYMBOLS.get(library, ()) if s in exports))
    if inits:
        ps = ProbeSet(path, tuple(inits), (0,) * len(inits), progs.comm_entry, progs.comm_return)
        ps.open()
        res.probes.append(ps)
    return res
