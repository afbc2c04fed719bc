"""recorder.cpython.gcprobe: where CPython's collector is probed, and the cookies that tell the BPF program where a
probe point's argument lies."""

from __future__ import annotations

import struct

from tests.support.interpreters import DEBIAN_PYTHON, pyenv_libpython
from tests.support.need import need
from tracer.recorder.cpython.gcprobe import cookie, gc_points, usdt_notes
from tracer.recorder.events import C

RSP, R12, RSI, RAX = 19, 3, 13, 10  # x86-64 struct pt_regs slots


def fields(c: int) -> tuple[int, int, int, int, int, int]:
    """(point, register slot, memory operand, size, signed, displacement) of a cookie, as gc.bpf.c reads them."""
    disp = c >> 32
    return c & 0xFF, (c >> 8) & 0xFF, (c >> 16) & 1, (c >> 17) & 0xF, (c >> 21) & 1, disp - (1 << 32) * (disp >> 31)


def test_cookie_of_a_stack_operand():  # Debian 3.11's gc__start(int generation)
    assert fields(cookie(C.GC_PT_START, "-4@112(%rsp)")) == (C.GC_PT_START, RSP, 1, 4, 1, 112)


def test_cookie_of_a_register_of_any_width():
    assert fields(cookie(C.GC_PT_DONE, "-8@%r12")) == (C.GC_PT_DONE, R12, 0, 8, 1, 0)
    assert fields(cookie(C.GC_PT_DONE, "4@%eax"))[1:5] == (RAX, 0, 4, 0)
    assert fields(cookie(C.GC_PT_START, "-4@-8(%rbp)"))[1:] == (4, 1, 4, 1, -8)
    assert fields(cookie(C.GC_PT_START, "%rsi"))[1:4] == (RSI, 0, 8)  # a function's second argument


def test_cookie_of_an_unknown_operand_reads_nothing():
    assert fields(cookie(C.GC_PT_START, "-4@%xmm0"))[1] == C.GC_ARG_NONE
    assert fields(cookie(C.GC_PT_START, None))[1] == C.GC_ARG_NONE


def _note(pc: int, base: int, sem: int, provider: str, name: str, args: str) -> bytes:
    desc = struct.pack("<QQQ", pc, base, sem) + f"{provider}\0{name}\0{args}\0".encode()
    pad = (-len(desc)) % 4
    return struct.pack("<III", 8, len(desc), 3) + b"stapsdt\0" + desc + b"\0" * pad


def test_usdt_notes():
    data = _note(0x42873B, 0x8CC5A0, 0xA84270, "python", "gc__done", "-8@%r12") + _note(
        0x4287F3, 0x8CC5A0, 0xA8426E, "python", "gc__start", "-4@112(%rsp)"
    )
    assert usdt_notes(data) == [
        (0x42873B, 0x8CC5A0, 0xA84270, "python", "gc__done", "-8@%r12"),
        (0x4287F3, 0x8CC5A0, 0xA8426E, "python", "gc__start", "-4@112(%rsp)"),
    ]


def test_debian_python_has_usdt_probes_with_semaphores():
    need(DEBIAN_PYTHON.exists(), f"{DEBIAN_PYTHON} (Debian's interpreter, built with USDT probes)")
    pts = gc_points(str(DEBIAN_PYTHON))
    assert pts is not None and pts.source == "usdt" and not pts.returns
    kinds = sorted(c & 0xFF for _, c, _ in pts.entries)
    assert kinds == [C.GC_PT_START, C.GC_PT_DONE] and all(sem for _, _, sem in pts.entries)


def test_pyenv_libpython_probes_the_collector_function():
    lib = pyenv_libpython("3.12")
    need(lib is not None, "a pyenv build of CPython 3.12")
    pts = gc_points(str(lib))
    assert pts is not None and pts.source == "symbol"
    ((off, c, sem),) = pts.entries
    ((roff, rc),) = pts.returns
    assert off == roff and sem == 0 and fields(c)[:2] == (C.GC_PT_START, RSI) and fields(rc)[:2] == (C.GC_PT_DONE, RAX)


def test_not_an_interpreter(tmp_path):
    (tmp_path / "x").write_bytes(b"not an ELF")
    assert gc_points(str(tmp_path / "x")) is None and gc_points(str(tmp_path / "missing")) is None
