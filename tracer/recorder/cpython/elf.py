"""The CPython layout of one ELF file (a libpython or a static python executable), cached on disk by build-id so
that configuring a new process costs milliseconds: the version (``Py_Version`` or the file name), and the
struct offsets, from DWARF when present (pyenv, docker ``python:`` images), else ``_Py_DebugOffsets`` at
``&_PyRuntime`` (3.13+), else the built-in :data:`~tracer.recorder.cpython.layouts.TABLE`. The ``autoTSSkey``
offset also falls back to disassembling ``PyGILState_GetThisThreadState``."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from dataclasses import asdict
from typing import Any

from tracer.recorder.cpython.layouts import OFFSET_NAMES, TABLE, V310, BinaryInfo, dwarf_fields
from tracer.recorder.procmaps import Mapping

log = logging.getLogger(__name__)

CACHE_VERSION = 2
# the compilation units whose DWARF holds the structs of dwarf_fields (reading only them saves seconds)
DWARF_CUS = ("Python/pystate.c", "Objects/codeobject.c", "Objects/frameobject.c", "Python/ceval.c")


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cuda-host-tracer")


def _version_from_name(path: str) -> tuple[int, int] | None:
    m = re.search(r"python(\d)\.(\d+)", os.path.basename(path))
    return (int(m.group(1)), int(m.group(2))) if m else None


def vaddr_to_offset(segs: list[tuple[int, int, int]], vaddr: int) -> int | None:
    """The file offset of virtual address ``vaddr``, given the PT_LOAD (p_offset, p_vaddr, p_filesz); None when no
    segment holds it in the file."""
    for p_offset, p_vaddr, p_filesz in segs:
        if p_vaddr <= vaddr < p_vaddr + p_filesz:
            return vaddr - p_vaddr + p_offset
    return None


def debug_offsets_313(data: bytes) -> dict[str, int | None] | None:
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


def disasm_tss(code: bytes, func_vaddr: int, runtime_vaddr: int) -> int | None:
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
            if not name or not any(name.value.decode(errors="replace").endswith(c) for c in DWARF_CUS):
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
            off = vaddr_to_offset(segs, vaddr)
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
                fields = dwarf_fields(version)
                dw = _Dwarf(elf)
                dw.load({s for s, _ in fields.values()})
                got = {n: dw.member_offset(s, p) for n, (s, p) in fields.items()}
                if all(got[n] is not None for n in ("ts_frame", "f_previous", "f_code", "f_instr", "co_filename")):
                    offsets = {n: got.get(n) for n in OFFSET_NAMES}
                    if version <= V310:
                        offsets["co_adaptive"] = 0
                    source = "dwarf"
            except Exception as e:  # malformed DWARF is not fatal, the table still works
                log.debug("%s: DWARF offsets failed: %s", path, e)
        if offsets is None and version >= (3, 13):
            raw = read_vaddr(syms["_PyRuntime"], 71 * 8)
            if raw and len(raw) == 71 * 8:
                offsets = debug_offsets_313(raw)
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
            tss = disasm_tss(code, fv, syms["_PyRuntime"]) if code else None
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


def load_bias(info: BinaryInfo, maps: list[Mapping], path: str) -> int | None:
    """Where a process mapped the file at ``path``: the amount added to the file's virtual addresses (0 for an
    ET_EXEC); None when none of its load segments is mapped."""
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
