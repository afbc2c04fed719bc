"""The one reader of /proc's per-process files and the boot id, shared by the recorder and the analyses.

``/proc/PID/stat`` is parsed here only: its comm may hold spaces and parentheses, so fields are counted from the
last ``)``. A pid names a process only within one boot and one start time: :func:`boot_id` and
:func:`process_start_ticks` together identify a process (a reused pid has a later start).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat the tracer uses."""

    comm: str
    state: str  # R, S, D, T, Z, ...
    ppid: int
    start_ticks: int  # field 22: start time in clock ticks since boot
    processor: int | None = None  # field 39: the CPU it last ran on (None: a stat line too short to have it)

    @property
    def zombie(self) -> bool:
        return self.state == "Z"


def parse_stat(data: str) -> ProcStat:
    """Parse the text of a /proc/PID/stat file."""
    close = data.rindex(")")
    fields = data[close + 2 :].split()  # fields 3.. (1-based): state, ppid, ...
    return ProcStat(
        comm=data[data.index("(") + 1 : close],
        state=fields[0],
        ppid=int(fields[1]),
        start_ticks=int(fields[22 - 3]),
        processor=int(fields[39 - 3]) if len(fields) > 39 - 3 else None,
    )


def stat(pid: int | str) -> ProcStat | None:
    """Return /proc/PID/stat of ``pid`` ("self" for this process), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    st = stat(pid)
    return st is not None and not st.zombie


def process_start_ticks(pid: int) -> int | None:
    """Return the start time of ``pid`` in clock ticks since boot; None if it is gone (a zombie counts as gone)."""
    st = stat(pid)
    return None if st is None or st.zombie else st.start_ticks


def seconds_since_start(pid: int | str = "self") -> float:
    """Seconds since ``pid`` started, against CLOCK_BOOTTIME (the clock /proc's start ticks count on)."""
    st = stat(pid)
    if st is None:
        raise ProcessLookupError(pid)
    return time.clock_gettime(time.CLOCK_BOOTTIME) - st.start_ticks / os.sysconf("SC_CLK_TCK")


def boot_id() -> str | None:
    """Return this boot's id (/proc/sys/kernel/random/boot_id): pids and start ticks mean nothing across boots."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def environ(pid: int) -> dict[str, str] | None:
    """Return the environment ``pid`` was started with (/proc/PID/environ); None when it cannot be read (gone, or
    another user's process without privileges). Later ``setenv`` calls of the process do not show here."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def processes() -> dict[int, ProcStat]:
    """Return every process's stat, zombies included, in one scan of /proc (a process gone meanwhile is left
    out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := stat(entry)) is not None:
            out[int(entry)] = st
    return out


def children(pid: int) -> list[int]:
    """Return the living (not zombie) child processes of ``pid``, in pid order."""
    return sorted(c for c, st in processes().items() if st.ppid == pid and not st.zombie)


def resident_bytes(pid: int | str = "self") -> int | None:
    """Return the resident memory of ``pid`` in bytes (/proc/PID/statm's second field), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def cpu_wait_ns(pid: int | str = "self") -> int | None:
    """Return the time every thread of ``pid`` has spent runnable but waiting for a CPU, summed, in ns
    (/proc/PID/task/*/schedstat's run_delay); None if it is gone. A thread that exited is no longer counted."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return total


# --- CPU placement and limits: affinity, the cgroup's cpuset and CPU quota, each CPU's idle time ----------------
#
# cgroup v2 (``0::/path`` in /proc/PID/cgroup: cpu.max, cpu.stat throttled_usec, cpuset.cpus.effective) and v1
# (``N:cpu,cpuacct:/path``: cpu.cfs_quota_us/cpu.cfs_period_us, cpu.stat throttled_time in ns;
# ``N:cpuset:/path``: cpuset.effective_cpus) are both read: hosts still run the hybrid layout, where the cpu
# controller is bound to v1 and cannot be enabled in the unified tree.

CGROUP_ROOT = "/sys/fs/cgroup"


def parse_cpu_list(text: str) -> frozenset[int]:
    """Parse a kernel CPU list ("0-3,6", "" for none) into a set of CPU numbers."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """Return ``cpus`` as a kernel CPU list, e.g. {0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cpus_allowed(pid: int) -> frozenset[int] | None:
    """Return the CPUs ``pid``'s main thread may run on (sched_getaffinity); None when it is gone."""
    try:
        return frozenset(os.sched_getaffinity(pid))
    except OSError:
        return None


@dataclass(frozen=True)
class CgroupCpu:
    """The CPU limits of a process's cgroup: the tightest quota on it or an ancestor, and its throttling."""

    path: str  # the process's cgroup (as /proc/PID/cgroup names it)
    limit_path: str | None  # the cgroup (it or an ancestor) whose quota applies; None: no quota
    quota_us: int | None  # CPU time per period (None: no limit)
    period_us: int | None
    cpuset: frozenset[int] | None  # the cgroup's effective cpuset (None: unknown)
    nr_periods: int = 0  # of limit_path's cpu.stat, cumulative
    nr_throttled: int = 0
    throttled_ns: int = 0  # summed over the CPUs its runqueues were throttled on


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cgroup_lines(pid: int) -> dict[str, str]:
    """Return controller -> cgroup path from /proc/PID/cgroup ("" keys the v2 unified tree)."""
    text = _read(f"/proc/{pid}/cgroup") or ""
    out: dict[str, str] = {}
    for line in text.splitlines():
        _, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


def cgroups(pid: int) -> dict[str, str]:
    """Return ``pid``'s cgroups, controller -> path ("" keys the v2 unified tree); {} when it is gone."""
    return _cgroup_lines(pid)


def _stat_fields(text: str | None) -> dict[str, int]:
    out = {}
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


def _ancestors(path: str) -> list[str]:
    """``path`` and its parents up to the root, innermost first."""
    out = [path]
    while path not in ("/", ""):
        path = path.rsplit("/", 1)[0] or "/"
        out.append(path)
    return out


def _cpu_dir_v1() -> str | None:
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        if os.path.exists(f"{CGROUP_ROOT}/{name}/cpu.cfs_quota_us"):
            return f"{CGROUP_ROOT}/{name}"
    return None


def _v2_root() -> str:
    return CGROUP_ROOT if os.path.exists(f"{CGROUP_ROOT}/cgroup.controllers") else f"{CGROUP_ROOT}/unified"


def cgroup_cpu(pid: int) -> CgroupCpu | None:
    """Return ``pid``'s cgroup CPU limits and throttling (v1 or v2); None when it is gone or has no cgroup."""
    lines = _cgroup_lines(pid)
    if not lines:
        return None
    v1 = _cpu_dir_v1() if "cpu" in lines else None
    path = lines["cpu"] if v1 else lines.get("", "/")
    best: tuple[float, str, int, int] | None = None  # (share of a CPU, cgroup, quota, period)
    for p in _ancestors(path):
        q = cpu_limit(p)
        if q is not None and (best is None or q[0] / q[1] < best[0]):
            best = (q[0] / q[1], p, q[0], q[1])
    cs_path = lines.get("cpuset", path if not v1 else None)
    cpuset = None
    if cs_path is not None:
        text = (
            _read(f"{CGROUP_ROOT}/cpuset{cs_path.rstrip('/')}/cpuset.effective_cpus")
            if "cpuset" in lines and os.path.isdir(f"{CGROUP_ROOT}/cpuset")
            else _read(f"{_v2_root()}{cs_path.rstrip('/')}/cpuset.cpus.effective")
        )
        cpuset = parse_cpu_list(text) if text and text.strip() else None
    if best is None:
        return CgroupCpu(path, None, None, None, cpuset)
    st = cgroup_throttling(best[1])
    return CgroupCpu(path, best[1], best[2], best[3], cpuset, *st)


def cpu_limit(path: str) -> tuple[int, int] | None:
    """Return (quota_us, period_us) of cgroup ``path`` (v1 cfs quota or v2 cpu.max); None when unlimited."""
    v1 = _cpu_dir_v1()
    if v1 is not None:
        q, p = _read(f"{v1}{path.rstrip('/')}/cpu.cfs_quota_us"), _read(f"{v1}{path.rstrip('/')}/cpu.cfs_period_us")
        if q is None or p is None or int(q) < 0:
            return None
        return int(q), int(p)
    text = _read(f"{_v2_root()}{path.rstrip('/')}/cpu.max")
    if not text:
        return None
    quota, *period = text.split()
    return None if quota == "max" else (int(quota), int(period[0]) if period else 100_000)


def cgroup_throttling(path: str) -> tuple[int, int, int]:
    """Return (nr_periods, nr_throttled, throttled_ns) of cgroup ``path``'s cpu.stat, cumulative; zeros if gone."""
    v1 = _cpu_dir_v1()
    if v1 is not None:
        f = _stat_fields(_read(f"{v1}{path.rstrip('/')}/cpu.stat"))
        return f.get("nr_periods", 0), f.get("nr_throttled", 0), f.get("throttled_time", 0)
    f = _stat_fields(_read(f"{_v2_root()}{path.rstrip('/')}/cpu.stat"))
    return f.get("nr_periods", 0), f.get("nr_throttled", 0), f.get("throttled_usec", 0) * 1000


def cpu_times() -> dict[int, tuple[int, int]]:
    """Return each CPU's cumulative (busy, idle) time in ns since boot, from /proc/stat's cpuN lines (idle
    counts iowait: a CPU waiting for I/O could run a runnable task)."""
    tick_ns = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    out = {}
    for line in (_read("/proc/stat") or "").splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *vals = line.split()
        v = [int(x) for x in vals[:8]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        out[int(name[3:])] = ((sum(v) - idle) * tick_ns, idle * tick_ns)
    return out
