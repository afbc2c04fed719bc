"""Where a thread's time went outside the moments a CUDA call was made: blocked time by the stack it blocked in
(``offcpu_stacks``), CPU time by the stacks it was sampled in (``cpu_samples``), each stack classified and
named by its Python line.

A blocked stack is classified by the native code it waits in (innermost frames after its innermost Python
frame), in this order:

- ``cuda``: inside a CUDA call (the call's own part of the breakdown);
- ``gil``: CPython taking its interpreter lock: ``take_gil`` / ``PyCOND_TIMEDWAIT`` / ``_PyMutex`` paths by name, or,
  where the interpreter is stripped of its static symbols (Debian's is), a condition-variable wait
  (``pthread_cond_*wait``) called straight from the interpreter's own code: in CPython 3.10-3.14 only the GIL
  waits on a condition variable from there (its locks wait on semaphores);
- ``lock``: a ``threading.Lock`` / queue / semaphore wait (``PyThread_acquire_lock*``, ``sem_*wait``,
  ``_PySemaphore_Wait``);
- ``io``: uninterruptible (D: disk I/O, page-cache writeback) or a file sync (``fsync``, ``fdatasync``, ...);
- ``sleep``: ``time.sleep`` and timed waits with nothing to wait for;
- ``other``: anything else (a pipe or socket read: a DataLoader's queue).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import duckdb

from tracer.analysis.code_site import Frame, short_site, site_of

GIL_FUNCTIONS = frozenset(
    {"take_gil", "PyCOND_TIMEDWAIT", "PyCOND_WAIT", "_PyEval_AcquireLock", "_PyMutex_LockTimed", "_PyMutex_LockSlow"}
)
COND_WAITS = frozenset({"pthread_cond_timedwait", "pthread_cond_wait", "pthread_cond_clockwait", "__pthread_cond_wait"})
LOCK_FUNCTIONS = frozenset(
    {
        "PyThread_acquire_lock_timed",
        "PyThread_acquire_lock",
        "_PySemaphore_Wait",
        "_PyParkingLot_Park",
        "sem_clockwait",
        "sem_timedwait",
        "sem_wait",
        "__new_sem_wait_slow64",
        "__new_sem_wait_slow",
    }
)
SYNC_FUNCTIONS = frozenset({"fsync", "fdatasync", "sync_file_range", "msync", "syncfs", "sync"})
SLEEP_FUNCTIONS = frozenset({"clock_nanosleep", "nanosleep", "__nanosleep", "usleep", "sleep"})


def is_interpreter(module: str | None) -> bool:
    """True for CPython's own code: the python3.x executable or libpython3.x."""
    m = (module or "").rsplit("/", 1)[-1]
    return m.startswith("python3") or m.startswith("libpython3")


def innermost_native(frames: list[Frame]) -> list[Frame]:
    """The native frames inside the innermost Python frame, innermost first (the whole stack without Python)."""
    out: list[Frame] = []
    for f in reversed(frames):
        if f[0] == "python":
            break
        if f[0] == "native":
            out.append(f)
    return out


def blocked_kind(frames: list[Frame], state: str, in_call: bool) -> str:
    """Classify where a thread blocked (see the module docstring)."""
    if in_call:
        return "cuda"
    natives = innermost_native(frames)
    names = [f[2] or "" for f in natives]
    if any(n in GIL_FUNCTIONS for n in names):
        return "gil"
    for i, n in enumerate(names):
        if n in COND_WAITS:
            caller = next((f for f in natives[i + 1 :] if f[2] not in COND_WAITS), None)
            if caller is not None and is_interpreter(caller[1]) and not any(m in LOCK_FUNCTIONS for m in names):
                return "gil"
            break
    if any(n in LOCK_FUNCTIONS for n in names):
        return "lock"
    if state == "D" or any(n in SYNC_FUNCTIONS for n in names):
        return "io"
    if any(n in SLEEP_FUNCTIONS for n in names):
        return "sleep"
    return "other"


def syscall_of(frames: list[Frame]) -> str | None:
    """The innermost named native function (the libc call the thread waits in), if any."""
    return next((f[2] for f in innermost_native(frames) if f[2] and f[2] != "?" and not f[2].startswith("0x")), None)


def load_frames(conn: duckdb.DuckDBPyConnection, stack_ids: Iterable[int]) -> dict[int, list[Frame]]:
    """Return stack_id -> its frames, outermost first."""
    ids = sorted({int(s) for s in stack_ids if s is not None})
    out: dict[int, list[Frame]] = {s: [] for s in ids}
    if not ids:
        return out
    for sid, kind, module, function, file, line in conn.execute(
        "SELECT stack_id, kind, module, function, file, line FROM stacks SEMI JOIN (SELECT unnest($ids) AS i) "
        "ON stack_id = i ORDER BY stack_id, depth",
        {"ids": ids},
    ).fetchall():
        out[sid].append((kind, module, function, file, line))
    return out


@dataclass
class StackTime:
    """Time of one thread in one stack: blocked (with its state and wakers) or on CPU."""

    stack_id: int | None
    ns: float = 0.0
    intervals: float = 0.0
    state: str = ""
    in_call: bool = False
    kind: str = "other"
    frames: list[Frame] = field(default_factory=list)
    wakers: dict[str, float] = field(default_factory=dict)  # waker name -> ns

    @property
    def site(self) -> str | None:
        return site_of(self.frames)


Weight = Callable[[int], float]


def _all(_sec: int) -> float:
    return 1.0


