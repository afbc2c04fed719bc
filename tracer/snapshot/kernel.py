"""A thread's kernel state from /proc, read without stopping it: its state letter, the system call it sits in,
its wait channel and how long since it last ran.

"Since it last ran": ``se.exec_start`` of /proc/PID/task/TID/sched is the scheduler clock at which the thread
last had its runtime accounted (when it last ran, to within a tick); the same field of the reading thread, which is
running, is "now" on that clock. The difference is how long the thread has been off CPU. It needs the kernel's
sched debug fields; without them ``idle_ns`` is None.

That clock is per CPU: each CPU's ``clock_task`` leaves out the time the hypervisor stole from it
(CONFIG_PARAVIRT_TIME_ACCOUNTING), so on a VM two CPUs' clocks drift apart by the difference of their steal. On this
project's 2-CPU VM they were 6.5 s apart (/proc/stat's steal), and a rank blocked 8 s read 3 s when the reader ran
on the other CPU than at attach. A thread's exec_start is therefore compared with "now" on the CPU it last ran on
(:class:`SchedClock`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from tracer import procfs

_CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc's start times are in these ticks since boot
STATE_NAMES = {"R": "running", "S": "sleeping", "D": "disk", "T": "stopped", "t": "traced", "Z": "zombie",
               "X": "dead", "I": "idle"}  # fmt: skip

# x86_64 system call numbers of the waits a stuck thread is most often found in
SYSCALL_NAMES = {0: "read", 1: "write", 7: "poll", 17: "pread64", 23: "select", 35: "nanosleep", 45: "recvfrom",
                 47: "recvmsg", 61: "wait4", 202: "futex", 230: "clock_nanosleep", 232: "epoll_wait",
                 257: "openat", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 441: "epoll_pwait2",
                 3: "close", 44: "sendto", 46: "sendmsg", 43: "accept", 288: "accept4", 42: "connect",
                 74: "fsync", 75: "fdatasync", 16: "ioctl", 4: "stat", 5: "fstat", 262: "newfstatat",
                 2: "open", 24: "sched_yield", 34: "pause", 128: "rt_sigtimedwait", 130: "rt_sigsuspend",
                 19: "readv", 20: "writev", 18: "pwrite64", 295: "preadv", 296: "pwritev"}  # fmt: skip


@dataclass(frozen=True)
class KernelThread:
    """One thread as the kernel sees it. ``syscall`` is the call's name (or ``syscall_N``), "" when running in user
    space, None when unreadable; ``user_pc`` the user instruction pointer the call was made from (0: unknown)."""

    pid: int
    tid: int
    comm: str
    state: str  # running | sleeping | disk | stopped | zombie | ...
    syscall: str | None
    syscall_args: tuple[int, ...]
    user_pc: int
    wchan: str
    idle_ns: int | None  # off CPU for this long (None: unknown)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def exec_start_ns(path: str) -> int | None:
    """``se.exec_start`` (ms with a fraction) of a sched file, in ns; None when absent."""
    text = _read(path)
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("se.exec_start"):
            ms = line.split(":", 1)[1].strip()
            whole, _, frac = ms.partition(".")
            return int(whole) * 1_000_000 + int((frac + "000000")[:6])
    return None


def now_exec_ns() -> int | None:
    """The scheduler clock of the calling thread's CPU now, as its own exec_start, made current by a yield first.

    A thread that has run for a while has the exec_start of its last accounting: with no tick on a CPU that runs one
    task, that is seconds old, and every other thread's time since it last ran read seconds short (a recorder busy
    attaching read 0 ms for threads blocked 2.5 s). sched_yield() accounts the caller's runtime now."""
    os.sched_yield()
    return exec_start_ns("/proc/thread-self/sched")


class SchedClock:
    """ "Now" on the scheduler clock of each CPU, read once per snapshot (use it as a context manager).

    Now on CPU c is read by moving the calling thread there (sched_setaffinity returns once it runs on c, its
    exec_start then on c's clock) and reading its own exec_start; on leaving, the thread gets its own CPUs back. A
    CPU it may not run on (a cpuset) or an unknown one falls back to the clock of the CPU it runs on, the reading
    before per-CPU clocks, which the thread's age still bounds."""

    def __init__(self) -> None:
        self._now: dict[int | None, int | None] = {}
        self._home: set[int] | None = None

    def __enter__(self) -> SchedClock:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._home is not None:
            try:
                os.sched_setaffinity(0, self._home)
            except OSError:
                pass
            self._home = None

    def now(self, cpu: int | None) -> int | None:
        """Now on ``cpu``'s scheduler clock (ns), or on this thread's CPU's when it cannot move there."""
        if cpu not in self._now:
            self._now[cpu] = self._read(cpu)
        return self._now[cpu]

    def _read(self, cpu: int | None) -> int | None:
        if cpu is not None:
            try:
                if self._home is None:
                    self._home = os.sched_getaffinity(0)
                os.sched_setaffinity(0, {cpu})
                here = procfs.parse_stat(_read("/proc/thread-self/stat") or "").processor
                if here == cpu:
                    return now_exec_ns()
            except (OSError, ValueError, IndexError):
                pass
        if None not in self._now:
            if self._home is not None:  # back where it may run before reading "its own CPU"
                try:
                    os.sched_setaffinity(0, self._home)
                except OSError:
                    pass
            self._now[None] = now_exec_ns()
        return self._now[None]


