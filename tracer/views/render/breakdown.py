"""Where each CUDA thread's time went (``tracer breakdown``): its parts with share bars, who held the CPU and
who woke it, per bucket, its process's threads, the tracer's cost."""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from tracer.analysis.breakdown.records import Breakdown, ThreadBreakdown
from tracer.views.render.cells import escaped, nbytes

PART_STYLE = {"cpu": "green", "sync": "cyan", "blocked": "magenta", "runq_other": "red", "runq_tree": "yellow"}
BAR = 30  # characters of a part's share bar


def _runs(tid: int, name: str) -> str | None:
    """What the thread ran, 'aggregate_metrics, metrics.py:15', where the breakdown named it by its hottest
    function (its OS name being generic); else None."""
    head = f"thread {tid} ("
    return name[len(head) : -1] if name.startswith(head) and name.endswith(")") else None


def _thread_view(t: ThreadBreakdown, basis: str) -> list[RenderableType]:
    head = Text()
    # named by what it runs where its OS name says nothing (python3, its process's): thread 12858 (fn, file:line)
    head.append(t.name if _runs(t.tid, t.name) else f"thread {t.tid} {t.comm}", "bold")
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
    w = t.cpu_wait
    if w.ms:
        # the whole wait for a CPU, the part inside calls too (a sync's wakeup behind the CPU's holder is in "sync")
        extra.append(f"  waiting for a CPU in all: {w.ms:,.1f} ms ({w.share:.1%})", "bold")
        if w.in_calls_ms:
            extra.append(f", {w.in_calls_ms:,.1f} ms of it inside CUDA calls (in their parts)")
        extra.append(": " + ", ".join(f"{c} {v:,.1f} ms" for c, v in w.by_holder_ms.items() if v) + "\n")
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
            "thread",
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
            runs = _runs(x.tid, x.name)
            pt.add_row(
                str(x.tid),
                escaped(f"{x.comm} ({runs})" if runs else x.comm),
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
