"""recorder/events.py: the numpy dtypes match the C structs of probes/common.h as bcc lays them out, and a record of
the wrong size is refused rather than misread."""

from __future__ import annotations

import ctypes as ct
from pathlib import Path

import numpy as np
import pytest

from tests.support.need import need_module, need_root
from tracer.recorder import events

PROBES = Path(__file__).resolve().parents[1] / "probes"

# One hash map per struct: bcc turns each value type into a ctypes structure (``table.Leaf``) from the layout
# clang computed for the kernel target, which is what the ring buffers carry.
# (map name, struct) for every struct user space decodes; the dtype each must match is in FIXED below.
STRUCTS = {
    "call_ev": "call_event",
    "sched_ev": "sched_event",
    "proc_ev": "proc_event",
    "stack_ev": "stack_event",
    "py_fr": "py_frame",
    "code_ev": "code_event",
    "map_ev": "map_event",
    "kname_ev": "kname_event",
    "comm_ev": "comm_event",
    "gc_ev": "gc_event",
    "ustack_ev": "ustack_event",
    "tb_key": "tb_key",
    "tb_val": "tb_val",
    "wake_key": "wake_key",
    "wake_val": "wake_val",
    "preempt_key": "preempt_key",
    "preempt_val": "preempt_val",
    "op_key": "op_key",
    "op_total": "op_total",
    "hist_key": "hist_key",
    "offcpu_key": "offcpu_key",
    "offcpu_val": "offcpu_val",
    "sample_key": "sample_key",
    "sample_val": "sample_val",
}
LAYOUT_PROGRAM = (
    '#include "common.h"\n'
    + "".join(f"BPF_HASH({m}, u32, struct {st}, 1);\n" for m, st in STRUCTS.items())
    + "int noop(void *ctx) { return 0; }\n"
)
FIXED = [
    ("call_ev", events.CALL_DTYPE),
    ("sched_ev", events.SCHED_DTYPE),
    ("proc_ev", events.PROC_DTYPE),
    ("py_fr", events.PY_FRAME_DTYPE),
    ("code_ev", events.CODE_DTYPE),
    ("map_ev", events.MAP_DTYPE),
    ("kname_ev", events.KNAME_DTYPE),
    ("comm_ev", events.COMM_DTYPE),
    ("gc_ev", events.GC_DTYPE),
    ("tb_key", events.TB_KEY_DTYPE),
    ("tb_val", events.TB_VAL_DTYPE),
    ("wake_key", events.WAKE_KEY_DTYPE),
    ("wake_val", events.WAKE_VAL_DTYPE),
    ("preempt_key", events.PREEMPT_KEY_DTYPE),
    ("preempt_val", events.PREEMPT_VAL_DTYPE),
    ("op_key", events.OP_KEY_DTYPE),
    ("op_total", events.OP_TOTAL_DTYPE),
    ("hist_key", events.HIST_KEY_DTYPE),
    ("offcpu_key", events.OFFCPU_KEY_DTYPE),
    ("offcpu_val", events.OFFCPU_VAL_DTYPE),
    ("sample_key", events.SAMPLE_KEY_DTYPE),
    ("sample_val", events.SAMPLE_VAL_DTYPE),
]


@pytest.fixture(scope="module")
def leaves() -> dict[str, type]:
    need_root("compiling with bcc")
    bcc = need_module("bcc")
    b = bcc.BPF(text=LAYOUT_PROGRAM, cflags=[f"-I{PROBES}"])
    try:
        return {name: b[name.encode()].Leaf for name in STRUCTS}
    finally:
        b.cleanup()


def _c_fields(leaf: type) -> dict[str, tuple[int, int]]:
    """Return name -> (offset, size) of a ctypes structure's named fields (bcc's padding fields dropped)."""
    return {
        name: (getattr(leaf, name).offset, getattr(leaf, name).size)
        for name, *_ in leaf._fields_
        if not name.startswith("__pad")
    }


def _np_fields(dt: np.dtype) -> dict[str, tuple[int, int]]:
    return {name: (off, sub.itemsize) for name, (sub, off, *_) in dt.fields.items()}


@pytest.mark.bpf
@pytest.mark.parametrize("leaf, dtype", FIXED, ids=[f for f, _ in FIXED])
def test_fixed_records_match_common_h(leaf: str, dtype: np.dtype, leaves: dict[str, type]) -> None:
    # GIVEN the struct as bcc laid it out; THEN the dtype has its size and every field at the same offset/size
    c = leaves[leaf]
    assert ct.sizeof(c) == dtype.itemsize
    assert _c_fields(c) == _np_fields(dtype)


@pytest.mark.bpf
def test_ustack_header_matches_common_h(leaves: dict[str, type]) -> None:
    # GIVEN struct ustack_event: the header dtype covers every field before the copied bytes
    c = leaves["ustack_ev"]
    fields = _c_fields(c)
    data_off, data_size = fields.pop("data")
    assert fields == _np_fields(events.USTACK_HEADER_DTYPE)
    assert data_off == events.USTACK_HEADER_DTYPE.itemsize and data_size == events.C.USTACK_MAX


