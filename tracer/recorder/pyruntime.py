"""CPython runtimes of traced processes: BPF configuration (the ``pycfg`` and ``py_binaries`` maps of
probes/pyframes.h) and symbolisation of the (code object, instruction index) pairs the BPF walk records.

What a binary looks like comes from :mod:`tracer.recorder.cpython` (layouts, ELF/DWARF analysis, line tables,
reads of another process's memory); this module keeps the per-process state.

Per process: the load bias from ``/proc/PID/maps``, hence ``&_PyRuntime`` and the TSS key address, written to
the ``pycfg`` map. Forked children get the parent's entry in BPF (pycfg_on_fork); user space only needs
``note_fork()`` so that ``resolve()`` can read code objects from the parent once the child has exited.

Line numbers are the executing line, decoded from ``co_linetable`` at the recorded instruction index, not the
``def`` line."""

from __future__ import annotations

import ctypes as ct
import functools
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracer.recorder.cpython.elf import analyze_binary, load_bias
from tracer.recorder.cpython.layouts import BinaryInfo, PyTarget
from tracer.recorder.cpython.linetable import decode_line
from tracer.recorder.cpython.memory import CodeInfo, read_code
from tracer.recorder.cpython.pycfg import NOT_PYTHON, build_cfg
from tracer.recorder.events import C, cstr1
from tracer.recorder.procmaps import read_maps

# A re-forked DataLoader worker sends the same code objects again (each process's are its own, by address), and
# decoding their line tables in Python was ~14% of resolving its stacks (cProfile, issue 33): the decode is a pure
# function of the table, so one decode serves every process. 4096 tables of a few hundred bytes: ~1-2 MiB at most.
_decode_line = functools.lru_cache(maxsize=4096)(decode_line)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PyFrameInfo:
    """One resolved Python frame. line is the executing line (1-based); 0 when unknown. ``approx``: the line is
    the def line, because the executing one could not be decoded (a line table cut at CODE_LT_MAX bytes)."""

    filename: str
    qualname: str
    line: int
    firstlineno: int
    approx: bool = False

    @property
    def resolved(self) -> bool:
        return bool(self.filename)


