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

    @property
    def zombie(self) -> bool:
        return self.state == "Z"


def parse_stat(data: str) -> ProcStat:
    """Parse the text of a /proc/PID/stat file."""
    close = data.rindex(")")
    fields = data[close + 2 :].split()  # fields 3.. (1-based): state, ppid, ...
    return ProcStat(
        comm=data[data.index("(") + 1 : close], state=fields[0], ppid=int(fields[1]), start_ticks=int(fields[22 - 3])
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
