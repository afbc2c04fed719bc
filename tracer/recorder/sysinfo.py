"""The environment a trace was taken in, and the /proc half of the ~1 Hz host samples."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Environment:
    host: str
    kernel: str
    cpu_model: str
    cpu_cores: int
    mem_bytes: int
    gpus: str
    driver: str


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> tuple[str, str]:
    """Return (GPU names, driver version) from nvidia-smi when present, else empty strings."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "", ""
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "", ""
    rows = [r.split(",") for r in out.strip().splitlines() if "," in r]
    return ", ".join(r[0].strip() for r in rows), (rows[0][1].strip() if rows else "")


def environment() -> Environment:
    """Return the host's environment as recorded in the session row."""
    gpus, driver = _gpus()
    return Environment(
        host=socket.gethostname(),
        kernel=platform.release(),
        cpu_model=_cpu_model(),
        cpu_cores=os.cpu_count() or 0,
        mem_bytes=_meminfo().get("MemTotal", 0),
        gpus=gpus,
        driver=driver,
    )


@dataclass(frozen=True)
class ProcSample:
    load1: float
    cpu_busy_pct: float
    runnable: int
    mem_available_bytes: int
    swap_used_bytes: int


class ProcSampler:
    """Samples /proc/loadavg, /proc/stat and /proc/meminfo; CPU busy % is over the time since the last sample."""

    def __init__(self) -> None:
        self._last = self._cpu_times()

    @staticmethod
    def _cpu_times() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals[:8]), idle

    def sample(self) -> ProcSample:
        """Return the current host sample."""
        with open("/proc/loadavg") as f:
            parts = f.read().split()
        total, idle = self._cpu_times()
        dt, di = total - self._last[0], idle - self._last[1]
        self._last = (total, idle)
        busy = 100.0 * (dt - di) / dt if dt > 0 else 0.0
        running = 0
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    running = int(line.split()[1])
        mi = _meminfo()
        return ProcSample(
            load1=float(parts[0]),
            cpu_busy_pct=round(busy, 1),
            runnable=running,
            mem_available_bytes=mi.get("MemAvailable", 0),
            swap_used_bytes=mi.get("SwapTotal", 0) - mi.get("SwapFree", 0),
        )
