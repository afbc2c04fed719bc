"""recorder/symbolize.py and recorder/unwind.py against the C++ fixture libraries (fixtures/cxx), loaded into this
process with ctypes. No BPF: the unwinder is fed a stack the fixture copies itself (cxxfix_capture_stack)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
from elftools.dwarf.callframe import RegisterRule
from elftools.elf.elffile import ELFFile

from tests.support import cxxfix
from tracer.recorder import elfcache
from tracer.recorder.procmaps import MapCache, ProcessMap, read_maps
from tracer.recorder.symbolize import ElfCache, ElfSymbols, Symbolizer, demangle
from tracer.recorder.unwind import (
    EhFrameTable,
    Regs,
    UnwindTables,
    _eval_expr,
    _Row,
    _Stack,
    rows_from_arrays,
    rows_to_arrays,
    unwind,
)

DISPATCH = "ns::detail::dispatch(void (*)(float*, int), int)"
LAUNCH = "ns::Launcher<float>::launch(int)"
VECTOR_ADD = "void kernels::vector_add<float>(float*, int)"
SCALE = "void kernels::scale<double>(double*, double, int)"


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cxxfix.build(tmp_path_factory.mktemp("cxxbuild"))


@pytest.fixture(scope="module", params=["fp", "nofp"])
def lib(request: pytest.FixtureRequest, build: Path) -> ctypes.CDLL:
    return cxxfix.load(build, request.param)


def _addr(fn: object) -> int:
    value = ctypes.cast(fn, ctypes.c_void_p).value
    assert value is not None
    return value


# --- ELF symbols and demangling -----------------------------------------------------------------------------


def symbol_vaddr(path: str, name: str) -> int | None:
    """The function symbol's address as pyelftools reads it from the file: the oracle for ElfSymbols' lookups."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for sec in (elf.get_section_by_name(n) for n in (".symtab", ".dynsym")):
            for sym in sec.iter_symbols() if sec is not None else ():
                if sym.name == name and sym["st_info"]["type"] == "STT_FUNC" and sym["st_value"]:
                    return int(sym["st_value"])
    return None


def test_elf_symbols_lookup_and_exact(build: Path) -> None:
    elf = ElfSymbols(str(build / "libcxxfix_nofp.so"))
    assert elf.build_id and len(elf.build_id) == 40
    for raw in ("cxxfix_leaf", "_ZN2ns6detail8dispatchEPFvPfiEi", "_ZN2ns8LauncherIfE6launchEi"):
        start = symbol_vaddr(elf.path, raw)
        assert start is not None
        assert elf.lookup(start) == (raw, 0)
        assert elf.lookup(start, exact=True) == (raw, 0)
        assert elf.lookup(start + 1) == (raw, 1)
        assert elf.lookup(start + 1, exact=True) is None
    assert elf.lookup(0) is None


def test_demangle_exact_names() -> None:
    assert demangle("_ZN2ns6detail8dispatchEPFvPfiEi") == DISPATCH
    assert demangle("_ZN2ns8LauncherIfE6launchEi") == LAUNCH
    assert demangle("_ZN7kernels10vector_addIfEEvPfi") == VECTOR_ADD
    assert demangle("cxxfix_leaf") == "cxxfix_leaf"
    assert demangle("_Znot_mangled_really") == "_Znot_mangled_really"
    assert demangle("_ZN7kernels10vector_addIfEEvPfi@@V1") == VECTOR_ADD + "@@V1"


def test_symbolize_code_addresses_demangled(lib: ctypes.CDLL) -> None:
    sym = Symbolizer()
    leaf = _addr(lib.cxxfix_leaf)
    (frame,) = sym.symbolize(os.getpid(), [leaf + 2])
    assert frame.function == "cxxfix_leaf" and frame.offset == 2
    assert frame.module == os.path.basename(lib._name)
    assert frame.build_id and frame.addr == leaf + 2
    assert frame.file == "cxxfix.cpp" and frame.line > 0  # a small library's .debug_line is decoded


def test_unknown_address_is_question_mark() -> None:
    heap = ctypes.create_string_buffer(16)
    (frame,) = Symbolizer().symbolize(os.getpid(), [ctypes.addressof(heap)])
    assert frame.function == "?" and frame.module == ""


