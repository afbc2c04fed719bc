"""recorder/ringbuf.py: a real BPF ring buffer read straight from its memory. Records come from a uprobe on libc's
``labs`` in this process, so each one carries the argument it was called with and the tests can check order,
content, wrap-around, overflow and the length check."""

from __future__ import annotations

import ctypes as ct
import os
import select
import threading

import numpy as np
import pytest

from tests.support.need import need_module, need_root
from tracer.recorder.events import DecodeError
from tracer.recorder.ringbuf import DirectRing

pytestmark = pytest.mark.bpf

# one page of ring (the smallest): 4096 / 32-byte slots = 128 records, so a few hundred calls wrap it
PROGRAM = r"""
#include <uapi/linux/ptrace.h>
struct rec { u64 arg; u32 tid; u32 pad; u32 tail; };   /* 20 bytes + 8 of header: 32-byte slots */
BPF_RINGBUF_OUTPUT(rb, 1);
BPF_ARRAY(force, u32, 1);
int on_labs(struct pt_regs *ctx)
{
    struct rec r = {.arg = PT_REGS_PARM1(ctx), .tid = (u32)bpf_get_current_pid_tgid(), .tail = 0xabcd};
    u32 k = 0;
    u32 *f = force.lookup(&k);
    rb.ringbuf_output(&r, 20, f && *f ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
    return 0;
}
"""

REC = np.dtype(
    {"names": ["arg", "tid", "tail"], "formats": ["<u8", "<u4", "<u4"], "offsets": [0, 8, 16], "itemsize": 20}
)


@pytest.fixture()
def ring():
    need_root()
    bcc = need_module("bcc")
    b = bcc.BPF(text=PROGRAM)
    b.attach_uprobe(name="c", sym="labs", fn_name="on_labs", pid=os.getpid())
    r = DirectRing(b["rb"], REC)
    yield b, r
    r.close()
    b.cleanup()


def _call(first: int, n: int) -> None:
    labs = ct.CDLL(None).labs
    for i in range(first, first + n):
        labs(i)


def test_records_arrive_in_order_with_their_content_across_many_wraps(ring) -> None:
    _, r = ring
    # GIVEN 25 batches of 50 calls (1250 records through a 128-slot ring), each drained before the next
    got: list[np.ndarray] = []
    for batch in range(25):
        _call(batch * 50, 50)
        got.append(r.drain())
    # THEN every record came back once, in call order, with the argument, tid and tail intact
    ev = np.concatenate(got)
    assert ev["arg"].tolist() == list(range(1250))
    assert set(ev["tid"].tolist()) == {threading.get_native_id()}
    assert (ev["tail"] == 0xABCD).all()
    # AND an empty ring drains to an empty array of the dtype
    empty = r.drain()
    assert len(empty) == 0 and empty.dtype == REC


def test_a_full_ring_keeps_the_first_records_and_the_next_drain_starts_clean(ring) -> None:
    _, r = ring
    # GIVEN 300 calls with no drain: the ring fills and the kernel drops the rest
    _call(0, 300)
    first = r.drain()
    # (the kernel keeps one byte free, so a ring of 128 slots holds 127 records)
    assert first["arg"].tolist() == list(range(127))
    # THEN after the drain the ring takes records again, from the next call on
    _call(1000, 10)
    assert r.drain()["arg"].tolist() == list(range(1000, 1010))


def test_a_record_of_another_size_is_an_error_not_garbage(ring) -> None:
    b, _ = ring
    # GIVEN a reader whose dtype is 4 bytes longer than what the program writes
    wrong = DirectRing(b["rb"], np.dtype({"names": ["arg"], "formats": ["<u8"], "itemsize": 24}))
    try:
        _call(0, 3)
        with pytest.raises(DecodeError, match="20 bytes, expected 24"):
            wrong.drain()
    finally:
        wrong.close()


def test_edge_triggered_poll_wakes_only_on_a_forced_wakeup(ring) -> None:
    b, r = ring
    ep = select.epoll()
    ep.register(r.fileno(), select.EPOLLIN | select.EPOLLET)
    try:
        # GIVEN records submitted with BPF_RB_NO_WAKEUP: the waiter is not woken
        r.drain()
        _call(0, 5)
        assert ep.poll(0.05) == []
        # WHEN one is submitted with BPF_RB_FORCE_WAKEUP, THEN it is
        b["force"][ct.c_int(0)] = ct.c_uint32(1)
        _call(5, 1)
        assert ep.poll(1.0) != []
        assert r.drain()["arg"].tolist() == list(range(6))
    finally:
        ep.close()


def test_discarded_records_are_skipped_and_a_busy_one_ends_the_batch() -> None:
    from tracer.recorder.ringbuf import BUSY, DISCARD, read_records, stride_of

    # GIVEN five records laid out as the kernel does: #1 discarded, #3 still being written (BUSY)
    stride = stride_of(REC)
    buf = bytearray(5 * stride)
    for i in range(5):
        hdr = REC.itemsize | (DISCARD if i == 1 else 0) | (BUSY if i == 3 else 0)
        buf[i * stride : i * stride + 4] = hdr.to_bytes(4, "little")
        rec = np.zeros(1, dtype=REC)
        rec["arg"], rec["tail"] = 100 + i, 0xABCD
        buf[i * stride + 8 : i * stride + 8 + REC.itemsize] = rec.tobytes()
    # WHEN they are read
    ev, used = read_records(bytes(buf), 0, 5, REC)
    # THEN the ones before the busy record are consumed, the discarded one left out; the rest wait
    assert used == 3
    assert ev["arg"].tolist() == [100, 102] and (ev["tail"] == 0xABCD).all()
