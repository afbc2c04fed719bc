"""CPython runtimes of traced processes: BPF configuration (the ``pycfg`` map of probes/pyframes.h) and
symbolisation of the (code object, instruction index) pairs the BPF walk records.

Per binary (libpython or a static python executable), cached on disk by build-id so that configuring a new
process costs milliseconds: the version (``Py_Version`` or the file name), and the struct offsets, from DWARF
when present (pyenv, docker ``python:`` images), else ``_Py_DebugOffsets`` at ``&_PyRuntime`` (3.13+), else
the built-in table ``TABLE`` keyed by (major, minor). The ``autoTSSkey`` offset also falls back to
disassembling ``PyGILState_GetThisThreadState``.

Per process: the load bias from ``/proc/PID/maps``, hence ``&_PyRuntime`` and the TSS key address, written to
the ``pycfg`` map. Forked children get the parent's entry in BPF (pycfg_on_fork); user space only needs
``note_fork()`` so that ``resolve()`` can read code objects from the parent once the child has exited.

Line numbers are the executing line, decoded from ``co_linetable`` (3.10 byte pairs, 3.11+ PEP 657 location
table) at the recorded instruction index, not the ``def`` line."""

from __future__ import annotations

import ctypes as ct
import json
import logging
import os
import re
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tracer import btf
from tracer.events import C, cstr1
from tracer.procmaps import Mapping, read_maps

log = logging.getLogger(__name__)

CACHE_VERSION = 2
PTHREAD_SPECIFIC_1ST = 0x310  # glibc x86_64 2.27-2.38: offsetof(struct pthread, specific_1stblock)
PTHREAD_SPECIFIC_2ND = 0x510  # offsetof(struct pthread, specific)
NO_OFFSET = 0xFFFF

NOT_PYTHON = 2  # py_bin.is_lib of a file named like an interpreter that does not embed CPython (pyframes.h)
# py_cfg.flags, as in probes/pyframes.h
PYCFG_F_LASTI_INT = 1
PYCFG_F_CFRAME = 2
PYCFG_F_TAGGED = 4

# Built-in offsets, x86_64, default (GIL) build. 3.10-3.13 verified against DWARF on pyenv builds and Debian
# 3.11 -dbg; 3.14 sourced from py-spy/OTel/CPython headers (see shared/research/python-frames.md). tss:
# offset of the Py_tss_t autoTSSkey inside _PyRuntime (None: unknown, use DWARF or disassembly).
# fmt: off
TABLE: dict[tuple[int, int], dict[str, int | None]] = {
    (3, 10): dict(ts_frame=24, cframe_current=None, f_previous=24, f_code=32, f_instr=96, f_owner=None,
                  co_adaptive=0, co_filename=104, co_name=112, co_qualname=None, co_firstlineno=40,
                  co_linetable=120, tss=584),
    (3, 11): dict(ts_frame=56, cframe_current=8, f_previous=48, f_code=32, f_instr=56, f_owner=None,
                  co_adaptive=184, co_filename=112, co_name=120, co_qualname=128, co_firstlineno=72,
                  co_linetable=136, tss=592),
    (3, 12): dict(ts_frame=56, cframe_current=0, f_previous=8, f_code=0, f_instr=56, f_owner=70,
                  co_adaptive=192, co_filename=112, co_name=120, co_qualname=128, co_firstlineno=68,
                  co_linetable=136, tss=1544),
    (3, 13): dict(ts_frame=72, cframe_current=None, f_previous=8, f_code=0, f_instr=56, f_owner=70,
                  co_adaptive=200, co_filename=112, co_name=120, co_qualname=128, co_firstlineno=68,
                  co_linetable=136, tss=2160),
    (3, 14): dict(ts_frame=72, cframe_current=None, f_previous=8, f_code=0, f_instr=56, f_owner=74,
                  co_adaptive=208, co_filename=112, co_name=120, co_qualname=128, co_firstlineno=68,
                  co_linetable=136, tss=None),
}
# fmt: on
OFFSET_NAMES = tuple(TABLE[(3, 12)])

# DWARF: (struct, dotted member path) per offset name and version family.
_V310, _V311, _V313 = (3, 10), (3, 11), (3, 13)


