"""The headline: the comparison in a few lines, most important first."""

from __future__ import annotations

from tracer.analysis.compare.model import ChainChange, Comparison
from tracer.analysis.compare.statistics import MIN_CALLS

TOP_OPS = 12  # ops shown in the summary lines


def _chain_line(ch: ChainChange) -> str:
    return (
        f"chain {ch.category} ({ch.culprit}): {ch.status}, {ch.severity_before or '-'} -> {ch.severity_after or 'gone'}"
    )


def headline(c: Comparison) -> list[str]:
    """Return steps/s (whatever its verdict: it is the question), then every other difference beyond noise.

    When steps/s moved beyond noise, its line also names the job's chains that explain it: those that went away or
    got better when it rose, those that appeared or got worse when it fell."""
    head, out = [], []
    st = c.steps
    own = [ch for ch in c.chains if ch.status != "unchanged" and "another process" not in ch.note]
    if st.comparable and st.before.steps_per_s is not None and st.after.steps_per_s is not None:
        pct = f" ({st.delta_pct:+.1f}%)" if st.delta_pct is not None else ""
        line = f"steps/s {st.before.steps_per_s:,.2f} -> {st.after.steps_per_s:,.2f}{pct}: " + st.noise.verdict.replace(
            "_", " "
        )
        if st.noise.verdict == "beyond_noise" and st.delta_per_s:
            why = ("gone", "better") if st.delta_per_s > 0 else ("appeared", "worse")
            explains = [ch for ch in own if ch.status in why]
            own = [ch for ch in own if ch not in explains]
            if explains:
                line += "; " + "; ".join(_chain_line(ch) for ch in explains)
        head.append(line)
    for p in c.training.parts if c.training else []:
        if p.noise.verdict == "beyond_noise":
            per_step = (
                f", {p.before_ms_per_step:,.2f} -> {p.after_ms_per_step:,.2f} ms per step"
                if p.before_ms_per_step is not None and p.after_ms_per_step is not None
                else ""
            )
            out.append(
                f"{p.part}: {p.before_share:.1%} -> {p.after_share:.1%} of the training thread's time "
                f"({p.delta_points:+.1f} points){per_step}: beyond noise"
            )
    out += [_chain_line(ch) for ch in own]  # the job's own changes; another process's are in the chains table
    for o in c.ops[:TOP_OPS]:
        if o.presence != "both" and (o.calls_before + o.calls_after) >= MIN_CALLS:
            where = "before" if o.presence == "before_only" else "after"
            out.append(f"{o.op} ({o.layer}) only {where}: {max(o.calls_before, o.calls_after):,} calls")
        elif o.rate_noise.verdict == "beyond_noise" or o.time_noise.verdict == "beyond_noise":
            out.append(
                f"{o.op} ({o.layer}): {o.calls_per_s_before:,.1f} -> {o.calls_per_s_after:,.1f} calls/s, "
                f"{o.ms_per_s_before:,.1f} -> {o.ms_per_s_after:,.1f} ms per second of loop: beyond noise"
            )
    if not out and st.noise.verdict != "beyond_noise":
        out.append("no difference beyond noise")
    return head + out
