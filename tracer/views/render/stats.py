"""The overview (``tracer stats``): environment, per-op latency, processes, host peaks, the training thread."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tracer.analysis.stats import TraceStats
from tracer.views.render.cells import SEVERITY_STYLE, escaped, nbytes, us
from tracer.views.render.processes import render_busy_threads, render_processes


def render_stats(st: TraceStats, *, show_all: bool = False) -> RenderableType:
    """Return the overview; processes grouped by (comm, parent, role, rank) unless ``show_all`` (one row each:
    the stats need ``detail``)."""
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
    if not st.recording.finished:  # live, or cut off: the numbers are partial
        head.append(f"\nrecording: {st.recording.ended}", "yellow")
    if st.job:  # several recordings: their processes' pids carry the recording (see the note)
        head.append(f"\n{st.job}", "dim")
    ops = Table(title="CUDA operations (exact, every call)", title_justify="left")
    for c in ("op", "layer", "calls", "p50", "p95", "p99", "max", "tail p99/p50", "bytes", "total"):
        ops.add_column(c, justify="left" if c in ("op", "layer") else "right", no_wrap=c != "op")
    for o in st.ops:
        tail_style = "bold red" if o.tail_ratio >= 100 else "yellow" if o.tail_ratio >= 10 else ""
        ops.add_row(
            escaped(o.op),
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
    procs = render_processes(st.process_groups, more=st.more_processes, every=st.processes if show_all else ())
    busy = render_busy_threads(st.busy_threads, st.more_busy_threads)
    h = st.host
    host = Text(
        f"Host peaks ({h.samples} samples): load1 {h.max_load1 if h.max_load1 is not None else '-'}, CPU busy "
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
    return Group(head, ops, procs, *([busy] if busy else []), host, _training_line(st), chains)


def _training_line(st: TraceStats) -> Text:
    """Return where the training thread's time went, largest parts first, and the tracer's own cost."""
    t = Text()
    tr = st.training_thread
    if tr is None:
        t.append("Training thread: none (no CUDA thread)")
    else:
        t.append(f"Training thread {tr.tid} ({tr.comm}, pid {tr.pid})", "bold")
        t.append(f" {tr.wall_ms / 1e3:,.1f} s" + (f" ({tr.basis})" if tr.basis != "exact" else "") + ": ")
        t.append(", ".join(f"{p.part} {p.share:.0%}" for p in tr.parts if p.share >= 0.005))
        in_calls = tr.cpu_wait_share - sum(p.share for p in tr.parts if p.part.startswith("runq_"))
        if in_calls >= 0.005:  # the wait for a CPU hidden in the call parts (a sync's wakeup): said in one figure
            t.append(f"; waiting for a CPU {tr.cpu_wait_share:.0%} in all, inside calls too")
        t.append("   (tracer breakdown --db …)", "dim")
    t.append(f"\nTracer: {st.tracer.summary}", "dim")
    return t
