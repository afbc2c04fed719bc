"""Causal chains (``tracer chains``): one panel per chain with its cost, evidence and fixes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.text import Text

from tracer.analysis.chains import CausalChain, ChainsResult
from tracer.analysis.chains.model import Coverage, Hop, Root
from tracer.views.render.cells import SEVERITY_STYLE, us

LIST_ITEMS = 8  # evidence lists show this many items, then how many there are in all
ROW_ITEMS = 5  # evidence lists of records (preemptors, stalls) show this many, one a line


def _few(items: Sequence[object], n: int = LIST_ITEMS) -> str:
    """Return the first ``n`` items comma-joined, then how many there are in all when there are more."""
    head = ", ".join(map(str, items[:n]))
    return head if len(items) <= n else f"{head}, … ({len(items)} in all)"


def _evidence_view(evidence: dict[str, Any]) -> list[RenderableType]:
    """Return a chain's evidence as lines: the numbers share lines, each list gets its own (cut to a few items
    and how many in all), and wrapped lines keep their indent."""
    out: list[RenderableType] = []
    scalars = [f"{k} {v}" for k, v in evidence.items() if not isinstance(v, (list, dict)) and v is not None]
    if scalars:
        out.append(Padding(Text("  ·  ".join(scalars)), (0, 0, 0, 2)))
    for k, v in evidence.items():
        if not isinstance(v, (list, dict)) or not v:
            continue
        if isinstance(v, dict):
            v = [v]
        if isinstance(v[0], dict):
            out.append(Padding(Text(f"{k}:"), (0, 0, 0, 2)))
            for d in v[:ROW_ITEMS]:
                out.append(Padding(Text(", ".join(f"{a}={b}" for a, b in d.items())), (0, 0, 0, 4)))
            if len(v) > ROW_ITEMS:
                out.append(Padding(Text(f"… ({len(v)} in all)"), (0, 0, 0, 4)))
        else:
            out.append(Padding(Text(f"{k}: {_few(v)}"), (0, 0, 0, 2)))
    return out


def _cost_line(c: CausalChain) -> Text:
    """Return "cost: N% of thread T's time · culprit: …" for a chain (its ranking key and who to act on)."""
    t = Text()
    t.append(f"cost {c.share:.1%} of thread {c.tid} ({c.thread_comm})'s steps", "bold")
    if c.basis != "exact":
        t.append(f" ({c.basis})", "dim")
    u = c.culprit
    if u is not None:
        who = " ".join(
            x for x in (u.comm, f"pid {u.pid}" if u.pid is not None else "", f"tid {u.tid}" if u.tid else "") if x
        )
        t.append(f"   culprit: {who} [{u.relation}]" + (f" at {u.code_site}" if u.code_site else ""))
    return t


def _hop(h: Hop) -> str:
    """One hop: 'name (tid) [role, state] at site'."""
    who = h.comm + (f" ({h.tid})" if h.tid is not None else f" (pid {h.pid})" if h.pid else "")
    return f"{who} [{h.role}, {h.state}]" + (f" at {h.site}" if h.site else "")


def path_lines(path: Sequence[Hop], root: Root | None, branches: Sequence[Hop] = ()) -> list[Text]:
    """A chain's wait path in a few lines: the affected thread, each hop with its edge and share, the root; the
    other branches of the first fork on one line under the first hop."""
    if not path:
        return []
    lines = [Text(f"path: {_hop(path[0])}")]
    for i, h in enumerate(path[1:]):
        lines.append(Text(f"  --{h.edge} {h.share:.0%}--> {_hop(h)}"))
        if i == 0 and branches:
            also = "; ".join(f"--{b.edge} {b.share:.0%}--> {_hop(b)}" for b in branches)
            lines.append(Text(f"     (also {also})", "dim"))
    if root is not None:
        lines.append(Text(f"  => root {root.kind}: {root.detail}", "bold"))
    else:
        lines.append(Text("  => root not found (a cycle of waits, or deeper than the graph follows)", "dim"))
    return lines


def render_coverage(cv: Coverage | None) -> RenderableType:
    """Return what the chains leave unexplained of the training thread's time: each part of at least 5% of its
    steps, with what explains it or, when nothing does, where its time went."""
    if cv is None:
        return Text("")
    head = Text(f"coverage of thread {cv.tid} (pid {cv.pid}), {cv.steps_ms:,.0f} ms of steps: ", "bold")
    head.append(f"{cv.unexplained_share:.0%} unexplained", "bold red" if cv.unexplained_share > 0.10 else "bold")
    if cv.lost_share:
        head.append(f"; root found for {cv.root_found_share:.0%} of its lost time ({cv.lost_share:.0%} of its steps)")
    lines: list[RenderableType] = [head]
    for p in cv.parts:
        why = ", ".join(p.explained_by) if p.explained_by else "unexplained"
        if p.root:
            why += f"  (root: {p.root})"
        lines.append(Padding(Text(f"{p.part:<11} {p.share:6.1%}  {p.ms:>10,.1f} ms  {why}"), (0, 0, 0, 2)))
        lines += [Padding(Text(site, "dim"), (0, 0, 0, 6)) for site in p.top_sites]
    return Group(*lines)


def render_chains(res: ChainsResult) -> RenderableType:
    if not res.chains:
        return Group(
            Text(
                f"No causal chains found ({res.total} total). The traced calls' tails are explained by "
                "nothing the host did."
            ),
            render_coverage(res.coverage),
        )
    parts: list[RenderableType] = [
        Text(
            f"{res.total} chains: " + ", ".join(f"{n} {k}" for k, n in res.by_severity.items() if n),
            style="bold",
        )
    ]
    for i, c in enumerate(res.chains, 1):
        body: list[RenderableType] = [
            Text(c.summary),
            Text(
                (f"op {c.op}: p50 {us(c.op_p50_us)}, p99 {us(c.op_p99_us)}   " if c.op else "")
                + f"pids {_few(c.pids, 6)}"
                f"   t = {c.start_ns / 1e9:.2f}-{c.end_ns / 1e9:.2f} s   impact {c.impact_ms:,.0f} ms",
                "dim",
            ),
            _cost_line(c),
            *path_lines(c.path, c.root, c.branches),
            Text("evidence", "bold"),
        ]
        # a typed evidence record (pydantic) or a plain dict: the same key/value view
        body += _evidence_view(c.evidence if isinstance(c.evidence, dict) else c.evidence.model_dump(exclude={"kind"}))
        body.append(Text("fix", "bold"))
        body += [Padding(Text(f"{j}. {r}"), (0, 0, 0, 2)) for j, r in enumerate(c.recommendations, 1)]
        parts.append(
            Panel(
                Group(*body),
                title=Text(f"#{i} {c.severity} {c.category}", style=SEVERITY_STYLE[c.severity]),
                title_align="left",
                subtitle=c.id,
                subtitle_align="right",
            )
        )
    if len(res.chains) < res.total:
        parts.append(Text(f"and {res.total - len(res.chains)} more chains (tracer chains --limit N)", "dim"))
    parts.append(render_coverage(res.coverage))
    return Group(*parts)
