"""tracer/recorder/stack_resolver.py: merging Python frames into native stacks, and kernel names (no BPF)."""

from __future__ import annotations

import ctypes
import os

import numpy as np

from probes.catalog import OP_IDS
from tracer.recorder import events
from tracer.recorder.procmaps import MapCache
from tracer.recorder.stack_resolver import StackResolver, merge_stacks


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
