"""BEFORE against AFTER (``tracer compare``): the headline, steps, the training thread's parts, ops, chains, each
difference with its verdict against the recordings' own noise."""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from tracer.analysis.compare import Comparison, Noise
from tracer.views.render.cells import escaped, us

VERDICT_STYLE = {"beyond_noise": "bold", "within_noise": "dim", "too_short": "yellow", "not_tested": "dim"}
VERDICT_LABEL = {"beyond_noise": "beyond noise", "within_noise": "noise", "too_short": "too short", "not_tested": "-"}
VERDICT_SHORT = {"beyond_noise": "BEYOND", "within_noise": "noise", "too_short": "short", "not_tested": "-"}
COMPARE_OPS = 12  # op rows shown; --json has them all


def _verdict(n: Noise, unit: str = "") -> Text:
    """Return a difference's verdict with its interval: 'beyond noise [-43.1, -41.8]'."""
    t = Text(VERDICT_LABEL[n.verdict], VERDICT_STYLE[n.verdict])
    if n.ci_lo is not None and n.ci_hi is not None:
        t.append(f" [{n.ci_lo:+,.4g}, {n.ci_hi:+,.4g}]{unit}", "dim")
    return t


def _arrow(a: float | None, b: float | None, fmt: str = "{:,.2f}") -> str:
    """Return 'a -> b' with missing sides as '-'."""
    return f"{'-' if a is None else fmt.format(a)} → {'-' if b is None else fmt.format(b)}"


def render_comparison(c: Comparison) -> RenderableType:
    """Return BEFORE against AFTER: the headline, steps, the training thread's parts, ops, chains, warnings."""
    parts: list[RenderableType] = []
    head = Text()
    head.append("Compare ", "bold")
    head.append(f"{c.before.name} → {c.after.name}")
    for label, r in (("before", c.before), ("after", c.after)):
        who = f"thread {r.training_tid} {r.training_comm}" if r.training_tid is not None else "no CUDA thread"
        head.append(
            f"\n  {label}: {r.target}  ({who}, loop {r.loop_s:,.1f} s from t = {r.loop_start_s:,.1f} s, "
            f"{r.seconds} whole seconds, {r.basis})",
            "dim",
        )
    parts.append(head)
    for w in c.warnings:
        parts.append(Text(f"{w.level}: {w.message}", "yellow" if w.level == "warning" else "dim"))
    parts.append(Padding(Text("\n".join(f"• {h}" for h in c.headline), "bold"), (1, 0, 1, 0)))
    st = c.steps
    steps = Table(
        "",
        "before",
        "after",
        "change",
        "verdict",
        title="Steps: " + st.method,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    if st.detected:
        steps.add_row(
            "steps/s",
            "-" if st.before.steps_per_s is None else f"{st.before.steps_per_s:,.2f}",
            "-" if st.after.steps_per_s is None else f"{st.after.steps_per_s:,.2f}",
            "" if st.delta_pct is None else f"{st.delta_pct:+.1f}%",
            _verdict(st.noise, " steps/s"),
        )
    for label, attr in (("waits for the GPU", "markers"), ("launches", "launches")):
        steps.add_row(
            label,
            f"{getattr(st.before, attr):,.0f}",
            f"{getattr(st.after, attr):,.0f}",
            "",
            "",
        )
    parts.append(steps)
    if c.training is not None:
        tr = Table(
            "part",
            "ms",
            "share",
            "change",
            "ms per step",
            "verdict (interval in points)",
            title=f"Training thread: where its time went ({c.training.before_wall_ms:,.0f} ms → "
            f"{c.training.after_wall_ms:,.0f} ms of loop)",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            show_edge=False,
        )
        for p in c.training.parts:
            tr.add_row(
                p.part,
                _arrow(p.before_ms, p.after_ms, "{:,.0f}"),
                _arrow(100 * p.before_share, 100 * p.after_share, "{:.1f}%"),
                f"{p.delta_points:+.1f} pts",
                _arrow(p.before_ms_per_step, p.after_ms_per_step, "{:,.2f}")
                if p.before_ms_per_step is not None
                else "",
                _verdict(p.noise),
            )
        parts.append(tr)
    ops = Table(
        title="CUDA ops (exact counts; rates per second of loop)",
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    for col in ("op", "calls/s", "change", "ms per s", "p50", "p99", "calls·time·p50·p99"):
        ops.add_column(col, justify="left" if col == "op" else "right", no_wrap=col != "op")
    for o in c.ops[:COMPARE_OPS]:
        verdicts = Text("·").join(
            Text(VERDICT_SHORT[n.verdict], VERDICT_STYLE[n.verdict])
            for n in (o.rate_noise, o.time_noise, o.p50_noise, o.p99_noise)
        )
        name = escaped(o.op) + ("" if o.layer in ("runtime", "") else f" ({o.layer})")
        ops.add_row(
            name + ("" if o.presence == "both" else f" [{o.presence.replace('_', ' ')}]"),
            _arrow(o.calls_per_s_before, o.calls_per_s_after, "{:,.1f}"),
            "" if o.calls_delta_pct is None else f"{o.calls_delta_pct:+.1f}%",
            _arrow(o.ms_per_s_before, o.ms_per_s_after, "{:,.1f}"),
            f"{us(o.p50_us_before)} → {us(o.p50_us_after)}",
            f"{us(o.p99_us_before)} → {us(o.p99_us_after)}",
            verdicts,
        )
    more = f"and {len(c.ops) - COMPARE_OPS} more ops (--json); " if len(c.ops) > COMPARE_OPS else ""
    ops.caption = more + "BEYOND: beyond noise; short: too few seconds or calls (--json: the intervals)"
    parts.append(ops)
    if c.chains:
        ch = Table(
            "chain",
            "status",
            "severity",
            "share",
            "culprit",
            title="Causal chains",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            show_edge=False,
        )
        for x in c.chains:
            ch.add_row(
                x.category,
                Text(x.status, "bold" if x.status != "unchanged" else "dim"),
                f"{x.severity_before or '-'} → {x.severity_after or '-'}",
                _arrow(
                    None if x.share_before is None else 100 * x.share_before,
                    None if x.share_after is None else 100 * x.share_after,
                    "{:.1f}%",
                ),
                escaped(x.culprit) + (f" ({x.note})" if x.note else ""),
            )
        parts.append(ch)
    else:
        parts.append(Text("Causal chains: none on either side"))
    parts.append(Text(f"Noise ({c.tests} tests): {c.noise_test}", "dim"))
    return Group(*parts)
