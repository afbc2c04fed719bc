"""A snapshot of every thread of a process tree: kernel state, rank, Python frames and the native pc."""

from __future__ import annotations

from dataclasses import dataclass, field

from tracer.recorder import rankenv
from tracer.recorder.pyruntime import PyRuntimeManager
from tracer.recorder.symbolize import Symbolizer
from tracer.snapshot import kernel
from tracer.snapshot.python import read_threads


@dataclass
class Frame:
    function: str
    file: str
    line: int


@dataclass
class ThreadSnapshot:
    """One thread now. ``frames``: Python frames innermost first (empty: not a Python thread or none running);
    ``native``: the function the thread's system call was made from (symbolised user pc), "" if unknown."""

    pid: int
    tid: int
    name: str
    rank: int | None
    state: str
    syscall: str | None
    wchan: str
    idle_ns: int | None
    native: str
    frames: list[Frame] = field(default_factory=list)
    partial: bool = False
    waits_on: str = ""  # the file its blocking call waits on (kernel.waits_on), "" if none

    def as_json(self) -> dict:
        return dict(pid=self.pid, tid=self.tid, name=self.name, rank=self.rank, state=self.state,
                    syscall=self.syscall, wchan=self.wchan, idle_ns=self.idle_ns, native=self.native,
                    frames=[f.__dict__ for f in self.frames], partial=self.partial,
                    waits_on=self.waits_on)  # fmt: skip


class Dumper:
    """Takes snapshots; keep one to reuse its caches (ELF analyses, code objects, symbols) across snapshots."""

    def __init__(self, runtime: PyRuntimeManager | None = None, symbolizer: Symbolizer | None = None) -> None:
        self.runtime = runtime or PyRuntimeManager(None)
        self.symbolizer = symbolizer or Symbolizer()

    def process(
        self, pid: int, clock: kernel.SchedClock | None = None, only: set[int] | None = None
    ) -> list[ThreadSnapshot]:
        """Every thread of ``pid`` (or those in ``only``); ``clock``: the snapshot's, shared by its processes."""
        if clock is None:
            with kernel.SchedClock() as own:
                return self.process(pid, own, only)
        ident = rankenv.read(pid)
        rank = ident.rank if ident else None
        py = {t.tid: t for t in (read_threads(pid, self.runtime) or [])}
        out = []
        for tid in kernel.tids(pid):
            if only is not None and tid not in only:
                continue
            k = kernel.read_thread(pid, tid, clock)
            if k is None:
                continue
            native = ""
            if k.user_pc:
                try:
                    f = self.symbolizer.symbolize(pid, [k.user_pc], return_addresses=False)[0]
                    native = f"{f.function}+{f.offset:#x} ({f.module})" if f.function else f.module
                except Exception:  # a mapping gone meanwhile: no native frame, never a failed dump
                    native = ""
            p = py.get(tid)
            frames = [Frame(f.qualname, f.filename, f.line) for f in (p.frames if p else []) if f.resolved]
            out.append(ThreadSnapshot(pid, tid, k.comm, rank, k.state, k.syscall, k.wchan, k.idle_ns, native,
                                      frames, bool(p and p.partial),
                                      kernel.waits_on(pid, k.syscall, k.syscall_args)))  # fmt: skip
        return out

    def tree(self, pid: int) -> list[ThreadSnapshot]:
        """Every thread of ``pid`` and of its descendants."""
        out = []
        with kernel.SchedClock() as clock:
            for p in kernel.tree(pid):
                out.extend(self.process(p, clock))
        return out


def snapshot_columns(threads: list[ThreadSnapshot], ts_ns: int, reason: str) -> dict[str, list]:
    """Rows of the ``thread_snapshots`` table (tracer/schema.py) for snapshots read at ``ts_ns`` (session ns)."""
    import json

    return {
        "ts_ns": [ts_ns] * len(threads),
        "reason": [reason] * len(threads),
        "pid": [t.pid for t in threads],
        "tid": [t.tid for t in threads],
        "comm": [t.name for t in threads],
        "rank": [t.rank for t in threads],
        "state": [t.state for t in threads],
        "syscall": [t.syscall for t in threads],
        "wchan": [t.wchan for t in threads],
        "blocked_since_ns": [None if t.idle_ns is None else ts_ns - t.idle_ns for t in threads],
        "native": [t.native for t in threads],
        "frames": [json.dumps([f.__dict__ for f in t.frames]) for t in threads],
        "waits_on": [t.waits_on for t in threads],
    }
