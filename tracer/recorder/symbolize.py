"""Native addresses -> (module, build-id, function, file:line), and CUDA kernel pointers -> kernel names.

Contract:

* Addresses are located through :class:`tracer.recorder.procmaps.MapCache`, which the recorder keeps current from
  mapping
  events, so an address resolves after its process has exited.
* ``ElfSymbols`` holds one file's function symbols (``.symtab``, local symbols included, else ``.dynsym``, else
  the separate debug file under ``/usr/lib/debug/.build-id``) as sorted numpy arrays; ``lookup(vaddr)`` is a
  bisect. Parsed files are cached by (device, inode, mtime) and by build-id.
* C++ names are demangled with ``cxxfilt`` (libstdc++'s ``__cxa_demangle``), cached per name.
* Unknown addresses become ``NativeFrame(function="?")`` with the module and offset filled in when known.
* File:line comes from ``.debug_line`` only for files whose line table is small (``MAX_DEBUG_LINE_BYTES``):
  decoding libpython's takes pyelftools seconds of CPU, which a recorder cannot spend.

Stacks hold the interrupted ip first and return addresses after it. A return address points after the call
instruction, which may already be the next function or the next line, so frames after the first are looked up at
``addr - 1`` (``offset`` is still reported from ``addr``).
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from tracer.recorder import elfcache
from tracer.recorder.procmaps import MapCache, Mapping

log = logging.getLogger(__name__)

UNKNOWN = "?"
# .debug_line of big libraries is not worth decoding in Python (libpython's: seconds of CPU; libtorch_cuda's:
# hundreds of MB); above this many bytes file:line is left empty. Small C/C++ libraries are covered.
MAX_DEBUG_LINE_BYTES = 256 << 10
DEBUG_ROOT = "/usr/lib/debug"
ELF64_SYM = np.dtype(
    [
        ("st_name", "<u4"),
        ("st_info", "u1"),
        ("st_other", "u1"),
        ("st_shndx", "<u2"),
        ("st_value", "<u8"),
        ("st_size", "<u8"),
    ]
)


@dataclass(frozen=True)
class NativeFrame:
    """One symbolised native frame. ``offset`` is from the function start, or from the module start when the
    function is unknown; ``file``/``line`` are empty/0 without DWARF line info."""

    module: str
    function: str
    offset: int
    file: str
    line: int
    build_id: str | None
    addr: int


# ---------------------------------------------------------------------------------------------------------
# ELF files


STAT_TTL_S = 1.0


def _file_key(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def read_build_id(elf: ELFFile) -> str | None:
    """The GNU build-id as hex, or None."""
    for sec in elf.iter_sections():
        if sec["sh_type"] != "SHT_NOTE":
            continue
        for note in sec.iter_notes():
            if note["n_type"] == "NT_GNU_BUILD_ID":
                return str(note["n_desc"])
    return None


@dataclass(frozen=True)
class LineTable:
    """A file's .debug_line rows sorted by address, as arrays: the ELF cache's own shape, so an entry is read back
    without building a tuple a row (8-18 K rows in the stand-in libraries, ~10 ms each)."""

    addrs: np.ndarray  # uint64: where each row starts
    lines: np.ndarray  # int64: its line; 0 ends a sequence (no line there)
    file_of: np.ndarray  # int64: its index in files
    files: list[str]


class ElfSymbols:
    """Function symbols and load segments of one ELF file; ``lookup`` by ELF virtual address."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.build_id: str | None = None
        # PT_LOAD segments: (p_offset, p_vaddr, p_filesz); text: the first executable one's (p_offset, p_vaddr)
        self.loads: list[tuple[int, int, int]] = []
        self.text: tuple[int, int] | None = None
        self._starts = np.zeros(0, dtype=np.uint64)
        self._ends = np.zeros(0, dtype=np.uint64)
        self._names: Sequence[str] = []  # a list once parsed; from the ELF cache, decoded name by name
        self._symbols_loaded = False
        self._lines: LineTable | None = None
        self._has_debug_line = False
        # Cheap part only (headers and notes): mapping an address needs the PT_LOADs, and the symbol tables are
        # read on the first lookup.
        with open(path, "rb") as f:
            elf = ELFFile(f)
            self.build_id = read_build_id(elf)
            for seg in elf.iter_segments():
                if seg["p_type"] != "PT_LOAD":
                    continue
                self.loads.append((seg["p_offset"], seg["p_vaddr"], seg["p_filesz"]))
                if seg["p_flags"] & 1 and self.text is None:  # PF_X
                    self.text = (seg["p_offset"], seg["p_vaddr"])
            dl = elf.get_section_by_name(".debug_line")
            self._has_debug_line = dl is not None and dl["sh_size"] <= MAX_DEBUG_LINE_BYTES

    # --- kept between recordings (tracer/recorder/elfcache.py) ---------------------------------------------------

    def cached_state(self) -> tuple[bool, bool]:
        """What has been parsed so far: (symbols, line table); an entry is worth (re)writing when it grew."""
        return self._symbols_loaded, self._lines is not None

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Everything parsed so far, as arrays for the ELF cache."""
        out = {
            "loads": np.array(self.loads, dtype=np.int64).reshape(-1, 3),
            "text": np.array(self.text if self.text is not None else (), dtype=np.int64),
            "build_id": np.frombuffer((self.build_id or "").encode(), dtype=np.uint8).copy(),
            "flags": np.array([self._has_debug_line, self._symbols_loaded, self._lines is not None], dtype=bool),
        }
        if self._symbols_loaded:
            out["starts"], out["ends"] = self._starts, self._ends
            out["names"], out["name_ends"] = elfcache.pack_names(self._names)
        if self._lines is not None:
            t = self._lines
            out["line_addrs"], out["line_nos"], out["line_files"] = t.addrs, t.lines, t.file_of
            out["files"], out["file_ends"] = elfcache.pack_strings(t.files)
        return out

    @classmethod
    def from_arrays(cls, path: str, a: dict[str, np.ndarray]) -> ElfSymbols:
        """The parsed file from an ELF cache entry.

        Raises:
            ValueError, KeyError: the entry lacks an array or has one of the wrong shape.
        """
        self = cls.__new__(cls)
        self.path = path
        loads, text, flags = a["loads"], a["text"], a["flags"]
        if loads.ndim != 2 or loads.shape[1] != 3 or len(text) not in (0, 2) or len(flags) != 3:
            raise ValueError("ELF cache entry of the wrong shape")
        self.loads = [tuple(r) for r in loads.tolist()]
        self.text = (int(text[0]), int(text[1])) if len(text) else None
        self.build_id = a["build_id"].tobytes().decode() or None
        self._has_debug_line, self._symbols_loaded, lines = (bool(f) for f in flags)
        self._starts, self._ends, self._names = np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64), []
        if self._symbols_loaded:
            self._starts, self._ends = a["starts"].astype(np.uint64), a["ends"].astype(np.uint64)
            self._names = elfcache.PackedStrings(a["names"], a["name_ends"])
            if not (len(self._starts) == len(self._ends) == len(self._names)):
                raise ValueError("ELF cache entry: symbol arrays differ in length")
        self._lines = None
        if lines:
            files = elfcache.unpack_strings(a["files"], a["file_ends"])
            addrs, nos, idx = a["line_addrs"].astype(np.uint64), a["line_nos"], a["line_files"]
            if not (len(addrs) == len(nos) == len(idx)) or (len(idx) and (idx.min() < 0 or idx.max() >= len(files))):
                raise ValueError("ELF cache entry: line arrays differ in length")
            self._lines = LineTable(addrs, nos.astype(np.int64), idx.astype(np.int64), files)
        return self

    def _ensure_symbols(self) -> None:
        if self._symbols_loaded:
            return
        self._symbols_loaded = True
        with open(self.path, "rb") as f:
            syms = self._read_symbols(ELFFile(f))
        if not syms and self.build_id:
            debug = os.path.join(DEBUG_ROOT, ".build-id", self.build_id[:2], self.build_id[2:] + ".debug")
            if os.path.exists(debug):
                with open(debug, "rb") as f:
                    syms = self._read_symbols(ELFFile(f))
        self._index(syms)

    @staticmethod
    def _read_symbols(elf: ELFFile) -> list[tuple[int, int, str]]:
        # Elf64_Sym decoded with numpy: pyelftools' iter_symbols takes ~0.3 s for libpython's 15k symbols and
        # minutes for libtorch's millions.
        for name in (".symtab", ".dynsym"):
            sec = elf.get_section_by_name(name)
            if not isinstance(sec, SymbolTableSection) or sec["sh_entsize"] != ELF64_SYM.itemsize:
                continue
            syms = np.frombuffer(sec.data(), dtype=ELF64_SYM)
            kind = syms["st_info"] & 0xF
            keep = ((kind == 2) | (kind == 10)) & (syms["st_shndx"] != 0) & (syms["st_value"] != 0)
            syms = syms[keep]
            if not len(syms):
                continue  # .symtab is a superset of .dynsym; try the next only if this one has no functions
            strtab = elf.get_section(sec["sh_link"]).data()
            out = []
            for value, size, off in zip(
                syms["st_value"].tolist(), syms["st_size"].tolist(), syms["st_name"].tolist(), strict=True
            ):
                end = strtab.find(b"\0", off)
                out.append((value, size, strtab[off:end].decode("utf-8", "replace")))
            return out
        return []

    def _index(self, syms: list[tuple[int, int, str]]) -> None:
        # Sort by start; among aliases at one address prefer the sized, global-looking (shortest) name.
        syms.sort(key=lambda s: (s[0], -s[1], s[2].startswith("_"), len(s[2])))
        dedup: list[tuple[int, int, str]] = []
        for s in syms:
            if dedup and dedup[-1][0] == s[0]:
                continue
            dedup.append(s)
        self._starts = np.array([s[0] for s in dedup], dtype=np.uint64)
        self._ends = np.array([s[0] + s[1] for s in dedup], dtype=np.uint64)
        self._names = [s[2] for s in dedup]

    def __len__(self) -> int:
        self._ensure_symbols()
        return len(self._names)

    def offset_to_vaddr(self, file_offset: int) -> int | None:
        """ELF virtual address of a file offset, through the PT_LOAD segment that holds it."""
        for off, vaddr, size in self.loads:
            if off <= file_offset < off + max(size, 1):
                return file_offset - off + vaddr
        return None

    def lookup(self, vaddr: int, *, exact: bool = False) -> tuple[str, int] | None:
        """(raw symbol name, offset into it) for an ELF vaddr, or None.

        A symbol with a size matches only inside it; a size-0 symbol (hand-written assembly) matches up to
        the next symbol. With ``exact``, only a symbol starting at ``vaddr`` matches.
        """
        self._ensure_symbols()
        i = int(np.searchsorted(self._starts, np.uint64(vaddr), side="right")) - 1
        if i < 0:
            return None
        start = int(self._starts[i])
        if exact:
            return (self._names[i], 0) if start == vaddr else None
        end = int(self._ends[i])
        if end > start and vaddr >= end:
            return None
        return self._names[i], vaddr - start

    def line_for(self, vaddr: int) -> tuple[str, int] | None:
        """(file, line) from .debug_line, or None (no DWARF, or too big to decode here)."""
        if not self._has_debug_line:
            return None
        if self._lines is None:
            self._lines = self._read_lines()
        t = self._lines
        i = int(np.searchsorted(t.addrs, np.uint64(vaddr), side="right")) - 1
        if i < 0 or t.lines[i] == 0:
            return None
        return t.files[int(t.file_of[i])], int(t.lines[i])

    def _read_lines(self) -> LineTable:
        pairs: list[tuple[int, str, int]] = []
        try:
            with open(self.path, "rb") as f:
                dwarf = ELFFile(f).get_dwarf_info()
                for cu in dwarf.iter_CUs():
                    lp = dwarf.line_program_for_CU(cu)
                    if lp is None:
                        continue
                    files = lp["file_entry"]
                    v5 = lp.header["version"] >= 5
                    for entry in lp.get_entries():
                        st = entry.state
                        if st is None:
                            continue
                        if st.end_sequence:
                            pairs.append((st.address, "", 0))
                            continue
                        idx = st.file if v5 else st.file - 1
                        name = files[idx].name.decode() if 0 <= idx < len(files) else ""
                        pairs.append((st.address, name, st.line))
        except (ELFError, OSError, KeyError, IndexError) as e:
            log.debug("no line table for %s: %s", self.path, e)
        pairs.sort(key=lambda p: p[0])
        files = sorted({p[1] for p in pairs})
        index = {f: i for i, f in enumerate(files)}
        return LineTable(
            np.array([p[0] for p in pairs], dtype=np.uint64),
            np.array([p[2] for p in pairs], dtype=np.int64),
            np.array([index[p[1]] for p in pairs], dtype=np.int64),
            files,
        )


class ElfCache:
    """Parsed ELF files, keyed by (device, inode, mtime) and by build-id."""

    def __init__(self, disk: Path | None = None) -> None:
        """``disk``: the directory of the ELF cache kept between recordings (tracer/recorder/elfcache.py), or None."""
        self._by_key: dict[tuple[int, int, int], ElfSymbols | None] = {}
        self._by_build_id: dict[str, ElfSymbols] = {}
        self._by_path: dict[str, ElfSymbols] = {}
        self.disk = disk
        self._stats: dict[str, tuple[tuple[int, int, int] | None, float]] = {}  # path -> (file_key, when)
        # per parsed file: its entry name and what that entry held when read (or nothing): written by save() if more
        self._entries: dict[int, tuple[ElfSymbols, str, tuple[bool, bool] | None]] = {}

    def file_key(self, path: str) -> tuple[int, int, int] | None:
        """The file's (device, inode, mtime), stat'ed at most once a STAT_TTL_S per path: every frame of every new
        stack asks (twice: its symbols and its unwind table), and the stat calls were 13% of resolving the stacks
        of re-forked workers (issue 33). A file replaced in place is seen within the TTL."""
        now = time.monotonic()
        got = self._stats.get(path)
        if got is not None and now - got[1] < STAT_TTL_S:
            return got[0]
        key = _file_key(path)
        self._stats[path] = (key, now)
        return key

    def _parse(self, path: str) -> ElfSymbols:
        key = elfcache.file_key(path, "sym") if self.disk is not None else None
        arrays = elfcache.load(self.disk, key)
        elf = None
        if arrays is not None:
            try:
                elf = ElfSymbols.from_arrays(path, arrays)
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                log.warning("elf cache: entry %s for %s is corrupt (%s): parsed again", key, path, e)
        if elf is None:
            elf = ElfSymbols(path)
        if key is not None:
            self._entries[id(elf)] = (elf, key, elf.cached_state() if arrays is not None else None)
        return elf

    def save(self) -> int:
        """Write the entry of every file parsed further than its entry held; return how many were written."""
        n = 0
        for elf, key, held in self._entries.values():
            now = elf.cached_state()
            # ~40 bytes a symbol (start, end, name offset, a name): an entry sure to pass the bound is not even packed
            if held != now and len(elf._names) * 40 <= elfcache.MAX_ENTRY_BYTES:
                if elfcache.store(self.disk, key, elf.to_arrays()):
                    n += 1
                    self._entries[id(elf)] = (elf, key, now)
        return n

    def get(self, path: str, build_id: str | None = None) -> ElfSymbols | None:
        """The parsed file: by build-id when known, else by path (must still exist). None if unreadable."""
        if build_id and build_id in self._by_build_id:
            return self._by_build_id[build_id]
        key = self.file_key(path)
        if key is None:
            elf = self._by_path.get(path)
            return elf if elf is not None and (build_id is None or elf.build_id == build_id) else None
        if key not in self._by_key:
            try:
                self._by_key[key] = self._parse(path)
            except (ELFError, OSError, struct.error, ValueError) as e:
                log.debug("cannot read ELF %s: %s", path, e)
                self._by_key[key] = None
        elf = self._by_key[key]
        if elf is None:
            return None
        if build_id and elf.build_id and elf.build_id != build_id:
            return None  # the file on disk changed since the event
        self._by_path[path] = elf
        if elf.build_id:
            self._by_build_id.setdefault(elf.build_id, elf)
        return elf


# ---------------------------------------------------------------------------------------------------------
# Demangling


@functools.lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """The demangled C++ (Itanium ABI) name; other names unchanged."""
    if not name.startswith("_Z"):
        return name
    base, at, version = name.partition("@")
    try:
        import cxxfilt

        out = cxxfilt.demangle(base, external_only=False)
    except Exception:  # cxxfilt.InvalidName, or libstdc++ not loadable
        return name
    return out + at + version if at else out


# ---------------------------------------------------------------------------------------------------------
# The symbolizer


class Symbolizer:
    """Symbolises native addresses of traced processes and names CUDA kernels from their host stubs.

    Keep one for the whole recording: it caches parsed ELF files and demangled names; the process maps come from
    ``maps`` (a fresh :class:`MapCache` reads /proc for processes it does not know yet).
    """

    def __init__(self, maps: MapCache | None = None, elves: ElfCache | None = None) -> None:
        self.maps = maps or MapCache()
        self.elves = elves or ElfCache()

    def symbolize(self, pid: int, addrs: Sequence[int], *, return_addresses: bool = True) -> list[NativeFrame]:
        """One ``NativeFrame`` per address, innermost first.

        Args:
            return_addresses: addrs[1:] are return addresses (a BPF stack trace or an unwind), so their
                symbol and line are looked up at addr - 1. Set False for a list of exact code addresses.
        """
        frames = []
        for i, addr in enumerate(addrs):
            adjust = 1 if return_addresses and i > 0 else 0
            frames.append(self.frame(self.maps.find(pid, addr), addr, adjust))
        return frames

    def _vaddr(self, m: Mapping, addr: int) -> tuple[ElfSymbols | None, int | None]:
        elf = self.elves.get(m.host_path) if m.host_path else None
        return elf, (elf.offset_to_vaddr(addr - m.start + m.offset) if elf else None)

    def frame(self, m: Mapping | None, addr: int, adjust: int = 0) -> NativeFrame:
        """The frame of ``addr`` inside mapping ``m`` (None: an address outside every file)."""
        if m is None:
            return NativeFrame("", UNKNOWN, addr, "", 0, None, addr)
        module = os.path.basename(m.path)
        elf, vaddr = self._vaddr(m, addr)
        file_offset = addr - m.start + m.offset
        if elf is None or vaddr is None:
            return NativeFrame(module, UNKNOWN, file_offset, "", 0, elf.build_id if elf else None, addr)
        hit = elf.lookup(vaddr - adjust)
        file, line = elf.line_for(vaddr - adjust) or ("", 0)
        if hit is None:
            return NativeFrame(module, UNKNOWN, file_offset, file, line, elf.build_id, addr)
        name, off = hit
        return NativeFrame(module, demangle(name), off + adjust, file, line, elf.build_id, addr)

    def kernel_name(self, pid: int, func_ptr: int) -> tuple[str | None, str | None]:
        """(demangled kernel name, None), or (None, why it cannot be named) for a launch's function pointer.

        A symbol starting exactly at ``func_ptr`` (the host stub nvcc emits, which cudaLaunchKernel receives; a
        local symbol in .symtab), else a sized function containing it. A pointer outside every file mapping is a
        driver handle (CUfunction/CUkernel) whose naming call was not seen.
        """
        if not func_ptr:
            return None, "no function pointer"
        m = self.maps.find(pid, func_ptr)
        if m is None:
            return None, "a driver handle (CUfunction/CUkernel) whose naming call (cuModuleGetFunction) was not seen"
        elf, vaddr = self._vaddr(m, func_ptr)
        module = os.path.basename(m.path)
        if elf is None or vaddr is None:
            return None, f"{module} could not be read"
        hit = elf.lookup(vaddr, exact=True) or elf.lookup(vaddr)
        if hit is None:
            bid = f" (build-id {elf.build_id}: names can come from its debuginfo)" if elf.build_id else ""
            return None, f"{module} has no symbol at {vaddr:#x}: stripped{bid}"
        return demangle(hit[0]), None
