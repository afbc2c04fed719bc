"""A thread's waits by waker (``tracer waits``): exact wakeups and blocked time, and how long the waits were."""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tracer.analysis.waits import LABELS, Waits
from tracer.views.render.cells import escaped


def render_waits(res: Waits) -> RenderableType:
    head = Text(res.headline + "\n", "bold")
    head.append(f"  off CPU inside CUDA calls: {res.in_call_off_cpu_ms:,.1f} ms", "dim")
    bins = [b for b in LABELS if any(b in w.histogram for w in res.wakers)]
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    for c in ("waker", "whose", "wakeups", "blocked ms", "in calls", "typical", "max", *bins):
        t.add_column(c, justify="left" if c in ("waker", "whose") else "right", no_wrap=c != "waker")
    for w in res.wakers:
        t.add_row(
            escaped(w.waker) + (f" {w.pid}/{w.tid}" if w.pid else ""),
            w.holder,
            f"{w.wakeups:,}",
            f"{w.blocked_ms:,.1f}",
            f"{w.in_call_ms:,.1f}",
            "-" if w.typical_ms is None else f"{w.typical_ms:,.2f}",
            "-" if w.max_ms is None else f"{w.max_ms:,.2f}",
            *(f"{w.histogram[b]:,}" if b in w.histogram else "" for b in bins),
        )
    parts: list[RenderableType] = [head, t]
    if res.more_wakers:
        parts.append(Text(f"and {res.more_wakers} more wakers (--json)", "dim"))
    parts.append(Text(res.note, "dim"))
    return Group(*parts)