def test_constants_come_from_common_h() -> None:
    # the C constants user space needs are read from the header itself, so they cannot drift
    assert events.C.TB_NFIELDS == events.TB_VAL_DTYPE["v"].shape[0]
    assert events.C.PROC_THREAD_END == events.PROC_KINDS.index("thread_end")
    assert len(events.TB_PARTS) == 12 and set(events.TB_PARTS) <= set(events.TB_COLUMNS)


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


def test_code_events_sent_to_their_line_tables_end_are_padded_back() -> None:
    # GIVEN two code events as pycode.h sends them: the head, then only the line table's bytes that were read
    rec = np.zeros(2, dtype=events.CODE_DTYPE)
    rec["code"], rec["lt_len"], rec["qualname"] = [0x10, 0x20], [3, 0], [b"f", b"g"]
    rec["linetable"][0][:3] = [1, 2, 3]
    buf = events.TailBuffer(events.CODE_DTYPE, head=events.CODE_EVENT_HEAD)
    for r in rec:
        _feed(buf, r.tobytes()[: events.CODE_EVENT_HEAD + int(r["lt_len"])])
    # WHEN drained; THEN both come back whole, the rest of each table zero
    assert buf.drain().tobytes() == rec.tobytes()
    # AND a record shorter than the head, or longer than the struct, is refused rather than misread
    for size in (events.CODE_EVENT_HEAD - 1, events.CODE_DTYPE.itemsize + 8):
        _feed(buf, bytes(size))
        with pytest.raises(events.DecodeError, match=str(size)):
            buf.drain()


@pytest.mark.bpf
def test_code_event_head_is_the_bytes_before_the_line_table(leaves: dict[str, type]) -> None:
    # the head user space pads from is where common.h's line table starts (CODE_EVENT_HEAD in C)
    assert _c_fields(leaves["code_ev"])["linetable"][0] == events.CODE_EVENT_HEAD


def test_decode_stack_keeps_frames_and_rejects_a_short_header() -> None:
    h = np.zeros(1, dtype=events.STACK_HEADER_DTYPE)
    h["stack_ref"], h["pid"], h["tid"], h["native_id"], h["n_py"] = 9, 1, 2, -1, 2
    fr = np.zeros(2, dtype=events.PY_FRAME_DTYPE)
    fr["code"], fr["lasti"] = [0x1000, 0x2000], [5, 6]
    rec = events.decode_stack(h.tobytes() + fr.tobytes())
    assert (rec.stack_ref, rec.pid, rec.tid, rec.native_id, rec.frames) == (9, 1, 2, -1, ((0x1000, 5), (0x2000, 6)))
    with pytest.raises(events.DecodeError):
        events.decode_stack(bytes(events.STACK_HEADER_DTYPE.itemsize - 1))


def test_decode_ustack_cuts_at_len() -> None:
    h = np.zeros(1, dtype=events.USTACK_HEADER_DTYPE)
    h["stack_ref"], h["ip"], h["sp"], h["bp"], h["pid"], h["tid"], h["len"], h["native_id"] = (
        5,
        0x401000,
        0x7FFD0000,
        0x7FFD0100,
        10,
        11,
        8,
        -14,
    )
    rec = events.decode_ustack(h.tobytes() + b"ABCDEFGH" + bytes(64))
    assert (rec.stack_ref, rec.pid, rec.tid, rec.native_id) == (5, 10, 11, -14)
    assert (rec.ip, rec.sp, rec.bp, rec.data) == (0x401000, 0x7FFD0000, 0x7FFD0100, b"ABCDEFGH")
    with pytest.raises(events.DecodeError):
        events.decode_ustack(b"short")


def test_map_names_come_outermost_first() -> None:
    e = np.zeros(1, dtype=events.MAP_DTYPE)[0]
    e["names"][:3] = [b"libcudart.so.12\0junk", b"lib", b"usr"]
    assert events.map_names(e["names"], 3) == ["usr", "lib", "libcudart.so.12"]


def test_c_strings_end_at_their_first_nul_in_small_and_large_batches() -> None:
    # BPF string reads leave a reused buffer's stale bytes after the NUL; a large batch decodes each distinct one once
    raw = [b"python3\0xx", b"pt_data_worker", b"kworker/0:1\0ab", b"\0stale", b"", b"python3"]
    want = ["python3", "pt_data_worker", "kworker/0:1", "", "", "python3"]
    for n in (1, 7, events.CSTR_UNIQUE_FROM + 1, 5000):
        idx = np.arange(n) * 7 % len(raw)
        rec = np.zeros(n, dtype=[("pid", "<u4"), ("comm", "S16")])  # a field of a record array, as drained
        rec["comm"] = [raw[i] for i in idx]
        assert events.cstr(rec["comm"]) == [want[i] for i in idx]
