"""Ring-buffer records to column batches: numpy dtypes mirroring probes/common.h, decoded in bulk.

The ring-buffer callbacks only copy bytes (:class:`RawBuffer`); decoding happens here, a batch at a time, with no
per-event Python objects for the fixed-size records. tests/test_events.py checks these dtypes against the
layouts bcc derives from the C.
"""

from __future__ import annotations

import ctypes as ct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

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
SCHED_DTYPE = np.dtype(
    [
        ("ts_ns", "<u8"),
        ("dur_ns", "<u8"),
        ("runq_ns", "<u8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("by_pid", "<u4"),
        ("cpu", "<u2"),
        ("reason", "u1"),
        ("in_call", "u1"),
        ("comm", "S16"),
        ("by_comm", "S16"),
    ]
)
PROC_DTYPE = np.dtype(
    [
        ("ts_ns", "<u8"),
        ("kind", "<u4"),
        ("pid", "<u4"),
        ("ppid", "<u4"),
        ("child", "<u4"),
        ("exit_code", "<i4"),
        ("_pad", "<u4"),
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
KNAME_DTYPE = np.dtype([("handle", "<u8"), ("pid", "<u4"), ("_pad", "<u4"), ("name", "S192")])
PY_FRAME_DTYPE = np.dtype([("code", "<u8"), ("lasti", "<u4"), ("_pad", "<u4")])

SCHED_REASONS = ("preempted", "sleep", "io")
PROC_KINDS = ("fork", "exec", "exit", "rename", "oom_kill")


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


@dataclass(frozen=True)
class StackRecord:
    stack_ref: int
    pid: int
    tid: int
    native_id: int
    py_status: int
    frames: tuple[tuple[int, int], ...]  # (code object address, lasti), innermost first


@dataclass
class StackBuffer:
    """Variable-size stack records (header + n Python frames); sampled, so decoded one by one."""

    chunks: list[bytes] = field(default_factory=list)
    # Called with each record as it arrives: the Python frames' code objects must be read while the process
    # lives, and a script's <module> code object is freed the moment the script body returns.
    on_record: Callable[[StackRecord], None] | None = None

    def callback(self, _ctx: int, data: int, size: int) -> None:
        raw = ct.string_at(data, size)
        self.chunks.append(raw)
        if self.on_record is not None:
            self.on_record(decode_stack(raw))

    def drain(self) -> list[StackRecord]:
        """Return the stack records received since the last drain."""
        chunks, self.chunks = self.chunks, []
        return [decode_stack(c) for c in chunks]


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
        int(h["py_status"]),
        tuple(zip(fr["code"].tolist(), fr["lasti"].tolist(), strict=True)),
    )


def cstr1(b: bytes) -> str:
    """Decode one NUL-padded C string, up to its first NUL: BPF string reads leave stale bytes of a reused scratch
    buffer after it."""
    return bytes(b).split(b"\0", 1)[0].decode(errors="replace")


def cstr(a: np.ndarray) -> list[str]:
    """Decode an array of NUL-padded byte strings (dtype S*) to Python strings."""
    return [cstr1(s) for s in a.tolist()]