def _dwarf_fields(ver: tuple[int, int]) -> dict[str, tuple[str, str]]:
    if ver <= _V310:
        frame = {
            "ts_frame": ("_ts", "frame"),
            "f_previous": ("_frame", "f_back"),
            "f_code": ("_frame", "f_code"),
            "f_instr": ("_frame", "f_lasti"),
        }
    elif ver < _V313:
        frame = {
            "ts_frame": ("_ts", "cframe"),
            "cframe_current": ("_PyCFrame", "current_frame"),
            "f_previous": ("_PyInterpreterFrame", "previous"),
            "f_code": ("_PyInterpreterFrame", "f_code"),
            "f_instr": ("_PyInterpreterFrame", "prev_instr"),
        }
        if ver >= (3, 12):
            frame["f_owner"] = ("_PyInterpreterFrame", "owner")
    else:
        frame = {
            "ts_frame": ("_ts", "current_frame"),
            "f_previous": ("_PyInterpreterFrame", "previous"),
            "f_code": ("_PyInterpreterFrame", "f_executable"),
            "f_instr": ("_PyInterpreterFrame", "instr_ptr"),
            "f_owner": ("_PyInterpreterFrame", "owner"),
        }
    code = {n: ("PyCodeObject", n) for n in ("co_filename", "co_name", "co_firstlineno", "co_linetable")}
    if ver > _V310:
        code["co_qualname"] = ("PyCodeObject", "co_qualname")
        code["co_adaptive"] = ("PyCodeObject", "co_code_adaptive")
    tss = ("pyruntimestate", "gilstate.autoTSSkey" if ver <= _V311 else "autoTSSkey")
    return {**frame, **code, "tss": tss}


_DWARF_CUS = ("Python/pystate.c", "Objects/codeobject.c", "Objects/frameobject.c", "Python/ceval.c")


@dataclass
class BinaryInfo:
    """What we know about one CPython binary, independent of any process. Cached on disk by build-id."""

    path: str
    build_id: str
    version: tuple[int, int]
    elf_type: str  # "ET_EXEC" or "ET_DYN"
    runtime_vaddr: int  # _PyRuntime
    code_type_vaddr: int  # PyCode_Type (0: unknown, no type check)
    offsets: dict[str, int | None]
    source: str  # "dwarf", "debug_offsets" or "table" (+ "+disasm" when the TSS offset came from code)
    load_segments: list[tuple[int, int]] = field(default_factory=list)  # (p_offset, p_vaddr) of PT_LOADs
    text_segments: list[tuple[int, int, bool]] = field(default_factory=list)  # (p_offset, p_vaddr, executable)


@dataclass
class PyTarget:
    """One configured process."""

    pid: int
    binary: BinaryInfo
    bias: int

    @property
    def version(self) -> tuple[int, int]:
        return self.binary.version

    @property
    def runtime_addr(self) -> int:
        return self.binary.runtime_vaddr + self.bias

    @property
    def tss_key_addr(self) -> int:
        tss = self.binary.offsets.get("tss")
        return self.runtime_addr + tss if tss is not None else 0


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


class PyCfg(ct.Structure):
    """ctypes mirror of struct py_cfg in probes/pyframes.h (56 bytes)."""

    _fields_ = [
        ("tss_key_addr", ct.c_uint64),
        ("runtime_addr", ct.c_uint64),
        ("version", ct.c_uint16),
        ("flags", ct.c_uint16),
        ("ts_frame", ct.c_uint16),
        ("cframe_current", ct.c_uint16),
        ("f_previous", ct.c_uint16),
        ("f_code", ct.c_uint16),
        ("f_instr", ct.c_uint16),
        ("f_owner", ct.c_uint16),
        ("co_adaptive", ct.c_uint16),
        ("frame_read", ct.c_uint16),
        ("pthread_spec1", ct.c_uint16),
        ("pthread_spec2", ct.c_uint16),
        ("co_filename", ct.c_uint16),
        ("co_name", ct.c_uint16),
        ("co_firstlineno", ct.c_uint16),
        ("co_linetable", ct.c_uint16),
        ("str_data", ct.c_uint16),
        ("owner_skip", ct.c_uint8),
        ("_pad", ct.c_uint8 * 5),
    ]


