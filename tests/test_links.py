"""recorder/links.py: uprobe_multi links with per-offset cookies, a pid filter, and detaching by close. Real BPF on
libc functions of this process."""

from __future__ import annotations

import ctypes as ct
import os

import pytest

from tests.support.need import need_module, need_root
from tracer.recorder.links import UPROBE_MULTI, LinkError, attach_multi, close_together
from tracer.recorder.procmaps import read_maps
from tracer.recorder.targets import exported_offsets

pytestmark = pytest.mark.bpf

PROGRAM = r"""
static __u64 (*cookie)(void *ctx) = (void *)174;
BPF_ARRAY(hits, u64, 4);
int on_call(struct pt_regs *ctx)
{
    u32 k = cookie(ctx) & 3;
    u64 *v = hits.lookup(&k);
    if (v)
        __sync_fetch_and_add(v, 1);
    return 0;
}
"""


@pytest.fixture(scope="module")
def prog():
    need_root()
    bcc = need_module("bcc")
    b = bcc.BPF(text=PROGRAM)
    fd = b.load_func("on_call", bcc.BPF.KPROBE, attach_type=UPROBE_MULTI).fd
    yield b, fd
    b.cleanup()


def _libc() -> tuple[str, dict[str, int]]:
    m = next(m for m in read_maps(os.getpid()) if os.path.basename(m.path).startswith("libc.so"))
    return m.host_path, exported_offsets(m.host_path)


def _hits(b) -> list[int]:
    return [b["hits"][ct.c_int(i)].value for i in range(3)]


def test_cookies_tell_the_functions_apart_and_close_detaches(prog) -> None:
    b, fd = prog
    path, offs = _libc()
    libc = ct.CDLL(None)
    # GIVEN one link over labs (cookie 1) and llabs (cookie 2), filtered on this process
    link = attach_multi(fd, path, [offs["labs"], offs["llabs"]], [1, 2], retprobe=False, pid=os.getpid())
    try:
        for _ in range(5):
            libc.labs(-3)
        for _ in range(7):
            libc.llabs(-3)
        # THEN each call counted under its own cookie
        assert _hits(b)[1:] == [5, 7]
    finally:
        link.close()
    # WHEN closed, nothing more is counted
    libc.labs(1)
    assert _hits(b)[1:] == [5, 7] and link.closed


def test_a_bad_offset_is_a_clear_error(prog) -> None:
    _, fd = prog
    path, _ = _libc()
    with pytest.raises(LinkError, match="uprobe_multi link on"):
        attach_multi(fd, path, [os.path.getsize(path) + 4096], [0], retprobe=False)


def test_close_together_runs_every_closer_and_raises_the_first_error() -> None:
    done: list[int] = []

    def ok(i: int) -> None:
        done.append(i)

    def bad() -> None:
        raise OSError(9, "bad fd")

    close_together([lambda i=i: ok(i) for i in range(5)])
    assert sorted(done) == [0, 1, 2, 3, 4]
    done.clear()
    with pytest.raises(OSError, match="bad fd"):
        close_together([*(lambda i=i: ok(i) for i in range(5)), bad])
    assert sorted(done) == [0, 1, 2, 3, 4]  # the others still ran
