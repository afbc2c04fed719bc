"""The traced process tree and the tracer's own processes: who exists, under which name and role, and their
threads' accounted spans.

Targets come from ``--pid`` (with the descendants alive at attach, from /proc) or the launched command; after
that the tree grows in kernel (lifecycle.bpf.c adds forked children to ``targets``) and this module learns of it
from the lifecycle events (:meth:`ProcessTree.apply`). The tracer's processes (the recorder, its guardian) are
kept with role ``tracer``, so the analyses can tell the observer from the observed.

The tree holds only what may still change: a process that exited (and whose children left the tree) and an
exited thread are *retired* (:meth:`ProcessTree.retire`) once their last events are surely drained, so the
recorder writes their final rows and drops them with every per-process cache (issue 21: a job that forks 100 K
short-lived processes must not keep 100 K records).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tracer import containers
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
    launcher: str | None = None  # it started ranks (rankenv.launchers), noted before those left the tree
    container: str = ""  # its short container id (tracer/containers.py), '' outside one: the metrics' label


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
class Retired:
    """What :meth:`ProcessTree.retire` took out of the tree: rows final from now on."""

    procs: list[ProcInfo] = field(default_factory=list)
    threads: list[ThreadInfo] = field(default_factory=list)


@dataclass
class LifecycleChanges:
    """What one batch of lifecycle events changed, for the parts that keep per-process state elsewhere."""

    forks: list[tuple[int, int]] = field(default_factory=list)  # (parent, child)
    execs: list[int] = field(default_factory=list)
    exec_from: dict[int, str] = field(default_factory=dict)  # exec'd pid -> the command line it replaced
    exits: list[int] = field(default_factory=list)


class ProcessTree:
    """Processes and threads of one recording. Times are ns relative to the session start."""

    def __init__(self, start_mono_ns: int) -> None:
        self.start_mono_ns = start_mono_ns
        self.procs: dict[int, ProcInfo] = {}
        self.threads: dict[int, ThreadInfo] = {}
        # an exited process or thread whose pid/tid came back before it was retired (pids wrap at pid_max, 32768
        # by default): retired at once, by the next retire(), so the new one gets a record of its own
        self._reused = Retired()
        self.retired_targets = 0

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
                container=ident.container if (ident := containers.read(pid)) else "",
            )
        return self.procs[pid]

    def release_exited(self, pid: int) -> None:
        """``pid`` exited and was reused by a process that joins now (the node agent): the exited one's row is
        final, as for a reused pid seen at its fork."""
        old = self.procs.get(pid)
        if old is not None and old.exit_ns is not None:
            self._reused.procs.append(self.procs.pop(pid))

    def add_tracer(self, pid: int, comm: str, cmdline: str = "") -> None:
        """One of the tracer's own processes (the recorder, its guardian)."""
        self.procs[pid] = ProcInfo(
            pid, os.getppid() if pid == os.getpid() else os.getpid(), comm, cmdline, 0, role=ROLE_TRACER
        )

    def targets(self) -> list[ProcInfo]:
        """The targets still in the tree (not retired)."""
        return [p for p in self.procs.values() if p.role == ROLE_TARGET]

    def target_count(self) -> int:
        """Every target of the recording, retired ones included."""
        return self.retired_targets + len(self.targets())

    def note_unseen_exits(self, now_ns: int, alive: Callable[[int], bool]) -> int:
        """Lifecycle events were lost: the targets that are gone with no exit seen exit at ``now_ns`` (so they can
        retire; an exit event still to come corrects the time). Returns how many."""
        gone = [p for p in self.procs.values() if p.role == ROLE_TARGET and p.exit_ns is None and not alive(p.pid)]
        for p in gone:
            p.exit_ns = now_ns
        return len(gone)

    def retire(self, before_ns: int) -> Retired:
        """Take out of the tree the targets that exited before ``before_ns`` and have no child left in it, and
        the threads that ended before it; return them (their rows are final).

        A parent stays while a child is in the tree, so the lookups that walk up from a
        forked worker (kernel names, code objects) still find it. ``before_ns`` must leave time for the process's
        last events (calls, stacks, per-second aggregates) to be drained: what uses its caches comes before.
        """
        out, self._reused = self._reused, Retired()
        # the launcher mark of a parent whose ranks leave now: process_columns sees only the rows it is given
        for pid, kind in rankenv.launchers(self.procs.values()).items():
            if self.procs[pid].role == ROLE_TARGET:
                self.procs[pid].launcher = kind
        parents = {p.ppid for p in self.procs.values()}
        for p in list(self.procs.values()):
            if p.role == ROLE_TARGET and p.exit_ns is not None and p.exit_ns < before_ns and p.pid not in parents:
                out.procs.append(self.procs.pop(p.pid))
        for t in list(self.threads.values()):
            if t.exited and t.end_ns is not None and t.end_ns < before_ns:
                out.threads.append(self.threads.pop(t.tid))
        self.retired_targets += sum(p.role == ROLE_TARGET for p in out.procs)
        return out

    def alive(self) -> list[int]:
        """Targets not known to have exited."""
        return [p.pid for p in self.targets() if p.exit_ns is None]

    def apply(self, ev: np.ndarray) -> LifecycleChanges:
        """Apply a batch of lifecycle events (events.PROC_DTYPE); return what changed."""
        ch = LifecycleChanges()
        exec_files: dict[int, str] = {}  # pid -> the file it exec'd last in this batch
        for e in ev:
            kind, pid = int(e["kind"]), int(e["pid"])
            ts = int(e["ts_ns"]) - self.start_mono_ns
            comm = events.cstr1(e["comm"])
            if kind == events.C.PROC_FORK:
                parent = self.procs.get(int(e["ppid"]))
                cmd = targets.proc_cmdline(pid) or (parent.cmdline if parent else "")
                # a fork has its parent's environment: its rank too, with no read (an exec that follows re-reads)
                dist = parent.dist if parent else None
                old = self.procs.get(pid)
                if old is not None and old.exit_ns is not None:  # a reused pid: the exited one's row is final
                    self._reused.procs.append(self.procs.pop(pid))
                # and its cgroup: a container's processes stay in it
                box = parent.container if parent else ""
                self.procs.setdefault(pid, ProcInfo(pid, int(e["ppid"]), comm, cmd, ts, dist=dist, container=box))
                ch.forks.append((int(e["ppid"]), pid))
            elif kind == events.C.PROC_THREAD_END:
                tid = int(e["tid"])
                first = max(0, int(e["aux"]) - self.start_mono_ns)
                old_t = self.threads.get(tid)
                if old_t is not None and old_t.exited:  # a reused tid: that thread's span is not this one's
                    self._reused.threads.append(self.threads.pop(tid))
                t = self.threads.setdefault(tid, ThreadInfo(pid, tid, comm, first))
                t.first_ns, t.end_ns, t.exited, t.comm = min(t.first_ns, first), ts, True, comm or t.comm
            elif pid in self.procs:
                p = self.procs[pid]
                if kind == events.C.PROC_EXEC:
                    # what ran before this image: a launcher (taskset, numactl) that set up the new one. Execs come
                    # in batches, read after they all happened: /proc already shows the last image
                    ch.exec_from[pid] = exec_files.get(pid) or p.cmdline
                    exec_files[pid] = events.cstr1(e["filename"])
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
