"""What a recording holds that a chain's subject and its advice depend on: a chain names only what exists (issue
23: a job with no DataLoader was told to set ``persistent_workers`` because of the ``bash`` commands its start-up
ran).

- DataLoader workers exist when a process of the traced tree has the role ``dataloader_worker`` (torch renames
  them ``pt_data_worker``): only then does advice name num_workers, prefetch_factor, persistent_workers or
  pin_memory.
- A *helper* is a child the thread waited for to finish (``subprocess.run``, ``os.system``, a shell at start-up):
  every wait of the thread it ended, ended as it exited (the exiting child wakes its parent in ``waitpid``, its
  last output just before). A worker that hands over data wakes the thread while it lives. A helper's waits are
  neither a starved loader's nor a respawn's.
"""

from __future__ import annotations

from tracer.analysis.chains.context import ChainContext
from tracer.vocabulary import TRACER_ROLE

MS = 1_000_000
# a wait ended this close to the waker's exit was ended by the exit (or by its last output, written just before);
# the exit is stamped at sched_process_exit, before the parent is woken
EXIT_WAKE_NS = 50 * MS


def has_dataloader(ctx: ChainContext) -> bool:
    """Return True when the traced tree has DataLoader workers (computed once per context)."""
    key = ("has_dataloader",)
    if key not in ctx.memo:
        ctx.memo[key] = bool(ctx.info.dataloader_pids)
    return ctx.memo[key]


def is_dataloader_worker(ctx: ChainContext, pid: int) -> bool:
    return pid in ctx.info.dataloader_pids


def helper_pids(ctx: ChainContext, tid: int) -> frozenset[int]:
    """Return the processes that ended waits of thread ``tid`` only by exiting: commands it waited for, not
    workers (see the module docstring). From ``sched``, which keeps every wait of 1 ms or more: the waits that
    cost anything. DataLoader workers are never helpers (their shutdown at an epoch's end also wakes the thread)."""
    key = ("helper_pids", tid)
    if key in ctx.memo:
        return ctx.memo[key]
    out: set[int] = set()
    if ctx.info.has("sched", "waker_pid"):
        # every wait it ended, within EXIT_WAKE_NS of its exit: its first and last are (a per-waker range, not
        # the thread's waits as rows: a training thread has hundreds of thousands)
        for wp, first, last in ctx.conn.execute(
            "SELECT waker_pid, min(e), max(e) FROM (SELECT waker_pid, ts_ns + dur_ns - coalesce(runq_ns, 0) AS e "
            "FROM sched WHERE tid = ? AND waker_pid > 0) GROUP BY waker_pid",
            [tid],
        ).fetchall():
            p = ctx.info.procs.get(wp)
            if p is None or p.exit_ns is None or p.role == TRACER_ROLE or is_dataloader_worker(ctx, wp):
                continue
            if p.exit_ns - EXIT_WAKE_NS <= first and last <= p.exit_ns + EXIT_WAKE_NS:
                out.add(int(wp))
    ctx.memo[key] = frozenset(out)
    return ctx.memo[key]
