"""Ring-buffer records to column batches: numpy dtypes mirroring probes/common.h, decoded in bulk, and the C
constants user space needs, read from common.h itself so that each is named once.

The ring-buffer callbacks only copy bytes (:class:`RawBuffer`); decoding happens here, a batch at a time, with no
per-event Python objects for the fixed-size records. tests/test_events.py checks every dtype against the layout
bcc derives from the C.
"""

from __future__ import annotations

import ctypes as ct
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

COMMON_H = Path(__file__).resolve().parents[2] / "probes" / "common.h"


def _defines(path: Path) -> dict[str, int]:
    """Every ``#define NAME <integer>`` of a C header (the header's #ifndef defaults included)."""
    out: dict[str, int] = {}
    for m in re.finditer(r"^\s*#define\s+(\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", path.read_text(), re.M):
        out[m.group(1)] = int(m.group(2), 0)
    return out


# The constants of probes/common.h: C.LOST_CALLS, C.CFG_START_NS, C.TB_CPU, C.MAP_EXE, ...
C = SimpleNamespace(**_defines(COMMON_H))

CALL_DTYPE = np.dtype(
    [
        ("ts_ns", "<u8"),
        ("dur_ns", "<u8"),
        ("bytes", "<u8"),
        ("stream", "<u8"),
        ("func", "<u8"),
        ("off_cpu_ns", "<u8"),
        ("runq_ns", "<u8"),
        ("stack_ref", "<u8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("ret", "<i4"),
        ("op", "<u2"),
        ("kind", "u1"),
        ("flags", "u1"),
        ("nested", "<u4"),
        ("_pad", "<u4"),
    ]
)
GC_DTYPE = np.dtype(
    [
        ("ts_ns", "<u8"),
        ("dur_ns", "<u8"),
        ("off_cpu_ns", "<u8"),
        ("runq_ns", "<u8"),
        ("stack_ref", "<u8"),
        ("collected", "<i8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("generation", "<i4"),
        ("_pad", "<u4"),
    ]
)
SCHED_DTYPE = np.dtype(
    [
        ("ts_ns", "<u8"),
        ("dur_ns", "<u8"),
        ("runq_ns", "<u8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("by_pid", "<u4"),
        ("waker_pid", "<u4"),
        ("waker_tid", "<u4"),
        ("cpu", "<u2"),
        ("reason", "u1"),
        ("in_call", "u1"),
        ("comm", "S16"),
        ("by_comm", "S16"),
        ("waker_comm", "S16"),
    ]
)
PROC_DTYPE = np.dtype(
    [
        ("ts_ns", "<u8"),
        ("aux", "<u8"),
        ("kind", "<u4"),
        ("pid", "<u4"),
        ("ppid", "<u4"),
        ("child", "<u4"),
        ("exit_code", "<i4"),
        ("tid", "<u4"),
        ("comm", "S16"),
        ("filename", "S64"),
    ]
)
STACK_HEADER_DTYPE = np.dtype(
    [
        ("stack_ref", "<u8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("native_id", "<i4"),
        ("n_py", "<u2"),
        ("py_status", "<u2"),
    ]
)
PY_FRAME_DTYPE = np.dtype([("code", "<u8"), ("lasti", "<u4"), ("_pad", "<u4")])
KNAME_DTYPE = np.dtype(
    [("handle", "<u8"), ("stub", "<u8"), ("pid", "<u4"), ("_pad", "<u4"), ("name", f"S{C.KNAME_MAX}")]
)
COMM_DTYPE = np.dtype(
    [
        ("ts_ns", "<u8"),
        ("dur_ns", "<u8"),
        ("comm", "<u8"),
        ("id_hash", "<u8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("nranks", "<i4"),
        ("rank", "<i4"),
        ("ret", "<i4"),
        ("_pad", "<u4"),
    ]
)
CODE_DTYPE = np.dtype(
    [
        ("code", "<u8"),
        ("pid", "<u4"),
        ("firstlineno", "<i4"),
        ("lt_len", "<u4"),
        ("lt_full", "<u4"),
        ("flags", "<u4"),
        ("_pad", "<u4"),
        ("qualname", f"S{C.CODE_NAME_MAX}"),
        ("filename", f"S{C.CODE_FILE_MAX}"),
        ("linetable", "u1", (C.CODE_LT_MAX,)),
    ]
)
CODE_EVENT_HEAD = CODE_DTYPE.fields["linetable"][1]  # probes/common.h: the bytes before the line table
MAP_DTYPE = np.dtype(
    [
        ("start", "<u8"),
        ("len", "<u8"),
        ("pgoff", "<u8"),
        ("ino", "<u8"),
        ("dev", "<u4"),
        ("pid", "<u4"),
        ("kind", "<u2"),
        ("depth", "<u2"),
        ("flags", "<u4"),
        ("names", f"S{C.PATH_NAME}", (C.PATH_DEPTH,)),
    ]
)
USTACK_HEADER_DTYPE = np.dtype(
    [
        ("stack_ref", "<u8"),
        ("ip", "<u8"),
        ("sp", "<u8"),
        ("bp", "<u8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("len", "<u4"),
        ("native_id", "<i4"),
    ]
)

# Map keys and values user space reads in bulk (tracer/recorder/bpfmaps.py), mirroring common.h.
TB_KEY_DTYPE = np.dtype([("tid", "<u4"), ("sec", "<u4")])
TB_VAL_DTYPE = np.dtype([("pid", "<u4"), ("_pad", "<u4"), ("v", "<u8", (C.TB_NFIELDS,))])
WAKE_KEY_DTYPE = np.dtype(
    [("tid", "<u4"), ("sec", "<u4"), ("waker_tid", "<u4"), ("in_call", "u1"), ("waker_irq", "u1"), ("_pad", "<u2")]
)
WAKE_VAL_DTYPE = np.dtype(
    [("pid", "<u4"), ("waker_pid", "<u4"), ("wakeups", "<u8"), ("blocked_ns", "<u8"), ("waker_comm", "S16")]
)
PREEMPT_KEY_DTYPE = np.dtype([("pid", "<u4"), ("tid", "<u4"), ("sec", "<u4"), ("_pad", "<u4"), ("comm", "S16")])
PREEMPT_VAL_DTYPE = np.dtype([("preemptions", "<u8"), ("runq_ns", "<u8"), ("is_target", "<u4"), ("is_tracer", "<u4")])
OP_KEY_DTYPE = np.dtype([("pid", "<u4"), ("op", "<u4")])
OFFCPU_KEY_DTYPE = np.dtype(
    [
        ("stack_ref", "<u8"),
        ("tid", "<u4"),
        ("sec", "<u4"),
        ("waker_pid", "<u4"),
        ("state", "u1"),
        ("in_call", "u1"),
        ("waker_irq", "u1"),
        ("_pad", "u1"),
    ]
)
OFFCPU_VAL_DTYPE = np.dtype(
    [("pid", "<u4"), ("waker_tid", "<u4"), ("count", "<u8"), ("blocked_ns", "<u8"), ("waker_comm", "S16")]
)
SAMPLE_KEY_DTYPE = np.dtype(
    [
        ("stack_ref", "<u8"),
        ("tid", "<u4"),
        ("sec", "<u4"),
        ("in_call", "u1"),
        ("kernel", "u1"),
        ("_pad", "<u2"),
        ("_pad2", "<u4"),
    ]
)
SAMPLE_VAL_DTYPE = np.dtype([("pid", "<u4"), ("_pad", "<u4"), ("count", "<u8")])
OP_TOTAL_DTYPE = np.dtype(
    [
        ("calls", "<u8"),
        ("total_ns", "<u8"),
        ("min_ns", "<u8"),
        ("max_ns", "<u8"),
        ("bytes", "<u8"),
        ("first_ns", "<u8"),
        ("last_ns", "<u8"),
    ]
)
COLL_KEY_DTYPE = np.dtype([("pid", "<u4"), ("op", "<u4"), ("comm", "<u8")])
COLL_COUNT_DTYPE = np.dtype([("calls", "<u8"), ("first_ns", "<u8"), ("last_ns", "<u8")])
HIST_KEY_DTYPE = np.dtype([("pid", "<u4"), ("op", "<u2"), ("slot", "<u2")])
COUNT_DTYPE = np.dtype("<u8")

SCHED_REASONS = ("preempted", "sleep", "io")
PROC_KINDS = ("fork", "exec", "exit", "rename", "oom_kill", "thread_end")
# thread_breakdown columns in struct tb_val.v order (TB_* in common.h), and the sched_stats ones derived from it.
TB_COLUMNS: dict[str, int] = {
    "cpu_ns": C.TB_CPU,
    "launch_ns": C.TB_CALL + 0,
    "sync_ns": C.TB_CALL + 1,
    "alloc_ns": C.TB_CALL + 2,
    "free_ns": C.TB_CALL + 3,
    "copy_ns": C.TB_CALL + 4,
    "other_ns": C.TB_CALL + 5,
    "runq_self_ns": C.TB_RUNQ_SELF,
    "runq_tree_ns": C.TB_RUNQ_TREE,
    "runq_other_ns": C.TB_RUNQ_OTHER,
    "runq_tracer_ns": C.TB_RUNQ_TRACER,
    "blocked_ns": C.TB_BLOCKED,
    "io_ns": C.TB_IO,
    "call_off_cpu_ns": C.TB_CALL_OFF,
    "call_runq_ns": C.TB_CALL_RUNQ,
    "faults": C.TB_FAULTS,
    "page_alloc_bytes": C.TB_PAGE_ALLOC,
    "page_cache_bytes": C.TB_PAGE_CACHE,
    "reclaim_ns": C.TB_RECLAIM,
}
# The parts that add up to a thread's accounted time (wall_ns).
TB_PARTS: tuple[str, ...] = (
    "cpu_ns",
    "launch_ns",
    "sync_ns",
    "alloc_ns",
    "free_ns",
    "copy_ns",
    "other_ns",
    "runq_self_ns",
    "runq_tree_ns",
    "runq_other_ns",
    "runq_tracer_ns",
    "blocked_ns",
)


class DecodeError(ValueError):
    """A record had the wrong size: the BPF program and this module disagree on a layout."""


@dataclass
class RawBuffer:
    """Bytes of fixed-size records appended by a ring-buffer callback; drained as one numpy array."""

    dtype: np.dtype
    chunks: list[bytes] = field(default_factory=list)

    def callback(self, _ctx: int, data: int, size: int) -> None:
        # The only per-event Python work: one copy. Everything else is batched in drain().
        self.chunks.append(ct.string_at(data, size))

    def drain(self) -> np.ndarray:
        """Return every record received since the last drain as a structured array."""
        if not self.chunks:
            return np.empty(0, dtype=self.dtype)
        chunks, self.chunks = self.chunks, []
        blob = b"".join(chunks)
        if len(blob) != len(chunks) * self.dtype.itemsize:
            bad = next(len(c) for c in chunks if len(c) != self.dtype.itemsize)
            raise DecodeError(f"ring-buffer record of {bad} bytes, expected {self.dtype.itemsize}")
        return np.frombuffer(blob, dtype=self.dtype)


@dataclass
class TailBuffer(RawBuffer):
    """Records whose last field, an array, is sent only as far as it was filled (a code event's line table:
    probes/pycode.h sends CODE_EVENT_HEAD + lt_len bytes); drained zero-padded to the dtype's size."""

    head: int = 0  # bytes before the array: no record is shorter

    def drain(self) -> np.ndarray:
        if not self.chunks:
            return np.empty(0, dtype=self.dtype)
        chunks, self.chunks = self.chunks, []
        size = self.dtype.itemsize
        bad = next((len(c) for c in chunks if not self.head <= len(c) <= size), None)
        if bad is not None:
            raise DecodeError(f"ring-buffer record of {bad} bytes, expected {self.head} to {size}")
        return np.frombuffer(b"".join(c.ljust(size, b"\0") for c in chunks), dtype=self.dtype)


@dataclass(frozen=True)
class StackRecord:
    stack_ref: int  # the stack's hash
    pid: int
    tid: int
    native_id: int
    frames: tuple[tuple[int, int], ...]  # (code object address, lasti), innermost first


def decode_stack(c: bytes) -> StackRecord:
    """Decode one stack record (header + n_py frames); raise DecodeError if it is shorter than its header."""
    hsize = STACK_HEADER_DTYPE.itemsize
    if len(c) < hsize:
        raise DecodeError(f"stack record of {len(c)} bytes, shorter than its {hsize}-byte header")
    h = np.frombuffer(c, dtype=STACK_HEADER_DTYPE, count=1)[0]
    n = min(int(h["n_py"]), (len(c) - hsize) // PY_FRAME_DTYPE.itemsize)
    fr = np.frombuffer(c, dtype=PY_FRAME_DTYPE, count=n, offset=hsize)
    return StackRecord(
        int(h["stack_ref"]),
        int(h["pid"]),
        int(h["tid"]),
        int(h["native_id"]),
        tuple(zip(fr["code"].tolist(), fr["lasti"].tolist(), strict=True)),
    )


@dataclass(frozen=True)
class UstackRecord:
    """A copy of a user stack: registers at the probe and the bytes from sp upwards."""

    stack_ref: int
    pid: int
    tid: int
    native_id: int
    ip: int
    sp: int
    bp: int
    data: bytes


def decode_ustack(raw: bytes) -> UstackRecord:
    """Decode one ustack_event; raise DecodeError if it is shorter than its header."""
    hsize = USTACK_HEADER_DTYPE.itemsize
    if len(raw) < hsize:
        raise DecodeError(f"ustack record of {len(raw)} bytes, shorter than its {hsize}-byte header")
    h = np.frombuffer(raw, dtype=USTACK_HEADER_DTYPE, count=1)[0]
    n = min(int(h["len"]), len(raw) - hsize)
    return UstackRecord(
        int(h["stack_ref"]),
        int(h["pid"]),
        int(h["tid"]),
        int(h["native_id"]),
        int(h["ip"]),
        int(h["sp"]),
        int(h["bp"]),
        raw[hsize : hsize + n],
    )


def map_names(names: np.ndarray, depth: int) -> list[str]:
    """A map_event's dentry names, outermost first (the event lists the file first)."""
    return [cstr1(n) for n in names[:depth].tolist()][::-1]


CSTR_UNIQUE_FROM = 64  # below this many strings, sorting them costs more than decoding each


def cstr1(b: bytes) -> str:
    """Decode one NUL-padded C string, up to its first NUL: BPF string reads leave stale bytes of a reused scratch
    buffer after it."""
    return bytes(b).split(b"\0", 1)[0].decode(errors="replace")


def cstr(a: np.ndarray) -> list[str]:
    """Decode an array of NUL-padded byte strings (dtype S*) to Python strings, each distinct one once: a batch's
    thousands of scheduler events name a few dozen threads (decoding every one was 3% of the demo's recorder CPU)."""
    if len(a) < CSTR_UNIQUE_FROM:
        return [cstr1(s) for s in a.tolist()]
    uniq, inverse = np.unique(a, return_inverse=True)
    names = np.array([cstr1(s) for s in uniq.tolist()], dtype=object)
    return names[inverse.reshape(-1)].tolist()