def test_addresses_resolve_from_the_map_after_the_process_is_gone(lib: ctypes.CDLL) -> None:
    # GIVEN this process's map, kept under a pid that no longer exists (as the recorder keeps an exited target's)
    gone = 2**22 + 3
    maps = MapCache()
    for m in read_maps(os.getpid()):
        maps.add(gone, m)
    # WHEN a symbolizer resolves addresses of that pid: THEN the cached map is enough, /proc is never read
    sym = Symbolizer(maps)
    (frame,) = sym.symbolize(gone, [_addr(lib.cxxfix_leaf)])
    assert frame.function == "cxxfix_leaf" and frame.offset == 0
    assert sym.kernel_name(gone, lib.cxxfix_kernel_ptr(0)) == (VECTOR_ADD, None)
    assert maps.proc_reads == 0


def test_kernel_name_resolves_host_stub_pointers(lib: ctypes.CDLL) -> None:
    sym = Symbolizer()
    assert sym.kernel_name(os.getpid(), lib.cxxfix_kernel_ptr(0)) == (VECTOR_ADD, None)
    assert sym.kernel_name(os.getpid(), lib.cxxfix_kernel_ptr(1)) == (SCALE, None)
    name, why = sym.kernel_name(os.getpid(), 0)
    assert name is None and why


def test_a_heap_pointer_is_a_driver_handle_whose_name_was_not_seen() -> None:
    handle = ctypes.addressof(ctypes.create_string_buffer(64))  # a heap pointer, like a real CUfunction
    name, why = Symbolizer().kernel_name(os.getpid(), handle)
    assert name is None and "cuModuleGetFunction" in (why or "")


def test_unwind_recovers_cxx_chain_and_interpreter(lib: ctypes.CDLL) -> None:
    # GIVEN a stack copied inside cxxfix_leaf (the way probes/native_stack.h copies it)
    cap = cxxfix.capture_own_stack(lib)
    data = cxxfix.stack_bytes(cap)
    maps = ProcessMap(read_maps(os.getpid()))
    # WHEN it is unwound with .eh_frame
    addrs = unwind(os.getpid(), Regs(cap.ip, cap.sp, cap.bp), data, maps)
    frames = Symbolizer().symbolize(os.getpid(), addrs)
    names = [f.function for f in frames]
    # THEN the C++ chain is there, in order, and the unwind goes on through ctypes into CPython
    assert names[:5] == ["cxxfix_capture_stack", "cxxfix_leaf", DISPATCH, LAUNCH, "cxxfix_run"]
    assert any(f.module.startswith("libffi") for f in frames)
    assert "_PyEval_EvalFrameDefault" in names
    assert len(frames) >= 12


def test_unwind_stops_at_the_end_of_a_short_copy(lib: ctypes.CDLL) -> None:
    cap = cxxfix.capture_own_stack(lib)
    data = cxxfix.stack_bytes(cap)[:64]
    addrs = unwind(os.getpid(), Regs(cap.ip, cap.sp, cap.bp), data, ProcessMap(read_maps(os.getpid())))
    assert 1 <= len(addrs) < 5


def test_eh_frame_table_rows_cover_functions(build: Path) -> None:
    path = str(build / "libcxxfix_nofp.so")
    table = EhFrameTable(path)
    start = symbol_vaddr(path, "_ZN2ns6detail8dispatchEPFvPfiEi")
    assert start is not None
    entry_row = table.row_for(start)
    assert entry_row is not None and entry_row.cfa_reg == 7 and entry_row.cfa_off == 8
    assert entry_row.ra is not None and entry_row.ra.arg == -8
    assert table.row_for(0) is None


def test_plt_style_cfa_expression() -> None:
    # The .plt FDE's CFA: rsp + 8 + ((rip & 15) >= 11 ? 8 : 0)
    expr = bytes([0x77, 8, 0x80, 0, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22])
    stack = _Stack(0, b"")
    assert _eval_expr(expr, {7: 0x1000, 16: 0x2000}, stack) == 0x1008
    assert _eval_expr(expr, {7: 0x1000, 16: 0x200B}, stack) == 0x1010
    assert _eval_expr(bytes([0x96]), {}, stack) is None  # DW_OP_nop alone leaves nothing


