"""BPF ring buffers of fixed-size records, read straight from their memory into numpy.

bcc consumes a ring buffer by calling a Python function through ctypes for every record (1-2 µs each): at tens of
thousands of call events and off-CPU intervals a second, that per-record Python was the recorder's biggest cost
after the fixes of issue 9. A ring whose records all have one size needs none of it: the kernel maps the ring to
user space (a consumer-position page we write, then a producer-position page and the data, mapped twice in a row,
so a span of records never wraps), and the records between the two positions are one strided numpy view.

Record layout (kernel/bpf/ringbuf.c): an 8-byte header (u32 length with BUSY and DISCARD bits, u32 page offset),
then the data, the whole rounded up to 8 bytes. A record still BUSY (reserved, not submitted) ends the batch: the
ones after it wait for the next drain, in order.

The ring's file descriptor also polls: registered edge-triggered (EPOLLET), it wakes a waiter only when a record is
submitted with BPF_RB_FORCE_WAKEUP (the probes force one when a burst has filled a third of the calls ring), not for
every record.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np

from tracer.recorder.events import DecodeError

BUSY = 1 << 31
DISCARD = 1 << 30
HEADER = 8


def stride_of(dtype: np.dtype) -> int:
    """Bytes one record of ``dtype`` takes in a ring: its header and data, rounded up to 8."""
    return (HEADER + dtype.itemsize + 7) & ~7


def read_records(buf: Any, offset: int, count: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
    """Decode up to ``count`` ring records of ``dtype`` starting at ``offset`` of ``buf``; return the submitted
    ones (a copy; discarded ones left out) and how many records were consumed (those before the first still BUSY).

    Raises:
        DecodeError: a record of another length (the BPF program and the dtype disagree).
    """
    stride = stride_of(dtype)
    # as bytes, one row per record: copying the events out is then one block copy, not a per-field struct copy
    raw = np.frombuffer(buf, dtype=np.uint8, count=count * stride, offset=offset).reshape(count, stride)
    hdr = np.ascontiguousarray(raw[:, :4]).view("<u4").ravel()
    busy = np.nonzero(hdr & BUSY)[0]
    if len(busy):
        count = int(busy[0])
        raw, hdr = raw[:count], hdr[:count]
    lengths = hdr & ~np.uint32(BUSY | DISCARD)
    if np.any(lengths != dtype.itemsize):
        bad = int(lengths[lengths != dtype.itemsize][0])
        raise DecodeError(f"ring-buffer record of {bad} bytes, expected {dtype.itemsize}")
    data = raw[:, HEADER : HEADER + dtype.itemsize]
    kept = (hdr & DISCARD) == 0
    if not kept.all():
        data = data[kept]
    return np.ascontiguousarray(data).view(dtype).reshape(-1), count


class DirectRing:
    """One ring buffer map of records of ``dtype`` (a bcc BPF_RINGBUF_OUTPUT table), drained without callbacks."""

    def __init__(self, table: Any, dtype: np.dtype) -> None:
        self.fd = int(table.map_fd)
        self.size = int(table.max_entries)
        if self.size & (self.size - 1):
            raise ValueError(f"ring buffer size {self.size} is not a power of two")
        page = mmap.PAGESIZE
        self._data_off = page
        self._stride = stride_of(dtype)
        self._cons = mmap.mmap(self.fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._prod = mmap.mmap(self.fd, page + 2 * self.size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self.dtype = dtype

    def fileno(self) -> int:
        return self.fd

    def drain(self) -> np.ndarray:
        """Every record submitted since the last drain, as a structured array of ``dtype`` (a copy).

        Raises:
            DecodeError: a record of another length (the BPF program and the dtype disagree).
        """
        (cons,) = struct.unpack_from("<Q", self._cons, 0)
        (prod,) = struct.unpack_from("<Q", self._prod, 0)
        n = (prod - cons) // self._stride
        if n <= 0:
            return np.empty(0, dtype=self.dtype)
        out, used = read_records(self._prod, self._data_off + (cons & (self.size - 1)), n, self.dtype)
        struct.pack_into("<Q", self._cons, 0, cons + used * self._stride)  # x86-64 TSO: ordered after the reads
        return out

    def close(self) -> None:
        self._cons.close()
        self._prod.close()