def blocked_stacks(
    conn: duckdb.DuckDBPyConnection, tid: int, weight: Weight = _all, frames: dict[int, list[Frame]] | None = None
) -> list[StackTime]:
    """Return the thread's blocked time by (stack, state, in call), most first; each second's rows weighted by
    ``weight(sec)`` (the share of that second inside the steps a chain judges)."""
    acc: dict[tuple, StackTime] = {}
    rows = conn.execute(
        "SELECT sec, stack_id, state, in_call, coalesce(waker_comm, '?'), sum(intervals), sum(blocked_ns) "
        "FROM offcpu_stacks WHERE tid = ? GROUP BY ALL",
        [tid],
    ).fetchall()
    for sec, sid, state, in_call, waker, n, ns in rows:
        w = weight(int(sec))
        if w <= 0:
            continue
        st = acc.setdefault((sid, state, bool(in_call)), StackTime(sid, state=state, in_call=bool(in_call)))
        st.ns += ns * w
        st.intervals += n * w
        st.wakers[waker] = st.wakers.get(waker, 0.0) + ns * w
    out = list(acc.values())
    fr = frames if frames is not None else load_frames(conn, (s.stack_id for s in out if s.stack_id is not None))
    for s in out:
        s.frames = fr.get(s.stack_id, []) if s.stack_id is not None else []
        s.kind = blocked_kind(s.frames, s.state, s.in_call)
    return sorted(out, key=lambda s: -s.ns)


def blocked_seconds(conn: duckdb.DuckDBPyConnection, tid: int, kind: str) -> dict[int, float]:
    """Return {sec: the thread's blocked ns in waits of ``kind`` (gil, lock, io, ...)} from its off-CPU stacks."""
    rows = conn.execute(
        "SELECT sec, stack_id, state, in_call, sum(blocked_ns) FROM offcpu_stacks WHERE tid = ? GROUP BY ALL", [tid]
    ).fetchall()
    frames = load_frames(conn, {sid for _, sid, *_ in rows if sid is not None})
    out: dict[int, float] = {}
    for sec, sid, state, in_call, ns in rows:
        if blocked_kind(frames.get(sid, []) if sid is not None else [], state, bool(in_call)) == kind:
            out[int(sec)] = out.get(int(sec), 0.0) + float(ns or 0)
    return out


def sampled_stacks(
    conn: duckdb.DuckDBPyConnection,
    tids: Iterable[int],
    weight: Weight = _all,
    *,
    outside_calls: bool = False,
    kernel: bool | None = None,
) -> dict[int, list[StackTime]]:
    """Return tid -> its sampled CPU time by stack, most first (``outside_calls``: samples outside CUDA calls only;
    ``kernel``: only samples in kernel code (True) or user code (False))."""
    tl = sorted(set(tids))
    if not tl:
        return {}
    rows = conn.execute(
        "SELECT tid, sec, stack_id, sum(cpu_ns), sum(samples) FROM cpu_samples SEMI JOIN (SELECT unnest($t) AS x) "
        "ON tid = x WHERE (NOT $outside OR NOT in_call) AND ($kernel IS NULL OR kernel = $kernel) GROUP BY ALL",
        {"t": tl, "outside": outside_calls, "kernel": kernel},
    ).fetchall()
    acc: dict[tuple[int, int | None], StackTime] = {}
    for tid, sec, sid, ns, n in rows:
        w = weight(int(sec))
        if w <= 0:
            continue
        st = acc.setdefault((tid, sid), StackTime(sid))
        st.ns += ns * w
        st.intervals += n * w
    fr = load_frames(conn, (sid for (_, sid) in acc if sid is not None))
    out: dict[int, list[StackTime]] = {}
    for (tid, sid), st in acc.items():
        st.frames = fr.get(sid, []) if sid is not None else []
        st.kind = "cpu"
        out.setdefault(tid, []).append(st)
    for v in out.values():
        v.sort(key=lambda s: -s.ns)
    return out


@dataclass(frozen=True)
class Line:
    """A Python line's share of some time: 'file:line function' and ns."""

    site: str | None
    ns: float


def top_lines(stacks: Iterable[StackTime], limit: int = 3) -> list[Line]:
    """Sum stacks by their innermost user Python line; the ``limit`` heaviest, most first."""
    acc: dict[str | None, float] = {}
    for s in stacks:
        acc[s.site] = acc.get(s.site, 0.0) + s.ns
    return [Line(k, v) for k, v in sorted(acc.items(), key=lambda kv: (-kv[1], kv[0] or ""))[:limit]]


def thread_name(comm: str, process_comm: str, tid: int, hottest: list[StackTime], blocked: bool = False) -> str:
    """A thread by what it runs: its OS name where it set one, else its tid and hottest Python function
    ("thread 12858 (aggregate_metrics, metrics.py:15)"). ``blocked``: ``hottest`` are where a mostly-blocked
    thread waits, and it is named so ("thread 12858 (blocked in recv: fetch_sample, fetch.py:42)"): a thread
    blocked 94% of its time in recv is not its CPU function (issue 28)."""
    if comm and comm != process_comm:
        return f"{comm} ({tid})"
    best = next((s for s in hottest if short_site(s.frames)), None)
    if best is None:
        return f"thread {tid}"
    fn, where = short_site(best.frames).split(" (", 1)
    if blocked:
        call = syscall_of(best.frames)
        return f"thread {tid} (blocked {f'in {call}: ' if call else 'at '}{fn}, {where}"
    return f"thread {tid} ({fn}, {where}"
