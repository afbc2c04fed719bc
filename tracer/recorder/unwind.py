"""Unwind a copied user stack (probes/native_stack.h) with the modules' .eh_frame CFI. x86-64 only.

Contract: ``unwind(pid, regs, stack_bytes, maps)`` returns the code addresses of the stack, innermost first:
the probed ip, then one return address per caller, the same shape as a BPF_STACK_TRACE walk (so
``Symbolizer.symbolize`` takes either). It never reads the live process: registers and the bytes copied from
%rsp at the probe are all it uses, plus the files named in the process map. It stops at the end of the copy,
at a return address outside every mapping, where the CFI marks the return address undefined (``_start``,
``clone``), or when the stack stops growing upwards.

Per frame: the module comes from the process map; file offset -> ELF vaddr through PT_LOAD; the FDE is found
through ``.eh_frame_hdr``'s sorted table and parsed alone (pyelftools), so a cold library costs milliseconds,
not the seconds a full ``EH_CFI_entries()`` parse of libpython takes. Then CFA = rsp/rbp + offset (or a DWARF
expression: PLT stubs, signal trampolines), the return address is read at CFA-8 and rbp is restored when the
CFI says it was saved. Without an FDE the innermost frame is assumed to be at function entry (CFA = rsp+8),
and outer frames fall back to the frame-pointer chain.
"""

from __future__ import annotations

import bisect
import io
import logging
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from elftools.common.exceptions import DWARFError, ELFError
from elftools.dwarf.callframe import FDE, CallFrameInfo, RegisterRule
from elftools.dwarf.dwarf_expr import DWARFExprParser
from elftools.dwarf.structs import DWARFStructs
from elftools.elf.elffile import ELFFile

from tracer.recorder import elfcache
from tracer.recorder.events import UstackRecord
from tracer.recorder.procmaps import Mapping, ProcessMap
from tracer.recorder.symbolize import ElfCache, read_build_id

log = logging.getLogger(__name__)

# DWARF register numbers on x86-64.
RBP = 6
RSP = 7
RIP = 16

MAX_FRAMES = 128

_STRUCTS = DWARFStructs(little_endian=True, dwarf_format=32, address_size=8)
_DW_EH_PE_datarel_sdata4 = 0x3B  # the only .eh_frame_hdr table encoding GNU ld and lld emit


@dataclass(frozen=True)
class Regs:
    """User registers at the probe."""

    ip: int
    sp: int
    bp: int


class _Row:
    """One decoded CFI row, reduced to what x86-64 unwinding needs."""

    __slots__ = ("cfa_reg", "cfa_off", "cfa_expr", "ra", "rbp")

    def __init__(self, line: dict[Any, Any]) -> None:
        cfa = line["cfa"]
        self.cfa_reg: int | None = cfa.reg
        self.cfa_off: int = cfa.offset or 0
        self.cfa_expr: bytes | None = bytes(cfa.expr) if cfa.expr is not None else None
        self.ra: RegisterRule | None = line.get(RIP)
        self.rbp: RegisterRule | None = line.get(RBP)

    @classmethod
    def of(
        cls,
        cfa_reg: int | None,
        cfa_off: int,
        cfa_expr: bytes | None,
        ra: RegisterRule | None,
        rbp: RegisterRule | None,
    ) -> _Row:
        """A row from its fields (read back from the ELF cache)."""
        row = cls.__new__(cls)
        row.cfa_reg, row.cfa_off, row.cfa_expr, row.ra, row.rbp = cfa_reg, cfa_off, cfa_expr, ra, rbp
        return row


Decoded = tuple[int, int, list[int], list[_Row]]  # one FDE: (start, size, each row's first pc, the rows)

