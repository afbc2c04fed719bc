"""Native user stacks from real eBPF: the frame-pointer walk (BPF_STACK_TRACE) and the stack copy
(probes/native_stack.h) unwound with .eh_frame (tracer/recorder/unwind.py), on the C++ fixtures built with and without
frame pointers. Needs root and a BPF-capable kernel.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.need import need, need_root
from tracer.recorder.events import USTACK_HEADER_DTYPE, C, UstackRecord, decode_ustack
from tracer.recorder.procmaps import MapCache
from tracer.recorder.symbolize import NativeFrame, Symbolizer
from tracer.recorder.unwind import unwind_record


def _stack_addrs(table: object, stack_id: int) -> list[int]:
    """One stack of a bcc BPF_STACK_TRACE table, innermost first; [] for a failed walk (a negative id)."""
    if stack_id < 0:
        return []
    try:
        return [int(a) for a in table.walk(stack_id)]  # type: ignore[attr-defined]
    except KeyError:
        return []


pytestmark = pytest.mark.bpf


@pytest.fixture(autouse=True)
def _root() -> None:
    need_root("eBPF")


REPO = Path(__file__).resolve().parents[2]

DISPATCH = "ns::detail::dispatch(void (*)(float*, int), int)"
LAUNCH = "ns::Launcher<float>::launch(int)"

BPF_TEXT = r"""
#include "common.h"
#include "native_stack.h"

/* key: stack id; value: up to 127 user return addresses; 1024: one per hit of this test, with room */
BPF_STACK_TRACE(native_stacks, 1024);
/* 64 pages = 256 KB: 15 ustack_events of 16 KB; the driver makes CALLS hits */
BPF_RINGBUF_OUTPUT(ustacks, 64);

int on_leaf(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != TARGET_PID)
        return 0;
    struct ustack_event *e = ustacks.ringbuf_reserve(sizeof(*e));
    if (!e)
        return 0;
    struct user_regs ur;
    user_regs_of_ctx(ctx, &ur);
    copy_user_stack(&ur, e);
    e->stack_ref = 0;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->native_id = native_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    ustacks.ringbuf_submit(e, 0);
    return 0;
}
"""

# Loads one fixture library, waits for "go" on stdin, calls into the C++ chain CALLS times, waits for "exit".
DRIVER = textwrap.dedent(
    """
    import ctypes, sys
    lib = ctypes.CDLL(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(int(sys.argv[2])):
        lib.cxxfix_run(i)
    print("done", flush=True)
    sys.stdin.readline()
    """
)
CALLS = 3


@pytest.fixture(scope="module")
def fixture_libs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need(shutil.which("g++") and shutil.which("make"), "needs g++ and make to build fixtures/cxx")
    build = tmp_path_factory.mktemp("cxxbuild")
    subprocess.run(["make", "-s", "-C", str(REPO / "fixtures" / "cxx"), f"BUILD={build}"], check=True)
    return build


def _capture(lib: Path, tmp_path: Path) -> tuple[list[list[NativeFrame]], list[list[NativeFrame]]]:
    """(FP-walk stacks, eh_frame-unwound stacks) of each hit of cxxfix_leaf in a driver using ``lib``."""
    from bcc import BPF

    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    proc = subprocess.Popen(
        [sys.executable, str(driver), str(lib), str(CALLS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        bpf = BPF(text=BPF_TEXT.encode(), cflags=[f"-I{REPO / 'probes'}", f"-DTARGET_PID={proc.pid}"])
        bpf.attach_uprobe(name=str(lib).encode(), sym=b"cxxfix_leaf", fn_name=b"on_leaf")
        cache = MapCache()
        symbolizer = Symbolizer(cache)
        maps = cache.attach(proc.pid)  # while it runs; the recorder keeps it current from mapping events
        assert maps is not None
        events: list[UstackRecord] = []
        sizes: set[int] = set()

        def on_event(_ctx: object, data: int, size: int) -> None:
            sizes.add(size)
            events.append(decode_ustack(_bytes_at(data, size)))

        bpf[b"ustacks"].open_ring_buffer(on_event)
        # WHEN the driver calls through the chain
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        deadline = time.monotonic() + 5
        while len(events) < CALLS and time.monotonic() < deadline:
            bpf.ring_buffer_poll(100)
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # THEN both stacks resolve, after the process is gone, through the map read while it ran
    assert len(events) == CALLS
    assert sizes == {USTACK_HEADER_DTYPE.itemsize + C.USTACK_MAX}  # common.h and tracer/recorder/events.py agree
    assert all(ev.data for ev in events)
    fp = [symbolizer.symbolize(ev.pid, _stack_addrs(bpf[b"native_stacks"], ev.native_id)) for ev in events]
    eh = [symbolizer.symbolize(ev.pid, unwind_record(ev, maps)) for ev in events]
    bpf.cleanup()
    return fp, eh


def _bytes_at(data: int, size: int) -> bytes:
    import ctypes

    return ctypes.string_at(data, size)


def _names(stack: list[NativeFrame]) -> list[str]:
    return [f.function for f in stack]


def _report(label: str, stack: list[NativeFrame]) -> None:
    print(f"\n{label}: {len(stack)} frames")
    for f in stack:
        print(f"  {f.module}!{f.function}+{f.offset:#x}")


def test_frame_pointer_lib_fp_walk_and_unwind(fixture_libs: Path, tmp_path: Path) -> None:
    # GIVEN the library built with frame pointers
    fp, eh = _capture(fixture_libs / "libcxxfix_fp.so", tmp_path)
    _report("fp lib, FP walk", fp[0])
    _report("fp lib, eh_frame", eh[0])
    # THEN the FP walk alone names the C++ frames, demangled
    for stack in fp:
        names = _names(stack)
        assert names[0] == "cxxfix_leaf"
        assert DISPATCH in names and LAUNCH in names
        assert names.index(DISPATCH) < names.index(LAUNCH)
    # AND the eh_frame unwind gets them too, and continues through ctypes into the interpreter
    for stack in eh:
        names = _names(stack)
        assert names[:5] == ["cxxfix_leaf", DISPATCH, LAUNCH, "cxxfix_run", names[4]]
        assert "_PyEval_EvalFrameDefault" in names
        assert len(stack) > len(fp[0])


def test_no_frame_pointer_lib_needs_eh_frame(fixture_libs: Path, tmp_path: Path) -> None:
    # GIVEN the -fomit-frame-pointer -O2 library
    fp, eh = _capture(fixture_libs / "libcxxfix_nofp.so", tmp_path)
    _report("nofp lib, FP walk", fp[0])
    _report("nofp lib, eh_frame", eh[0])
    for fp_stack, eh_stack in zip(fp, eh, strict=True):
        # THEN the FP walk misses the C++ callers (it jumps straight to whatever last kept rbp)
        assert LAUNCH not in _names(fp_stack)
        # AND the eh_frame unwind recovers the whole chain, into libffi/_ctypes and the interpreter
        names = _names(eh_stack)
        assert names[:4] == ["cxxfix_leaf", DISPATCH, LAUNCH, "cxxfix_run"]
        modules = {f.module for f in eh_stack}
        assert any(m.startswith("libffi") for m in modules)
        assert any(m.startswith("_ctypes") for m in modules)
        assert "_PyEval_EvalFrameDefault" in names
        assert len(eh_stack) > len(fp_stack)
