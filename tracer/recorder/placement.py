"""Where the traced processes may run and how their CPU is capped (issue 28): each process's affinity, its
cgroup's cpuset and CPU quota (``process_placement``), the quota-bound cgroups' throttling once a second
(``cgroup_cpu``), and each CPU's idle time once a second (``cpu_idle``). With them the analysis can tell a job
that waited for a CPU while CPUs it was not allowed on sat idle, or while its cgroup was throttled.

Cheap by construction: a process is read at attach and at each exec (three small /proc and cgroup files; a
forked child inherits its parent's placement, so forks read nothing), each distinct quota cgroup and /proc/stat
once a second, and the live processes once more at the end, written only when their placement changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tracer import containers, procfs

ENV_KEYS = ("SLURM_CPUS_PER_TASK", "SLURM_CPU_BIND", "SLURM_JOB_ID", "KUBERNETES_SERVICE_HOST", "container")
Columns = dict[str, list]
CONTAINER_COLUMNS = ("container_id", "pod_uid", "pod_name", "pod_namespace")  # containers.Identity's, stored


@dataclass(frozen=True)
class Placement:
    cpus: frozenset[int]
    cg: procfs.CgroupCpu | None

    def key(self) -> tuple:
        cg = self.cg
        return (self.cpus, cg.path, cg.cpuset, cg.limit_path, cg.quota_us, cg.period_us) if cg else (self.cpus,)


def read(pid: int) -> Placement | None:
    """Return ``pid``'s placement now; None when it is gone."""
    cpus = procfs.cpus_allowed(pid)
    return None if cpus is None else Placement(cpus, procfs.cgroup_cpu(pid))


def _env(pid: int) -> str | None:
    env = procfs.environ(pid) or {}
    got = [f"{k}={env[k]}" for k in ENV_KEYS if k in env]
    return " ".join(got) or None


class PlacementWatch:
    """The placement rows of one recording, and the per-second throttling and idle samples."""

    def __init__(self) -> None:
        self._last: dict[int, tuple] = {}  # pid -> (the placement key, exec_from) last written
        self._baseline: list[tuple[int, str, int, int]] = []  # quota cgroups found since the last sample
        self._limits: dict[str, tuple[int, int]] = {}  # quota cgroup -> (quota_us, period_us)
        self._cpu_last = procfs.cpu_times()
        self.rows: Columns = _empty()

    def note(self, pid: int, ts_ns: int, exec_from: str | None = None, force: bool = True) -> None:
        """Read ``pid``'s placement and keep a row for it (``force`` False: only when it changed)."""
        p = read(pid)
        # two execs in one batch (a launcher's, then the job's) read the same placement: one row
        if p is None or self._last.get(pid) == (p.key(), exec_from) or (not force and self._last_key(pid) == p.key()):
            return
        self._last[pid] = (p.key(), exec_from)
        cg = p.cg
        if cg is not None and cg.limit_path is not None and cg.quota_us is not None and cg.period_us is not None:
            if cg.limit_path not in self._limits:  # its first throttling sample now: the next second's is a difference
                self._baseline.append((ts_ns, cg.limit_path, cg.quota_us, cg.period_us))
            self._limits[cg.limit_path] = (cg.quota_us, cg.period_us)
        r = self.rows
        r["ts_ns"].append(ts_ns)
        r["pid"].append(pid)
        r["cpus_allowed"].append(procfs.format_cpu_list(p.cpus))
        r["cpus"].append(len(p.cpus))
        r["cgroup"].append(cg.path if cg else None)
        r["cpuset_cpus"].append(procfs.format_cpu_list(cg.cpuset) if cg and cg.cpuset is not None else None)
        r["limit_cgroup"].append(cg.limit_path if cg else None)
        r["quota_us"].append(cg.quota_us if cg else None)
        r["period_us"].append(cg.period_us if cg else None)
        r["exec_from"].append(exec_from or None)
        r["env"].append(_env(pid))
        ident = containers.read(pid)
        for k in CONTAINER_COLUMNS:
            r[k].append(getattr(ident, k) if ident else None)

    def _last_key(self, pid: int) -> tuple | None:
        last = self._last.get(pid)
        return last[0] if last else None

    def recheck(self, pids: list[int], ts_ns: int, parent_of: Callable[[int], int | None]) -> None:
        """At the end: a row for each of ``pids`` whose placement differs from its last row, or, for a forked
        process without one, from the placement it inherited (a worker_init_fn that pins each worker)."""
        for pid in pids:
            if pid in self._last:
                self.note(pid, ts_ns, force=False)
                continue
            p, inherited, seen = parent_of(pid), None, {pid}
            while p is not None and p not in seen and inherited is None:
                seen.add(p)
                inherited = self._last_key(p)
                p = parent_of(p)
            now = read(pid)
            if now is not None and inherited is not None and now.key() != inherited:
                self.note(pid, ts_ns)

    def forget(self, pid: int) -> None:
        self._last.pop(pid, None)

    def take_rows(self) -> Columns:
        """Return the placement rows kept since the last call."""
        out, self.rows = self.rows, _empty()
        return out

    def sample(self, ts_ns: int) -> tuple[Columns, Columns]:
        """Return this second's (cgroup_cpu, cpu_idle) rows."""
        cg: Columns = {k: [] for k in ("ts_ns", "cgroup", "quota_us", "period_us", "nr_periods", "nr_throttled")}
        cg["throttled_ns"] = []
        samples = [*self._baseline, *((ts_ns, path, q, p) for path, (q, p) in self._limits.items())]
        self._baseline = []
        for ts, path, quota, period in samples:
            n, thr, ns = procfs.cgroup_throttling(path)
            for k, v in zip(cg, (ts, path, quota, period, n, thr, ns), strict=True):
                cg[k].append(v)
        now = procfs.cpu_times()
        idle: Columns = {"ts_ns": [], "cpu": [], "idle_ns": [], "busy_ns": []}
        for cpu, (busy, idl) in sorted(now.items()):
            b0, i0 = self._cpu_last.get(cpu, (busy, idl))
            idle["ts_ns"].append(ts_ns)
            idle["cpu"].append(cpu)
            idle["idle_ns"].append(max(idl - i0, 0))
            idle["busy_ns"].append(max(busy - b0, 0))
        self._cpu_last = now
        return cg, idle


def _empty() -> Columns:
    return {
        k: []
        for k in (
            "ts_ns",
            "pid",
            "cpus_allowed",
            "cpus",
            "cgroup",
            "cpuset_cpus",
            "limit_cgroup",
            "quota_us",
            "period_us",
            "exec_from",
            "env",
            *CONTAINER_COLUMNS,
        )
    }
