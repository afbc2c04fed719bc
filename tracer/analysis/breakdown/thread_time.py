"""One thread's time, second by second: the model the breakdown, the chains and compare share.

A :class:`ThreadTime` holds a thread's parts (:data:`tracer.analysis.taxonomy.PART_NAMES`, which add up to its
``wall``), the extras counted beside them (:data:`EXTRA_NS`) and its memory counts (:data:`COUNTS`), in total and
per second; :class:`ThreadTimes` holds every accounted thread of a recording and the basis they rest on (read by
:func:`tracer.analysis.breakdown.load.load_thread_times`).

The training thread is the thread with the most time issuing and waiting for GPU work (launch + sync), ties
broken by CUDA calls then tid: it is the one whose time a job's step time is made of, and unlike a call count
it is not inflated by cheap calls nor deflated when launch probes are duty-cycled. Each process that issues CUDA
calls has such a *driver* thread; the training thread is the top one. In a distributed job every rank trains: each
rank's own process (``RecordingInfo.rank_pids``) has a training thread too, its driver thread, else (a rank with
no CUDA call) its main thread, and :meth:`ThreadTimes.role_of` calls every one of them ``training``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, overload

import numpy as np

from tracer.analysis.taxonomy import CALL_PART_NAMES, PART_NAMES, RUNQ_PART_NAMES
from tracer.vocabulary import CUDA_THREAD, DRIVER_THREAD, PLAIN_THREAD, TRAINING_THREAD

S = 1_000_000_000
MS = 1_000_000
# every per-second quantity of thread_breakdown kept per thread: the parts (they sum to wall) and the extras
EXTRA_NS: tuple[str, ...] = ("io", "call_off_cpu", "call_runq", "reclaim")
COUNTS: tuple[str, ...] = ("faults", "page_alloc_bytes")
FIELDS: tuple[str, ...] = ("wall", *PART_NAMES, *EXTRA_NS, *COUNTS)

Basis = Literal["exact", "estimated", "none"]


def column_of(name: str) -> str:
    """Return the ``thread_breakdown`` column of quantity ``name`` of :data:`FIELDS` (times are stored in ns)."""
    return name if name in COUNTS else f"{name}_ns"


class SecondRows(Mapping[int, dict[str, int]]):
    """A thread's rows per second, read-only, made into dicts of :data:`FIELDS` only when asked for.

    A fork-heavy recording has 100 K threads of a second or two each; the analyses read the seconds of a few
    (the training thread, the workers): building every row's dict up front was most of loading the recording
    (issue 21). ``secs`` is sorted and unique; ``values[i]`` holds second ``secs[i]``'s quantities in FIELDS order.
    """

    __slots__ = ("_all_secs", "_all_values", "_a", "_b", "_rows", "_index")

    def __init__(self, secs: np.ndarray, values: np.ndarray, a: int = 0, b: int | None = None) -> None:
        # rows [a, b) of arrays shared by every thread: a slice per thread was a third of loading 200 K threads
        self._all_secs = secs
        self._all_values = values
        self._a = a
        self._b = len(secs) if b is None else b
        self._rows: dict[int, dict[str, int]] | None = None
        self._index: dict[int, int] | None = None

    @property
    def _secs(self) -> np.ndarray:
        return self._all_secs[self._a : self._b]

    @property
    def _values(self) -> np.ndarray:
        return self._all_values[self._a : self._b]

    def _all(self) -> dict[int, dict[str, int]]:
        if self._rows is None:
            self._rows = {
                int(sec): dict(zip(FIELDS, row, strict=True))
                for sec, row in zip(self._secs.tolist(), self._values.tolist(), strict=True)
            }
        return self._rows

    def __getitem__(self, sec: int) -> dict[str, int]:
        return self._all()[sec]

    def __contains__(self, sec: object) -> bool:
        if self._rows is not None:
            return sec in self._rows
        if self._index is None:
            self._index = {int(x): i for i, x in enumerate(self._secs.tolist())}
        return sec in self._index

    def __iter__(self) -> Iterator[int]:
        return iter(self._secs.tolist())

    def __len__(self) -> int:
        return self._b - self._a

    def sec_range(self) -> tuple[int, int] | None:
        """Return the first and last second with a row, None when there is none."""
        return (int(self._all_secs[self._a]), int(self._all_secs[self._b - 1])) if self._b > self._a else None


@dataclass
class ThreadTime:
    """One thread's time: totals and per second, in ns (counts for faults/page_alloc_bytes), keyed by FIELDS."""

    pid: int
    tid: int
    comm: str
    first_ns: int
    end_ns: int
    exited: bool
    cuda_calls: int
    total: dict[str, int] = field(default_factory=dict)
    by_sec: Mapping[int, dict[str, int]] = field(default_factory=dict)  # a dict, or SecondRows when loaded exact

    @property
    def wall(self) -> int:
        return self.total.get("wall", 0)

    @property
    def span_ns(self) -> int:
        return max(self.end_ns - self.first_ns, 0)

    def ns(self, *names: str) -> int:
        """Return the sum of the named parts/extras in ns over the whole span."""
        return sum(self.total.get(n, 0) for n in names)

    def share(self, ns: float) -> float:
        """Return ``ns`` as a share of the thread's accounted wall time (0 when it has none)."""
        return ns / self.wall if self.wall > 0 else 0.0

    @property
    def host_ns(self) -> int:
        """Time the thread was doing its own work, on CPU or inside non-waiting calls (not sync, queue, blocked)."""
        return self.ns("cpu", *(p for p in CALL_PART_NAMES if p != "sync"))

    @property
    def runq_ns(self) -> int:
        return self.ns(*RUNQ_PART_NAMES)

    @property
    def gpu_work_key(self) -> tuple[int, int, int]:
        """Sort key of the training-thread rule: launch + sync time, then CUDA calls, then lowest tid."""
        return (self.ns("launch", "sync"), self.cuda_calls, -self.tid)


