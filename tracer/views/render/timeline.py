"""When things happened (``tracer timeline``): fixed time buckets, and every event around one instant."""

from __future__ import annotations

from rich.console import RenderableType
from rich.table import Table

from tracer.analysis.timeline import Around, Timeline
from tracer.views.render.cells import escaped, nbytes, us

TIMELINE_PARTS = ("launch", "sync", "alloc", "free", "copy")  # the catalog's parts (sync copies are sync)
# the bucket's counts and sync p99 come from the stored calls, not the exact histogram (none per bucket): said
# under the table, as the overview's "* scaled from a sample"
SAMPLED_NOTE = (
    "launch … copy: stored calls; * p99 of the stored syncs, a sample once the recording's row budget binds (every "
    "slow call, some fast ones): it can lean high. Exact per-op percentiles: tracer stats"
)


def render_timeline(tl: Timeline) -> RenderableType:
    t = Table(
        "t (s)",
        "launch",
        "sync",
        "alloc",
        "free",
        "copy",
        "sync p99*",
        "sync max",
        "off-CPU",
        "preempt",
        "worst stall",
        "page alloc",
        "load",
        title=f"{tl.bucket_s} s buckets" + (f", pid {tl.pid}" if tl.pid else ""),
        title_justify="left",
        caption=SAMPLED_NOTE,
        caption_justify="left",
    )
    for b in tl.buckets:
        t.add_row(
            f"{b.start_s:.0f}",
            *(str(b.calls.get(k, 0)) for k in TIMELINE_PARTS),
            us(b.sync_p99_us_sampled),
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
            escaped(e.comm),
            escaped(e.what),
            us(e.dur_us),
            escaped(e.detail),
        )
    return t
