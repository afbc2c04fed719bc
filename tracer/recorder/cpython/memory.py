"""Reads of another process's CPython objects through /proc/PID/mem: a code object's names, first line and line
table, for frames whose code object BPF did not send (or sent without a name it could read)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from tracer.recorder.cpython.layouts import PyTarget, ascii_data_offset

# x86_64's user half ends below 2**47 (2**56 with 5-level paging); pread's offset is a signed 64-bit off_t
USER_TOP = 1 << 63


class ProcessMemory:
    """Reads of another process's memory through /proc/PID/mem."""

    def __init__(self, pid: int) -> None:
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)

    def read(self, addr: int, n: int) -> bytes:
        """``n`` bytes at ``addr``; OSError for any that cannot be read. An address comes from the target's memory or
        from BPF and may be garbage: one past the user half (>= 2**63, a kernel or torn pointer) is an OSError too,
        not the OverflowError pread's signed offset raises (CI run of stop 38: a forked child's torn code pointer
        crashed the recording's drain)."""
        if not 0 <= addr <= USER_TOP - n:
            raise OSError(f"address {addr:#x} is outside the user address space")
        data = os.pread(self.fd, n, addr)
        if len(data) != n:
            raise OSError(f"short read at {addr:#x}")
        return data

    def close(self) -> None:
        os.close(self.fd)


def read_str(mem: ProcessMemory, addr: int, version: tuple[int, int]) -> str:
    """A str object: compact ASCII or compact non-ASCII (latin-1/UCS-2/UCS-4)."""
    head = mem.read(addr, 48)
    (length,) = struct.unpack_from("<q", head, 16)
    (state,) = struct.unpack_from("<I", head, 32)
    kind = (state >> 2) & 7
    compact = (state >> 5) & 1
    ascii_ = (state >> 6) & 1
    if not compact or length < 0 or length > 4096:
        return "?"
    if ascii_:
        return mem.read(addr + ascii_data_offset(version), length).decode("ascii", "replace")
    # sizeof(PyCompactUnicodeObject), which lost its wstr_length with the wstr pointer in 3.12
    data = mem.read(addr + (72 if version <= (3, 11) else 56), length * kind)
    return data.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}.get(kind, "latin-1"), "replace")


@dataclass
class CodeInfo:
    """One code object as the frame resolver needs it: names, first line, line table, and its decoded lines."""

    filename: str
    qualname: str
    firstlineno: int
    linetable: bytes
    truncated: bool = False  # the line table was cut (CODE_LT_MAX) or unreadable: later lines are approximate
    lines: dict[int, tuple[int, bool]] = field(default_factory=dict)  # lasti -> (line, approx)


def read_code(pid: int, t: PyTarget, addr: int) -> CodeInfo | None:
    """The code object at ``addr`` in ``pid``, laid out as ``t`` says; None when it cannot be read or is not a code
    object (the type check, when the binary's ``PyCode_Type`` is known)."""
    o = t.binary.offsets
    try:
        mem = ProcessMemory(pid)
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
        return CodeInfo(read_str(mem, fn_p, t.version), read_str(mem, qn_p, t.version), first, linetable)
    except (OSError, struct.error, ValueError):
        return None
    finally:
        mem.close()
