"""Where to probe CPython's cyclic garbage collector in an interpreter file (probes/gc.bpf.c), and attaching there.

Two kinds of interpreter:

* with USDT probes (Debian's and Ubuntu's system Pythons, built ``--with-dtrace``): ``python:gc__start(int
  generation)`` and ``python:gc__done(long collected)``. Their code runs only while the probe's semaphore is
  non-zero; the uprobe_multi link's ``ref_ctr_offsets`` make the kernel raise it in every process that maps the
  file, now or later, so one link per file serves every process with no per-process step;
* without (pyenv's builds): the collector's own function, ``gc_collect_main`` (a local symbol in 3.10-3.13),
  probed at entry (its second argument is the generation) and at return (the objects it collected).

On 3.10/3.11 a collection runs inside the allocation that crossed the threshold, so the stack at its start names
the allocating line. On 3.12+ that allocation only schedules it (``_PyObject_GC_Link`` -> ``_Py_ScheduleGC``, which
sets a "scheduled" flag and the eval breaker) and it runs at the next eval-breaker check: another line, a loop's
back edge, even another thread. ``_Py_ScheduleGC`` is inlined into ``_PyObject_GC_Link`` (pyenv's 3.12.1 and
3.13.0: its own copy is never called), so the point probed is the instruction after the inlined store of the flag,
which only an allocation that finds the flag clear reaches: one hit per collection (:func:`schedule_site`). A
second point, ``_Py_RunGC``'s entry (the eval-breaker check running it), marks the thread whose next collection is
the scheduled one: a ``gc.collect()`` in between keeps its own stack.

Each point's kind and where its argument lies are packed into the link's cookie (common.h GC_PT_*), so one BPF
program serves every interpreter version, with no recompile.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import struct
from dataclasses import dataclass, field

from tracer.recorder.events import C
from tracer.recorder.links import Link, LinkError, attach_multi

log = logging.getLogger(__name__)

COLLECTOR_SYMBOLS = ("gc_collect_main",)  # 3.10-3.13: gc_collect_main(tstate, generation, ...) -> collected
SCHEDULE_SYMBOLS = ("_Py_ScheduleGC", "_PyObject_GC_Link")  # 3.12+: the scheduler, and the allocation it is inlined in
RUN_SYMBOL = "_Py_RunGC"  # 3.12+: runs the scheduled collection (called, not inlined, in pyenv's 3.12.1 and 3.13.0)
# x86-64 struct pt_regs slots (arch/x86/include/asm/ptrace.h), by the USDT argument's register name (any width)
_PT_REGS = {
    "r15": 0, "r14": 1, "r13": 2, "r12": 3, "bp": 4, "bx": 5, "r11": 6, "r10": 7, "r9": 8, "r8": 9,
    "ax": 10, "cx": 11, "dx": 12, "si": 13, "di": 14, "ip": 16, "sp": 19,
}  # fmt: skip
_ARG = re.compile(r"^(-?)(\d+)@(?:(-?\d+)?\((%\w+)\)|(%\w+))$")  # -4@112(%rsp), -8@%r12, 4@%eax


def _reg_slot(name: str) -> int | None:
    """The pt_regs slot of an x86-64 register of any width (%rax %eax %ax %al, %r12 %r12d, %rsi %esi %sil)."""
    r = name.lstrip("%")
    m = re.fullmatch(r"(r\d+)[dwb]?", r)
    if m:
        return _PT_REGS.get(m.group(1))
    r = re.sub(r"^[re]", "", r) if len(r) == 3 else r
    r = {"al": "ax", "bl": "bx", "cl": "cx", "dl": "dx", "sil": "si", "dil": "di", "bpl": "bp", "spl": "sp"}.get(r, r)
    return _PT_REGS.get(r)


def cookie(point: int, arg: str | None) -> int:
    """The link cookie of a probe point: its kind (C.GC_PT_START / GC_PT_DONE) and its argument's location, from a
    USDT argument spec (``-4@112(%rsp)``) or a plain register (``%rsi``); an unknown location reads as -1."""
    reg, deref, size, signed, disp = C.GC_ARG_NONE, 0, 8, 1, 0
    m = _ARG.match(arg) if arg and "@" in arg else None
    if m and os.uname().machine == "x86_64":
        slot = _reg_slot(m.group(4) or m.group(5))
        if slot is not None and int(m.group(2)) in (1, 2, 4, 8):
            reg, size, signed = slot, int(m.group(2)), int(m.group(1) == "-")
            deref, disp = int(m.group(4) is not None), int(m.group(3) or 0)
    elif arg and arg.startswith("%") and os.uname().machine == "x86_64":
        slot = _reg_slot(arg)
        reg = slot if slot is not None else C.GC_ARG_NONE
    return point | reg << 8 | deref << 16 | size << 17 | signed << 21 | (disp & 0xFFFFFFFF) << 32


@dataclass(frozen=True)
class GcPoints:
    """The probe points of one interpreter file: file offsets, cookies, and (USDT) semaphore file offsets."""

    source: str  # "usdt" | "symbol"
    entries: tuple[tuple[int, int, int], ...]  # (file offset, cookie, semaphore file offset or 0)
    returns: tuple[tuple[int, int], ...] = ()  # (file offset, cookie): return probes (symbol source)
    schedule: tuple[int, int] | None = None  # 3.12+: file offsets of the schedule point and of _Py_RunGC


def _segments(elf: object) -> list[tuple[int, int, int]]:
    return [(s["p_offset"], s["p_vaddr"], s["p_filesz"]) for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]  # type: ignore[attr-defined]


def _to_offset(segs: list[tuple[int, int, int]], vaddr: int) -> int | None:
    for p_offset, p_vaddr, p_filesz in segs:
        if p_vaddr <= vaddr < p_vaddr + p_filesz:
            return vaddr - p_vaddr + p_offset
    return None


def usdt_notes(data: bytes) -> list[tuple[int, int, int, str, str, str]]:
    """The SystemTap SDT notes of a ``.note.stapsdt`` section: (pc, base, semaphore, provider, name, args)."""
    out = []
    i = 0
    while i + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from("<III", data, i)
        i += 12
        name = data[i : i + namesz].rstrip(b"\0")
        i += (namesz + 3) & ~3
        desc = data[i : i + descsz]
        i += (descsz + 3) & ~3
        if name != b"stapsdt" or ntype != 3 or len(desc) < 24:
            continue
        pc, base, sem = struct.unpack_from("<QQQ", desc, 0)
        provider, probe, args = (desc[24:].split(b"\0") + [b"", b"", b""])[:3]
        out.append((pc, base, sem, provider.decode(), probe.decode(), args.decode()))
    return out


def _symbol_value(symtab: object, strtab: object, name: str) -> int | None:
    """st_value of the first symbol ``name`` of a 64-bit little-endian symbol table (see :func:`_symbol`)."""
    sym = _symbol(symtab, strtab, name)
    return sym[0] if sym else None


def _symbol(symtab: object, strtab: object, name: str) -> tuple[int, int] | None:
    """(st_value, st_size) of the first symbol ``name`` of a 64-bit little-endian symbol table, by a scan of its raw
    entries:
    pyelftools' by-name lookup builds a dict of every symbol first (0.3-0.6 s for a libpython, on the path that
    holds a starting interpreter)."""
    import numpy as np

    strs = strtab.data()  # type: ignore[attr-defined]
    at = strs.find(b"\0" + name.encode() + b"\0")
    if at < 0:
        return None
    syms = np.frombuffer(
        symtab.data(),  # type: ignore[attr-defined]
        dtype=np.dtype(
            [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"), ("size", "<u8")]
        ),
    )
    hit = np.nonzero((syms["name"] == at + 1) & (syms["value"] != 0))[0]
    return (int(syms["value"][hit[0]]), int(syms["size"][hit[0]])) if len(hit) else None


# x86-64 stores of an immediate to [register + displacement], the forms _Py_ScheduleGC sets its flag with (3.12:
# movl $1, disp32(%rdi); 3.13: lock orq $0x10, disp8(%rdi)): opcode -> (immediate bytes, allowed ModRM reg fields)
_STORES = {0xC6: (1, {0}), 0xC7: (4, {0}), 0x80: (1, {0, 1}), 0x81: (4, {0, 1}), 0x83: (1, {0, 1})}


def _first_store(code: bytes) -> tuple[int, int | None, int, int, bytes] | None:
    """The first immediate store to memory in ``code`` (a tiny function's body): (lock prefix, REX or None, opcode,
    ModRM with its base register cleared, displacement + immediate bytes)."""
    for i, op in enumerate(code):
        if op not in _STORES or i + 1 >= len(code):
            continue
        modrm = code[i + 1]
        mod, reg, rm = modrm >> 6, (modrm >> 3) & 7, modrm & 7
        imm, regs = _STORES[op]
        if mod not in (1, 2) or rm == 4 or reg not in regs:
            continue  # no register-relative address, a SIB byte, or not a store (cmp, and, ...)
        rex = code[i - 1] if i >= 1 and 0x40 <= code[i - 1] <= 0x4F else None
        lock = int((i >= 1 and code[i - 1] == 0xF0) or (rex is not None and i >= 2 and code[i - 2] == 0xF0))
        tail = code[i + 2 : i + 2 + (1 if mod == 1 else 4) + imm]
        return lock, rex, op, modrm & ~7, bytes(tail)
    return None


def schedule_site(scheduler: bytes, link: bytes) -> int | None:
    """Offset in ``link`` (``_PyObject_GC_Link``'s body) of the instruction after its inlined copy of
    ``scheduler``'s (``_Py_ScheduleGC``'s) flag store, or None unless exactly one copy is there. The store itself is
    not probed: a uprobe refuses an instruction with a lock prefix (3.13's ``lock or``); the instruction after it
    is reached only through it (the function returns right after)."""
    store = _first_store(scheduler)
    if store is None:
        return None
    lock, rex, op, modrm, tail = store
    rexes = [bytes([(rex or 0x40) & ~1]), bytes([(rex or 0x40) | 1])]  # the base register may be any (REX.B)
    if rex is None:
        rexes[0] = b""
    pat = (
        (b"\xf0" if lock else b"")
        + b"(?:" + b"|".join(re.escape(r) for r in rexes) + b")"
        + re.escape(bytes([op]))
        + b"[" + b"".join(re.escape(bytes([modrm | r])) for r in (0, 1, 2, 3, 5, 6, 7)) + b"]"
        + re.escape(tail)
    )  # fmt: skip
    hits = [m.end() for m in re.finditer(pat, link, re.DOTALL)]
    return hits[0] if len(hits) == 1 else None


def _schedule_points(
    f: object, elf: object, symtab: object, segs: list[tuple[int, int, int]]
) -> tuple[int, int] | None:
    """File offsets of the point an allocation that schedules a collection passes and of _Py_RunGC's entry (3.12+),
    or None."""
    strtab = elf.get_section(symtab["sh_link"])  # type: ignore[attr-defined]
    syms = [_symbol(symtab, strtab, n) for n in SCHEDULE_SYMBOLS]
    run = _symbol(symtab, strtab, RUN_SYMBOL)
    run_off = _to_offset(segs, run[0]) if run else None
    if not all(syms) or run_off is None or os.uname().machine != "x86_64":
        return None
    bodies = []
    for vaddr, size in syms:  # type: ignore[misc]
        off = _to_offset(segs, vaddr)
        if off is None or not 0 < size < 4096:
            return None
        f.seek(off)  # type: ignore[attr-defined]
        bodies.append((off, f.read(size)))  # type: ignore[attr-defined]
    at = schedule_site(bodies[0][1], bodies[1][1])
    return (bodies[1][0] + at, run_off) if at is not None else None


@functools.cache
def _points(path: str, _ino: int, _mtime_ns: int) -> GcPoints | None:
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        segs = _segments(elf)
        notes = elf.get_section_by_name(".note.stapsdt")
        if notes is not None:
            base_sec = elf.get_section_by_name(".stapsdt.base")
            entries = []
            for pc, base, sem, provider, name, args in usdt_notes(notes.data()):
                if provider != "python" or name not in ("gc__start", "gc__done"):
                    continue
                if base_sec is not None and base:  # prelink moved the file: addresses shift with .stapsdt.base
                    pc += base_sec["sh_addr"] - base
                    sem += base_sec["sh_addr"] - base if sem else 0
                off = _to_offset(segs, pc)
                sem_off = _to_offset(segs, sem) if sem else 0
                if off is None or sem_off is None:
                    continue
                point = C.GC_PT_START if name == "gc__start" else C.GC_PT_DONE
                entries.append((off, cookie(point, args.split()[0] if args else None), sem_off))
            if {e[1] & 0xFF for e in entries} == {C.GC_PT_START, C.GC_PT_DONE}:
                return GcPoints("usdt", tuple(entries))
        symtab = elf.get_section_by_name(".symtab")
        if symtab is None:
            return None
        for name in COLLECTOR_SYMBOLS:
            vaddr = _symbol_value(symtab, elf.get_section(symtab["sh_link"]), name)
            off = _to_offset(segs, vaddr) if vaddr else None
            if off is not None:
                return GcPoints(
                    "symbol",
                    ((off, cookie(C.GC_PT_START, "%rsi"), 0),),
                    ((off, cookie(C.GC_PT_DONE, "%rax")),),
                    _schedule_points(f, elf, symtab, segs),
                )
    return None


def gc_points(path: str) -> GcPoints | None:
    """The collector's probe points in the interpreter file at ``path`` (an executable or a libpython), or None
    when it has neither USDT probes nor the collector's symbol."""
    try:
        st = os.stat(path)
        return _points(path, st.st_ino, st.st_mtime_ns)
    except Exception as e:  # a bad ELF (pyelftools raises its own errors) has no points, never a crash
        log.debug("%s: no GC probe points: %s", path, e)
        return None


@dataclass
class GcProbes:
    """The collector's probes on every interpreter file seen; one program (gc.bpf.c gc_probe) for all."""

    prog_fd: int
    links: dict[tuple[int, int], list[Link]] = field(default_factory=dict)  # (st_dev, st_ino) -> links
    sources: dict[str, str] = field(default_factory=dict)  # path -> "usdt" | "symbol" | why none
    notes: list[str] = field(default_factory=list)

    def attach(self, path: str) -> str | None:
        """Probe the collector in the interpreter file at ``path`` (once per file); return the source used."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino)
        if key in self.links:
            return self.sources.get(path)
        self.links[key] = []
        pts = gc_points(path)
        if pts is None:
            self.sources[path] = "none"
            return None
        try:
            entries = pts.entries
            if pts.schedule is not None:
                entries += ((pts.schedule[0], C.GC_PT_SCHEDULE, 0), (pts.schedule[1], C.GC_PT_RUN, 0))
            offs, cookies, sems = zip(*entries, strict=True)
            self.links[key].append(
                attach_multi(self.prog_fd, path, offs, cookies, retprobe=False, ref_ctr_offsets=sems)
            )
            if pts.returns:
                roffs, rcookies = zip(*pts.returns, strict=True)
                self.links[key].append(attach_multi(self.prog_fd, path, roffs, rcookies, retprobe=True))
        except LinkError as e:
            self.close_file(key)
            self.notes.append(f"no garbage-collector probes on {path}: {e}")
            return None
        self.sources[path] = pts.source
        log.info("garbage-collector probes on %s (%s)", path, pts.source)
        return pts.source

    def close_file(self, key: tuple[int, int]) -> None:
        for link in self.links.get(key, []):
            link.close()
        self.links[key] = []

    def closers(self) -> list[object]:
        """Every link's close, for links.close_together."""
        return [link.close for ls in self.links.values() for link in ls]
