"""The executing line of a code object at an instruction index, decoded from its ``co_linetable``: 3.10's byte
pairs (Objects/lnotab_notes.txt) or the 3.11+ PEP 657 location table (Objects/locations.md)."""

from __future__ import annotations

from tracer.recorder.cpython.layouts import V310


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
    """Line of the code unit ``lasti`` in CPython ``version``'s table; None: the unit has no line."""
    if lasti >= 0x80000000:  # u32 from BPF: -1 means "just entered"
        lasti -= 1 << 32
    if version <= V310:
        return line_310(linetable, firstlineno, lasti)
    return line_311(linetable, firstlineno, lasti)
