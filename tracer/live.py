"""MCP while recording (`tracer record --mcp-http HOST:PORT`): the tools answer over what has been flushed so far.

DuckDB lets no other process open a file while one writes it, and a query run inside the recorder could take its
CPU, its memory, or (a hostile run_sql) its writer. So the recorder serves snapshots: when a tool call comes, the
server touches a request file; the recorder's loop sees it within a second and has its store's writer thread
checkpoint the DB, copy it, mark the copy's session ``snapshot`` and rename it into place
(:meth:`tracer.recorder.store.Store.snapshot`). The server, a separate `tracer mcp serve --live` process with every
protection of a normal one (query workers it can kill, limits, Host and token checks), waits up to FRESH_WAIT_S for
that copy and answers from it; session.flushed_ns says how far it goes. The recording never waits on a query: a
snapshot costs the writer thread one file copy, at most once per MIN_INTERVAL_S, and only when asked.

The server never outlives the recorder: started through :mod:`tracer.commands.live_server`, it ends within about
a second of the recorder's death, a `kill -9` included, and removes the snapshots (:func:`tie_to_recorder`). Its
own watch is a thread of a busy Python process, so the recorder's guardian (tracer/recorder/guardian.py) does it
too, from outside: snapshots removed, SIGTERM, SIGKILL a second later.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0  # at most one snapshot a second
FRESH_WAIT_S = 2.0  # a tool call waits this long at most for a snapshot newer than its request
SNAPSHOT = "live.duckdb"
REQUEST = "live.request"
WATCH_S = 0.2  # the server checks this often that its recorder is still its parent
EXIT_S = 1.0  # after its recorder's death, the server's graceful stop may take this long, then it is ended
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# the live server's entry point: a command, since it runs the CLI (this module is shared by both halves)
SERVER_MODULE = "tracer.commands.live_server"


class LiveServer:
    """The recorder's half: the snapshot directory, the server process, and taking snapshots when asked.

    Args:
        listen: ``[HOST]:PORT`` as ``tracer mcp serve --http`` takes it.
        token_file: the bearer token file for a non-loopback address (else TRACER_MCP_TOKEN).
        snapshot: called with the snapshot path (and a callback for when it is in place) to queue one; the
            recorder passes its store's :meth:`~tracer.recorder.store.Store.snapshot`.
    """

    def __init__(self, listen: str, token_file: Path | None, snapshot: Callable[[Path], None]) -> None:
        self.listen = listen
        self.token_file = token_file
        self._snapshot = snapshot
        self.dir = Path(tempfile.mkdtemp(prefix="tracer-live-"))
        self.path = self.dir / SNAPSHOT
        self._request = self.dir / REQUEST
        self._taken = 0.0
        self._last_wall = 0.0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Take the first snapshot (queued; the server waits for it) and start the server process."""
        self.refresh(force=True)
        cmd = [
            sys.executable,
            "-m",
            SERVER_MODULE,  # its main(): `tracer mcp serve ...`, tied to this process (it must not outlive us)
            str(os.getpid()),
            str(self.dir),
            "mcp",
            "serve",
            "--db",
            str(self.path),
            "--http",
            self.listen,
            "--live",
        ]
        if self.token_file is not None:
            cmd += ["--token-file", str(self.token_file)]
        logf = open(self.dir / "server.log", "wb")  # the child keeps it; closed in stop()
        self._log = logf
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)

    def refresh(self, force: bool = False) -> None:
        """Queue a snapshot if the server asked for one since the last (or ``force``), at most once a
        MIN_INTERVAL_S."""
        now = time.monotonic()
        if not force:
            try:
                asked = self._request.stat().st_mtime
            except FileNotFoundError:
                return
            if asked <= self._last_wall or now - self._taken < MIN_INTERVAL_S:
                return
        self._taken = now
        self._last_wall = time.time()
        self._snapshot(self.path)

    def failure(self) -> str | None:
        """Why the server process stopped (the end of its log), or None while it runs."""
        if self.proc is None or self.proc.poll() is None:
            return None
        try:
            tail = (self.dir / "server.log").read_text(errors="replace").strip().splitlines()[-3:]
        except OSError:
            tail = []
        return " / ".join(tail) or f"exit code {self.proc.returncode}"

    def stop(self) -> None:
        """Stop the server and remove the snapshots."""
        if self.proc is not None and self.proc.poll() is None:
            _terminate(self.proc, grace_s=3)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _terminate(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM ``proc``, and SIGKILL it if it has not exited ``grace_s`` later; reap it either way."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def freshen(snapshot: Path) -> Callable[[], None]:
    """The server's half, run before each tool call: ask the recorder for a new snapshot and wait for it (up to
    FRESH_WAIT_S; an older one is used if it does not come)."""
    request = snapshot.with_name(REQUEST)

    def ask() -> None:
        asked = time.time()
        request.touch()
        deadline = time.monotonic() + FRESH_WAIT_S
        while time.monotonic() < deadline:
            try:
                if snapshot.stat().st_mtime >= asked:
                    return
            except FileNotFoundError:
                pass
            time.sleep(0.05)
        log.info("no fresh snapshot within %.1f s; answering from the last one", FRESH_WAIT_S)

    return ask


def wait_for_snapshot(snapshot: Path, timeout_s: float = 30.0) -> bool:
    """True once the first snapshot exists (the server starts before the recorder has written it)."""
    deadline = time.monotonic() + timeout_s
    while not snapshot.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return os.path.getsize(snapshot) > 0


_parent_died = threading.Event()


def tie_to_recorder(recorder: int, snapshots: Path) -> bool:
    """Make this process, the live server, end with ``recorder``, its parent, however that ends (issue 17: a
    server outlived a `kill -9` of its recorder and still answered 30 minutes later). False if it already has.

    The kernel signals us when the parent dies (PR_SET_PDEATHSIG, SIGUSR1: its handler only wakes the watcher,
    so the order below holds whatever wakes it); a thread also polls for the reparenting every WATCH_S, in case
    the signal could not be armed. Then the watcher removes ``snapshots`` (a copy of the recording no one else
    will remove), sends this process SIGTERM (the server stops within a second: :func:`mcp_server.http.serve_http`)
    and ends it EXIT_S later if it has not. Must be called on the main thread, before the server starts.
    """
    signal.signal(signal.SIGUSR1, lambda *_: _parent_died.set())
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG): %s; polling for the recorder instead", os.strerror(ctypes.get_errno()))
    if os.getppid() != recorder:  # it died before the signal was armed
        _remove_snapshots(snapshots)
        return False
    threading.Thread(target=_watch, args=(recorder, snapshots), name="recorder-watch", daemon=True).start()
    return True