class LazyThreads(Sequence[ThreadTime]):
    """Every thread of an exact breakdown, made into a :class:`ThreadTime` only when read, each once (the same
    object every time it is asked for).

    A fork-heavy recording has 200 K threads of a second or two each, and an analysis reads a few (the training
    thread, a process's workers, the CUDA threads): building every one was most of `tracer breakdown` (issue 21).
    The threads are columns, in (pid, tid) order: their tids, pids, CUDA calls and totals (FIELDS order), what
    the lookups and sums read; ``make(i)`` builds thread ``i``'s ThreadTime."""

    def __init__(
        self,
        tids: np.ndarray,
        pids: np.ndarray,
        cuda_calls: np.ndarray,
        totals: np.ndarray,
        make: Callable[[int], ThreadTime],
    ) -> None:
        self.tids, self.pids, self.cuda_calls, self.totals = tids, pids, cuda_calls, totals
        self._make = make
        self._made: list[ThreadTime | None] = [None] * len(tids)
        self._by_tid: dict[int, int] | None = None

    def __len__(self) -> int:
        return len(self.tids)

    @overload
    def __getitem__(self, i: int) -> ThreadTime: ...
    @overload
    def __getitem__(self, i: slice) -> list[ThreadTime]: ...
    def __getitem__(self, i: int | slice) -> ThreadTime | list[ThreadTime]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        t = self._made[i]
        if t is None:
            t = self._made[i] = self._make(i)
        return t

    def __iter__(self) -> Iterator[ThreadTime]:
        return (self[i] for i in range(len(self)))

    def index_of(self, tid: int) -> int | None:
        if self._by_tid is None:  # a tid the kernel reused: its first thread, as a scan in (pid, tid) order finds
            tids, first = np.unique(self.tids, return_index=True)
            self._by_tid = dict(zip(tids.tolist(), first.tolist(), strict=True))
        return self._by_tid.get(tid)

    def of_pid(self, pid: int) -> list[ThreadTime]:
        """Process ``pid``'s threads, in tid order (the rows are sorted by pid)."""
        lo, hi = np.searchsorted(self.pids, pid, "left"), np.searchsorted(self.pids, pid, "right")
        return [self[i] for i in range(int(lo), int(hi))]

    def where(self, mask: np.ndarray) -> list[ThreadTime]:
        return [self[i] for i in np.flatnonzero(mask).tolist()]

    def column_sum(self, name: str) -> int:
        return int(self.totals[:, FIELDS.index(name)].sum()) if name in FIELDS else 0


