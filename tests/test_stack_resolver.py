"""tracer/recorder/stack_resolver.py: merging Python frames into native stacks, and kernel names (no BPF)."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from probes.catalog import OP_IDS
from tests.support import cxxfix
from tracer.recorder import events
from tracer.recorder.cpython.layouts import TABLE, BinaryInfo, PyTarget
from tracer.recorder.procmaps import MapCache
from tracer.recorder.pyruntime import PyRuntimeManager
from tracer.recorder.stack_resolver import StackResolver, merge_stacks

LAUNCH = "ns::Launcher<float>::launch(int)"
DISPATCH = "ns::detail::dispatch(void (*)(float*, int), int)"


def _n(fn: str) -> tuple:
    return ("native", "lib.so", fn, None, None, False)


def _p(fn: str, line: int) -> tuple:
    return ("python", "t.py", fn, "t.py", line, False)


def test_python_frames_replace_the_eval_loop() -> None:
    native = [
        _n("_start"),
        _n("main"),
        _n("_PyEval_EvalFrameDefault"),
        _n("_PyEval_EvalFrameDefault"),
        _n("ffi_call"),
        _n("cudaMalloc"),
    ]
    py = [_p("<module>", 3), _p("step", 9)]
    got = merge_stacks(py, native)
    assert [f[2] for f in got] == ["_start", "main", "<module>", "step", "ffi_call", "cudaMalloc"]
    assert merge_stacks(py, [_n("ffi_call")]) == py + [_n("ffi_call")]  # no eval loop seen: Python on top
    assert merge_stacks([], native) == native


def _resolver(written: list) -> StackResolver:
    return StackResolver(
        MapCache(),
        None,
        native_walk=lambda _id: [],
        put_stack=lambda sid, f: written.append(sid),
        parent_of=lambda pid: {11: 10}.get(pid),
    )


def test_a_forked_worker_uses_its_parents_named_handles() -> None:
    r = _resolver([])
    kn = np.zeros(1, dtype=events.KNAME_DTYPE)
    kn["pid"], kn["handle"], kn["name"] = 10, 0xABC, b"_ZN7kernels10vector_addIfEEvPfi"
    r.add_knames(kn)
    assert r.kernel(11, 0xABC) == ("void kernels::vector_add<float>(float*, int)", None)
    name, why = r.kernel(12, 0xABC)  # an unrelated process: not named, and the reason says why
    assert name is None and why


def test_a_handle_from_a_host_stub_is_named_by_the_stubs_symbol() -> None:
    # GIVEN __cudaGetKernel's (handle, stub) pair, the stub being a real function of this process (libc's labs)
    r = _resolver([])
    stub = ctypes.cast(ctypes.CDLL(None).labs, ctypes.c_void_p).value
    kn = np.zeros(1, dtype=events.KNAME_DTYPE)
    kn["pid"], kn["handle"], kn["stub"] = os.getpid(), 0x5000, stub
    r.add_knames(kn)
    # THEN a launch with the opaque handle gets the stub's name
    assert r.kernel(os.getpid(), 0x5000) == ("labs", None)


def test_stack_ids_are_shared_by_equal_stacks_and_missing_ones_are_null() -> None:
    written: list = []
    r = _resolver(written)
    r._frames = {0x11: (_p("step", 3),), 0x21: (_p("step", 3),), 0x31: (_p("other", 4),)}
    op = OP_IDS["cudaMalloc"]
    ids = r.stack_ids(np.array([0x11, 0x21, 0x31, 0, 0x99], dtype=np.uint64), np.full(5, op))
    assert ids[0] == ids[1] and ids[2] != ids[0] and ids[3] is None and ids[4] is None
    assert written == [ids[0], ids[2]]  # each stack written once


def _pystack(ref: int, pid: int, codes: list[int]) -> bytes:
    """A stack record of pid with Python frames (code address, lasti 0), innermost first."""
    h = np.zeros(1, dtype=events.STACK_HEADER_DTYPE)
    h["stack_ref"], h["pid"], h["tid"], h["native_id"], h["n_py"] = ref, pid, pid, -1, len(codes)
    fr = np.zeros(len(codes), dtype=events.PY_FRAME_DTYPE)
    fr["code"] = codes
    return h.tobytes() + fr.tobytes()


def _code_event(pid: int, code: int, name: bytes, first: int = 7, flags: int = 0) -> np.ndarray:
    ev = np.zeros(1, dtype=events.CODE_DTYPE)
    ev["pid"], ev["code"], ev["qualname"], ev["filename"], ev["firstlineno"] = pid, code, name, b"w.py", first
    ev["flags"] = flags
    return ev


def _py_resolver(written: list) -> tuple[StackResolver, PyRuntimeManager]:
    # a process gone by the time its stack is resolved (no /proc to read a code object from): only BPF's code
    # events can name its frames
    pid = 2**22 + 11
    pyrt = PyRuntimeManager(None)
    info = BinaryInfo("x", "b", (3, 12), "ET_DYN", 0, 0, dict(TABLE[(3, 12)]), "table")
    pyrt.targets[pid] = PyTarget(pid, info, 0)
    r = StackResolver(
        MapCache(),
        pyrt,
        native_walk=lambda _id: [],
        put_stack=lambda sid, f: written.append(f),
        parent_of=lambda p: None,
    )
    return r, pyrt


def _names(frames) -> list[str]:
    return [f[2] for f in frames if f[0] == "python"]


def test_a_stack_whose_code_objects_come_a_drain_later_is_named_by_them() -> None:
    # GIVEN a stack drained before the code object the kernel read just after it (pycode.h submits the stack first)
    written: list = []
    r, pyrt = _py_resolver(written)
    pid = next(iter(pyrt.targets))
    pyrt.add_code_events(_code_event(pid, 0x9000, b"outer"))
    r.add_stacks([_pystack(0x11, pid, [0x9100, 0x9000])])
    # WHEN the missing code object arrives at the next drain, and an off-CPU event then asks for the stack
    pyrt.add_code_events(_code_event(pid, 0x9100, b"inner"))
    r.add_stacks([])
    (sid,) = r.plain_stack_ids(np.array([0x11], dtype=np.uint64))
    # THEN both frames are named, outermost first
    assert sid is not None and _names(written[0]) == ["outer", "inner"]


def test_an_event_that_asks_for_a_waiting_stack_resolves_it_at_once() -> None:
    # GIVEN a stack whose second code object is still missing
    written: list = []
    r, pyrt = _py_resolver(written)
    pid = next(iter(pyrt.targets))
    pyrt.add_code_events(_code_event(pid, 0x9000, b"outer"))
    r.add_stacks([_pystack(0x21, pid, [0x9100, 0x9000])])
    # WHEN a call of the same drain refers to it (its code objects never came: lost in a full ring)
    (sid,) = r.stack_ids(np.array([0x21], dtype=np.uint64), np.array([OP_IDS["cudaMalloc"]]))
    # THEN it gets a stack at once, with the missing frame marked unresolved rather than dropped
    assert sid is not None
    assert _names(written[0]) == ["outer", "<unresolved 0x9100>"]


def test_a_stack_that_waited_one_drain_is_resolved_even_without_its_code_objects() -> None:
    written: list = []
    r, pyrt = _py_resolver(written)
    pid = next(iter(pyrt.targets))
    r.add_stacks([_pystack(0x31, pid, [0x9100])])
    assert r.resolved == 0  # waiting
    r.add_stacks([])
    assert r.resolved == 1 and 0x31 in r._frames


def test_a_forked_childs_unreadable_name_is_its_parents_for_the_same_code_object() -> None:
    # GIVEN a parent that sent code object 0x9000 ("a", first line 7), and a child forked from it that has exited
    # (no /proc to read), whose own event for 0x9000 says BPF could not read the name (suite run 9)
    written: list = []
    r, pyrt = _py_resolver(written)
    parent = next(iter(pyrt.targets))
    child, later = parent + 1, parent + 2
    pyrt.add_code_events(_code_event(parent, 0x9000, b"a"))
    pyrt.note_fork(parent, child)
    pyrt.note_fork(parent, later)
    unread = events.C.CODE_F_NAME_UNREAD
    pyrt.add_code_events(_code_event(child, 0x9000, b"", flags=unread))
    # and another child whose object at that address was made after the fork: another first line
    pyrt.add_code_events(_code_event(later, 0x9000, b"", first=30, flags=unread))
    r.add_stacks([_pystack(0x41, child, [0x9000]), _pystack(0x42, later, [0x9000])])
    assert None not in r.plain_stack_ids(np.array([0x41, 0x42], dtype=np.uint64))
    # THEN the child's frame has the parent's name; the other's says it could not be read
    assert sorted(_names(f)[0] for f in written) == ["<unreadable 0x9000>", "a"]


def test_a_call_drained_before_its_stacks_code_objects_reads_them_once_more() -> None:
    # GIVEN a stack whose code object is not in yet, and a call that refers to it in the same drain: the kernel
    # sends a call whose stack it took at the call's return before that stack's code objects (call_with_stack)
    written: list = []
    r, pyrt = _py_resolver(written)
    pid = next(iter(pyrt.targets))
    late = [_code_event(pid, 0x9100, b"inner")]  # in the code objects' ring, not yet read
    reads = []

    def more_codes() -> None:
        reads.append(1)
        while late:
            pyrt.add_code_events(late.pop())

    r.more_codes = more_codes
    pyrt.add_code_events(_code_event(pid, 0x9000, b"outer"))
    r.add_stacks([_pystack(0x51, pid, [0x9100, 0x9000])])
    # WHEN the call asks for its stack
    (sid,) = r.stack_ids(np.array([0x51], dtype=np.uint64), np.array([OP_IDS["cudaMalloc"]]))
    # THEN the ring is read once more first, and both frames are named
    assert sid is not None and reads == [1]
    assert _names(written[0]) == ["outer", "inner"]


# --- native frames shared by the processes of one image --------------------------------------------------------


@pytest.fixture(scope="module")
def cxx(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    # without frame pointers: only the .eh_frame unwind of the copy gets past dispatch()
    return cxxfix.load(cxxfix.build(tmp_path_factory.mktemp("cxxbuild")), "nofp")


def _ustack(ref: int, pid: int, cap: cxxfix.Capture, data: bytes, sp: int) -> bytes:
    h = np.zeros(1, dtype=events.USTACK_HEADER_DTYPE)
    h["stack_ref"], h["pid"], h["tid"], h["native_id"] = ref, pid, pid, -1
    h["ip"], h["sp"], h["bp"], h["len"] = cap.ip, sp, cap.bp, len(data)
    return h.tobytes() + data


def test_a_stack_a_forked_sibling_sent_again_is_unwound_once_per_image(cxx: ctypes.CDLL) -> None:
    # GIVEN this process's stack copied inside the C++ fixture, and a map cache where two processes were forked
    # from this one (one image: the same files at the same addresses) and a third exec'd the same files anew
    cap = cxxfix.capture_own_stack(cxx)
    data = cxxfix.stack_bytes(cap)
    me, child, sibling, execd = os.getpid(), 2**22 + 1, 2**22 + 2, 2**22 + 3
    maps = MapCache()
    assert maps.attach(me) is not None
    for p in (child, sibling, execd):
        maps.on_fork(me, p)
    maps.on_exec(execd)
    for e in maps.get(me).entries:
        maps.add(execd, e)
    r = StackResolver(maps, None, native_walk=lambda _id: [], put_stack=lambda sid, f: None, parent_of=lambda p: None)

    def resolve(ref: int, pid: int, sp: int = cap.sp) -> tuple:
        # the kernel hashes stacks per process, so each process sends its own record and copy (cuda.bpf.c)
        r.add_ustacks([_ustack(ref, pid, cap, data, sp)])
        r.add_stacks([_pystack(ref, pid, [])])  # no Python frames: the native part alone
        return r._frames[ref]

    # WHEN each process sends the stack
    first = resolve(1, me)
    assert [f[2] for f in first][-4:] == [LAUNCH, DISPATCH, "cxxfix_leaf", "cxxfix_capture_stack"]
    assert r.unwound == 1
    # THEN the forked ones get its frames without unwinding their copies again
    assert resolve(2, child) == first and resolve(3, sibling) == first
    assert r.unwound == 1
    # AND a process that exec'd is another image, unwound on its own, to the same frames here
    assert resolve(4, execd) == first
    assert r.unwound == 2
    # AND a copy taken at another depth of the same image is unwound too
    resolve(5, sibling, sp=cap.sp + 8)
    assert r.unwound == 3
    # AND a forgotten process's image is not reused by a new process with its pid
    maps.forget(child)
    maps.add(child, maps.get(me).entries[0])
    assert maps.image_of(child) not in {maps.image_of(me), maps.image_of(execd)}