class PyRuntimeManager:
    """Configures traced CPython processes in the ``pycfg`` map and resolves their recorded frames.

    Args:
        bpf: the loaded ``bcc.BPF`` whose program includes probes/pyframes.h; None for resolve-only use.
    """

    def __init__(self, bpf: Any | None) -> None:
        self.bpf = bpf
        self.targets: dict[int, PyTarget] = {}
        self.parents: dict[int, int] = {}
        # (major, minor) -> processes seen with it: the session's Python version outlives the processes
        self.versions: dict[tuple[int, ...], int] = {}
        self._binaries: dict[tuple[str, int, int], BinaryInfo | None] = {}
        self._codes: dict[int, dict[int, CodeInfo]] = {}  # pid -> code address -> code object; forget() drops a pid
        self._registered: dict[tuple[int, int], BinaryInfo | None] = {}  # (st_dev, st_ino) in py_binaries
        # called with the path of each interpreter file registered (the executable or libpython embedding CPython):
        # the session probes its garbage collector there (cpython/gcprobe.py)
        self.on_interpreter: Callable[[str], object] | None = None

    # -- configuration ---------------------------------------------------------------------------------------

    def _binary(self, path: str, pid: int) -> BinaryInfo | None:
        real = path if os.path.exists(path) else f"/proc/{pid}/root{path}"
        try:
            st = os.stat(real)
        except OSError:
            return None
        key = (real, st.st_ino, int(st.st_mtime))
        if key not in self._binaries:
            try:
                self._binaries[key] = analyze_binary(real)
            except Exception as e:  # a bad ELF means "not Python", never a crash
                log.debug("%s: not analysable: %s", real, e)
                self._binaries[key] = None
        return self._binaries[key]

    def configure(self, pid: int) -> PyTarget | None:
        """Detects CPython in `pid` (a mapped libpython, else the executable) and writes its pycfg entry.
        Returns None when the process is not CPython, is gone, or has an unsupported layout."""
        try:
            maps = read_maps(pid)
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            return None
        candidates = []
        for m in maps:
            if re.search(r"/libpython3\.\d+[^/]*\.so", m.path) and m.path not in candidates:
                candidates.append(m.path)
        if exe not in candidates:
            candidates.append(exe)
        for path in candidates:
            info = self._binary(path, pid)
            if info is None:
                continue
            bias = load_bias(info, maps, path)
            if bias is None:
                continue
            target = PyTarget(pid=pid, binary=info, bias=bias)
            if not target.tss_key_addr:
                log.warning("pid %d: %s: no autoTSSkey offset for %d.%d", pid, path, *info.version)
                return None
            self._set_target(target)
            self._write_cfg(target)
            self.register(path, pid)
            return target
        return None

    def register(self, path: str, pid: int | None = None) -> BinaryInfo | None:
        """Analyse the file at ``path`` and register its layout in the ``py_binaries`` map, so the kernel configures
        every process that maps it from now on (at exec, or at the mmap of a libpython), with no race and no hold.
        A file that does not embed CPython is registered as such (an executable named python* that links a
        libpython is not held again). Returns its layout, or None."""
        info = self._binary(path, pid) if pid is not None else self._binary(path, 0)
        real = path if os.path.exists(path) else f"/proc/{pid}/root{path}"
        try:
            st = os.stat(real)
        except OSError:
            return info
        if (st.st_dev, st.st_ino) in self._registered:
            return info
        self._registered[(st.st_dev, st.st_ino)] = info if info is not None and info.offsets.get("tss") else None
        if info is not None and self.on_interpreter is not None:
            self.on_interpreter(real)
        if self.bpf is None:
            return info
        table = self.bpf["py_binaries"]
        k = table.Key()
        k.ino, k.dev = st.st_ino, (os.major(st.st_dev) << 20) | os.minor(st.st_dev)
        v = table.Leaf()
        if info is None or not info.offsets.get("tss"):
            v.is_lib = NOT_PYTHON
        else:
            cfg = build_cfg(PyTarget(0, info, 0))
            ct.memmove(ct.addressof(v.cfg), ct.addressof(cfg), ct.sizeof(cfg))
            text = next(((o, va) for o, va, x in info.text_segments if x), None)
            if text is None:
                return info
            v.text_offset, v.text_vaddr = text
            v.is_lib = int(bool(re.search(r"libpython3", os.path.basename(path))))
        table[k] = v
        return info

    def note_mapped(self, pid: int, dev: int, ino: int, start: int, pgoff: int, is_exe: bool) -> PyTarget | None:
        """A registered interpreter was mapped by ``pid`` (its exec, or its libpython's text at ``start`` holding file
        offset ``pgoff``): the kernel configured the walker itself; note the layout here too, so frames of a process
        that exits before it could be looked at still decode. Returns the target, or None if not an interpreter."""
        info = self._registered.get((dev, ino))
        if info is None:
            return None
        text = next(((o, va) for o, va, x in info.text_segments if x), None)
        if text is None:
            return None
        bias = start - text[1] if is_exe else start - pgoff + text[0] - text[1]
        if info.elf_type == "ET_EXEC":
            bias = 0
        target = PyTarget(pid=pid, binary=info, bias=bias)
        self._set_target(target)
        return target

    def _set_target(self, t: PyTarget) -> None:
        if self.targets.get(t.pid) is None:
            self.versions[t.version] = self.versions.get(t.version, 0) + 1
        self.targets[t.pid] = t

    def _write_cfg(self, t: PyTarget) -> None:
        if self.bpf is None:
            return
        cfg = build_cfg(t)
        table = self.bpf["pycfg"]
        table[table.Key(t.pid)] = ct.cast(ct.pointer(cfg), ct.POINTER(table.Leaf)).contents

    def note_fork(self, parent: int, child: int) -> None:
        """The child was forked from parent: same layout, and code objects created before the fork sit at the
        same address, so resolve() may read them from the parent once the child has exited."""
        self.parents[child] = parent
        if parent in self.targets and child not in self.targets:
            pt = self.targets[parent]
            self._set_target(PyTarget(pid=child, binary=pt.binary, bias=pt.bias))

    def forget(self, pid: int) -> None:
        """Drops the per-pid caches (call after the last stack of an exited process has been resolved, and of its
        forked children: their frames may be read through it)."""
        self.targets.pop(pid, None)
        self.parents.pop(pid, None)
        self._codes.pop(pid, None)

    # -- symbolisation ---------------------------------------------------------------------------------------

    def _code(self, pid: int, addr: int) -> tuple[CodeInfo | None, PyTarget | None]:
        """The code object at ``addr`` as ``pid`` saw it, and the layout to decode it with: from BPF's code events
        (of the process or an ancestor it was forked from), else read from the live process or its ancestors."""
        chain = self._lineage(pid)
        layout = next((self.targets[q] for q in chain if q in self.targets), None)
        for q in chain:
            info = self._codes.get(q, {}).get(addr)
            if info is not None:
                return info, layout
        for q in chain:
            t = self.targets.get(q)
            if t is None:
                continue
            info = read_code(q, t, addr)
            if info is not None:
                self._codes.setdefault(q, {})[addr] = info
                return info, t
        return None, None

    def _lineage(self, pid: int) -> list[int]:
        """``pid`` and the ancestors it was forked from (note_fork), nearest first: whose code objects it shares."""
        chain: list[int] = []
        p: int | None = pid
        while p is not None and p not in chain:
            chain.append(p)
            p = self.parents.get(p)
        return chain

    def codes_missing(self, pid: int, frames: Sequence[tuple[int, int]]) -> bool:
        """Whether a frame's code object has not come from BPF yet, for pid or an ancestor it was forked from."""
        known = [c for q in self._lineage(pid) if (c := self._codes.get(q)) is not None]
        return any(code and not any(code in c for c in known) for code, _ in frames)

    def resolve(self, pid: int, frames: list[tuple[int, int]]) -> list[PyFrameInfo]:
        """Frames (code object address, lasti) as walked in BPF, innermost first, to PyFrameInfo. Slots with
        code 0 (shim frames) are dropped. Code objects come from BPF's code events (add_code_events); one never
        sent is read from /proc/PID/mem once per (pid, code), falling back to the fork parent's memory
        (note_fork). A frame that cannot be read comes back with filename "" and qualname ``<unresolved 0x...>``."""
        out = []
        for code, lasti in frames:
            if not code:
                continue
            info, t = self._code(pid, code)
            if info is None or t is None:
                out.append(PyFrameInfo("", f"<unresolved {code:#x}>", 0, 0))
                continue
            hit = info.lines.get(lasti)
            if hit is None:
                line = _decode_line(t.version, info.linetable, info.firstlineno, lasti)
                # an instruction the table does not cover (cut table) or marks lineless: say the def line, flagged
                hit = (line, False) if line is not None else (info.firstlineno, True)
                info.lines[lasti] = hit
            out.append(PyFrameInfo(info.filename, info.qualname, hit[0], info.firstlineno, hit[1]))
        return out

    def add_code_events(self, ev: np.ndarray) -> None:
        """Take code objects read in BPF (a batch of events.CODE_DTYPE): what names each frame and decodes its
        lines, keyed by (pid, code address). A name BPF could not read (not compact ASCII) is read from the
        process if it still runs."""
        log.debug("%d code objects read in BPF, pids %s", len(ev), sorted(set(ev["pid"].tolist())))
        for e in ev:
            pid, code, flags = int(e["pid"]), int(e["code"]), int(e["flags"])
            name, file, first = cstr1(e["qualname"]), cstr1(e["filename"]), int(e["firstlineno"])
            if flags & (C.CODE_F_NAME_UNREAD | C.CODE_F_FILE_UNREAD):
                other = self._named_elsewhere(pid, code, first)
                if other is not None:
                    name = other.qualname if flags & C.CODE_F_NAME_UNREAD else name
                    file = other.filename if flags & C.CODE_F_FILE_UNREAD else file
            n = int(e["lt_len"])
            truncated = bool(flags & C.CODE_F_LT_UNREAD) or int(e["lt_full"]) > n
            self._codes.setdefault(pid, {})[code] = CodeInfo(
                file, name or f"<unreadable {code:#x}>", first, e["linetable"][:n].tobytes(), truncated
            )

    def _named_elsewhere(self, pid: int, code: int, first: int) -> CodeInfo | None:
        """The code object at ``code`` whose name or file BPF could not read in ``pid``: from the process itself if it
        still runs, else from the processes it was forked from, which hold the same object when it was made before
        the fork (their code event, or their memory), the same first line telling it from one made after the fork at
        the same address. A forked worker that exits right after its calls is gone before its events are drained
        (suite run 9: its frame of a function defined before the fork was ``<unreadable>``)."""
        for q in self._lineage(pid):
            known = self._codes.get(q, {}).get(code) if q != pid else None
            if known is not None and known.firstlineno == first and not known.qualname.startswith("<unreadable "):
                return known
            t = self.targets.get(q)
            live = read_code(q, t, code) if t is not None else None
            if live is not None and (q == pid or live.firstlineno == first):
                return live
        return None
