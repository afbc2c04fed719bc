"""recorder/guardian.py: what the guardian does with the `held` map, against a real BPF map and a real stopped process
(the end-to-end SIGKILL case is tests/integration/test_guardian_bpf.py)."""

from __future__ import annotations

import ctypes as ct
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def _server(ignore_term: bool) -> subprocess.Popen:
    """A stand-in live server: sleeps; ``ignore_term`` makes it ignore SIGTERM, as a server stuck in a call would."""
    code = "import signal, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('ready', flush=True)\ntime.sleep(60)\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


def test_the_recorders_death_ends_its_live_servers_and_removes_their_snapshots(tmp_path) -> None:
    need_root()
    bcc = need_module("bcc")
    b = bcc.BPF(text="BPF_HASH(held, u32, u64, 16);\nBPF_ARRAY(cfg, u64, 8);\nint noop(void *ctx) { return 0; }")
    stuck, polite = _server(ignore_term=True), _server(ignore_term=False)
    dirs = [tmp_path / "tracer-live-a", tmp_path / "tracer-live-b", tmp_path / "not-ours"]
    for d in dirs:
        d.mkdir()
        (d / "snapshot.duckdb").write_bytes(b"x" * 1000)
    try:
        # GIVEN a guardian told of two live servers: one that ignores SIGTERM, one that stops on it
        g = guardian.spawn(b["held"].map_fd, b["cfg"].map_fd, 3)
        g.also_end(stuck.pid, dirs[0])
        g.also_end(polite.pid, dirs[1])
        g.also_end(2**22 + 1, dirs[2])  # no such process, and a directory the recorder never made
        # WHEN the recorder dies: its end of the pipe closes without a goodbye
        os.close(g.pipe_w)
        g.pipe_w = -1
        t = time.monotonic()
        # THEN the polite server stops on SIGTERM at once, and both snapshot directories are gone
        assert polite.wait(timeout=5) == -signal.SIGTERM
        assert not dirs[0].exists() and not dirs[1].exists()
        # AND the stuck one is killed SERVER_EXIT_S later, whatever it does with SIGTERM
        assert stuck.wait(timeout=5) == -signal.SIGKILL
        assert guardian.SERVER_EXIT_S <= time.monotonic() - t < guardian.SERVER_EXIT_S + 2
        # AND a directory not named as the recorder names its snapshots is never removed
        assert dirs[2].exists()
        assert g.proc.wait(timeout=10) == 0
    finally:
        for p in (stuck, polite):
            p.kill()
            p.wait()
        b.cleanup()


def test_a_recorder_that_ends_normally_leaves_its_server_to_itself(tmp_path) -> None:
    need_root()
    bcc = need_module("bcc")
    b = bcc.BPF(text="BPF_HASH(held, u32, u64, 16);\nBPF_ARRAY(cfg, u64, 8);\nint noop(void *ctx) { return 0; }")
    server = _server(ignore_term=False)
    snapshots = tmp_path / "tracer-live-c"
    snapshots.mkdir()
    try:
        # GIVEN a guardian told of a live server; WHEN the recorder says goodbye (it stops the server itself)
        g = guardian.spawn(b["held"].map_fd, b["cfg"].map_fd, 3)
        g.also_end(server.pid, snapshots)
        g.finish()
        assert g.proc.wait(timeout=10) == 0
        # THEN the guardian touched neither
        assert server.poll() is None and snapshots.exists()
    finally:
        server.kill()
        server.wait()
        b.cleanup()


def test_messages_are_read_across_chunks() -> None:
    # GIVEN the recorder's lines cut anywhere by the pipe
    m = guardian.Messages()
    for chunk in (b"live 12 3", b"4 /tmp/tracer-live-x y\nli", b"ve bad 1 /d\n", b"x", b"\n"):
        m.feed(chunk)
    # THEN each whole line counts once, a path with a space included, a malformed one not at all
    assert m.servers == [(12, 34, Path("/tmp/tracer-live-x y"))] and m.goodbye