def _watch(recorder: int, snapshots: Path) -> None:
    while os.getppid() == recorder:
        # The signal also comes when only the thread that started us ends (the kernel ties it to a thread):
        # the parent pid, not the signal, says whether the recorder is gone.
        _parent_died.wait(WATCH_S)
        _parent_died.clear()
    log.warning("the recorder (pid %d) is gone: stopping the live MCP server", recorder)
    _remove_snapshots(snapshots)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(EXIT_S)
    os._exit(1)  # the query workers wait on a pidfd of this process and exit with it


def _remove_snapshots(snapshots: Path) -> None:
    if snapshots.name.startswith("tracer-live-"):  # only a directory LiveServer made: never what a bad argv names
        shutil.rmtree(snapshots, ignore_errors=True)


# --- the chain watch: tracer_chain_active over the recording in progress -----------------------------------------

CHAINS_MODULE = "tracer.commands.chain_watch"  # the chain watch's process (it imports the analyses; we do not)
CHAINS_SNAPSHOT = "chains.duckdb"
ACTIVE_S = 180.0  # a chain is active while its affected range ended less than this before the data's end


class ChainWatch:
    """The recorder's half of ``tracer_chain_active`` (--metrics): every ``every_s`` at most, and only when new
    calls were stored since the last time, a snapshot of the recording (the live MCP server's kind,
    :meth:`tracer.recorder.store.Store.snapshot`) is handed to a child process, ``python -m
    tracer.commands.chain_watch``, which computes the causal chains over it, as `tracer chains` does, and answers
    the (category, severity) of the HIGH and MEDIUM ones active (:data:`ACTIVE_S`) on one line of JSON.

    Why a child: the recorder never imports the analyses (tests/test_layout.py), and a chain computation (a second
    or more of CPU over a large recording) must neither hold the recorder's GIL while it drains the rings nor take
    the job's CPU: the child runs at nice 19. One computation at a time; a request while one runs waits for the
    next ``every_s``. The child ends with the recorder: at its stdin's EOF, and through
    :func:`tie_to_recorder` if the recorder is killed (the guardian also ends it).

    Args:
        every_s: the least time between two computations.
        snapshot: called with (path, on_done) to queue a snapshot (the recorder's writer thread takes it, then
            calls on_done).
        publish: called on the recorder's thread with the active (category, severity) pairs of each answer.
    """

    def __init__(
        self,
        every_s: float,
        snapshot: Callable[[Path, Callable[[], None]], None],
        publish: Callable[[list[tuple[str, str]]], None],
    ) -> None:
        self.every_s = every_s
        self._snapshot = snapshot
        self._publish = publish
        self.dir = Path(tempfile.mkdtemp(prefix="tracer-live-"))  # the prefix: _remove_snapshots may remove it
        self.path = self.dir / CHAINS_SNAPSHOT
        self.proc: subprocess.Popen[bytes] | None = None
        self._busy = False  # a snapshot queued or a computation running
        self._last = -float("inf")  # monotonic s of the last request
        self._seen = -1  # stored calls at the last request
        self._buf = b""
        self.computed = 0  # answers received
        self.failures = 0  # answers that were an error (logged once)

    def start(self) -> None:
        cmd = [sys.executable, "-m", CHAINS_MODULE, str(os.getpid()), str(self.dir), str(ACTIVE_S)]
        logf = open(self.dir / "chains.log", "wb")  # the child keeps it; closed in stop()
        self._log = logf
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, start_new_session=True
        )
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)

    def tick(self, stored_calls: int, now: float | None = None) -> None:
        """Called by the recorder's tick: read an answer if one came; queue a computation if it is time and new
        calls were stored."""
        now = time.monotonic() if now is None else now
        self._read()
        if self._busy or self.proc is None or self.proc.poll() is not None:
            return
        if now - self._last < self.every_s or stored_calls == self._seen:
            return
        self._busy, self._last, self._seen = True, now, stored_calls
        self._snapshot(self.path, self._hand_over)

    def _hand_over(self) -> None:
        """On the writer thread, once the snapshot is in place: tell the child to compute over it."""
        try:
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write(str(self.path).encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:  # the child is gone: no chains from here on
            log.warning("the chain watch is gone: %s", e)

    def _read(self) -> None:
        if self.proc is None or self.proc.stdout is None:
            return
        try:
            chunk = self.proc.stdout.read()
        except OSError:
            chunk = None
        if chunk:
            self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            self._busy = False
            self._answer(line)

    def _answer(self, line: bytes) -> None:
        import json

        try:
            msg = json.loads(line)
            if "error" in msg:
                raise ValueError(msg["error"])
            active = [(str(c), str(s)) for c, s in msg["active"]]
        except (ValueError, KeyError, TypeError) as e:
            if not self.failures:
                log.warning("the chain watch failed (tracer_chain_active keeps its last values): %s", e)
            self.failures += 1
            return
        self.computed += 1
        self._publish(active)

    def stop(self) -> None:
        """End the child (EOF on its stdin, then SIGTERM, SIGKILL) and remove the snapshot."""
        if self.proc is not None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                _terminate(self.proc, grace_s=2)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