def _row_facts(row: object) -> tuple | None:
    """A CFI row as plain values: the decoded row and its copy from the ELF cache must agree on these."""
    if row is None:
        return None

    def rule(r: RegisterRule | None) -> tuple | None:
        if r is None:
            return None
        arg = bytes(r.arg) if r.type in (RegisterRule.EXPRESSION, RegisterRule.VAL_EXPRESSION) else r.arg
        return (r.type, arg)

    return (row.cfa_reg, row.cfa_off, row.cfa_expr, rule(row.ra), rule(row.rbp))


@pytest.mark.parametrize("name", ["libcxxfix_nofp.so", "libc"])
def test_decoded_fdes_are_kept_for_the_next_recording(build: Path, tmp_path: Path, name: str) -> None:
    # GIVEN an unwind table whose FDEs a recording decoded (every one of a small library, the first 300 of libc, whose
    # .plt FDE has a DWARF expression for its CFA), and a root-owned ELF cache directory
    path = (
        str(build / name)
        if name.endswith(".so")
        else next(m.host_path for m in read_maps(os.getpid()) if "/libc." in m.path)
    )
    disk = tmp_path / "elf"
    disk.mkdir(mode=0o700)
    first = UnwindTables(ElfCache(disk=disk))
    table = first.table(path)
    assert table is not None
    probes = [int(p) + d for p in table._pcs[:400] for d in (0, 5, 8, 17)]
    want = [_row_facts(table.row_for(v)) for v in probes]
    assert sum(w is not None for w in want) > len(probes) // 2
    assert name != "libc" or any(w is not None and w[2] is not None for w in want)  # a CFA expression among them
    # WHEN the recording ends (the cache saved) and the next one meets the same file
    assert first.save() == 2  # the .eh_frame index and the decoded FDEs
    second = UnwindTables(ElfCache(disk=disk))
    again = second.table(path)
    assert again is not None and again.cached_rows == len(table.decoded())

    def not_again(off: int) -> None:
        raise AssertionError(f"FDE at {off:#x} decoded again")

    again._cfi._parse_entry_at = not_again  # type: ignore[method-assign]
    # THEN every row comes back from the cache, equal, without pyelftools decoding an FDE
    assert [_row_facts(again.row_for(v)) for v in probes] == want
    # AND nothing new was decoded, so the next save writes nothing
    assert second.save() == 0


def test_decoded_fdes_without_any_expression_round_trip() -> None:
    # (an entry with no DWARF expression at all has empty expression arrays: every cache entry of the demo's libraries
    # but libc's once failed to load for it)
    rows = {
        0x40: (0x1000, 0x20, [0x1000, 0x1004], [_Row.of(7, 8, None, RegisterRule(RegisterRule.OFFSET, -8), None)] * 2),
        0x90: (0x2000, 0x10, [], []),  # an FDE that failed to decode: kept, so it is not decoded again
    }
    back = rows_from_arrays(rows_to_arrays(rows))
    assert back.keys() == rows.keys() and back[0x90] == (0x2000, 0x10, [], [])
    start, size, pcs, got = back[0x40]
    assert (start, size, pcs) == (0x1000, 0x20, [0x1000, 0x1004])
    assert [_row_facts(r) for r in got] == [(7, 8, None, ("OFFSET", -8), None)] * 2


def test_a_corrupt_cfi_entry_is_decoded_again(build: Path, tmp_path: Path) -> None:
    path = str(build / "libcxxfix_nofp.so")
    disk = tmp_path / "elf"
    disk.mkdir(mode=0o700)
    first = UnwindTables(ElfCache(disk=disk))
    table = first.table(path)
    want = [_row_facts(table.row_for(int(p))) for p in table._pcs]
    first.save()
    bad = rows_to_arrays(table.decoded())
    bad["rows"] = bad["rows"][:-1]  # a row short: the counts no longer add up
    assert elfcache.store(disk, elfcache.file_key(path, "cfi"), bad)
    again = UnwindTables(ElfCache(disk=disk)).table(path)
    assert again.cached_rows == 0
    assert [_row_facts(again.row_for(int(p))) for p in again._pcs] == want