def build_cfg(t: PyTarget) -> PyCfg:
    """The pycfg map value for a configured process."""
    o = t.binary.offsets
    ver = t.version
    flags = 0
    if ver <= _V310:
        flags |= PYCFG_F_LASTI_INT
    if o.get("cframe_current") is not None:
        flags |= PYCFG_F_CFRAME
    if ver >= (3, 14):
        flags |= PYCFG_F_TAGGED
    owner = o.get("f_owner")
    read = max(o["f_previous"] or 0, o["f_code"] or 0, o["f_instr"] or 0) + 8
    if owner is not None:
        read = max(read, owner + 1)
    return PyCfg(
        tss_key_addr=t.tss_key_addr,
        runtime_addr=t.runtime_addr,
        version=ver[0] << 8 | ver[1],
        flags=flags,
        ts_frame=o["ts_frame"] or 0,
        cframe_current=o.get("cframe_current") or 0,
        f_previous=o["f_previous"] or 0,
        f_code=o["f_code"] or 0,
        f_instr=o["f_instr"] or 0,
        f_owner=owner if owner is not None else NO_OFFSET,
        co_adaptive=o.get("co_adaptive") or 0,
        frame_read=min((read + 7) & ~7, 128),
        pthread_spec1=PTHREAD_SPECIFIC_1ST,
        pthread_spec2=PTHREAD_SPECIFIC_2ND,
        co_filename=o["co_filename"] or 0,
        co_name=o.get("co_qualname") or o["co_name"] or 0,
        co_firstlineno=o["co_firstlineno"] or 0,
        co_linetable=o["co_linetable"] or 0,
        str_data=ascii_data_offset(ver),
        owner_skip=3 if owner is not None else 255,
    )


def ascii_data_offset(version: tuple[int, int]) -> int:
    """Offset of a compact ASCII str's characters: sizeof(PyASCIIObject), which lost its wstr pointer in 3.12."""
    return 48 if version <= (3, 11) else 40


def cflags() -> list[str]:
    """The -D flags pyframes.h needs: FSBASE_OFF, offsetof(task_struct, thread.fsbase) from kernel BTF."""
    return [f"-DFSBASE_OFF={btf.member_offset('task_struct', 'thread.fsbase')}"]


# ------------------------------------------------------------------------------------------------------------
# Line tables


def _varint(t: bytes, i: int) -> tuple[int, int]:
    b = t[i]
    i += 1
    val = b & 63
    shift = 0
    while b & 64:
        b = t[i]
        i += 1
        shift += 6
        val |= (b & 63) << shift
    return val, i


def _svarint(t: bytes, i: int) -> tuple[int, int]:
    v, i = _varint(t, i)
    return (-(v >> 1) if v & 1 else v >> 1), i


def line_311(linetable: bytes, firstlineno: int, lasti: int) -> int | None:
    """Line of the code unit `lasti` from a 3.11+ location table (Objects/locations.md); None: no line.
    lasti < 0 (frame just entered) gives firstlineno."""
    if lasti < 0:
        return firstlineno
    line = firstlineno
    addr = 0
    i = 0
    n = len(linetable)
    while i < n:
        first = linetable[i]
        i += 1
        code = (first >> 3) & 15
        length = (first & 7) + 1
        cur: int | None = line
        if code == 15:
            cur = None
        elif code == 14:
            delta, i = _svarint(linetable, i)
            line += delta
            cur = line
            for _ in range(3):
                _, i = _varint(linetable, i)
        elif code == 13:
            delta, i = _svarint(linetable, i)
            line += delta
            cur = line
        elif code >= 10:
            line += code - 10
            cur = line
            i += 2
        else:
            i += 1
        if addr <= lasti < addr + length:
            return cur
        addr += length
    return None


def line_310(linetable: bytes, firstlineno: int, lasti: int) -> int | None:
    """Line of the code unit `lasti` (3.10 ``f_lasti``) from a 3.10 ``co_linetable``
    (Objects/lnotab_notes.txt:
    byte pairs of (byte delta, signed line delta), -128 = no line). lasti < 0 gives firstlineno."""
    if lasti < 0:
        return firstlineno
    target = lasti * 2
    line = firstlineno
    addr = 0
    for i in range(0, len(linetable) - 1, 2):
        end = addr + linetable[i]
        ldelta = linetable[i + 1] - 256 if linetable[i + 1] >= 128 else linetable[i + 1]
        cur: int | None
        if ldelta == -128:
            cur = None
        else:
            line += ldelta
            cur = line
        if addr <= target < end:
            return cur
        addr = end
    return None


