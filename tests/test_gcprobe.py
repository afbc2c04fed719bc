"""recorder.cpython.gcprobe: where CPython's collector is probed, and the cookies that tell the BPF program where a
probe point's argument lies."""

from __future__ import annotations

import struct
from pathlib import Path

from tests.support.interpreters import DEBIAN_PYTHON, pyenv_libpython
from tests.support.need import need
from tracer.recorder.cpython.gcprobe import cookie, gc_points, schedule_site, usdt_notes
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


# _Py_ScheduleGC's body and the tail of _PyObject_GC_Link it is inlined into (from its threshold test on), as
# pyenv's builds have them (objdump -d): 3.12.1 sets interp->ceval.gc_scheduled (movl $1, 0x18c(%rdi)) and the eval
# breaker; 3.13.0 sets the thread's _PY_GC_SCHEDULED_BIT (lock orq $0x10, 0x18(%rdi)).
SCHEDULE_312 = bytes.fromhex(
    "83bf3801000001740a8b878c01000085c07405c30f1f4000c7878c01000001000000c7877001000001000000c3"
)
LINK_312 = bytes.fromhex(  # ... cmpl $0,0x18c(%rdx); jne; movl $1,0x18c(%rdx); movl $1,0x170(%rdx); pop %rbx; ret
    "8b823801000085c075ed488b46604885c07407488378080075dd8b828c01000085c075d3"
    "c7828c01000001000000c78270010000010000005bc3"
)
SCHEDULE_313 = bytes.fromhex("488b4718a8107408c30f1f8000000000f048834f1810c3")
LINK_313 = bytes.fromhex(  # ... test $0x10,%al; jne; lock orq $0x10,0x18(%rsi); pop %rbx; ret
    "8b82b01d000085c075f0488b46704885c07407488378080075e0488b4618a81075d8f048834e18105bc3"
)


def test_schedule_site_is_the_instruction_after_the_inlined_flag_store():
    # 3.12: after the gc_scheduled store (its base register %rdx, not the function's %rdi), at the eval breaker's
    at = schedule_site(SCHEDULE_312, LINK_312)
    assert at is not None and LINK_312[at - 10 : at] == bytes.fromhex("c7828c01000001000000")
    # 3.13: after the lock or, which a uprobe refuses to step over: the pop that only it falls through to
    at = schedule_site(SCHEDULE_313, LINK_313)
    assert at is not None and LINK_313[at - 6 : at] == bytes.fromhex("f048834e1810") and LINK_313[at] == 0x5B


def test_schedule_site_of_a_register_above_r7():  # REX.B: the same store through %r8
    link = LINK_313.replace(bytes.fromhex("f048834e1810"), bytes.fromhex("f049834818105b"))
    at = schedule_site(SCHEDULE_313, link)
    assert at is not None and link[at - 6 : at] == bytes.fromhex("f04983481810")


def test_no_schedule_site_unless_exactly_one_copy():
    assert schedule_site(SCHEDULE_312, LINK_312[:40]) is None  # the threshold test, no store
    assert schedule_site(SCHEDULE_312, LINK_312 + LINK_312) is None  # two copies: which one is not known
    assert schedule_site(bytes.fromhex("83bf3801000001c3"), LINK_312) is None  # only a cmpl: no store to find
    # the same store to another field is not the flag's
    assert schedule_site(SCHEDULE_313, LINK_313.replace(bytes.fromhex("834e18"), bytes.fromhex("834e20"))) is None


def _body(lib: Path, name: str) -> range:
    """File offsets of function ``name``'s body, by pyelftools' own symbol lookup (the .text segment's file offsets
    are its addresses in these libraries: checked)."""
    from elftools.elf.elffile import ELFFile

    with open(lib, "rb") as f:
        elf = ELFFile(f)
        (sym,) = elf.get_section_by_name(".symtab").get_symbol_by_name(name)
        text = elf.get_section_by_name(".text")
        assert text["sh_addr"] == text["sh_offset"]
        return range(sym["st_value"], sym["st_value"] + sym["st_size"])


def test_pyenv_312_and_313_probe_the_allocation_that_schedules_a_collection():
    for version in ("3.12", "3.13"):
        lib = pyenv_libpython(version)
        need(lib is not None, f"a pyenv build of CPython {version}")
        pts = gc_points(str(lib))
        assert pts is not None and pts.schedule is not None, version
        site, run = pts.schedule
        assert site in _body(lib, "_PyObject_GC_Link") and run == _body(lib, "_Py_RunGC").start, version
    for version in ("3.10", "3.11"):  # the collection runs inside the allocation: nothing to schedule
        lib = pyenv_libpython(version)
        need(lib is not None, f"a pyenv build of CPython {version}")
        pts = gc_points(str(lib))
        assert pts is not None and pts.schedule is None, version
