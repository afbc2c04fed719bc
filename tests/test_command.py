"""tracer.recorder.command: a launched command is held before its exec until released, reaped when it exits, and ended
by
the end-of-recording rule (stopped, interrupted or left running), with real child processes."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tracer.recorder.command import EXIT_NOT_RUN, LaunchedCommand


def wait_exit(cmd: LaunchedCommand, timeout: float = 30.0) -> int:
    """Poll reap() until the child has exited; return its wait status (fails after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while (status := cmd.reap()) is None:
        assert time.monotonic() < deadline, "the command did not exit"
        time.sleep(0.01)
    return status


@pytest.fixture
def started():
    """Commands started by a test; any still ours at its end are killed and reaped."""
    cmds: list[LaunchedCommand] = []

    def start(argv: list[str], ignore_term: bool = False) -> LaunchedCommand:
        cmd = LaunchedCommand(argv)
        # An ignored signal stays ignored across fork and exec: set here, the child ignores TERM from its first
        # instruction, with no race against a handler it would install itself. SIGINT is made not ignored, as
        # it is under a terminal (a suite started in the background inherits it ignored).
        old_term = signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_term else signal.SIG_DFL)
        old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            cmd.start()
        finally:
            signal.signal(signal.SIGTERM, old_term)
            signal.signal(signal.SIGINT, old_int)
        cmds.append(cmd)
        return cmd

    yield start
    for cmd in cmds:
        cmd.release()
        if cmd.pid is not None:
            os.kill(cmd.pid, signal.SIGKILL)
            os.waitpid(cmd.pid, 0)


def test_held_before_exec_until_released(started, tmp_path):
    out = tmp_path / "ran"
    cmd = started(["sh", "-c", f"echo ran > {out}"])
    # THEN until released, the child is still this interpreter, blocked before its exec
    assert os.path.realpath(f"/proc/{cmd.pid}/exe") == os.path.realpath(sys.executable)
    assert cmd.reap() is None and cmd.fate is None and not out.exists()
    cmd.release()
    cmd.release()  # idempotent
    status = wait_exit(cmd)
    assert os.waitstatus_to_exitcode(status) == 0 and out.read_text() == "ran\n"
    assert (cmd.fate, cmd.pid, cmd.status) == ("exited", None, status)


def test_a_command_that_cannot_run_exits_127_with_a_message(started, capfd):
    cmd = started(["/nonexistent/dir/prog"])
    cmd.release()
    assert os.waitstatus_to_exitcode(wait_exit(cmd)) == EXIT_NOT_RUN
    assert "error: cannot run /nonexistent/dir/prog" in capfd.readouterr().err


def test_complete_stops_it_with_sigterm(started):
    cmd = started(["sleep", "60"])
    cmd.release()
    pid = cmd.pid
    cmd.end("complete", keep_running=False)
    # THEN it was stopped by the SIGTERM and reaped within the grace period
    assert cmd.fate == "stopped" and cmd.pid is None and pid is not None
    assert os.WIFSIGNALED(cmd.status) and os.WTERMSIG(cmd.status) == signal.SIGTERM


def test_complete_kills_a_command_that_ignores_sigterm(started):
    cmd = started(["sleep", "60"], ignore_term=True)
    cmd.release()
    pid = cmd.pid
    cmd.end("complete", keep_running=False, grace_s=0.3)
    # THEN after the grace period it got SIGKILL (left for the caller to reap)
    assert cmd.fate == "stopped" and pid is not None
    _, status = os.waitpid(pid, 0)
    cmd.pid = None
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.parametrize("status,keep", [("complete", True), ("failed", False)])
def test_left_running_with_keep_running_or_when_the_recorder_failed(started, status, keep):
    cmd = started(["sleep", "60"])
    cmd.end(status, keep_running=keep)  # released by end() itself
    assert cmd.fate == "left running" and cmd.pid is not None
    assert cmd.reap() is None  # still running


def test_interrupted_passes_on_the_sigint(started):
    cmd = started(["sleep", "60"])
    cmd.release()
    cmd.end("interrupted", keep_running=False)
    assert cmd.fate == "interrupted"
    status = wait_exit(cmd)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT


def test_a_command_that_exited_keeps_its_fate(started):
    cmd = started(["true"])
    cmd.release()
    status = wait_exit(cmd)
    cmd.end("complete", keep_running=False)
    cmd.signal(signal.SIGTERM)  # nothing to signal: not an error
    assert (cmd.fate, cmd.status) == ("exited", status) and os.waitstatus_to_exitcode(status) == 0


def test_signals_are_as_a_command_expects(started, tmp_path):
    # GIVEN a recorder-like parent: Python ignores SIGPIPE and SIGXFSZ, and SIGTERM has a Python handler
    out = tmp_path / "status"
    old = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        cmd = started(["sh", "-c", f"grep -E '^Sig(Ign|Cgt)' /proc/$$/status > {out}"])
    finally:
        signal.signal(signal.SIGTERM, old)
    cmd.release()
    assert os.waitstatus_to_exitcode(wait_exit(cmd)) == 0
    masks = dict(line.split(":\t") for line in out.read_text().splitlines())
    ignored = int(masks["SigIgn"], 16)
    # THEN the command does not inherit them ignored (a pipe's reader closing ends it, as under a shell)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM, signal.SIGINT):
        assert not ignored & (1 << (sig - 1)), sig


def test_a_signal_the_shell_ignored_stays_ignored(started, tmp_path):
    out = tmp_path / "status"
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        cmd = started(["sh", "-c", f"grep -E '^SigIgn' /proc/$$/status > {out}"])
    finally:
        signal.signal(signal.SIGHUP, old)
    cmd.release()
    assert os.waitstatus_to_exitcode(wait_exit(cmd)) == 0
    assert int(out.read_text().split(":\t")[1], 16) & (1 << (signal.SIGHUP - 1))