def decode_line(version: tuple[int, int], linetable: bytes, firstlineno: int, lasti: int) -> int | None:
    if lasti >= 0x80000000:  # u32 from BPF: -1 means "just entered"
        lasti -= 1 << 32
    if version <= _V310:
        return line_310(linetable, firstlineno, lasti)
    return line_311(linetable, firstlineno, lasti)


# ------------------------------------------------------------------------------------------------------------
# ELF analysis


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cuda-host-tracer")


def _version_from_name(path: str) -> tuple[int, int] | None:
    m = re.search(r"python(\d)\.(\d+)", os.path.basename(path))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _vaddr_to_offset(segs: list[tuple[int, int, int]], vaddr: int) -> int | None:
    for p_offset, p_vaddr, p_filesz in segs:
        if p_vaddr <= vaddr < p_vaddr + p_filesz:
            return vaddr - p_vaddr + p_offset
    return None


def _debug_offsets_313(data: bytes) -> dict[str, int | None] | None:
    """Offsets from 3.13's _Py_DebugOffsets (Include/internal/pycore_runtime.h), read from the ELF file."""
    if data[:8] != b"xdebugpy":
        return None
    q = struct.unpack_from("<71Q", data, 0)
    version = q[1]
    if (version >> 16) != 0x030D or q[2]:  # other minor versions have other layouts; free-threaded: not ours
        return None
    # u64 index: runtime_state at 3, interpreter_state at 6 (13 fields), thread_state at 19 (9),
    # interpreter_frame
    # at 28 (6), code_object at 34 (10).
    ts, fr, co = 19, 28, 34
    return dict(
        ts_frame=q[ts + 4],
        cframe_current=None,
        f_previous=q[fr + 1],
        f_code=q[fr + 2],
        f_instr=q[fr + 3],
        f_owner=q[fr + 5],
        co_filename=q[co + 1],
        co_name=q[co + 2],
        co_qualname=q[co + 3],
        co_linetable=q[co + 4],
        co_firstlineno=q[co + 5],
        co_adaptive=q[co + 9],
        tss=None,
    )


def _disasm_tss(code: bytes, func_vaddr: int, runtime_vaddr: int) -> int | None:
    """Offset of the autoTSSkey Py_tss_t in _PyRuntime, from PyGILState_GetThisThreadState's first
    instructions.

    PIC (shared libpython): ``mov rax, [rip+GOT(_PyRuntime)]`` then ``lea r64, [rax+disp32]`` (48 8d /r,
    mod=10,
    rm=rax). Non-PIC: ``lea rdi, [rip+d]`` (the Py_tss_t) or ``mov edi, [rip+d]`` (its _key, Py_tss_t + 4).
    """
    for i in range(0, min(len(code), 64) - 7):
        if code[i : i + 2] == b"\x48\x8d" and code[i + 2] & 0xC7 == 0x80:
            (d,) = struct.unpack_from("<i", code, i + 3)
            return d
        if code[i : i + 3] == b"\x48\x8d\x3d":
            (d,) = struct.unpack_from("<i", code, i + 3)
            return func_vaddr + i + 7 + d - runtime_vaddr
        if code[i : i + 2] == b"\x8b\x3d" and (i == 0 or not 0x40 <= code[i - 1] < 0x50):
            (d,) = struct.unpack_from("<i", code, i + 2)
            return func_vaddr + i + 6 + d - 4 - runtime_vaddr
    return None


