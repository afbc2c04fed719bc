"""The command `tracer record -- CMD` launches: forked held before its exec until the probes are attached, reaped
when it exits, and ended by a rule of its own when the recording ends first.

Held before exec, not stopped: the child blocks reading a pipe, so no signal can leave it stopped, and the probes
see its exec and every call after it. Its fate is what the summary and ``session.command_fate`` report.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Literal

GRACE_S = 5.0  # --duration ends a launched command with SIGTERM, then SIGKILL after this long
EXIT_NOT_RUN = 127  # the child's exit code when the command cannot be executed (as a shell's)

Fate = Literal["exited", "interrupted", "left running", "stopped"]


class LaunchedCommand:
    """One launched command: :meth:`start` forks it held, :meth:`release` lets it exec, :meth:`reap` notices its
    exit, :meth:`end` applies the end-of-recording rule.

    Attributes:
        pid: the child's pid while it is ours to wait for; None before start and once reaped.
        fate: what became of it (None while it runs on its own).
        status: its wait status once reaped.
    """

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.pid: int | None = None
        self.fate: Fate | None = None
        self.status: int | None = None
        self._go_fd: int | None = None

    def start(self) -> int:
        """Fork the command, held before its exec until :meth:`release`; return its pid."""
        r, w = os.pipe()
        # Blocked across the fork: one sent right after it (a Ctrl-C at start-up, or end() at once) would reach the
        # child before Python's after-fork code, which forgets signals already caught; blocked, it waits for the
        # child's default dispositions and then ends it as it would end the command.
        saved = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        pid = os.fork()
        if pid == 0:  # child: wait for the go, then exec
            try:
                _default_signals()
                signal.pthread_sigmask(signal.SIG_SETMASK, saved)
                os.close(w)
                os.read(r, 1)
                os.close(r)
                os.execvp(self.argv[0], self.argv)
            except BaseException as e:
                os.write(2, f"error: cannot run {self.argv[0]}: {e}\n".encode())
            os._exit(EXIT_NOT_RUN)
        signal.pthread_sigmask(signal.SIG_SETMASK, saved)
        os.close(r)
        self._go_fd = w
        self.pid = pid
        return pid

    def release(self) -> None:
        """Let the held child exec (idempotent). Closing the pipe alone would release it too: a recorder that dies
        before this never leaves it waiting."""
        if self._go_fd is not None:
            os.write(self._go_fd, b"g")
            os.close(self._go_fd)
            self._go_fd = None

    def reap(self) -> int | None:
        """Return the child's wait status if it has exited since the last call (its fate is then "exited"), else
        None; never blocks."""
        if self.pid is None:
            return None
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: its status is lost
            pid, status = self.pid, 0
        if pid != self.pid:
            return None
        self.pid, self.status, self.fate = None, status, "exited"
        return status

    def end(self, status: str, keep_running: bool, grace_s: float = GRACE_S) -> None:
        """Apply the rule for a command still running when the recording ends with ``status``: at --duration
        ("complete") it is stopped (SIGTERM, then SIGKILL after ``grace_s``) unless ``keep_running``; on Ctrl-C
        ("interrupted") it gets the SIGINT the terminal would have sent it; when the recorder itself failed (a full
        disk) it is left running: the job is not the one at fault."""
        self.release()
        if self.pid is None:
            return
        if status == "interrupted":
            self.signal(signal.SIGINT)  # the terminal's Ctrl-C reached it too; a kill/TERM of the recorder did not
            self.fate = "interrupted"
        elif keep_running or status != "complete":
            self.fate = "left running"
        else:
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and self.reap() is None:
                time.sleep(0.05)
            if self.pid is not None:
                self.signal(signal.SIGKILL)
            self.fate = "stopped"

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child if it is still ours; a child that is gone already is not an error."""
        try:
            if self.pid is not None:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


def _default_signals() -> None:
    """In the forked child, before its exec: the dispositions a command expects. Python ignores SIGPIPE and
    SIGXFSZ, and an ignored signal stays ignored across exec (``yes | head`` would never end): back to default, as
    subprocess does. A recorder's Python handler of SIGINT or SIGTERM would swallow one sent before the exec (a
    Ctrl-C at start-up): default too. A signal the user's shell ignored stays ignored."""
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    for sig in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)