def parse_syscall(text: str | None) -> tuple[str | None, tuple[int, ...], int]:
    """/proc/PID/task/TID/syscall: "NR a1..a6 sp pc", "-1 sp pc" (blocked, not in a call) or "running"."""
    if text is None:
        return None, (), 0
    parts = text.split()
    if not parts or parts[0] == "running":
        return "", (), 0
    nr = int(parts[0])
    pc = int(parts[-1], 16) if len(parts) >= 3 else 0
    if nr < 0:
        return "", (), pc
    args = tuple(int(a, 16) for a in parts[1:7])
    return SYSCALL_NAMES.get(nr, f"syscall_{nr}"), args, pc


@dataclass(frozen=True)
class OffCpu:
    """How long a thread has been off CPU, and the clock reading that tells whether it ran since."""

    state: str  # /proc's state letter
    comm: str
    idle_ns: int | None  # 0 while running; None: unknown
    last_ran: int | None  # exec_start on its CPU's clock: unchanged while it has not run since (None: unknown)


def off_cpu(pid: int, tid: int, clock: SchedClock | None) -> OffCpu | None:
    """Thread ``tid``'s time off CPU from two files (stat and sched), or None once it is gone: what the recorder's
    per-second look for threads idle long enough to snapshot needs (``read_thread`` reads two more)."""
    base = f"/proc/{pid}/task/{tid}"
    stat_text = _read(f"{base}/stat")
    if stat_text is None:
        return None
    try:
        st = procfs.parse_stat(stat_text)
    except (ValueError, IndexError):
        return None
    if st.state == "R":
        return OffCpu(st.state, st.comm, 0, None)
    last = exec_start_ns(f"{base}/sched")
    if clock is None:  # whether it ran since an earlier look, not for how long it has not
        return OffCpu(st.state, st.comm, None, last)
    now_ns = clock.now(st.processor) if last is not None else None
    if last is None or now_ns is None:
        return OffCpu(st.state, st.comm, None, last)
    # never longer than the thread has lived: where the reader cannot move to the thread's CPU, the clocks it
    # compares are two CPUs' (a thread of a 2.3 s old process read 7.1 s)
    age = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - st.start_ticks * 1_000_000_000 // _CLK_TCK
    return OffCpu(st.state, st.comm, min(max(0, now_ns - last), max(age, 0)), last)


def read_thread(pid: int, tid: int, clock: SchedClock | None) -> KernelThread | None:
    """Thread ``tid`` of ``pid``, or None once it is gone (``clock``: now on each CPU; None: no ``idle_ns``)."""
    off = off_cpu(pid, tid, clock)
    if off is None:
        return None
    base = f"/proc/{pid}/task/{tid}"
    name, args, pc = parse_syscall(_read(f"{base}/syscall"))
    wchan = (_read(f"{base}/wchan") or "").strip()
    running = off.state == "R"
    return KernelThread(pid, tid, off.comm, STATE_NAMES.get(off.state, off.state), "" if running else name, args, pc,
                        "" if wchan == "0" else wchan, off.idle_ns)  # fmt: skip


# the calls whose first argument is the file descriptor the thread waits on
FD_CALLS = frozenset({"read", "write", "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev", "fsync",
                      "fdatasync", "recvfrom", "recvmsg", "sendto", "sendmsg", "accept", "accept4", "connect",
                      "ioctl"})  # fmt: skip
# the calls whose path argument (a pointer into the thread's memory) is the file it waits to open
PATH_CALLS = {"openat": 1, "open": 0, "stat": 0, "newfstatat": 1}
MAX_PATH = 512


def waits_on(pid: int, syscall: str | None, args: tuple[int, ...]) -> str:
    """What a thread blocked in ``syscall`` waits on: the file its fd names (/proc/PID/fd, e.g. a path, a
    ``pipe:[N]`` or ``socket:[N]``), or the path it is opening, read from its memory without stopping it (a
    FIFO nobody writes blocks its opener). "" when the call has none or it is unreadable (the process exited)."""
    if not syscall or not args:
        return ""
    if syscall in FD_CALLS:
        try:
            return os.readlink(f"/proc/{pid}/fd/{args[0]}")
        except OSError:
            return ""
    i = PATH_CALLS.get(syscall)
    if i is None or i >= len(args) or not args[i]:
        return ""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
            f.seek(args[i])
            raw = f.read(MAX_PATH)
    except (OSError, OverflowError, ValueError):
        return ""
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def tids(pid: int) -> list[int]:
    """The threads of ``pid`` (empty once it is gone)."""
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def tree(pid: int) -> list[int]:
    """``pid`` and its living descendants, parents first."""
    procs = procfs.processes()
    kids: dict[int, list[int]] = {}
    for p, st in procs.items():
        if not st.zombie:
            kids.setdefault(st.ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(kids.get(p, [])))
    return out