class _Dwarf:
    """Struct member offsets from DWARF, restricted to a few compilation units (0.4-1.2 s per libpython)."""

    def __init__(self, elf: Any) -> None:
        self.dwarf = elf.get_dwarf_info()
        self.structs: dict[str, Any] = {}

    def load(self, wanted: set[str]) -> None:
        for cu in self.dwarf.iter_CUs():
            top = cu.get_top_DIE()
            name = top.attributes.get("DW_AT_name")
            if not name or not any(name.value.decode(errors="replace").endswith(c) for c in _DWARF_CUS):
                continue
            for die in top.iter_children():
                if die.tag not in ("DW_TAG_structure_type", "DW_TAG_union_type"):
                    continue
                a = die.attributes.get("DW_AT_name")
                if a is None or "DW_AT_declaration" in die.attributes:
                    continue
                self.structs.setdefault(a.value.decode(), die)
            if wanted <= set(self.structs):
                return

    @staticmethod
    def _strip(die: Any) -> Any:
        while die.tag in ("DW_TAG_typedef", "DW_TAG_const_type", "DW_TAG_volatile_type"):
            die = die.get_DIE_from_attribute("DW_AT_type")
        return die

    def member_offset(self, struct_name: str, path: str) -> int | None:
        die = self.structs.get(struct_name)
        total = 0
        for part in path.split("."):
            if die is None:
                return None
            die = self._strip(die)
            if "DW_AT_declaration" in die.attributes:
                die = self.structs.get(die.attributes["DW_AT_name"].value.decode())
                if die is None:
                    return None
            for m in die.iter_children():
                a = m.attributes.get("DW_AT_name")
                if m.tag == "DW_TAG_member" and a is not None and a.value.decode() == part:
                    loc = m.attributes.get("DW_AT_data_member_location")
                    total += loc.value if loc is not None and isinstance(loc.value, int) else 0
                    die = m.get_DIE_from_attribute("DW_AT_type")
                    break
            else:
                return None
        return total


def analyze_binary(path: str, *, use_cache: bool = True) -> BinaryInfo | None:
    """The CPython layout of the ELF at `path`, or None if it does not embed CPython (_PyRuntime)."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        build_id = ""
        sec = elf.get_section_by_name(".note.gnu.build-id")
        if sec is not None:
            for note in sec.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID":
                    build_id = note["n_desc"]
        if not build_id:
            st = os.stat(path)
            build_id = f"nobid-{st.st_size}-{int(st.st_mtime)}"
        cache_file = os.path.join(_cache_dir(), f"pyrt-{build_id}.json")
        if use_cache:
            try:
                with open(cache_file) as cf:
                    d = json.load(cf)
                if d.get("cache_version") == CACHE_VERSION:
                    d.pop("cache_version")
                    d["version"] = tuple(d["version"])
                    d["load_segments"] = [tuple(s) for s in d["load_segments"]]
                    d["text_segments"] = [tuple(s) for s in d.get("text_segments", [])]
                    return BinaryInfo(**d)
            except (OSError, ValueError, TypeError, KeyError):
                pass

        loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        segs = [(s["p_offset"], s["p_vaddr"], s["p_filesz"]) for s in loads]
        text_segments = [(s["p_offset"], s["p_vaddr"], bool(s["p_flags"] & 1)) for s in loads]

        def read_vaddr(vaddr: int, n: int) -> bytes | None:
            off = _vaddr_to_offset(segs, vaddr)
            if off is None:
                return None
            f.seek(off)
            return f.read(n)

        syms: dict[str, int] = {}
        for secname in (".dynsym", ".symtab"):
            sec = elf.get_section_by_name(secname)
            if sec is None:
                continue
            for name in ("_PyRuntime", "Py_Version", "PyCode_Type", "PyGILState_GetThisThreadState"):
                if name in syms:
                    continue
                found = sec.get_symbol_by_name(name)
                if found:
                    syms[name] = found[0]["st_value"]
        if "_PyRuntime" not in syms:
            return None
        version = None
        if "Py_Version" in syms:
            raw = read_vaddr(syms["Py_Version"], 4)
            if raw and len(raw) == 4:
                (hexv,) = struct.unpack("<I", raw)
                version = (hexv >> 24, (hexv >> 16) & 0xFF)
        version = version or _version_from_name(path)
        if version is None:
            log.warning("%s: CPython of unknown version, not configured", path)
            return None

        if version >= (3, 13):
            head = read_vaddr(syms["_PyRuntime"], 24)
            if head and head[:8] == b"xdebugpy" and struct.unpack_from("<Q", head, 16)[0]:
                # free-threaded (3.13t/3.14t): bigger object headers, per-thread bytecode; not supported
                log.warning("%s: free-threaded CPython is not supported", path)
                return None
        offsets: dict[str, int | None] | None = None
        source = ""
        if elf.has_dwarf_info() and elf.get_section_by_name(".debug_info") is not None:
            try:
                fields = _dwarf_fields(version)
                dw = _Dwarf(elf)
                dw.load({s for s, _ in fields.values()})
                got = {n: dw.member_offset(s, p) for n, (s, p) in fields.items()}
                if all(got[n] is not None for n in ("ts_frame", "f_previous", "f_code", "f_instr", "co_filename")):
                    offsets = {n: got.get(n) for n in OFFSET_NAMES}
                    if version <= _V310:
                        offsets["co_adaptive"] = 0
                    source = "dwarf"
            except Exception as e:  # malformed DWARF is not fatal, the table still works
                log.debug("%s: DWARF offsets failed: %s", path, e)
        if offsets is None and version >= (3, 13):
            raw = read_vaddr(syms["_PyRuntime"], 71 * 8)
            if raw and len(raw) == 71 * 8:
                offsets = _debug_offsets_313(raw)
                if offsets is not None:
                    source = "debug_offsets"
        if offsets is None:
            if version not in TABLE:
                log.warning("%s: CPython %d.%d has no built-in offsets and no DWARF", path, *version)
                return None
            offsets = dict(TABLE[version])
            source = "table"
        if offsets.get("tss") is None and version in TABLE and TABLE[version]["tss"] is not None:
            offsets["tss"] = TABLE[version]["tss"]
        if offsets.get("tss") is None and "PyGILState_GetThisThreadState" in syms:
            fv = syms["PyGILState_GetThisThreadState"]
            code = read_vaddr(fv, 64)
            tss = _disasm_tss(code, fv, syms["_PyRuntime"]) if code else None
            if tss is not None and 0 <= tss < 1 << 16:
                offsets["tss"] = tss
                source += "+disasm"
        info = BinaryInfo(
            path=path,
            build_id=build_id,
            version=version,
            elf_type=elf["e_type"],
            runtime_vaddr=syms["_PyRuntime"],
            code_type_vaddr=syms.get("PyCode_Type", 0),
            offsets=offsets,
            source=source,
            load_segments=[(o, v) for o, v, _ in segs],
            text_segments=text_segments,
        )
    if use_cache:
        try:
            os.makedirs(os.path.dirname(cache_file), exist_ok=True)
            tmp = f"{cache_file}.{os.getpid()}.tmp"
            with open(tmp, "w") as cf:
                json.dump({**asdict(info), "cache_version": CACHE_VERSION}, cf)
            os.replace(tmp, cache_file)
        except OSError as e:
            log.debug("cannot write %s: %s", cache_file, e)
    return info


def _load_bias(info: BinaryInfo, maps: list[Mapping], path: str) -> int | None:
    if info.elf_type == "ET_EXEC":
        return 0
    for m in maps:
        start, off, p = m.start, m.offset, m.path
        if p != path:
            continue
        for p_offset, p_vaddr in info.load_segments:
            if off == p_offset & ~0xFFF:
                return start - (p_vaddr & ~0xFFF)
    return None


# ------------------------------------------------------------------------------------------------------------
# Process memory


class _Mem:
    """Reads of another process's memory through /proc/PID/mem."""

    def __init__(self, pid: int) -> None:
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)

    def read(self, addr: int, n: int) -> bytes:
        data = os.pread(self.fd, n, addr)
        if len(data) != n:
            raise OSError(f"short read at {addr:#x}")
        return data

    def close(self) -> None:
        os.close(self.fd)


