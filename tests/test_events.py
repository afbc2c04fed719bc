"""tracer/events.py: the numpy dtypes match the C structs of probes/common.h as bcc lays them out, and a record of
the wrong size is refused rather than misread."""

from __future__ import annotations

import ctypes as ct
import os
from pathlib import Path

import numpy as np
import pytest

from tracer import events

PROBES = Path(__file__).resolve().parents[1] / "probes"

# One hash map per struct: bcc turns each value type into a ctypes structure (``table.Leaf``) from the layout
# clang computed for the kernel target, which is what the ring buffers carry.
LAYOUT_PROGRAM = r"""
#include "common.h"
BPF_HASH(call_ev, u32, struct call_event, 1);
BPF_HASH(sched_ev, u32, struct sched_event, 1);
BPF_HASH(proc_ev, u32, struct proc_event, 1);
BPF_HASH(stack_ev, u32, struct stack_event, 1);
BPF_HASH(py_fr, u32, struct py_frame, 1);
int noop(void *ctx) { return 0; }
"""


@pytest.fixture(scope="module")
def leaves() -> dict[str, type]:
    if os.geteuid() != 0:
        pytest.skip("compiling with bcc needs root")
    bcc = pytest.importorskip("bcc")
    b = bcc.BPF(text=LAYOUT_PROGRAM, cflags=[f"-I{PROBES}"])
    try:
        return {name: b[name.encode()].Leaf for name in ("call_ev", "sched_ev", "proc_ev", "stack_ev", "py_fr")}
    finally:
        b.cleanup()


def _c_fields(leaf: type) -> dict[str, tuple[int, int]]:
    """Return name -> (offset, size) of a ctypes structure's named fields (bcc's padding fields dropped)."""
    return {name: (getattr(leaf, name).offset, getattr(leaf, name).size)
            for name, *_ in leaf._fields_ if not name.startswith("__pad")}


def _np_fields(dt: np.dtype) -> dict[str, tuple[int, int]]:
    return {name: (off, sub.itemsize) for name, (sub, off, *_) in dt.fields.items()}


@pytest.mark.bpf
@pytest.mark.parametrize(
    "leaf, dtype",
    [("call_ev", events.CALL_DTYPE), ("sched_ev", events.SCHED_DTYPE), ("proc_ev", events.PROC_DTYPE),
     ("py_fr", events.PY_FRAME_DTYPE)],
)
def test_fixed_records_match_common_h(leaf: str, dtype: np.dtype, leaves: dict[str, type]) -> None:
    # GIVEN the struct as bcc laid it out; THEN the dtype has its size and every field at the same offset/size
    c = leaves[leaf]
    assert ct.sizeof(c) == dtype.itemsize
    assert _c_fields(c) == _np_fields(dtype)


@pytest.mark.bpf
def test_stack_header_matches_common_h(leaves: dict[str, type]) -> None:
    # GIVEN struct stack_event: the header dtype covers every field before the frames, which start right after
    c = leaves["stack_ev"]
    fields = _c_fields(c)
    frames_off, frames_size = fields.pop("frames")
    assert fields == _np_fields(events.STACK_HEADER_DTYPE)
    assert frames_off == events.STACK_HEADER_DTYPE.itemsize
    assert frames_size % events.PY_FRAME_DTYPE.itemsize == 0
    assert ct.sizeof(c) == frames_off + frames_size


def _feed(buf: events.RawBuffer | events.StackBuffer, data: bytes) -> None:
    b = ct.create_string_buffer(data, len(data))
    buf.callback(0, ct.addressof(b), len(data))


def test_drain_decodes_whole_records() -> None:
    # GIVEN two call records as the ring buffer hands them over
    rec = np.zeros(2, dtype=events.CALL_DTYPE)
    rec["pid"], rec["op"], rec["dur_ns"] = [7, 8], [3, 4], [100, 200]
    buf = events.RawBuffer(events.CALL_DTYPE)
    for r in rec:
        _feed(buf, r.tobytes())
    # WHEN drained; THEN both come back field for field, and the buffer is empty afterwards
    out = buf.drain()
    assert out.tolist() == rec.tolist()
    assert len(buf.drain()) == 0


def test_drain_rejects_a_wrong_size_record() -> None:
    # GIVEN a good record followed by one a byte short (the C and the dtype disagree)
    buf = events.RawBuffer(events.CALL_DTYPE)
    _feed(buf, bytes(events.CALL_DTYPE.itemsize))
    _feed(buf, bytes(events.CALL_DTYPE.itemsize - 1))
    # WHEN drained; THEN DecodeError names the bad size instead of misreading the rest
    with pytest.raises(events.DecodeError, match=str(events.CALL_DTYPE.itemsize - 1)):
        buf.drain()


def test_stack_buffer_decodes_frames_and_rejects_a_short_header() -> None:
    h = np.zeros(1, dtype=events.STACK_HEADER_DTYPE)
    h["stack_ref"], h["pid"], h["tid"], h["native_id"], h["n_py"] = 9, 1, 2, -1, 2
    fr = np.zeros(2, dtype=events.PY_FRAME_DTYPE)
    fr["code"], fr["lasti"] = [0x1000, 0x2000], [5, 6]
    buf = events.StackBuffer()
    _feed(buf, h.tobytes() + fr.tobytes())
    (rec,) = buf.drain()
    assert (rec.stack_ref, rec.pid, rec.tid, rec.native_id, rec.frames) == (9, 1, 2, -1, ((0x1000, 5), (0x2000, 6)))
    _feed(buf, bytes(events.STACK_HEADER_DTYPE.itemsize - 1))
    with pytest.raises(events.DecodeError):
        buf.drain()
