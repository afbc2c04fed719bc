"""A ``run_sql`` result (``tracer sql``) as a table."""

from __future__ import annotations

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from tracer.analysis.sql.result import SqlResult


def render_sql(res: SqlResult) -> RenderableType:
    t = Table(
        *res.columns,
        caption=f"{res.row_count} rows{' (truncated)' if res.truncated else ''}, {res.elapsed_ms:.0f} ms",
    )
    for r in res.rows:
        t.add_row(*[Text("NULL", style="dim") if v is None else Text(str(v)) for v in r])
    return t