def _read_str(mem: _Mem, addr: int, version: tuple[int, int]) -> str:
    """A str object: compact ASCII or compact non-ASCII (latin-1/UCS-2/UCS-4)."""
    head = mem.read(addr, 48)
    (length,) = struct.unpack_from("<q", head, 16)
    (state,) = struct.unpack_from("<I", head, 32)
    kind = (state >> 2) & 7
    compact = (state >> 5) & 1
    ascii_ = (state >> 6) & 1
    if not compact or length < 0 or length > 4096:
        return "?"
    old = version <= (3, 11)
    if ascii_:
        return mem.read(addr + (48 if old else 40), length).decode("ascii", "replace")
    data = mem.read(addr + (72 if old else 56), length * kind)
    return data.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}.get(kind, "latin-1"), "replace")


@dataclass
class _CodeInfo:
    filename: str
    qualname: str
    firstlineno: int
    linetable: bytes
    truncated: bool = False  # the line table was cut (CODE_LT_MAX) or unreadable: later lines are approximate
    lines: dict[int, tuple[int, bool]] = field(default_factory=dict)  # lasti -> (line, approx)


class PyRuntimeManager:
    """Configures traced CPython processes in the ``pycfg`` map and resolves their recorded frames.

    Args:
        bpf: the loaded ``bcc.BPF`` whose program includes probes/pyframes.h; None for resolve-only use.
    """

    def __init__(self, bpf: Any | None) -> None:
        self.bpf = bpf
        self.targets: dict[int, PyTarget] = {}
        self.parents: dict[int, int] = {}
        self._binaries: dict[tuple[str, int, int], BinaryInfo | None] = {}
        self._codes: dict[tuple[int, int], _CodeInfo | None] = {}
        self._registered: dict[tuple[int, int], BinaryInfo | None] = {}  # (st_dev, st_ino) in py_binaries

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
            bias = _load_bias(info, maps, path)
            if bias is None:
                continue
            target = PyTarget(pid=pid, binary=info, bias=bias)
            if not target.tss_key_addr:
                log.warning("pid %d: %s: no autoTSSkey offset for %d.%d", pid, path, *info.version)
                return None
            self.targets[pid] = target
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
        self.targets[pid] = target
        return target

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
            self.targets[child] = PyTarget(pid=child, binary=pt.binary, bias=pt.bias)

    def forget(self, pid: int) -> None:
        """Drops the per-pid caches (call after the last stack of an exited process has been resolved)."""
        self.targets.pop(pid, None)
        for k in [k for k in self._codes if k[0] == pid]:
            del self._codes[k]

    # -- symbolisation ---------------------------------------------------------------------------------------

    def _read_code(self, pid: int, t: PyTarget, addr: int) -> _CodeInfo | None:
        o = t.binary.offsets
        try:
            mem = _Mem(pid)
        except OSError:
            return None
        try:
            head = mem.read(addr, 160)
            if t.binary.code_type_vaddr:
                (ob_type,) = struct.unpack_from("<Q", head, 8)
                if ob_type != t.binary.code_type_vaddr + t.bias:
                    return None
            (fn_p,) = struct.unpack_from("<Q", head, o["co_filename"])
            name_off = o.get("co_qualname") or o["co_name"]
            (qn_p,) = struct.unpack_from("<Q", head, name_off)
            (first,) = struct.unpack_from("<i", head, o["co_firstlineno"])
            (lt_p,) = struct.unpack_from("<Q", head, o["co_linetable"])
            (lt_len,) = struct.unpack_from("<q", mem.read(lt_p + 16, 8))
            linetable = mem.read(lt_p + 32, lt_len) if 0 < lt_len < 1 << 20 else b""
            return _CodeInfo(_read_str(mem, fn_p, t.version), _read_str(mem, qn_p, t.version), first, linetable)
        except (OSError, struct.error, ValueError):
            return None
        finally:
            mem.close()

    def _code(self, pid: int, addr: int) -> tuple[_CodeInfo | None, PyTarget | None]:
        """The code object at ``addr`` as ``pid`` saw it, and the layout to decode it with: from BPF's code events
        (of the process or an ancestor it was forked from), else read from the live process or its ancestors."""
        chain: list[int] = []
        p: int | None = pid
        while p is not None and p not in chain:
            chain.append(p)
            p = self.parents.get(p)
        layout = next((self.targets[q] for q in chain if q in self.targets), None)
        for q in chain:
            info = self._codes.get((q, addr))
            if info is not None:
                return info, layout
        for q in chain:
            t = self.targets.get(q)
            if t is None:
                continue
            info = self._read_code(q, t, addr)
            if info is not None:
                self._codes[(q, addr)] = info
                return info, t
        return None, None

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
                line = decode_line(t.version, info.linetable, info.firstlineno, lasti)
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
            name, file = cstr1(e["qualname"]), cstr1(e["filename"])
            if flags & (C.CODE_F_NAME_UNREAD | C.CODE_F_FILE_UNREAD) and pid in self.targets:
                live = self._read_code(pid, self.targets[pid], code)
                if live is not None:
                    name = live.qualname if flags & C.CODE_F_NAME_UNREAD else name
                    file = live.filename if flags & C.CODE_F_FILE_UNREAD else file
            n = int(e["lt_len"])
            truncated = bool(flags & C.CODE_F_LT_UNREAD) or int(e["lt_full"]) > n
            self._codes[(pid, code)] = _CodeInfo(
                file, name or f"<unreadable {code:#x}>", int(e["firstlineno"]), e["linetable"][:n].tobytes(), truncated
            )
