"""Rich renderers of the analysis records (one function per record), and JSON output for ``--json``.

Renderers only format: every number comes from the record, so the CLI shows what MCP returns. Traced strings
(comm, paths, kernel names) are data: they are escaped so that rich markup inside them is printed, not
applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tracer.analysis import Record
from tracer.analysis.breakdown import Breakdown, ThreadBreakdown
from tracer.analysis.chains import CausalChain, ChainsResult
from tracer.analysis.compare import Comparison, Noise
from tracer.analysis.sql import SqlResult
from tracer.analysis.stacks import Frame, StacksResult
from tracer.analysis.stats import ProcessStat, TraceStats
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


def render_stats(st: TraceStats, *, show_all: bool = False) -> RenderableType:
    """Return the overview; processes are grouped by (comm, role) unless ``show_all`` (one row each)."""
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
    ops = Table(title="CUDA operations (exact, every call)", title_justify="left")
    for c in ("op", "layer", "calls", "p50", "p95", "p99", "max", "tail p99/p50", "bytes", "total"):
        ops.add_column(c, justify="left" if c in ("op", "layer") else "right", no_wrap=c != "op")
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
    procs = render_processes(st.processes, show_all=show_all)
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
    return Group(head, ops, procs, host, _training_line(st), chains)


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
        t.append("   (tracer breakdown --db …)", "dim")
    t.append(f"\nTracer: {st.tracer.summary}", "dim")
    return t


TOP_PROCESS_GROUPS = 8  # rows of the grouped process table; the rest is one "and M more" line


@dataclass(frozen=True)
class ProcessGroup:
    """Processes sharing (comm, role), e.g. the DataLoader workers re-forked every epoch, summed."""

    comm: str
    role: str
    pids: list[int]
    cuda_calls: int
    context_switches: int
    preemptions: int
    off_cpu_s: float
    runq_s: float
    worst_stall_ms: float
    exited: int
    failed: int  # exited with a non-zero status
    first: ProcessStat  # the group's first process (the whole group when it has one)


def group_processes(procs: Sequence[ProcessStat]) -> list[ProcessGroup]:
    """Return ``procs`` grouped by (comm, role), in the order of each group's first process (the analysis'
    ranking: main process first, then by CUDA calls and off-CPU time). Totals are sums; worst stall the max."""
    members: dict[tuple[str, str], list[ProcessStat]] = {}
    for p in procs:
        members.setdefault((p.comm, p.role), []).append(p)
    return [
        ProcessGroup(
            comm=comm,
            role=role,
            pids=[p.pid for p in ps],
            cuda_calls=sum(p.cuda_calls for p in ps),
            context_switches=sum(p.context_switches for p in ps),
            preemptions=sum(p.preemptions for p in ps),
            off_cpu_s=sum(p.off_cpu_s for p in ps),
            runq_s=sum(p.runq_s for p in ps),
            worst_stall_ms=max(p.worst_stall_ms for p in ps),
            exited=sum(p.exit_s is not None for p in ps),
            failed=sum(bool(p.exit_code) for p in ps if p.exit_s is not None),
            first=ps[0],
        )
        for (comm, role), ps in members.items()
    ]


def _exit_cell(g: ProcessGroup) -> str:
    if len(g.pids) == 1:
        p = g.first
        return "" if p.exit_s is None else f"{p.exit_s:.1f}s code {p.exit_code}"
    if not g.exited:
        return ""
    parts = [f"{g.exited} exited" if g.exited < len(g.pids) else "all exited"]
    if g.failed:
        parts.append(f"{g.failed} failed")
    return ", ".join(parts)


def render_processes(procs: Sequence[ProcessStat], *, show_all: bool = False, top: int = TOP_PROCESS_GROUPS) -> Table:
    """Return the process table: the top ``top`` (comm, role) groups with counts and totals, then one line for
    the rest; with ``show_all``, one row per process."""
    groups = group_processes(procs)
    shown = [group_processes([p])[0] for p in procs] if show_all else groups[:top]
    # no column rules: eleven columns fit 120 terminal columns with the longest comm and role unabridged
    t = Table(
        title="Processes",
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),
    )
    for c in ("comm", "role", "procs", "pid", "calls", "ctx sw", "preempt", "off-CPU", "runq", "worst", "exit"):
        # numbers never wrap: rich narrows comm and role instead
        t.add_column(c, justify="left" if c in ("comm", "role", "exit") else "right", no_wrap=c not in ("comm", "role"))
    for g in shown:
        pid = str(g.pids[0]) if len(g.pids) == 1 else f"{min(g.pids)}…{max(g.pids)}"
        t.add_row(
            _s(g.comm),
            g.role,
            f"{len(g.pids):,}",
            pid,
            f"{g.cuda_calls:,}",
            f"{g.context_switches:,}",
            f"{g.preemptions:,}",
            f"{g.off_cpu_s:.2f}s",
            f"{g.runq_s:.2f}s",
            us(g.worst_stall_ms * 1e3),
            _exit_cell(g),
        )
    lines = []
    if not show_all and len(groups) > top:
        rest = groups[top:]
        lines.append(
            f"and {len(rest)} more ({sum(len(g.pids) for g in rest):,} processes, "
            f"{sum(g.cuda_calls for g in rest):,} CUDA calls; tracer stats --all)"
        )
    if not show_all and len(groups) < len(procs):
        lines.append(f"{len(procs):,} processes grouped by (comm, role); one row each: tracer stats --all")
    t.caption = "\n".join(lines) or None
    return t


LIST_ITEMS = 8  # evidence lists show this many items, then how many there are in all
ROW_ITEMS = 5  # evidence lists of records (preemptors, stalls) show this many, one a line
NATIVE_RUN = 6  # a run of more native frames than this (interpreter start-up, ctypes) shows its ends only


def _few(items: Sequence[object], n: int = LIST_ITEMS) -> str:
    """Return the first ``n`` items comma-joined, then how many there are in all when there are more."""
    head = ", ".join(map(str, items[:n]))
    return head if len(items) <= n else f"{head}, … ({len(items)} in all)"


def _fold_native(frames: Sequence[Frame]) -> list[Frame | int]:
    """Return ``frames`` with each run of more than NATIVE_RUN native frames cut to its two outermost and two
    innermost frames around the count of those left out: the Python lines and the CUDA call stay whole."""
    out: list[Frame | int] = []
    run: list[Frame] = []
    for f in [*frames, None]:
        if f is not None and f.kind == "native":
            run.append(f)
            continue
        out += [*run[:2], len(run) - 4, *run[-2:]] if len(run) > NATIVE_RUN else run
        run = []
        if f is not None:
            out.append(f)
    return out


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
        body: list[RenderableType] = [
            Text(c.summary),
            Text(
                (f"op {c.op}: p50 {us(c.op_p50_us)}, p99 {us(c.op_p99_us)}   " if c.op else "")
                + f"pids {_few(c.pids, 6)}"
                f"   t = {c.start_ns / 1e9:.2f}-{c.end_ns / 1e9:.2f} s   impact {c.impact_ms:,.0f} ms",
                "dim",
            ),
            _cost_line(c),
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
    return Group(*parts)


def render_stacks(res: StacksResult) -> RenderableType:
    parts: list[RenderableType] = [
        Text(
            f"{res.op}: {res.op_calls_total:,} calls in total, {res.stored_calls:,} stored, {res.distinct_stacks} "
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
        for depth, f in enumerate(_fold_native(s.frames)):
            if isinstance(f, int):
                body.append("   " + "  " * depth + f"⋮ {f} native frames (--json for all)\n", "dim")
                continue
            if prev is not None and prev != f.kind:
                body.append("   " + "  " * depth + "↓\n", "dim")
            where = f"{f.file}:{f.line}" if f.file else f.module
            body.append("   " + "  " * depth)
            body.append(f"{KIND_LABEL.get(f.kind, f.kind):7}", "cyan" if f.kind == "python" else "dim")
            body.append(f" {where}  ")
            body.append(f"{f.function}\n", "bold" if f.kind == "python" else "")
            prev = f.kind
        parts.append(body)
    if len(res.stacks) < res.distinct_stacks:
        parts.append(Text(f"and {res.distinct_stacks - len(res.stacks)} more stacks (tracer stacks --limit N)", "dim"))
    return Group(*parts)


def render_sql(res: SqlResult) -> RenderableType:
    t = Table(
        *res.columns,
        caption=f"{res.row_count} rows{' (truncated)' if res.truncated else ''}, {res.elapsed_ms:.0f} ms",
    )
    for r in res.rows:
        t.add_row(*[Text("NULL", style="dim") if v is None else Text(str(v)) for v in r])
    return t


TIMELINE_PARTS = ("launch", "sync", "alloc", "free", "copy")  # the catalog's parts (sync copies are sync)


def render_timeline(tl: Timeline) -> RenderableType:
    t = Table(
        "t (s)",
        "launch",
        "sync",
        "alloc",
        "free",
        "copy",
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
            *(str(b.calls.get(k, 0)) for k in TIMELINE_PARTS),
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


PART_STYLE = {"cpu": "green", "sync": "cyan", "blocked": "magenta", "runq_other": "red", "runq_tree": "yellow"}
BAR = 30  # characters of a part's share bar


def _thread_view(t: ThreadBreakdown, basis: str) -> list[RenderableType]:
    head = Text()
    head.append(f"thread {t.tid} {t.comm}", "bold")
    head.append(
        f"  pid {t.pid} ({t.process_comm}), {t.role}, t = {t.first_s:.2f}-{t.end_s:.2f} s, wall {t.wall_ms:,.0f} ms, "
        f"{t.cuda_calls:,} CUDA calls"
    )
    if t.check is not None:
        head.append(
            f"\n  parts cover {t.check.accounted_ms:,.1f} of {t.check.span_ms:,.1f} ms of its span "
            f"(gap {t.check.gap_ms:,.1f} ms, {t.check.gap_pct:.2f}%)",
            "dim",
        )
    parts = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    for c in ("part", "ms", "share", ""):
        parts.add_column(c, justify="right" if c in ("ms", "share") else "left")
    for p in t.parts:
        if p.ms == 0:
            continue
        parts.add_row(
            p.part, f"{p.ms:,.1f}", f"{p.share:.1%}", Text("█" * round(p.share * BAR), PART_STYLE.get(p.part, ""))
        )
    out: list[RenderableType] = [head, Padding(parts, (0, 0, 0, 2), expand=False)]
    extra = Text()
    if t.in_call_off_cpu_ms:
        extra.append(
            f"  inside calls: {t.in_call_off_cpu_ms:,.1f} ms off CPU, {t.in_call_runq_ms:,.1f} ms of it waiting "
            "for a CPU\n"
        )
    if t.io_ms:
        extra.append(f"  of blocked: {t.io_ms:,.1f} ms uninterruptible (I/O, page-fault I/O, mmap lock)\n")
    if t.faults or t.page_alloc_bytes or t.reclaim_ms:
        extra.append(
            f"  page faults {t.faults:,}, pages allocated {nbytes(t.page_alloc_bytes)}, direct reclaim "
            f"{t.reclaim_ms:,.1f} ms\n"
        )
    if t.holders:
        extra.append("  waited for a CPU held by: ")
        extra.append("; ".join(f"{h.comm} {h.pid} [{h.holder}] {h.runq_ms:,.1f} ms" for h in t.holders))
        extra.append(f"  ({t.holders_note})\n" if t.holders_note else "\n", "dim")
    if t.wakers:
        extra.append("  woken by: ")
        extra.append(
            "; ".join(f"{w.comm} {w.pid}/{w.tid} [{w.holder}] {w.wakeups:,}x {w.blocked_ms:,.1f} ms" for w in t.wakers)
            + "\n"
        )
    elif basis != "exact":
        extra.append("  woken by: not recorded (no wakers in this recording)\n", "dim")
    if extra:
        out.append(extra)
    if t.buckets:
        cols = (
            "cpu",
            "launch",
            "sync",
            "alloc",
            "free",
            "copy",
            "other",
            "runq_self",
            "runq_tree",
            "runq_other",
            "runq_tracer",
            "blocked",
        )
        shown = [c for c in cols if any(c in b.ms for b in t.buckets)]
        bt = Table(
            "t (s)",
            "wall ms",
            *shown,
            "faults",
            "page alloc",
            box=box.SIMPLE_HEAD,
            show_edge=False,
            title="per bucket, share of the bucket",
            title_justify="left",
        )
        for b in t.buckets:
            bt.add_row(
                f"{b.start_s:.0f}",
                f"{b.wall_ms:,.0f}",
                *(f"{b.share.get(c, 0):.0%}" if c in b.share else "" for c in shown),
                f"{b.faults:,}" if b.faults else "",
                nbytes(b.page_alloc_bytes) if b.page_alloc_bytes else "",
            )
        out.append(Padding(bt, (0, 0, 0, 2), expand=False))
    return out


def render_breakdown(b: Breakdown) -> RenderableType:
    """Return where each CUDA thread's time went (training thread first), its process's threads, the tracer."""
    parts: list[RenderableType] = []
    head = Text()
    head.append("Time breakdown", "bold")
    head.append(f" ({b.basis})" + (f", pid {b.pid}" if b.pid is not None else "") + f", buckets of {b.bucket_s} s")
    if b.note:
        head.append(f"\n{b.note}", "yellow")
    parts.append(head)
    if not b.threads:
        where = f" for pid {b.pid}" if b.pid is not None else ""
        parts.append(Text(f"No CUDA thread in this recording{where}."))
    for t in b.threads:
        parts += _thread_view(t, b.basis)
    if len(b.process_threads) > 1:
        pt = Table(
            "tid",
            "comm",
            "cuda calls",
            "wall ms",
            "cpu ms",
            "in calls ms",
            "runq ms",
            "blocked ms",
            "faults",
            "page alloc",
            "reclaim ms",
            title=f"threads of pid {b.process_threads[0].pid}, most page allocation first",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            show_edge=False,
        )
        for x in b.process_threads:
            pt.add_row(
                str(x.tid),
                _s(x.comm),
                f"{x.cuda_calls:,}",
                f"{x.wall_ms:,.0f}",
                f"{x.cpu_ms:,.0f}",
                f"{x.in_calls_ms:,.0f}",
                f"{x.runq_ms:,.0f}",
                f"{x.blocked_ms:,.0f}",
                f"{x.faults:,}",
                nbytes(x.page_alloc_bytes),
                f"{x.reclaim_ms:,.1f}",
            )
        parts.append(pt)
    parts.append(Text(f"Tracer: {b.tracer.summary}", "dim"))
    return Group(*parts)


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
        name = _s(o.op) + ("" if o.layer in ("runtime", "") else f" ({o.layer})")
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
                _s(x.culprit) + (f" ({x.note})" if x.note else ""),
            )
        parts.append(ch)
    else:
        parts.append(Text("Causal chains: none on either side"))
    parts.append(Text(f"Noise ({c.tests} tests): {c.noise_test}", "dim"))
    return Group(*parts)


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
    }[type(record)]  # type: ignore[index]
    console.print(view(record))  # type: ignore[operator]
