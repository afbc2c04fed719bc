"""Where CPython keeps what the BPF frame walk reads, per (major, minor) version: the built-in struct offsets
(:data:`TABLE`), the DWARF members that give the same offsets on a build with debug info, and what is known of
one analysed binary (:class:`BinaryInfo`) and of one process running it (:class:`PyTarget`)."""

from __future__ import annotations

from dataclasses import dataclass, field

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

# the version families whose frame and code layouts differ
V310, V311, V313 = (3, 10), (3, 11), (3, 13)


def dwarf_fields(ver: tuple[int, int]) -> dict[str, tuple[str, str]]:
    """The DWARF (struct, dotted member path) that holds each offset of :data:`TABLE` in CPython ``ver``."""
    if ver <= V310:
        frame = {
            "ts_frame": ("_ts", "frame"),
            "f_previous": ("_frame", "f_back"),
            "f_code": ("_frame", "f_code"),
            "f_instr": ("_frame", "f_lasti"),
        }
    elif ver < V313:
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
    if ver > V310:
        code["co_qualname"] = ("PyCodeObject", "co_qualname")
        code["co_adaptive"] = ("PyCodeObject", "co_code_adaptive")
    tss = ("pyruntimestate", "gilstate.autoTSSkey" if ver <= V311 else "autoTSSkey")
    return {**frame, **code, "tss": tss}


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


def ascii_data_offset(version: tuple[int, int]) -> int:
    """Offset of a compact ASCII str's characters: sizeof(PyASCIIObject), which lost its wstr pointer in 3.12."""
    return 48 if version <= (3, 11) else 40
