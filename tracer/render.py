"""Rich renderers of the analysis records (one function per record), and JSON output for ``--json``.

Renderers only format: every number comes from the record, so the CLI shows what MCP returns. Traced strings
(comm, paths, kernel names) are data: they are escaped so that rich markup inside them is printed, not
applied.
"""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tracer.analysis import Record
from tracer.analysis.chains import ChainsResult
from tracer.analysis.sql import SqlResult
from tracer.analysis.stacks import StacksResult
from tracer.analysis.stats import TraceStats
from tracer.analysis.timeline import Around, Timeline

SEVERITY_STYLE = {"HIGH": "bold red", "MEDIUM": "yellow", "LOW": "cyan"}
KIND_LABEL = {"python": "Python", "native": "native", "cuda": "CUDA"}


def to_json(record: Record) -> str:
    """Return the record as indented JSON (the same object the MCP tool returns)."""
    return record.model_dump_json(indent=2)


def us(v: float | None) -> str:
    """Format a µs latency with a readable unit: 850µs, 1.2ms, 3.40s."""
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f}s"
    if v >= 1e3:
        return f"{v / 1e3:.1f}ms"
    return f"{v:.0f}µs" if v >= 10 else f"{v:.1f}µs"


def nbytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.1f} {unit}"
    return f"{v:.0f} B"


def _s(text: object) -> str:
    return escape(str(text))


def render_stats(st: TraceStats) -> RenderableType:
    e = st.environment
    head = Text.assemble(
        ("Trace ", "bold"),
        (f"{e.started_at}  {e.duration_s:.1f} s  status {e.status}\n", ""),
        (
            f"{e.host}: {e.cpu_model} ({e.cpu_cores} CPUs, {nbytes(e.mem_bytes)} RAM), GPU {e.gpus or 'none'}"
            f"{' driver ' + e.driver if e.driver else ''}, kernel {e.kernel}, Python {e.python_version}\n",
            "",
        ),
        (
            f"target {e.target}  |  events traced {st.events_traced:,}, stored {st.events_stored:,}, lost "
            f"{st.events_lost:,}",
            "dim",
        ),
    )
    ops = Table(title="CUDA operations (exact, every call)", title_justify="left")
    for c in ("op", "layer", "calls", "p50", "p95", "p99", "max", "tail p99/p50", "bytes", "total"):
        ops.add_column(c, justify="left" if c in ("op", "layer") else "right")
    for o in st.ops:
        tail_style = "bold red" if o.tail_ratio >= 100 else "yellow" if o.tail_ratio >= 10 else ""
        ops.add_row(
            _s(o.op),
            o.layer,
            f"{o.calls:,}" + ("*" if o.sampled_fraction < 1 else ""),
            us(o.p50_us),
            us(o.p95_us),
            us(o.p99_us),
            us(o.max_us),
            Text(f"{o.tail_ratio:,.1f}x", style=tail_style),
            nbytes(o.bytes) if o.bytes else "",
            f"{o.total_ms / 1e3:.2f}s",
        )
    if any(o.sampled_fraction < 1 for o in st.ops):
        ops.caption = "* scaled from a sample"
    procs = Table(title="Processes", title_justify="left")
    for c in (
        "pid",
        "comm",
        "role",
        "cuda calls",
        "ctx switches",
        "preempted",
        "off-CPU",
        "runq",
        "worst stall",
        "exit",
    ):
        procs.add_column(c, justify="left" if c in ("comm", "role", "exit") else "right")
    for p in st.processes:
        ex = "" if p.exit_s is None else f"{p.exit_s:.1f}s code {p.exit_code}"
        procs.add_row(
            str(p.pid),
            _s(p.comm),
            p.role,
            f"{p.cuda_calls:,}",
            f"{p.context_switches:,}",
            f"{p.preemptions:,}",
            f"{p.off_cpu_s:.2f}s",
            f"{p.runq_s:.2f}s",
            f"{p.worst_stall_ms:.1f}ms",
            ex,
        )
    h = st.host
    host = Text(
        f"Host peaks ({h.samples} samples): load1 {h.max_load1 if h.max_load1 is not None else '-'}, CPU busy "  # noqa: E501
        f"{h.max_cpu_busy_pct if h.max_cpu_busy_pct is not None else '-'}%, min MemAvailable "
        f"{nbytes(h.min_mem_available_bytes)}, page alloc {nbytes(h.max_page_alloc_bytes_per_s)}/s, swap "
        f"{nbytes(h.max_swap_used_bytes)}"
    )
    sev = st.chains_by_severity
    chains = Text.assemble(
        ("Causal chains: ", "bold"),
        *[(f"{sev.get(k, 0)} {k}  ", SEVERITY_STYLE[k]) for k in ("HIGH", "MEDIUM", "LOW")],
    )
    if st.top_chain:
        chains.append(f"\nworst: {st.top_chain}\nnext: tracer chains --db …")
    return Group(head, ops, procs, host, chains)


