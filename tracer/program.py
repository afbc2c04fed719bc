"""The BPF program: source assembly from probes/, compile flags, and uprobe attachment per library file.

One program holds every concern (cuda.bpf.c, host.bpf.c, and pyframes.h when the Python walker is enabled), so
the maps they share (probes/maps.h) are one set. The per-op probe functions are generated from the catalog with
constant argument indices.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from probes.catalog import CATALOG, OP_COUNT_MAX, OP_IDS, OpClass, ProbeSpec, specs_for

log = logging.getLogger(__name__)

PROBES_DIR = Path(__file__).resolve().parent.parent / "probes"


def _stub(op_id: int, spec: ProbeSpec) -> str:
    twin = OP_IDS[spec.runtime_twin] if spec.runtime_twin else -1
    args = (
        spec.bytes_arg,
        spec.kind_arg,
        spec.fixed_kind,
        spec.stream_arg,
        spec.stream_deref,
        spec.func_arg,
        twin,
        int(spec.op_class == OpClass.LAUNCH),
    )
    argl = ", ".join(str(int(a)) for a in args)
    return (
        f"int entry_{spec.op}(struct pt_regs *ctx) {{ return on_entry(ctx, {op_id}, {argl}); }}\n"
        f"int return_{spec.op}(struct pt_regs *ctx) {{ return on_return(ctx, {op_id}); }}\n"
    )


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


def program_text(with_pyframes: bool) -> str:
    """Return the full BPF C text: the probe sources plus one entry/return function pair per catalog op."""
    seen: set[str] = set()
    parts = [
        _inline_includes(PROBES_DIR / name, seen)
        for name in ("cuda.bpf.c", "host.bpf.c", "libload.bpf.c", "kernel_names.bpf.c")
    ]
    parts += [_stub(i, s) for i, s in enumerate(CATALOG)]
    return "\n".join(parts) + "\n"


@dataclass
class ProgramOptions:
    with_pyframes: bool = False
    max_py_frames: int = 64
    extra_cflags: list[str] = field(default_factory=list)


def cflags(opts: ProgramOptions) -> list[str]:
    """Return the compile flags: include path, sizes, kernel-derived offsets."""
    flags = [
        f"-I{PROBES_DIR}",
        f"-DOP_COUNT={OP_COUNT_MAX}",
        f"-DMAX_PY_FRAMES={opts.max_py_frames}",
        f"-DPAGE_BYTES={os.sysconf('SC_PAGE_SIZE')}",
        "-Wno-unused-function",
        "-Wno-macro-redefined",
    ]
    try:
        from tracer import btf

        flags.append(f"-DEXIT_CODE_OFF={btf.member_offset('task_struct', 'exit_code')}")
    except Exception as e:  # BTF reader missing or no BTF: exit codes come from /proc polling instead
        log.debug("no task_struct.exit_code offset: %s", e)
    if opts.with_pyframes:
        from tracer import pyruntime

        flags += ["-DWITH_PYFRAMES", *pyruntime.cflags()]
    return flags + opts.extra_cflags


def compile_program(opts: ProgramOptions):
    """Compile and load the program; return the ``bcc.BPF`` object."""
    from bcc import BPF

    return BPF(text=program_text(opts.with_pyframes), cflags=cflags(opts))


# Driver functions that hand out launch handles with the kernel's name (probes/kernel_names.bpf.c).
KERNEL_NAME_SYMBOLS = frozenset({"cuModuleGetFunction", "cuLibraryGetKernel"})


@dataclass
class AttachResult:
    path: str
    attached: list[str] = field(default_factory=list)  # op names
    probes: list[tuple[str, str]] = field(default_factory=list)  # (symbol, op) pairs attached
    skipped: list[str] = field(default_factory=list)  # ops whose symbols the file does not export


def attach_library(bpf, path: str, library: str, skip: frozenset[str] = frozenset()) -> AttachResult:
    """Attach entry/return uprobes for every catalog op of ``library`` found in the file at ``path``.

    A symbol the file does not export is skipped, not an error: real libraries differ by version. Variants
    (``_v2``, ``_ptsz``) of one op all feed the same op id. Probes attach to the file (inode), so they fire in
    every process that maps it, now or later; the in-kernel tgid filter keeps only the traced tree.
    """
    from tracer.targets import exported_functions

    exported = exported_functions(path)
    res = AttachResult(path)
    for _op_id, spec in specs_for(library):
        if spec.op in skip:
            continue
        found = [s for s in spec.symbols if s in exported]
        if not found:
            res.skipped.append(spec.op)
            continue
        for sym in found:
            bpf.attach_uprobe(name=path, sym=sym, fn_name=f"entry_{spec.op}")
            bpf.attach_uretprobe(name=path, sym=sym, fn_name=f"return_{spec.op}")
            res.probes.append((sym, spec.op))
        res.attached.append(spec.op)
    if library == "cuda":
        for sym in KERNEL_NAME_SYMBOLS & exported:
            bpf.attach_uprobe(name=path, sym=sym, fn_name="kname_entry")
            bpf.attach_uretprobe(name=path, sym=sym, fn_name="kname_return")
    return res


def detach_in_background(bpf) -> None:
    """Hand the probes' teardown to a detached child process, so the recorder exits at once.

    Unregistering a uprobe waits for an RCU grace period: ~0.1 s each in a VM, seconds for a full catalog. A
    forked child inherits the perf-event fds; this process drops its references (cheap while another holder
    remains), and the child closes them, in parallel, after this process is gone. The target filter is emptied
    first, so the probes do nothing meanwhile but the trap.
    """
    from concurrent.futures import ThreadPoolExecutor

    try:
        bpf["targets"].clear()
    except Exception:
        pass
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            # Start only once the recorder is gone: its exit would otherwise queue behind these releases.
            deadline = time.monotonic() + 60
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.02)
            # let go of the terminal and any pipes, so nobody waiting on the recorder's output waits for this
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            keys = list(bpf.uprobe_fds.keys())
            with ThreadPoolExecutor(16) as ex:
                list(ex.map(bpf.detach_uprobe_event, keys))
            bpf.cleanup()
        finally:
            os._exit(0)
    # this process: forget the probe fds so bcc's atexit cleanup does not detach them one by one
    bpf.uprobe_fds.clear()
    bpf.tracepoint_fds.clear()
