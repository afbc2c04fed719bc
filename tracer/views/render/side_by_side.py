"""Processes or threads side by side (``tracer compare-processes``): one column each, one row per measure."""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tracer.analysis.side_by_side import Row, SideBySide
from tracer.views.render.cells import escaped


def _cell(r: Row, v: float | None) -> str:
    if v is None:
        return "-"
    if r.unit == "share":
        return f"{v:.1%}"
    if r.unit == "count":
        return f"{v:,.0f}"
    return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"


def render_side_by_side(res: SideBySide) -> RenderableType:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    t.add_column("")
    for c in res.columns:
        t.add_column(escaped(c.label), justify="right")
    for label, values in (
        ("role", [c.role for c in res.columns]),
        ("thread", [f"{c.tid} {c.comm} ({c.thread_role})" for c in res.columns]),
        ("top waker", [c.top_waker or "-" for c in res.columns]),
        ("top CPU holder", [c.top_holder or "-" for c in res.columns]),
    ):
        t.add_row(label, *(escaped(v) for v in values))
    for r in res.rows:
        t.add_row(
            f"{r.measure} ({r.unit})" if r.unit == "ms" else r.measure,
            *(_cell(r, v) for v in r.values),
        )
    parts: list[RenderableType] = [Text(res.headline, "bold"), t]
    if res.more:
        parts.append(Text(f"{res.more} more left out: pass the pids to compare", "dim"))
    return Group(*parts)