# RegisterRule types by code, for the ELF cache; -1 codes an absent rule
_RULE_TYPES = (
    RegisterRule.UNDEFINED,
    RegisterRule.SAME_VALUE,
    RegisterRule.OFFSET,
    RegisterRule.VAL_OFFSET,
    RegisterRule.REGISTER,
    RegisterRule.EXPRESSION,
    RegisterRule.VAL_EXPRESSION,
    RegisterRule.ARCHITECTURAL,
)
_RULE_CODE = {t: i for i, t in enumerate(_RULE_TYPES)}
_EXPR_RULES = {RegisterRule.EXPRESSION, RegisterRule.VAL_EXPRESSION}
_ROW_COLS = 10  # pc, cfa_reg, cfa_off, cfa_expr, ra type/arg/expr, rbp type/arg/expr (expr: index, -1 none)


def rows_to_arrays(decoded: dict[int, Decoded]) -> dict[str, np.ndarray]:
    """Decoded FDEs (by their offset in .eh_frame) as arrays for the ELF cache; an FDE that failed to decode (no
    rows) is kept too, so that it is not decoded again."""
    fdes, ints, exprs = [], [], []

    def expr(b: Any) -> int:
        exprs.append(bytes(b))
        return len(exprs) - 1

    def rule(r: RegisterRule | None) -> tuple[int, int, int]:
        if r is None:
            return (-1, 0, -1)
        if r.type in _EXPR_RULES:
            return (_RULE_CODE[r.type], 0, expr(r.arg))
        return (_RULE_CODE[r.type], int(r.arg or 0), -1)

    for off, (start, size, pcs, rows) in sorted(decoded.items()):
        fdes.append((off, start, size, len(rows)))
        for pc, row in zip(pcs, rows, strict=True):
            cfa_reg = -1 if row.cfa_reg is None else row.cfa_reg
            cfa_expr = -1 if row.cfa_expr is None else expr(row.cfa_expr)
            ints.append((pc, cfa_reg, row.cfa_off, cfa_expr, *rule(row.ra), *rule(row.rbp)))
    blob, ends = elfcache.pack_bytes(exprs)
    return {
        "fdes": np.array(fdes, dtype=np.int64).reshape(-1, 4),
        "rows": np.array(ints, dtype=np.int64).reshape(-1, _ROW_COLS),
        "exprs": blob,
        "expr_ends": ends,
    }


def rows_from_arrays(a: dict[str, np.ndarray]) -> dict[int, Decoded]:
    """What :func:`rows_to_arrays` wrote.

    Raises:
        ValueError, KeyError, IndexError: an entry of the wrong shape (a corrupt or foreign cache file).
    """
    fdes, ints = a["fdes"], a["rows"]
    if fdes.ndim != 2 or fdes.shape[1] != 4 or ints.ndim != 2 or ints.shape[1] != _ROW_COLS:
        raise ValueError("ELF cache CFI entry of the wrong shape")
    if int(fdes[:, 3].sum()) != len(ints) or (fdes[:, 3] < 0).any():
        raise ValueError("ELF cache CFI entry: row counts do not add up")
    exprs = elfcache.unpack_bytes(a["exprs"], a["expr_ends"])

    def rule(code: int, arg: int, ex: int) -> RegisterRule | None:
        if code < 0:
            return None
        kind = _RULE_TYPES[code]
        return RegisterRule(kind, exprs[ex] if kind in _EXPR_RULES else arg)

    out: dict[int, Decoded] = {}
    at = 0
    for off, start, size, n in fdes.tolist():
        pcs, rows = [], []
        for pc, cfa_reg, cfa_off, cfa_ex, rt, ra_arg, ra_ex, bt, bp_arg, bp_ex in ints[at : at + n].tolist():
            pcs.append(pc)
            rows.append(
                _Row.of(
                    None if cfa_reg < 0 else cfa_reg,
                    cfa_off,
                    exprs[cfa_ex] if cfa_ex >= 0 else None,
                    rule(rt, ra_arg, ra_ex),
                    rule(bt, bp_arg, bp_ex),
                )
            )
        out[off] = (start, size, pcs, rows)
        at += n
    return out


