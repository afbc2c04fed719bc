"""The ranks of a distributed job (``tracer ranks``): one row per rank with its time by phase, per step when the
steps are known, and the straggler the others wait for."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tracer.analysis.ranks.report import RanksResult


def render_ranks(res: RanksResult) -> RenderableType:
    if not res.ranks:
        head = Text(f"No rank table: {res.note}")
        if res.launchers:
            head.append("\nlaunchers: " + ", ".join(f"{p.comm} (pid {p.pid}, {p.launcher})" for p in res.launchers))
        return head
    per_step = all(r.phases_ms_per_step is not None for r in res.ranks)
    unit = "ms/step" if per_step else "ms"
    shown = [p for p in res.legend if any((r.phases_ms.get(p) or 0) >= 1 for r in res.ranks)]
    title = (
        f"{len(res.ranks)} ranks"
        + (f" of {res.world_size}" if res.world_size else "")
        + (f", job {res.job_id}" if res.job_id else "")
        + f": t = {res.window_start_s:.1f}-{res.window_end_s:.1f} s"
        + (f", {res.steps:,.0f} steps of {res.step_ms:.1f} ms" if res.steps and res.step_ms else "")
    )
    table = Table(title=title, title_justify="left", show_edge=False)
    for col in ("rank", "pid", "tid"):
        table.add_column(col, justify="right")
    for p in shown:
        table.add_column(f"{p}\n{unit}", justify="right")
    table.add_column("waits in\ncollectives", justify="right")
    for r in res.ranks:
        vals = r.phases_ms_per_step if per_step and r.phases_ms_per_step is not None else r.phases_ms
        style = "bold red" if r.straggler else ""
        table.add_row(
            f"{r.rank}{' *' if r.straggler else ''}",
            str(r.pid),
            str(r.tid),
            *(f"{vals.get(p, 0.0):,.1f}" for p in shown),
            f"{r.collective_share:.0%}",
            style=style,
        )
    parts: list[RenderableType] = [table]
    legend = Text()
    for p in shown:
        legend.append(f"  {p}: ", "dim")
        legend.append(f"{res.legend[p]}\n", "dim")
    parts.append(legend)
    if res.straggler_summary:
        parts.append(Text("* straggler: ", "bold red") + Text(res.straggler_summary))
        if res.chain_id:
            parts.append(Text(f"  chain {res.chain_id} (tracer chains)", "dim"))
    else:
        parts.append(Text("No straggler: the ranks wait for each other about equally."))
    if res.launchers:
        parts.append(
            Text("launchers: " + ", ".join(f"{p.comm} (pid {p.pid}, {p.launcher})" for p in res.launchers), "dim")
        )
    if res.note:
        parts.append(Text(f"note: {res.note}", "yellow"))
    return Group(*parts)
