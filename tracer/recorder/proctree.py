"""The traced process tree and the tracer's own processes: who exists, under which name and role, and their
threads' accounted spans.

Targets come from ``--pid`` (with the descendants alive at attach, from /proc) or the launched command; after
that the tree grows in kernel (lifecycle.bpf.c adds forked children to ``targets``) and this module learns of it
from the lifecycle events (:meth:`ProcessTree.apply`). The tracer's processes (the recorder, its guardian) are
kept with role ``tracer``, so the analyses can tell the observer from the observed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from tracer.recorder import events, rankenv, targets
from tracer.recorder.rankenv import RankIdentity
from tracer.vocabulary import TARGET_ROLE as ROLE_TARGET
from tracer.vocabulary import TRACER_ROLE as ROLE_TRACER


@dataclass
class ProcInfo:
    pid: int
    ppid: int
    comm: str
    cmdline: str
    first_ns: int
    exit_ns: int | None = None
    exit_code: int | None = None
    role: str = ROLE_TARGET
    dist: RankIdentity | None = None  # its rank in a distributed job, from its environment (rankenv)


@dataclass
class ThreadInfo:
    """A target thread's accounted span (accounting.h): [first_ns, end_ns], both relative to the session."""

    pid: int
    tid: int
    comm: str
    first_ns: int
    end_ns: int | None = None
    exited: bool = False


@dataclass
class LifecycleChanges:
    """What one batch of lifecycle events changed, for the parts that keep per-process state elsewhere."""

    forks: list[tuple[int, int]] = field(default_factory=list)  # (parent, child)
    execs: list[int] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)


class ProcessTree:
    """Processes and threads of one recording. Times are ns relative to the session start."""

    def __init__(self, start_mono_ns: int) -> None:
        self.start_mono_ns = start_mono_ns
        self.procs: dict[int, ProcInfo] = {}
        self.threads: dict[int, ThreadInfo] = {}

    def add_target(self, pid: int, ppid: int | None = None, first_ns: int = 0) -> ProcInfo:
        """A process joins the tree (at attach, or found late); returns its record."""
        if pid not in self.procs:
            st = targets.proc_stat(pid)
            self.procs[pid] = ProcInfo(
                pid,
                ppid if ppid is not None else (st[1] if st else 0),
                st[0] if st else "",
                targets.proc_cmdline(pid),
                first_ns,
                dist=rankenv.read(pid),
            )
        return self.procs[pid]

    def add_tracer(self, pid: int, comm: str, cmdline: str = "") -> None:
        """One of the tracer's own processes (the recorder, its guardian)."""
        self.procs[pid] = ProcInfo(
            pid, os.getppid() if pid == os.getpid() else os.getpid(), comm, cmdline, 0, role=ROLE_TRACER
        )

    def targets(self) -> list[ProcInfo]:
        return [p for p in self.procs.values() if p.role == ROLE_TARGET]

    def alive(self) -> list[int]:
        """Targets not known to have exited."""
        return [p.pid for p in self.targets() if p.exit_ns is None]

    def ancestors(self, pid: int) -> list[int]:
        """``pid``, its parent, and so on up the traced tree."""
        out, seen = [], set()
        p: int | None = pid
        while p is not None and p in self.procs and p not in seen:
            seen.add(p)
            out.append(p)
            p = self.procs[p].ppid
        return out

    def apply(self, ev: np.ndarray) -> LifecycleChanges:
        """Apply a batch of lifecycle events (events.PROC_DTYPE); return what changed."""
        ch = LifecycleChanges()
        for e in ev:
            kind, pid = int(e["kind"]), int(e["pid"])
            ts = int(e["ts_ns"]) - self.start_mono_ns
            comm = events.cstr1(e["comm"])
            if kind == events.C.PROC_FORK:
                parent = self.procs.get(int(e["ppid"]))
                cmd = targets.proc_cmdline(pid) or (parent.cmdline if parent else "")
                # a fork has its parent's environment: its rank too, with no read (an exec that follows re-reads)
                dist = parent.dist if parent else None
                self.procs.setdefault(pid, ProcInfo(pid, int(e["ppid"]), comm, cmd, ts, dist=dist))
                ch.forks.append((int(e["ppid"]), pid))
            elif kind == events.C.PROC_THREAD_END:
                tid = int(e["tid"])
                first = max(0, int(e["aux"]) - self.start_mono_ns)
                t = self.threads.setdefault(tid, ThreadInfo(pid, tid, comm, first))
                t.first_ns, t.end_ns, t.exited, t.comm = min(t.first_ns, first), ts, True, comm or t.comm
            elif pid in self.procs:
                p = self.procs[pid]
                if kind == events.C.PROC_EXEC:
                    p.comm = comm
                    p.cmdline = targets.proc_cmdline(pid) or events.cstr1(e["filename"])
                    # the exec has happened (this event is read after it): environ holds what the launcher set
                    p.dist = rankenv.read(pid)
                    ch.execs.append(pid)
                elif kind == events.C.PROC_EXIT:
                    p.exit_ns = ts
                    p.exit_code = int(e["exit_code"]) if int(e["exit_code"]) >= 0 else p.exit_code
                    ch.exits.append(pid)
                elif kind == events.C.PROC_RENAME:
                    p.comm = comm
        return ch

    def note_live_thread(self, pid: int, tid: int, first_ns: int, end_ns: int) -> None:
        """A thread still alive at the end: its span ends with the recording."""
        comm = ""
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            pass
        t = self.threads.setdefault(tid, ThreadInfo(pid, tid, comm, first_ns))
        if not t.exited:
            t.end_ns = end_ns
            t.comm = t.comm or comm
