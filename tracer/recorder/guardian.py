"""The guardian: a small process that outlives the recorder and makes sure no traced process stays stopped.

The probes stop a target (SIGSTOP) when it opens a CUDA library the tracer has not attached to, and the recorder
continues it once attached. If the recorder dies between the two (SIGKILL, OOM kill, a crash), the target would
stay stopped forever: a multi-day training run hung by its observer. So the recorder starts this process first,
passing it only the BPF maps it needs (``held``: which processes the probes stopped; ``cfg``: the switch that
enables stopping) and the read end of a pipe. The recorder writes one byte when it ends normally; if the pipe
closes without it, the recorder died: the guardian turns stopping off, then continues every held process, again
and again for ``SWEEP_S`` (a hold may race the death), and exits. It ignores the signals a terminal sends (it runs
in its own session).

It also holds the recorder's tracepoints (their perf event fds), and does nothing with them: a tracepoint's detach
waits for RCU grace periods under a kernel-wide mutex, one tracepoint after the other (0.8 s for the 20), and the
last holder of the fds pays it when it exits. Held here, that wait is the guardian's, after the recorder has
returned the terminal, instead of the recorder's. By then stopping is off and the recorder has emptied its target
list (or died), so the programs still attached do no more than a lookup that fails.

It also ends the live MCP server (``record --mcp-http``), which must not outlive the recorder either. The server
watches its parent itself (tracer/live.py), but that watch is a thread of a Python process that also serves
queries: under load it was seen still answering 5 s after a `kill -9` of the recorder. The recorder writes the
server's pid, start time and snapshot directory into the pipe; on the recorder's death the guardian removes the
snapshots, sends the server SIGTERM, and SIGKILL SERVER_EXIT_S later if it still runs (the same process: its start
time is checked, as a pid may be reused).

It is run as ``python -m tracer.recorder.guardian HELD_FD CFG_FD GATE_INDEX PIPE_FD`` (GATE_INDEX: CFG_LIBGATE of
probes/common.h, passed by the recorder so this process imports nothing else) and uses raw bpf(2) calls, not
bcc: a process exec'd fresh, with a few MB of memory and no threads, cannot be hung by a lock the recorder held
when it died.
"""

from __future__ import annotations

import ctypes as ct
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tracer import procfs  # standard library only: the guardian imports nothing that could hold a lock

SWEEP_S = 2.0  # keep continuing held processes this long after the recorder's death
SWEEP_EVERY_S = 0.05
SERVER_EXIT_S = 1.0  # a live server's graceful stop after SIGTERM may take this long, then it is killed
GOODBYE = b"x"  # the recorder's last message when it ends normally
SNAPSHOT_PREFIX = "tracer-live-"  # only a directory the recorder made is ever removed (tracer/live.py)
_NR_BPF = {"x86_64": 321, "aarch64": 280}
_LOOKUP, _UPDATE, _DELETE, _NEXT_KEY = 1, 2, 3, 4


def _bpf(cmd: int, fd: int, key: ct.Array | None, val: ct.Array | None, flags: int = 0) -> int:
    libc = ct.CDLL(None, use_errno=True)
    libc.syscall.restype = ct.c_long
    attr = ct.create_string_buffer(32)
    struct.pack_into(
        "<IIQQQ",
        attr,
        0,
        fd,
        0,
        ct.addressof(key) if key is not None else 0,
        ct.addressof(val) if val is not None else 0,
        flags,
    )
    return int(libc.syscall(_NR_BPF[os.uname().machine], cmd, attr, 32))


def held_pids(held_fd: int) -> list[int]:
    """The tgids in the ``held`` map (key u32)."""
    out = []
    key, nxt = ct.create_string_buffer(4), ct.create_string_buffer(4)
    first = True
    while _bpf(_NEXT_KEY, held_fd, None if first else key, nxt) == 0:
        (pid,) = struct.unpack("<I", nxt.raw)
        out.append(pid)
        ct.memmove(key, nxt, 4)
        first = False
    return out


def release(held_fd: int) -> int:
    """SIGCONT every held process and forget it; return how many were continued."""
    n = 0
    for pid in held_pids(held_fd):
        try:
            os.kill(pid, signal.SIGCONT)
            n += 1
        except ProcessLookupError:
            pass
        _bpf(_DELETE, held_fd, ct.create_string_buffer(struct.pack("<I", pid), 4), None)
    return n


def disable_holds(cfg_fd: int, gate_index: int) -> None:
    """Set cfg[gate_index] = 0: the probes (if still attached) stop nobody from now on."""
    key = ct.create_string_buffer(struct.pack("<I", gate_index), 4)
    val = ct.create_string_buffer(struct.pack("<Q", 0), 8)
    _bpf(_UPDATE, cfg_fd, key, val)


