"""tracer/recorder/btf.py: member offsets from a hand-built BTF blob (nested, anonymous, unions, typedefs,
bitfields) and from the running kernel, checked against reality: the fsbase read by a tiny BPF program is
pthread_self()."""

from __future__ import annotations

import ctypes as ct
import os
import struct
import threading
from pathlib import Path

import pytest

from tests.support.need import need, need_root
from tracer.recorder import btf

VMLINUX = Path(btf.VMLINUX_BTF)


class _Builder:
    """Minimal BTF writer: enough kinds to exercise the reader."""

    def __init__(self) -> None:
        self.strs = b"\0"
        self.types = b""
        self.n = 0

    def s(self, name: str) -> int:
        if not name:
            return 0
        off = len(self.strs)
        self.strs += name.encode() + b"\0"
        return off

    def add(self, name: str, kind: int, vlen: int, size_or_type: int, extra: bytes = b"", kflag: int = 0) -> int:
        info = (kflag << 31) | (kind << 24) | vlen
        self.types += struct.pack("<III", self.s(name), info, size_or_type) + extra
        self.n += 1
        return self.n

    def int_(self, name: str, size: int) -> int:
        return self.add(name, btf.KIND_INT, 0, size, struct.pack("<I", size * 8))

    def struct_(
        self, name: str, size: int, members: list[tuple[str, int, int]], union: bool = False, kflag: int = 0
    ) -> int:
        extra = b"".join(struct.pack("<III", self.s(m), t, bits) for m, t, bits in members)
        return self.add(name, btf.KIND_UNION if union else btf.KIND_STRUCT, len(members), size, extra, kflag)

    def blob(self) -> bytes:
        hdr = struct.pack("<HBBIIIII", btf.BTF_MAGIC, 1, 0, 24, 0, len(self.types), len(self.types), len(self.strs))
        return hdr + self.types + self.strs


def _sample() -> btf.Btf:
    b = _Builder()
    i32 = b.int_("int", 4)  # 1
    i64 = b.int_("long", 8)  # 2
    inner = b.struct_("inner", 16, [("x", i32, 0), ("y", i64, 64)])  # 3
    td = b.add("inner_t", btf.KIND_TYPEDEF, 0, inner)  # 4
    cst = b.add("", btf.KIND_CONST, 0, td)  # 5
    anon_s = b.struct_("", 16, [("p", i64, 0), ("q", i64, 64)])  # 6
    anon_u = b.struct_("", 16, [("u1", i32, 0), ("", anon_s, 0)], union=True)  # 7
    b.add("proto", btf.KIND_FUNC_PROTO, 2, i32, struct.pack("<IIII", 0, i32, 0, i64))  # 8 (skipped over)
    bits = b.struct_("bits", 8, [("lo", i32, (3 << 24) | 0), ("hi", i32, (5 << 24) | 3), ("w", i32, 32)], kflag=1)
    b.struct_(
        "outer",
        72,
        [("a", i32, 0), ("", anon_u, 64), ("in", cst, 192), ("bits", bits, 320), ("tail", i64, 384)],
    )
    b.struct_("outer", 0, [])  # a forward-like empty duplicate must not shadow the real one
    return btf.Btf(b.blob())


def test_synthetic_offsets() -> None:
    t = _sample()
    assert t.member_offset("outer", "a") == 0
    assert t.member_offset("outer", "u1") == 8  # member of an anonymous union
    assert t.member_offset("outer", "q") == 16  # anonymous struct inside the anonymous union
    assert t.member_offset("outer", "in.y") == 32  # through const + typedef
    assert t.member_offset("outer", "bits.w") == 44  # bitfield-encoded (kind_flag) offsets
    assert t.member_offset("outer", "tail") == 48
    with pytest.raises(btf.BtfError, match="bitfield"):
        t.member_offset("outer", "bits.hi")
    with pytest.raises(btf.BtfError, match="no member"):
        t.member_offset("outer", "nope")
    with pytest.raises(btf.BtfError, match="not found"):
        t.member_offset("missing", "a")
    with pytest.raises(btf.BtfError, match="magic"):
        btf.Btf(b"\0" * 32)


def _need_btf() -> None:
    need(VMLINUX.exists(), f"the kernel has no BTF ({VMLINUX})")


def test_kernel_offsets() -> None:
    _need_btf()
    k = btf.load()  # its cost (0.12 s here) is part of bench/startup's start-up, not bounded by a test
    fsbase = k.member_offset("task_struct", "thread.fsbase")
    assert fsbase == btf.member_offset("task_struct", "thread.fsbase")
    if os.uname().release.startswith("6.18."):
        assert fsbase == 3128  # the real offset on this kernel; the installed 6.1 headers say 5416
    assert 0 < k.member_offset("task_struct", "exit_code") < fsbase + 4096
    assert k.member_offset("list_head", "prev") == 8


def test_disk_cache(tmp_path, monkeypatch) -> None:
    _need_btf()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    btf.member_offset.cache_clear()
    off = btf.member_offset("task_struct", "thread.fsbase")
    (cache,) = (tmp_path / "cuda-host-tracer").glob("btf-*.json")
    assert '"task_struct:thread.fsbase"' in cache.read_text()
    btf.member_offset.cache_clear()
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/nonexistent")
    assert btf.member_offset("task_struct", "thread.fsbase") == off
    btf.member_offset.cache_clear()


FSBASE_PROG = r"""
#include <uapi/linux/ptrace.h>
#include <linux/sched.h>

/* key: tid (0 = slot count); value: fsbase read at the uprobe, via the BTF offset. */
BPF_HASH(seen, u32, u64, 64);

int on_labs(struct pt_regs *ctx)
{
    if (PT_REGS_PARM1(ctx) != 4242424)
        return 0;
    struct task_struct *task = (struct task_struct *)bpf_get_current_task();
    u64 fs = 0;
    bpf_probe_read_kernel(&fs, sizeof(fs), (void *)((char *)task + FSBASE_OFF));
    u32 tid = bpf_get_current_pid_tgid();
    seen.update(&tid, &fs);
    return 0;
}
"""


@pytest.mark.bpf
def test_fsbase_is_pthread_self() -> None:
    _need_btf()
    need_root("eBPF")
    from bcc import BPF

    b = BPF(
        text=FSBASE_PROG.encode(),
        cflags=[f"-DFSBASE_OFF={btf.member_offset('task_struct', 'thread.fsbase')}"],
    )
    try:
        b.attach_uprobe(name="c", sym="labs", fn_name="on_labs")
        libc = ct.CDLL(None)
        libc.labs.argtypes = [ct.c_long]
        libc.pthread_self.restype = ct.c_ulong
        want: dict[int, int] = {}

        def call() -> None:
            want[threading.get_native_id()] = libc.pthread_self()
            libc.labs(4242424)

        call()
        th = threading.Thread(target=call)
        th.start()
        th.join()
        got = {k.value: v.value for k, v in b["seen"].items()}
        assert got == want and len(want) == 2
    finally:
        b.cleanup()