def render_chains(res: ChainsResult) -> RenderableType:
    if not res.chains:
        return Text(
            f"No causal chains found ({res.total} total). The traced calls' tails are explained by "
            "nothing the host did."
        )
    parts: list[RenderableType] = [
        Text(
            f"{res.total} chains: " + ", ".join(f"{n} {k}" for k, n in res.by_severity.items() if n),
            style="bold",
        )
    ]
    for i, c in enumerate(res.chains, 1):
        body = Text()
        body.append(f"{c.summary}\n")
        body.append(
            f"op {c.op}: p50 {us(c.op_p50_us)}, p99 {us(c.op_p99_us)}   pids {', '.join(map(str, c.pids))}"
            f"   t = {c.start_ns / 1e9:.2f}-{c.end_ns / 1e9:.2f} s   impact {c.impact_ms:,.0f} ms\n",
            "dim",
        )
        body.append("evidence\n", "bold")
        for k, v in c.evidence.items():
            if v is None or v == [] or v == {}:
                continue
            if isinstance(v, list) and v and isinstance(v[0], dict):
                v = "; ".join(", ".join(f"{a}={b}" for a, b in d.items()) for d in v[:5])
            body.append(f"  {k}: {v}\n")
        body.append("fix\n", "bold")
        for j, r in enumerate(c.recommendations, 1):
            body.append(f"  {j}. {r}\n")
        parts.append(
            Panel(
                body,
                title=Text(f"#{i} {c.severity} {c.category}", style=SEVERITY_STYLE[c.severity]),
                title_align="left",
                subtitle=c.id,
                subtitle_align="right",
            )
        )
    return Group(*parts)


def render_stacks(res: StacksResult) -> RenderableType:
    parts: list[RenderableType] = [
        Text(
            f"{res.op}: {res.op_calls_total:,} calls in total, {res.stored_calls:,} stored, {res.distinct_stacks} "  # noqa: E501
            f"distinct stacks" + (f" (pid {res.pid})" if res.pid is not None else ""),
            style="bold",
        )
    ]
    for i, s in enumerate(res.stacks, 1):
        body = Text()
        body.append(f"#{i} {s.label}", "bold")
        body.append(
            f"  {s.calls:,} calls  avg {us(s.avg_us)}  min {us(s.min_us)}  max {us(s.max_us)}"
            + (f"  {nbytes(s.total_bytes)}" if s.total_bytes else "")
            + f"  pids {', '.join(map(str, s.pids))}\n"
        )
        prev = None
        for depth, f in enumerate(s.frames):
            if prev is not None and prev != f.kind:
                body.append("   " + "  " * depth + "↓\n", "dim")
            where = f"{f.file}:{f.line}" if f.file else f.module
            body.append("   " + "  " * depth)
            body.append(f"{KIND_LABEL.get(f.kind, f.kind):7}", "cyan" if f.kind == "python" else "dim")
            body.append(f" {where}  ")
            body.append(f"{f.function}\n", "bold" if f.kind == "python" else "")
            prev = f.kind
        parts.append(body)
    return Group(*parts)


def render_sql(res: SqlResult) -> RenderableType:
    t = Table(
        *res.columns,
        caption=f"{res.row_count} rows{' (truncated)' if res.truncated else ''}, {res.elapsed_ms:.0f} ms",
    )
    for r in res.rows:
        t.add_row(*[Text("NULL", style="dim") if v is None else Text(str(v)) for v in r])
    return t


def render_timeline(tl: Timeline) -> RenderableType:
    t = Table(
        "t (s)",
        "launch",
        "sync",
        "alloc",
        "memcpy",
        "sync p99",
        "sync max",
        "off-CPU",
        "preempt",
        "worst stall",
        "page alloc",
        "load",
        title=f"{tl.bucket_s} s buckets" + (f", pid {tl.pid}" if tl.pid else ""),
        title_justify="left",
    )
    for b in tl.buckets:
        t.add_row(
            f"{b.start_s:.0f}",
            *(str(b.calls.get(k, 0)) for k in ("launch", "sync", "alloc", "memcpy")),
            us(b.sync_p99_us),
            us(b.sync_max_us),
            f"{b.off_cpu_ms:.1f} ms",
            str(b.preemptions),
            f"{b.worst_stall_ms:.1f} ms",
            nbytes(b.page_alloc_bytes),
            "" if b.max_load1 is None else f"{b.max_load1:.2f}",
        )
    return t


def render_around(a: Around) -> RenderableType:
    t = Table(
        "offset",
        "src",
        "pid",
        "tid",
        "comm",
        "what",
        "dur",
        "detail",
        title=f"±{a.window_ms:g} ms around t = {a.ts_ns / 1e9:.6f} s",
        title_justify="left",
    )
    for e in a.events:
        t.add_row(
            f"{e.offset_us:+.0f} µs",
            e.source,
            str(e.pid),
            "" if e.tid is None else str(e.tid),
            _s(e.comm),
            _s(e.what),
            us(e.dur_us),
            _s(e.detail),
        )
    return t


def print_record(record: Record, console: Console, *, as_json: bool) -> None:
    """Print ``record`` to ``console``: JSON, or its rich view."""
    if as_json:
        console.print_json(to_json(record)) if console.is_terminal else console.out(to_json(record), highlight=False)
        return
    view = {
        TraceStats: render_stats,
        ChainsResult: render_chains,
        StacksResult: render_stacks,
        SqlResult: render_sql,
        Timeline: render_timeline,
        Around: render_around,
    }[type(record)]  # type: ignore[index]
    console.print(view(record))  # type: ignore[operator]