@dataclass
class Messages:
    """What the recorder said through the pipe: goodbye (it ended normally) and the live servers to end."""

    goodbye: bool = False
    servers: list[tuple[int, int, Path]] = field(default_factory=list)  # (pid, start ticks, snapshot directory)
    _rest: bytes = b""

    def feed(self, chunk: bytes) -> None:
        """Take bytes read from the pipe: lines ``x`` (goodbye) and ``live PID START_TICKS DIR``."""
        *lines, self._rest = (self._rest + chunk).split(b"\n")
        for line in lines:
            word = line.split(b" ", 3)
            if line == GOODBYE:
                self.goodbye = True
            elif word[0] == b"live" and len(word) == 4 and word[1].isdigit() and word[2].isdigit():
                self.servers.append((int(word[1]), int(word[2]), Path(os.fsdecode(word[3]))))


def read_until_closed(pipe_fd: int) -> Messages:
    """Read the pipe until the recorder closes it: by ending (after a goodbye) or by dying (without one)."""
    got = Messages()
    while True:
        try:
            chunk = os.read(pipe_fd, 4096)
        except InterruptedError:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            return got
        got.feed(chunk)


def _same(pid: int, ticks: int) -> bool:
    """True while ``pid`` is still the process that started at ``ticks`` (not a zombie, not a reused pid)."""
    return procfs.process_start_ticks(pid) == ticks


def stop_servers(servers: list[tuple[int, int, Path]]) -> list[tuple[int, int]]:
    """Remove each live server's snapshots and send it SIGTERM; return the (pid, ticks) sent it."""
    sent = []
    for pid, ticks, snapshots in servers:
        if snapshots.name.startswith(SNAPSHOT_PREFIX):
            shutil.rmtree(snapshots, ignore_errors=True)
        if _same(pid, ticks):
            try:
                os.kill(pid, signal.SIGTERM)
                sent.append((pid, ticks))
            except ProcessLookupError:
                pass
    return sent


def kill_servers(sent: list[tuple[int, int]]) -> None:
    """SIGKILL the servers that did not stop on SIGTERM."""
    for pid, ticks in sent:
        if _same(pid, ticks):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(argv: list[str]) -> int:
    held_fd, cfg_fd, gate_index, pipe_fd = (int(a) for a in argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    said = read_until_closed(pipe_fd)  # blocks until the recorder says goodbye or dies
    if said.goodbye:
        release(held_fd)  # normal end: the recorder released everything; this is a last check
        return 0
    disable_holds(cfg_fd, gate_index)
    release(held_fd)  # first: a stopped job is the worst thing the recorder's death can leave
    sent = stop_servers(said.servers)
    now = time.monotonic()
    deadline, kill_at = now + SWEEP_S, now + SERVER_EXIT_S
    while time.monotonic() < deadline:
        release(held_fd)
        if sent and time.monotonic() >= kill_at:
            kill_servers(sent)
            sent = []
        time.sleep(SWEEP_EVERY_S)
    kill_servers(sent)
    return 0


@dataclass
class Guardian:
    """The recorder's handle on its guardian."""

    proc: subprocess.Popen[bytes]
    pipe_w: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    def also_end(self, pid: int, snapshots: Path) -> None:
        """Have the guardian end live server ``pid`` and remove its ``snapshots`` if the recorder dies."""
        ticks = procfs.process_start_ticks(pid)
        if self.pipe_w >= 0 and ticks is not None:
            try:
                os.write(self.pipe_w, b"live %d %d %s\n" % (pid, ticks, os.fsencode(snapshots)))
            except OSError:
                pass

    def finish(self) -> None:
        """The recorder ends normally: the guardian makes a last check and exits."""
        if self.pipe_w >= 0:
            try:
                os.write(self.pipe_w, GOODBYE + b"\n")
            except OSError:
                pass
            os.close(self.pipe_w)
            self.pipe_w = -1


def spawn(held_fd: int, cfg_fd: int, gate_index: int, keep_fds: Sequence[int] = ()) -> Guardian:
    """Start the guardian with the two map fds; it runs until :meth:`Guardian.finish` or the recorder's death.

    ``keep_fds``: fds it only holds until it exits (the tracepoints: their detach is then its wait, see above).
    """
    r, w = os.pipe()
    os.set_inheritable(w, False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracer.recorder.guardian", str(held_fd), str(cfg_fd), str(gate_index), str(r)],
        pass_fds=(held_fd, cfg_fd, r, *keep_fds),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C in the terminal must not reach it before the recorder has finished
        cwd="/",
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))},
    )
    os.close(r)
    return Guardian(proc, w)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
