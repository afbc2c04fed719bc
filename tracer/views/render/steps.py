"""A thread's step series (``tracer steps``): the typical step, the periodic slow steps and what they spent their
extra time on, the other slow steps. Plain ``Text``: traced names in it are printed as they are, never as markup."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from tracer.analysis.steps import StepSeries


def render_steps(res: StepSeries) -> RenderableType:
    if res.basis == "none":
        return Text(res.note or res.headline, "yellow")
    unit = "step" if res.basis == "steps" else "second"
    head = Text()
    head.append(f"thread {res.tid} {res.comm}", "bold")
    head.append(
        f"  pid {res.pid}: {res.steps:,} {unit}s"
        + (f" ended by {res.marker} ({res.markers_per_step} per step)" if res.basis == "steps" else "")
        + "\n"
    )
    head.append(
        f"  typical {res.typical_ms:,.2f} ms (spread {res.spread_ms:,.2f}), mean {res.mean_ms:,.2f}, p90 "
        f"{res.p90_ms:,.2f}, max {res.max_ms:,.2f} ms"
        + (f"; {res.steps_per_s:,.1f} steps/s" if res.basis == "steps" else "")
        + f"; slow above {res.slow_above_ms:,.2f} ms: {res.slow_steps:,}\n"
    )
    parts: list[RenderableType] = [head]
    for p in res.patterns:
        body = Text()
        body.append(p.summary + "\n", "bold yellow")
        for x in p.extra:
            body.append(f"    {x.ms:+9,.1f} ms  {x.what}\n")
        parts.append(body)
    if res.irregular:
        others = res.slow_steps - sum(p.count for p in res.patterns)
        parts.append(
            Text(
                f"{others:,} other slow {unit}s, slowest: "
                + "; ".join(f"{unit} {s.step} at {s.start_s:.2f} s {s.ms:,.1f} ms" for s in res.irregular[:8])
                + (" (--json for 20)" if others > 8 else "")
            )
        )
    if res.note:
        parts.append(Text(res.note, "dim"))
    return Group(*parts)
