"""fixtures/cxx loaded into the test process: a C++ call chain that copies its own stack the way
probes/native_stack.h does (cxxfix_capture_stack), for the unwinder's and the stack resolver's tests."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

from tests.support.need import need

REPO = Path(__file__).resolve().parents[2]


class Capture(ctypes.Structure):
    """struct cxxfix_capture in fixtures/cxx/cxxfix.cpp."""

    _fields_ = [
        ("ip", ctypes.c_uint64),
        ("sp", ctypes.c_uint64),
        ("bp", ctypes.c_uint64),
        ("limit", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("data", ctypes.c_ubyte * 16384),
    ]


def build(out: Path) -> Path:
    """Build fixtures/cxx into ``out``; return it."""
    need(shutil.which("g++") and shutil.which("make"), "needs g++ and make to build fixtures/cxx")
    subprocess.run(["make", "-s", "-C", str(REPO / "fixtures" / "cxx"), f"BUILD={out}"], check=True)
    return out


def load(built: Path, variant: str) -> ctypes.CDLL:
    """The library built with (``fp``) or without (``nofp``) frame pointers."""
    cdll = ctypes.CDLL(str(built / f"libcxxfix_{variant}.so"))
    cdll.cxxfix_kernel_ptr.restype = ctypes.c_void_p
    return cdll


def capture_own_stack(lib: ctypes.CDLL) -> Capture:
    """This thread's stack, copied inside cxxfix_leaf (cxxfix_run -> Launcher::launch -> dispatch -> leaf)."""
    top = next(
        int(line.split()[0].split("-")[1], 16)
        for line in Path("/proc/self/maps").read_text().splitlines()
        if line.endswith("[stack]")
    )
    cap = Capture()
    cap.limit = top
    lib.cxxfix_set_capture(ctypes.byref(cap))
    try:
        lib.cxxfix_run(3)
    finally:
        lib.cxxfix_set_capture(None)
    return cap


def stack_bytes(cap: Capture) -> bytes:
    """The bytes the capture copied."""
    return ctypes.string_at(ctypes.addressof(cap) + Capture.data.offset, cap.len)