@dataclass
class ThreadTimes:
    """Every accounted thread of a recording (or of one pid), the driver threads and the basis."""

    basis: Basis
    note: str
    threads: Sequence[ThreadTime]  # a list, or LazyThreads when loaded exact
    # each rank's own process in a distributed job (RecordingInfo.rank_pids): each one has a training thread
    rank_pids: frozenset[int] = frozenset()

    def by_tid(self, tid: int) -> ThreadTime | None:
        if isinstance(self.threads, LazyThreads):
            i = self.threads.index_of(tid)
            return None if i is None else self.threads[i]
        return next((t for t in self.threads if t.tid == tid), None)

    def of_pid(self, pid: int | None) -> list[ThreadTime]:
        """Return process ``pid``'s threads (none for None)."""
        if pid is None:
            return []
        if isinstance(self.threads, LazyThreads):
            return self.threads.of_pid(pid)
        return [t for t in self.threads if t.pid == pid]

    def total_ns(self, name: str) -> int:
        """Return quantity ``name`` summed over every thread."""
        if isinstance(self.threads, LazyThreads):
            return self.threads.column_sum(name)
        return sum(t.total.get(name, 0) for t in self.threads)

    @cached_property
    def cuda_threads(self) -> list[ThreadTime]:
        if isinstance(self.threads, LazyThreads):
            return self.threads.where(self.threads.cuda_calls > 0)
        return [t for t in self.threads if t.cuda_calls > 0]

    @cached_property
    def drivers(self) -> list[ThreadTime]:
        """Per process, its CUDA thread with the most launch + sync time; best first (once: the threads are fixed
        when loaded, and every thread's role asks)."""
        best: dict[int, ThreadTime] = {}
        for t in self.cuda_threads:
            if t.pid not in best or t.gpu_work_key > best[t.pid].gpu_work_key:
                best[t.pid] = t
        return sorted(best.values(), key=lambda t: t.gpu_work_key, reverse=True)

    @property
    def training(self) -> ThreadTime | None:
        d = self.drivers
        return d[0] if d else None

    def rank_thread(self, pid: int) -> ThreadTime | None:
        """Return the thread that trains in rank process ``pid``: its driver thread, else its main thread."""
        d = next((x for x in self.drivers if x.pid == pid), None)
        return d if d is not None else self.by_tid(pid)

    @cached_property
    def training_tids(self) -> frozenset[int]:
        """The tids of the threads that train: the training thread and each rank's (:meth:`rank_thread`)."""
        out = {self.drivers[0].tid} if self.drivers else set()
        for pid in self.rank_pids:
            if (t := self.rank_thread(pid)) is not None:
                out.add(t.tid)
        return frozenset(out)

    def role_of(self, t: ThreadTime) -> str:
        """Return what thread ``t`` is (tracer.vocabulary.THREAD_ROLES): a training thread (the training thread,
        or under a launcher any rank's), another process's driver thread, another CUDA thread, or a thread with
        no CUDA call."""
        if t.tid in self.training_tids:
            return TRAINING_THREAD
        if any(d.tid == t.tid for d in self.drivers):
            return DRIVER_THREAD
        return CUDA_THREAD if t.cuda_calls else PLAIN_THREAD

    def pick(self, pid: int | None = None, tid: int | None = None) -> ThreadTime | None:
        """Return the thread a question is about: ``tid``; else ``pid``'s driver thread; else the training
        thread (the tools that follow one thread, steps and waits, ask this)."""
        if tid is not None:
            return self.by_tid(tid)
        if pid is not None:
            return next((d for d in self.drivers if d.pid == pid), None)
        return self.training


def window_shares(t: ThreadTime, start_ns: int, end_ns: int) -> dict[int, float]:
    """Return {sec: the share of the thread's accounted time in that second that lies in [start_ns, end_ns)}: the one
    rule for clipping a thread's seconds to a window (its steps, the ranks' common window). A second is the part of
    it the thread lived in (its first and last second are partial); a second outside its life counts whole."""
    out = {}
    for sec in t.by_sec:
        lo, hi = max(sec * S, t.first_ns), min((sec + 1) * S, t.end_ns)
        if hi <= lo:
            lo, hi = sec * S, (sec + 1) * S
        ov = min(hi, end_ns) - max(lo, start_ns)
        if ov > 0:
            out[sec] = min(ov / (hi - lo), 1.0)
    return out


def zero_row() -> dict[str, int]:
    """Return a row of every quantity of :data:`FIELDS` at 0."""
    return dict.fromkeys(FIELDS, 0)


def add_row(into: dict[str, int], row: dict[str, int]) -> None:
    """Add ``row``'s quantities to ``into`` (None counts as 0)."""
    for k, v in row.items():
        into[k] = into.get(k, 0) + int(v or 0)
