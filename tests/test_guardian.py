"""recorder/guardian.py: what the guardian does with the `held` map, against a real BPF map and a real stopped process
(the end-to-end SIGKILL case is tests/integration/test_guardian_bpf.py)."""

from __future__ import annotations

import ctypes as ct
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.need import need_module, need_root
from tracer import procfs
from tracer.recorder import guardian

pytestmark = pytest.mark.bpf


def _state(pid: int) -> str:
    st = procfs.stat(pid)
    return "?" if st is None else st.state


def test_release_continues_every_held_process_and_empties_the_map() -> None:
    need_root()
    bcc = need_module("bcc")
    b = bcc.BPF(text="BPF_HASH(held, u32, u64, 16);\nBPF_ARRAY(cfg, u64, 8);\nint noop(void *ctx) { return 0; }")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        # GIVEN a stopped process in the held map, and holds enabled
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while _state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        b["held"][ct.c_uint32(child.pid)] = ct.c_uint64(123)
        b["cfg"][ct.c_int(3)] = ct.c_uint64(1)
        assert guardian.held_pids(b["held"].map_fd) == [child.pid]
        # WHEN the guardian's steps run on the map fds
        guardian.disable_holds(b["cfg"].map_fd, 3)
        assert guardian.release(b["held"].map_fd) == 1
        # THEN the process runs again, the map is empty and holds are off
        time.sleep(0.1)
        assert _state(child.pid) != "T"
        assert guardian.held_pids(b["held"].map_fd) == []
        assert b["cfg"][ct.c_int(3)].value == 0
    finally:
        child.kill()
        child.wait()
        b.cleanup()


def test_the_guardian_holds_the_fds_it_is_given_until_it_exits() -> None:
    need_root()
    bcc = need_module("bcc")
    b = bcc.BPF(text="BPF_HASH(held, u32, u64, 16);\nBPF_ARRAY(cfg, u64, 8);\nint noop(void *ctx) { return 0; }")
    r, w = os.pipe()
    try:
        # GIVEN a guardian given the write end of a pipe to keep (as it keeps the tracepoints), and the recorder's
        # own copy closed
        g = guardian.spawn(b["held"].map_fd, b["cfg"].map_fd, 3, keep_fds=[w])
        os.close(w)
        w = -1
        os.set_blocking(r, False)
        # THEN the pipe is still open for writing: its reader sees no end of file while the guardian lives
        time.sleep(0.2)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
        # WHEN the recorder ends normally, THEN the guardian exits and with it the last writer
        g.finish()
        assert g.proc.wait(timeout=10) == 0
        assert os.read(r, 1) == b""
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        b.cleanup()
