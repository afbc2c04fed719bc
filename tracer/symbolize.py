"""Native addresses -> (module, build-id, function, file:line), and CUDA kernel pointers -> kernel names.

Contract:

* ``ProcessMaps.snapshot(pid)`` reads ``/proc/PID/maps`` once. Take it at event time (``Symbolizer.snapshot``
  caches one per pid and re-reads it on a miss): after the process exits, the addresses it produced still
  resolve through the snapshot, and ``Symbolizer.locate`` turns them into ``ModuleAddr`` records
  (path, build-id, file offset, ELF vaddr) that can be stored and symbolised later, in another process.
* ``ElfSymbols`` holds one file's function symbols (``.symtab``, else ``.dynsym``, else the separate debug
  file under ``/usr/lib/debug/.build-id``) as sorted numpy arrays; ``lookup(vaddr)`` is a bisect.
  Parsed files are cached by (device, inode, mtime) and by build-id.
* C++ names are demangled with ``cxxfilt`` (libstdc++'s ``__cxa_demangle``), cached per name.
* Unknown addresses become ``NativeFrame(function="?")`` with the module and offset filled in when known.

Stacks from a ``BPF_STACK_TRACE`` map hold the interrupted ip first and return addresses after it. A return
address points after the call instruction, which may already be the next function or the next line, so
frames after the first are looked up at ``addr - 1`` (``offset`` is still reported from ``addr``).
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

log = logging.getLogger(__name__)

UNKNOWN = "?"
# .debug_line of big libraries (libtorch_cuda: hundreds of MB) is not worth decoding in Python; above this
# many bytes file:line is left empty.
MAX_DEBUG_LINE_BYTES = 4 << 20
DEBUG_ROOT = "/usr/lib/debug"
_ELF64_SYM = np.dtype(
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


@dataclass(frozen=True)
class MapEntry:
    """One file-backed executable-or-not mapping of /proc/PID/maps."""

    start: int
    end: int
    offset: int  # file offset of `start`
    path: str  # as the target sees it
    perms: str
    host_path: str  # the same file as seen from here (through /proc/PID/root); "" if not a file
    build_id: str | None = None


@dataclass(frozen=True)
class ModuleAddr:
    """A native address pinned to its file: enough to symbolise after the process is gone."""

    path: str
    build_id: str | None
    file_offset: int
    vaddr: int | None  # ELF virtual address (what symbols and .eh_frame use); None if the file is unreadable
    host_path: str = ""


def _parse_maps_line(line: str) -> tuple[int, int, str, int, str] | None:
    parts = line.split(None, 5)
    if len(parts) < 5:
        return None
    lo, _, hi = parts[0].partition("-")
    path = parts[5].strip() if len(parts) == 6 else ""
    return int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), path


class ProcessMaps:
    """The file mappings of one process at one moment, sorted by start address."""

    def __init__(self, pid: int, entries: Sequence[MapEntry]) -> None:
        self.pid = pid
        self.entries = sorted(entries, key=lambda e: e.start)
        self._starts = [e.start for e in self.entries]

    @classmethod
    def parse(cls, pid: int, text: str, root: str = "/") -> ProcessMaps:
        """Parse the text of /proc/PID/maps; file paths are resolved under ``root`` (the target's root)."""
        entries = []
        for line in text.splitlines():
            parsed = _parse_maps_line(line)
            if parsed is None:
                continue
            start, end, perms, offset, path = parsed
            if not path.startswith("/"):
                continue  # [heap], [stack], [vdso], anonymous: no file to symbolise from
            if path.endswith(" (deleted)"):
                path = path[: -len(" (deleted)")]
            host = os.path.join(root, path.lstrip("/")) if root != "/" else path
            entries.append(MapEntry(start, end, offset, path, perms, host))
        return cls(pid, entries)

    @classmethod
    def snapshot(cls, pid: int) -> ProcessMaps:
        """Read /proc/PID/maps now. Raises ``ProcessLookupError`` if the process is gone."""
        try:
            with open(f"/proc/{pid}/maps") as f:
                text = f.read()
        except FileNotFoundError:
            raise ProcessLookupError(pid) from None
        # Paths in maps are in the target's mount namespace; /proc/PID/root reaches them from ours.
        root = f"/proc/{pid}/root"
        if os.path.realpath(root) == "/":
            root = "/"
        maps = cls.parse(pid, text, root)
        for i, e in enumerate(maps.entries):
            if not os.path.exists(e.host_path):
                # Deleted or unreachable: the kernel still holds the file open (root only).
                alt = f"/proc/{pid}/map_files/{e.start:x}-{e.end:x}"
                if os.path.exists(alt):
                    maps.entries[i] = MapEntry(e.start, e.end, e.offset, e.path, e.perms, alt)
        return maps

    def find(self, addr: int) -> MapEntry | None:
        """The mapping that contains ``addr``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self.entries[i].end:
            return self.entries[i]
        return None

    def modules(self) -> list[str]:
        """Distinct mapped file paths, in address order."""
        seen: dict[str, None] = {}
        for e in self.entries:
            seen.setdefault(e.path, None)
        return list(seen)


# ---------------------------------------------------------------------------------------------------------
# ELF files


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


class ElfSymbols:
    """Function symbols and load segments of one ELF file; ``lookup`` by ELF virtual address."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.build_id: str | None = None
        # PT_LOAD segments: (p_offset, p_vaddr, p_filesz)
        self.loads: list[tuple[int, int, int]] = []
        self._starts = np.zeros(0, dtype=np.uint64)
        self._ends = np.zeros(0, dtype=np.uint64)
        self._names: list[str] = []
        self._symbols_loaded = False
        self._lines: tuple[np.ndarray, list[tuple[str, int]]] | None = None
        self._has_debug_line = False
        # Cheap part only (headers and notes): locate() at event time needs the build-id and PT_LOADs, and the
        # symbol tables are read on the first lookup.
        with open(path, "rb") as f:
            elf = ELFFile(f)
            self.build_id = read_build_id(elf)
            self.loads = [
                (seg["p_offset"], seg["p_vaddr"], seg["p_filesz"])
                for seg in elf.iter_segments()
                if seg["p_type"] == "PT_LOAD"
            ]
            dl = elf.get_section_by_name(".debug_line")
            self._has_debug_line = dl is not None and dl["sh_size"] <= MAX_DEBUG_LINE_BYTES

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
            if not isinstance(sec, SymbolTableSection) or sec["sh_entsize"] != _ELF64_SYM.itemsize:
                continue
            syms = np.frombuffer(sec.data(), dtype=_ELF64_SYM)
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

    def address_of(self, name: str) -> int | None:
        """ELF vaddr of the function symbol with this raw (mangled) name, or None."""
        self._ensure_symbols()
        try:
            return int(self._starts[self._names.index(name)])
        except ValueError:
            return None

    def offset_to_vaddr(self, file_offset: int) -> int | None:
        """ELF virtual address of a file offset, through the PT_LOAD segment that holds it."""
        for off, vaddr, size in self.loads:
            if off <= file_offset < off + max(size, 1):
                return file_offset - off + vaddr
        return None

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        for off, seg_vaddr, size in self.loads:
            if seg_vaddr <= vaddr < seg_vaddr + max(size, 1):
                return vaddr - seg_vaddr + off
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
        addrs, rows = self._lines
        i = int(np.searchsorted(addrs, np.uint64(vaddr), side="right")) - 1
        if i < 0 or rows[i][1] == 0:
            return None
        return rows[i]

    def _read_lines(self) -> tuple[np.ndarray, list[tuple[str, int]]]:
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
        return np.array([p[0] for p in pairs], dtype=np.uint64), [(p[1], p[2]) for p in pairs]


class ElfCache:
    """Parsed ELF files, keyed by (device, inode, mtime) and by build-id."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, int, int], ElfSymbols | None] = {}
        self._by_build_id: dict[str, ElfSymbols] = {}
        self._by_path: dict[str, ElfSymbols] = {}

    def get(self, path: str, build_id: str | None = None) -> ElfSymbols | None:
        """The parsed file: by build-id when known, else by path (must still exist). None if unreadable."""
        if build_id and build_id in self._by_build_id:
            return self._by_build_id[build_id]
        key = _file_key(path)
        if key is None:
            elf = self._by_path.get(path)
            return elf if elf is not None and (build_id is None or elf.build_id == build_id) else None
        if key not in self._by_key:
            try:
                self._by_key[key] = ElfSymbols(path)
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


def demangle_all(names: Iterable[str]) -> list[str]:
    return [demangle(n) for n in names]


# ---------------------------------------------------------------------------------------------------------
# BPF stack maps


def stack_addrs(bpf_table: object, stack_id: int) -> list[int]:
    """Addresses of one stack in a bcc ``BPF_STACK_TRACE`` table, innermost first; [] for a negative id."""
    if stack_id < 0:
        return []
    try:
        return [int(a) for a in bpf_table.walk(stack_id)]  # type: ignore[attr-defined]
    except KeyError:
        return []


# ---------------------------------------------------------------------------------------------------------
# The symbolizer


class Symbolizer:
    """Symbolises native addresses of traced processes and names CUDA kernels.

    Keep one for the whole recording: it caches maps per pid, parsed ELF files and demangled names.
    """

    def __init__(self) -> None:
        self.elves = ElfCache()
        self._maps: dict[int, ProcessMaps] = {}
        self._cufunctions: dict[tuple[int, int], str] = {}

    # -- maps -------------------------------------------------------------------------------------------

    def snapshot(self, pid: int, *, refresh: bool = False) -> ProcessMaps | None:
        """The cached maps of ``pid`` (read now if absent or ``refresh``); None if it is gone and unseen."""
        if refresh or pid not in self._maps:
            try:
                self._maps[pid] = ProcessMaps.snapshot(pid)
            except (ProcessLookupError, PermissionError):
                return self._maps.get(pid)
        return self._maps[pid]

    def set_maps(self, maps: ProcessMaps) -> None:
        """Use a snapshot taken elsewhere (e.g. stored with the trace)."""
        self._maps[maps.pid] = maps

    def forget(self, pid: int) -> None:
        self._maps.pop(pid, None)
        self._cufunctions = {k: v for k, v in self._cufunctions.items() if k[0] != pid}

    def _entry(self, pid: int, addr: int) -> MapEntry | None:
        maps = self.snapshot(pid)
        e = maps.find(addr) if maps else None
        if e is None and maps is not None:
            # A library loaded since the snapshot (dlopen): re-read once; keep the old one if the pid is gone.
            maps = self.snapshot(pid, refresh=True)
            e = maps.find(addr) if maps else None
        return e

    def locate(self, pid: int, addrs: Sequence[int]) -> list[ModuleAddr | None]:
        """Pin addresses to (path, build-id, file offset, vaddr). Call at event time; store the result."""
        out: list[ModuleAddr | None] = []
        for addr in addrs:
            e = self._entry(pid, addr)
            if e is None:
                out.append(None)
                continue
            file_offset = addr - e.start + e.offset
            elf = self.elves.get(e.host_path)
            vaddr = elf.offset_to_vaddr(file_offset) if elf else None
            out.append(ModuleAddr(e.path, elf.build_id if elf else None, file_offset, vaddr, e.host_path))
        return out

    # -- symbols ------------------------------------------------------------------------------------------

    def symbolize(self, pid: int, addrs: Sequence[int], *, return_addresses: bool = True) -> list[NativeFrame]:
        """One ``NativeFrame`` per address, innermost first.

        Args:
            return_addresses: addrs[1:] are return addresses (a BPF stack trace or an unwind), so their
                symbol and line are looked up at addr - 1. Set False for a list of exact code addresses.
        """
        locs = self.locate(pid, addrs)
        return self.symbolize_located(locs, addrs, return_addresses=return_addresses)

    def symbolize_located(
        self,
        locs: Sequence[ModuleAddr | None],
        addrs: Sequence[int] | None = None,
        *,
        return_addresses: bool = True,
    ) -> list[NativeFrame]:
        """Symbolise addresses located earlier (possibly by a process that has exited since)."""
        frames = []
        for i, loc in enumerate(locs):
            addr = addrs[i] if addrs is not None else 0
            adjust = 1 if return_addresses and i > 0 else 0
            frames.append(self._frame(loc, addr, adjust))
        return frames

    def _frame(self, loc: ModuleAddr | None, addr: int, adjust: int) -> NativeFrame:
        if loc is None:
            return NativeFrame("", UNKNOWN, addr, "", 0, None, addr)
        module = os.path.basename(loc.path)
        elf = self.elves.get(loc.host_path or loc.path, loc.build_id)
        if elf is None or loc.vaddr is None:
            vaddr = None if elf is None else elf.offset_to_vaddr(loc.file_offset)
            if elf is None or vaddr is None:
                return NativeFrame(module, UNKNOWN, loc.file_offset, "", 0, loc.build_id, addr)
            loc = ModuleAddr(loc.path, loc.build_id, loc.file_offset, vaddr, loc.host_path)
        assert loc.vaddr is not None
        hit = elf.lookup(loc.vaddr - adjust)
        file, line = elf.line_for(loc.vaddr - adjust) or ("", 0)
        if hit is None:
            return NativeFrame(module, UNKNOWN, loc.file_offset, file, line, loc.build_id, addr)
        name, off = hit
        return NativeFrame(module, demangle(name), off + adjust, file, line, loc.build_id, addr)

    def symbolize_vaddr(self, path: str, build_id: str | None, vaddr: int) -> NativeFrame:
        """Symbolise an ELF vaddr of a known file (no process needed)."""
        elf = self.elves.get(path, build_id)
        off = elf.vaddr_to_offset(vaddr) if elf else None
        loc = ModuleAddr(path, build_id or (elf.build_id if elf else None), off or 0, vaddr, path)
        return self._frame(loc, 0, 0)

    # -- kernel names -------------------------------------------------------------------------------------

    def note_cufunction(self, pid: int, handle: int, name: str) -> None:
        """Remember a driver ``CUfunction`` handle's kernel name (from a cuModuleGetFunction probe)."""
        self._cufunctions[(pid, handle)] = demangle(name)

    def kernel_name(self, pid: int, func_ptr: int) -> str | None:
        """The demangled kernel name for a launch's function pointer, or None.

        Tries, in order: a CUfunction handle noted with ``note_cufunction``; a symbol starting exactly at
        ``func_ptr`` (the host stub nvcc emits, which cudaLaunchKernel receives); a sized function containing
        it. Heap pointers (CUfunction handles never noted) give None.
        """
        if not func_ptr:
            return None
        noted = self._cufunctions.get((pid, func_ptr))
        if noted is not None:
            return noted
        (loc,) = self.locate(pid, [func_ptr])
        if loc is None or loc.vaddr is None:
            return None
        elf = self.elves.get(loc.host_path or loc.path, loc.build_id)
        if elf is None:
            return None
        hit = elf.lookup(loc.vaddr, exact=True) or elf.lookup(loc.vaddr)
        if hit is None:
            return None
        return demangle(hit[0])
