"""Rich renderers of the analysis records (one module per view), and JSON output for ``--json``.

Renderers only format: every number comes from the record, so the CLI shows what MCP returns. Traced strings
(comm, paths, kernel names) are data: they are escaped so that rich markup inside them is printed, not
applied (:func:`tracer.views.render.cells.escaped`).
"""

from __future__ import annotations

from rich.console import Console

from tracer.analysis import Record
from tracer.analysis.breakdown.records import Breakdown
from tracer.analysis.chains import ChainsResult
from tracer.analysis.compare import Comparison
from tracer.analysis.ranks.report import RanksResult
from tracer.analysis.side_by_side import SideBySide
from tracer.analysis.sql.result import SqlResult
from tracer.analysis.stacks import StacksResult
from tracer.analysis.stats import TraceStats
from tracer.analysis.steps import StepSeries
from tracer.analysis.timeline import Around, Timeline
from tracer.analysis.waits import Waits
from tracer.views.render.breakdown import render_breakdown
from tracer.views.render.cells import nbytes, us
from tracer.views.render.chains import render_chains
from tracer.views.render.compare import render_comparison
from tracer.views.render.processes import render_busy_threads, render_processes
from tracer.views.render.ranks import render_ranks
from tracer.views.render.side_by_side import render_side_by_side
from tracer.views.render.sql import render_sql
from tracer.views.render.stacks import NATIVE_RUN, render_stacks
from tracer.views.render.stats import render_stats
from tracer.views.render.steps import render_steps
from tracer.views.render.timeline import render_around, render_timeline
from tracer.views.render.waits import render_waits

__all__ = [
    "NATIVE_RUN",
    "TOP_PROCESS_GROUPS",
    "nbytes",
    "print_record",
    "render_around",
    "render_breakdown",
    "render_chains",
    "render_comparison",
    "render_busy_threads",
    "render_processes",
    "render_ranks",
    "render_side_by_side",
    "render_sql",
    "render_stacks",
    "render_stats",
    "render_steps",
    "render_timeline",
    "render_waits",
    "to_json",
    "us",
]


def to_json(record: Record) -> str:
    """Return the record as indented JSON (the same object the MCP tool returns)."""
    return record.model_dump_json(indent=2)


def print_record(record: Record, console: Console, *, as_json: bool, show_all: bool = False) -> None:
    """Print ``record`` to ``console``: JSON, or its rich view (``show_all``: every process, ungrouped)."""
    if as_json:
        console.print_json(to_json(record)) if console.is_terminal else console.out(to_json(record), highlight=False)
        return
    if isinstance(record, TraceStats):
        console.print(render_stats(record, show_all=show_all))
        return
    view = {
        TraceStats: render_stats,
        ChainsResult: render_chains,
        StacksResult: render_stacks,
        SqlResult: render_sql,
        Timeline: render_timeline,
        Around: render_around,
        Breakdown: render_breakdown,
        Comparison: render_comparison,
        RanksResult: render_ranks,
        StepSeries: render_steps,
        Waits: render_waits,
        SideBySide: render_side_by_side,
    }[type(record)]  # type: ignore[index]
    console.print(view(record))  # type: ignore[operator]