class EhFrameTable:
    """The .eh_frame of one ELF file, indexed through .eh_frame_hdr and decoded one FDE at a time."""

    def __init__(self, path: str, cached: dict[str, np.ndarray] | None = None) -> None:
        """``cached``: an ELF cache entry of this file (:meth:`to_arrays`): the section is read at its file offset,
        the index taken as it is, without parsing the ELF headers again.

        Raises:
            ELFError: no .eh_frame. ValueError, KeyError: a cached entry of the wrong shape.
        """
        self.path = path
        if cached is not None:
            self._from_arrays(cached)
            return
        with open(path, "rb") as f:
            elf = ELFFile(f)
            self.build_id = read_build_id(elf)
            eh = elf.get_section_by_name(".eh_frame")
            hdr = elf.get_section_by_name(".eh_frame_hdr")
            if eh is None:
                raise ELFError(f"{path}: no .eh_frame")
            self._eh_addr: int = eh["sh_addr"]
            self._eh_file: tuple[int, int] = (eh["sh_offset"], eh["sh_size"])
            eh_data = eh.data()
            hdr_data = hdr.data() if hdr is not None else None
            hdr_addr = hdr["sh_addr"] if hdr is not None else 0
        self._set_cfi(eh_data)
        self._rows: dict[int, Decoded] = {}  # fde offset -> decoded
        self.cached_rows = 0  # of them, read from the ELF cache (the rest were decoded here)
        self._pcs: np.ndarray
        self._offsets: np.ndarray
        if hdr_data is not None and len(hdr_data) >= 12 and hdr_data[3] == _DW_EH_PE_datarel_sdata4:
            (count,) = struct.unpack_from("<I", hdr_data, 8) if hdr_data[2] == 0x03 else (None,)
            if count is not None:
                table = np.frombuffer(hdr_data, dtype="<i4", count=2 * count, offset=12).astype(np.int64)
                self._pcs = table[0::2] + hdr_addr
                self._offsets = table[1::2] + hdr_addr - self._eh_addr
                return
        self._index_by_full_parse()

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The index and where the section lies in the file, for the ELF cache (tracer/recorder/elfcache.py)."""
        return {
            "eh": np.array([self._eh_addr, *self._eh_file], dtype=np.int64),
            "pcs": self._pcs.astype(np.int64),
            "offsets": self._offsets.astype(np.int64),
            "build_id": np.frombuffer((self.build_id or "").encode(), dtype=np.uint8).copy(),
        }

    def _from_arrays(self, a: dict[str, np.ndarray]) -> None:
        eh, pcs, offsets = a["eh"], a["pcs"], a["offsets"]
        if eh.shape != (3,) or pcs.ndim != 1 or pcs.shape != offsets.shape:
            raise ValueError("ELF cache entry of the wrong shape")
        self._eh_addr, self._eh_file = int(eh[0]), (int(eh[1]), int(eh[2]))
        self.build_id = a["build_id"].tobytes().decode() or None
        with open(self.path, "rb") as f:
            f.seek(self._eh_file[0])
            eh_data = f.read(self._eh_file[1])
        if len(eh_data) != self._eh_file[1]:
            raise ValueError("ELF cache entry: .eh_frame past the file's end")
        self._set_cfi(eh_data)
        self._rows = {}
        self.cached_rows = 0
        self._pcs, self._offsets = pcs.astype(np.int64), offsets.astype(np.int64)

    def add_rows(self, decoded: dict[int, Decoded]) -> None:
        """FDEs decoded by an earlier recording (rows_from_arrays): pyelftools decodes one in ~0.25 ms, and a
        recording's first stacks meet a hundred or more (~35 ms of `tracer demo`'s recorder CPU, issue 33)."""
        self._rows.update(decoded)
        self.cached_rows = len(self._rows)

    def decoded(self) -> dict[int, Decoded]:
        """Every FDE decoded so far, by offset, for the ELF cache."""
        return self._rows

    def _set_cfi(self, eh_data: bytes) -> None:
        self._cfi = CallFrameInfo(
            stream=io.BytesIO(eh_data),
            size=len(eh_data),
            address=self._eh_addr,
            base_structs=_STRUCTS,
            for_eh_frame=True,
        )

    def _index_by_full_parse(self) -> None:
        # No usable .eh_frame_hdr (rare: some hand-linked objects): parse every entry once.
        pcs, offs = [], []
        for entry in self._cfi.get_entries():
            if isinstance(entry, FDE):
                pcs.append(entry["initial_location"])
                offs.append(entry.offset)
        order = np.argsort(np.array(pcs, dtype=np.int64), kind="stable")
        self._pcs = np.array(pcs, dtype=np.int64)[order]
        self._offsets = np.array(offs, dtype=np.int64)[order]

    def __len__(self) -> int:
        return len(self._pcs)

    def row_for(self, vaddr: int) -> _Row | None:
        """The CFI row in force at ELF vaddr, or None if no FDE covers it."""
        i = int(np.searchsorted(self._pcs, vaddr, side="right")) - 1
        if i < 0:
            return None
        off = int(self._offsets[i])
        dec = self._rows.get(off)
        if dec is None:
            try:
                fde = self._cfi._parse_entry_at(off)  # private in pyelftools 0.31-0.33, stable since 2013
                if not isinstance(fde, FDE):
                    return None
                table = fde.get_decoded().table
                rows = [_Row(line) for line in table]
                dec = (fde["initial_location"], fde["address_range"], [line["pc"] for line in table], rows)
            except (DWARFError, ELFError, struct.error, KeyError, ValueError, AssertionError) as e:
                log.debug("bad FDE at %#x in %s: %s", off, self.path, e)
                dec = (0, 0, [], [])
            self._rows[off] = dec
        start, size, pcs, rows = dec
        if not rows or not (start <= vaddr < start + size):
            return None
        j = bisect.bisect_right(pcs, vaddr) - 1
        return rows[j] if j >= 0 else None


class UnwindTables:
    """EhFrameTable and ElfSymbols (for PT_LOAD) per file, cached by (device, inode, mtime) and build-id."""

    def __init__(self, elves: ElfCache | None = None) -> None:
        self._tables: dict[Any, EhFrameTable | None] = {}
        self.elves = elves or ElfCache()
        self._unsaved: list[tuple[EhFrameTable, str]] = []  # parsed here, not read from the ELF cache (elves.disk)
        self._decoded: list[tuple[EhFrameTable, str]] = []  # every table, with the cache entry of its decoded FDEs

    def _key(self, path: str) -> Any:
        key = self.elves.file_key(path)
        return ("missing", path) if key is None else key

    def table(self, path: str) -> EhFrameTable | None:
        key = self._key(path)
        if key not in self._tables:
            self._tables[key] = self._parse(path)
        return self._tables[key]

    def _parse(self, path: str) -> EhFrameTable | None:
        table = self._index(path)
        disk = self.elves.disk
        entry = elfcache.file_key(path, "cfi") if table is not None and disk is not None else None
        if table is not None and entry is not None:
            self._decoded.append((table, entry))
            arrays = elfcache.load(disk, entry)
            if arrays is not None:
                try:
                    table.add_rows(rows_from_arrays(arrays))
                except (ValueError, KeyError, IndexError, TypeError) as e:
                    log.warning("elf cache: entry %s for %s is corrupt (%s): decoded again", entry, path, e)
        return table

    def _index(self, path: str) -> EhFrameTable | None:
        disk = self.elves.disk
        entry = elfcache.file_key(path, "eh") if disk is not None else None
        arrays = elfcache.load(disk, entry)
        if arrays is not None:
            try:
                return EhFrameTable(path, cached=arrays)
            except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError) as e:
                log.warning("elf cache: entry %s for %s is corrupt (%s): parsed again", entry, path, e)
        try:
            table = EhFrameTable(path)
        except (ELFError, DWARFError, OSError, struct.error, ValueError) as e:
            log.debug("no unwind table for %s: %s", path, e)
            return None
        if entry is not None:
            self._unsaved.append((table, entry))
        return table

    def save(self) -> int:
        """Write the ELF cache entries of the tables parsed, and of the FDEs decoded, since the last save; return
        how many were written."""
        done = sum(elfcache.store(self.elves.disk, entry, t.to_arrays()) for t, entry in self._unsaved)
        self._unsaved = []
        for table, entry in self._decoded:
            rows = table.decoded()
            if len(rows) > table.cached_rows:
                done += elfcache.store(self.elves.disk, entry, rows_to_arrays(rows))
                table.cached_rows = len(rows)
        return done

    def vaddr(self, entry: Mapping, addr: int) -> int | None:
        elf = self.elves.get(entry.host_path) if entry.host_path else None
        return elf.offset_to_vaddr(addr - entry.start + entry.offset) if elf else None


_DEFAULT_TABLES = UnwindTables()


class _Stack:
    def __init__(self, base: int, data: bytes) -> None:
        self.base = base
        self.data = data

    def u64(self, addr: int) -> int | None:
        i = addr - self.base
        if i < 0 or i + 8 > len(self.data):
            return None
        return int.from_bytes(self.data[i : i + 8], "little")


_BINOPS = {
    "DW_OP_plus": lambda a, b: a + b,
    "DW_OP_minus": lambda a, b: a - b,
    "DW_OP_mul": lambda a, b: a * b,
    "DW_OP_and": lambda a, b: a & b,
    "DW_OP_or": lambda a, b: a | b,
    "DW_OP_xor": lambda a, b: a ^ b,
    "DW_OP_shl": lambda a, b: a << b,
    "DW_OP_shr": lambda a, b: a >> b,
    "DW_OP_ge": lambda a, b: int(a >= b),
    "DW_OP_gt": lambda a, b: int(a > b),
    "DW_OP_le": lambda a, b: int(a <= b),
    "DW_OP_lt": lambda a, b: int(a < b),
    "DW_OP_eq": lambda a, b: int(a == b),
    "DW_OP_ne": lambda a, b: int(a != b),
}
_EXPR_PARSER = DWARFExprParser(_STRUCTS)


def _eval_expr(expr: bytes, regs: dict[int, int], stack: _Stack, push_cfa: int | None = None) -> int | None:
    """The value of a CFI DWARF expression (breg, lit, const, arithmetic, deref); None if unsupported."""
    st: list[int] = [push_cfa] if push_cfa is not None else []
    try:
        for op in _EXPR_PARSER.parse_expr(list(expr)):
            name = op.op_name
            if name.startswith("DW_OP_breg"):
                reg = int(name[len("DW_OP_breg") :])
                if reg not in regs:
                    return None
                st.append(regs[reg] + op.args[0])
            elif name.startswith("DW_OP_lit"):
                st.append(int(name[len("DW_OP_lit") :]))
            elif name.startswith("DW_OP_const"):
                st.append(op.args[0])
            elif name == "DW_OP_plus_uconst":
                st.append(st.pop() + op.args[0])
            elif name in _BINOPS:
                b, a = st.pop(), st.pop()
                st.append(_BINOPS[name](a, b) & 0xFFFFFFFFFFFFFFFF)
            elif name == "DW_OP_deref":
                v = stack.u64(st.pop())
                if v is None:
                    return None
                st.append(v)
            elif name == "DW_OP_dup":
                st.append(st[-1])
            elif name == "DW_OP_drop":
                st.pop()
            elif name == "DW_OP_swap":
                st[-1], st[-2] = st[-2], st[-1]
            else:
                return None
    except (IndexError, KeyError, ValueError, DWARFError):
        return None
    return st[-1] if st else None


def unwind(
    pid: int,
    regs: Regs,
    stack_bytes: bytes,
    maps: ProcessMap,
    *,
    tables: UnwindTables | None = None,
    max_frames: int = MAX_FRAMES,
) -> list[int]:
    """Code addresses of the copied stack, innermost first: ``regs.ip``, then return addresses.

    Args:
        pid: only for log messages; the process may have exited.
        regs: ip/sp/bp at the probe (``ustack_event``).
        stack_bytes: the user stack copied from ``regs.sp`` upwards.
        maps: the process's map (tracer.recorder.procmaps.MapCache keeps it current from mapping events).
        tables: the parsed-table cache; a process-wide one by default.
    """
    tables = tables or _DEFAULT_TABLES
    stack = _Stack(regs.sp, stack_bytes)
    ip, sp, bp = regs.ip, regs.sp, regs.bp
    frames = [ip]
    for depth in range(max_frames - 1):
        entry = maps.find(ip)
        row = None
        if entry is not None:
            vaddr = tables.vaddr(entry, ip)
            table = tables.table(entry.host_path) if vaddr is not None else None
            if table is not None and vaddr is not None:
                # A return address may be the first byte after a noreturn call's function: look up ip - 1.
                row = table.row_for(vaddr if depth == 0 else vaddr - 1)
        cur = {RSP: sp, RBP: bp, RIP: ip}
        if row is not None:
            if row.cfa_expr is not None:
                cfa = _eval_expr(row.cfa_expr, cur, stack)
            elif row.cfa_reg in cur:
                cfa = cur[row.cfa_reg] + row.cfa_off
            else:
                cfa = None  # CFA in a register we did not save (rare: realigned stacks use rbp)
            if cfa is None:
                break
            if row.ra is not None and row.ra.type == RegisterRule.UNDEFINED:
                break  # outermost frame (_start, clone, start_thread)
            ra = _read_rule(row.ra, cfa, cur, stack) if row.ra is not None else stack.u64(cfa - 8)
            same = row.rbp is None or row.rbp.type == RegisterRule.SAME_VALUE
            new_bp = bp if same else _read_rule(row.rbp, cfa, cur, stack)
        elif depth == 0:
            cfa = sp + 8  # no FDE at the probe: assume function entry, return address at [rsp]
            ra = stack.u64(sp)
            new_bp = bp
        else:
            # No FDE for a caller: trust the frame-pointer chain if rbp points into the copy.
            cfa = bp + 16
            ra = stack.u64(bp + 8)
            new_bp = stack.u64(bp)
        if ra is None or ra == 0 or new_bp is None or cfa <= sp:
            break
        if maps.find(ra) is None:
            break
        ip, sp, bp = ra, cfa, new_bp
        frames.append(ip)
    else:
        log.debug("pid %d: stack deeper than %d frames", pid, max_frames)
    return frames


def _read_rule(rule: RegisterRule | None, cfa: int, cur: dict[int, int], stack: _Stack) -> int | None:
    """The caller's value of a register under ``rule``; None if it cannot be read."""
    if rule is None:
        return None
    if rule.type == RegisterRule.OFFSET:
        return stack.u64(cfa + rule.arg)
    if rule.type == RegisterRule.VAL_OFFSET:
        return cfa + rule.arg
    if rule.type == RegisterRule.SAME_VALUE:
        return None
    if rule.type == RegisterRule.REGISTER:
        return cur.get(rule.arg)
    if rule.type == RegisterRule.EXPRESSION:
        addr = _eval_expr(bytes(rule.arg), cur, stack, push_cfa=cfa)
        return stack.u64(addr) if addr is not None else None
    if rule.type == RegisterRule.VAL_EXPRESSION:
        return _eval_expr(bytes(rule.arg), cur, stack, push_cfa=cfa)
    return None


def unwind_record(ev: UstackRecord, maps: ProcessMap, *, tables: UnwindTables | None = None) -> list[int]:
    """``unwind`` for a decoded ustack_event."""
    return unwind(ev.pid, Regs(ev.ip, ev.sp, ev.bp), ev.data, maps, tables=tables)
