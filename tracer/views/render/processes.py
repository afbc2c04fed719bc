"""The process table (groups from :func:`tracer.analysis.processes.group_processes`, or one row per process) and
the busy threads."""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.table import Table

from tracer.analysis.processes import BusyThread, ProcessGroup, group_processes
from tracer.analysis.stats import ProcessStat
from tracer.views.render.cells import escaped, us


def _exit_cell(g: ProcessGroup) -> str:
    if g.processes == 1:
        return "" if g.exit_s is None else f"{g.exit_s:.1f}s code {g.exit_code}"
    if not g.exited:
        return ""
    parts = [f"{g.exited} exited" if g.exited < g.processes else "all exited"]
    if g.failed:
        parts.append(f"{g.failed} failed")
    return ", ".join(parts)


def render_processes(
    groups: Sequence[ProcessGroup], *, more: str | None = None, every: Sequence[ProcessStat] = ()
) -> Table:
    """Return the process table: ``groups`` with counts and totals then ``more`` (what was left out); with
    ``every`` (the one-row-per-process list), one row per process."""
    rows = [g for p in every for g in group_processes([p])] if every else list(groups)
    # no column rules: eleven columns fit 120 terminal columns with the longest comm and role unabridged
    t = Table(
        title="Processes",
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),
    )
    for c in ("comm", "role", "procs", "pid", "calls", "ctx sw", "preempt", "off-CPU", "runq", "worst", "exit"):
        # numbers never wrap: rich narrows comm and role instead
        t.add_column(c, justify="left" if c in ("comm", "role", "exit") else "right", no_wrap=c not in ("comm", "role"))
    for g in rows:
        t.add_row(
            escaped(g.comm),
            g.role + (f" {g.rank}" if g.rank is not None else ""),
            f"{g.processes:,}",
            str(g.pid) if g.processes == 1 else f"{g.pid}…",
            f"{g.cuda_calls:,}",
            f"{g.context_switches:,}",
            f"{g.preemptions:,}",
            f"{g.off_cpu_s:.2f}s",
            f"{g.runq_s:.2f}s",
            us(g.worst_stall_ms * 1e3),
            _exit_cell(g),
        )
    lines = []
    if not every and more:
        lines.append(f"and {more.replace('detail=True', 'tracer stats --all')}")
    if not every and any(g.processes > 1 for g in rows):
        lines.append("processes grouped by (comm, parent, role, rank); one row each: tracer stats --all")
    t.caption = "\n".join(lines) or None
    return t


def render_busy_threads(threads: Sequence[BusyThread], more: int = 0) -> Table | None:
    """Return the table of threads that used a meaningful share of a core, or None when there are none
    (``more``: the busy threads the overview left out, named in the caption)."""
    if not threads:
        return None
    t = Table(title="Busy threads (>= 5% of a core)", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    for c in ("thread", "process", "role", "core", "CUDA calls", "time"):
        t.add_column(c, justify="right" if c in ("core", "CUDA calls") else "left", no_wrap=c != "time")
    for b in threads:
        t.add_row(
            f"{escaped(b.comm)} {b.tid}",
            f"{escaped(b.process_comm)} {b.pid}",
            b.role,
            f"{b.core_share:.0%}",
            f"{b.cuda_calls:,}",
            b.headline,
        )
    if more:
        t.caption = f"and {more} more busy thread{'s' if more > 1 else ''}: tracer stats --all"
    return t
