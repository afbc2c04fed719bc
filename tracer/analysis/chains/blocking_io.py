"""blocking_io: the thread did file I/O itself (a synchronous checkpoint: write + fsync), waiting for the disk in
uninterruptible sleep and copying data into the page cache on its own CPU.

Blocked stacks (offcpu_stacks) classified ``io`` (D state, or a file sync such as fsync) are the waits; the
kernel-mode CPU samples (cpu_samples.kernel) at lines of the functions that waited are the writes' copies into
the page cache. Cost: both, in the thread's steps. The page cache the thread filled (thread_breakdown
page_cache_bytes) is the write's, which memory_pressure leaves to this chain.
"""

from __future__ import annotations

from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, grade
from tracer.analysis.chains.model import BlockingIoEvidence, CausalChain, Culprit, IoSite
from tracer.analysis.code_site import user_frame
from tracer.analysis.stack_time import StackTime, blocked_stacks, sampled_stacks, syscall_of

CATEGORY = "blocking_io"
HIGH = HIGH_SHARE
MEDIUM = MEDIUM_SHARE
LOW = LOW_SHARE
MS = 1_000_000
# the libc calls of a file write and its sync
WRITE_CALLS = frozenset(
    {"fsync", "fdatasync", "sync_file_range", "msync", "write", "__libc_write", "pwrite64", "writev", "open", "open64"}
)


def _function(s: StackTime) -> tuple[str | None, str | None]:
    f = user_frame(s.frames)
    return (f[3], f[2]) if f else (None, None)


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return a chain per subject that lost time in its own file I/O."""
    if not ctx.info.has("offcpu_stacks"):
        return []
    out = []
    for s in ctx.subjects:
        weight = ctx.in_steps(s)
        io = [b for b in blocked_stacks(ctx.conn, s.tid, weight) if b.kind == "io"]
        if not io:
            continue
        # the functions that wrote: their kernel CPU is the copy into the page cache (a mkdir or an unlink that
        # waited once elsewhere in the loop's own function must not claim that function's kernel time)
        funcs = {_function(b) for b in io if syscall_of(b.frames) in WRITE_CALLS} - {(None, None)}
        writes: list[StackTime] = []
        if ctx.info.has("cpu_samples") and funcs:
            kern = sampled_stacks(ctx.conn, [s.tid], weight, outside_calls=True, kernel=True).get(s.tid, [])
            writes = [k for k in kern if _function(k) in funcs]
        wait = sum(b.ns for b in io)
        cpu = sum(k.ns for k in writes)
        cost = wait + cpu
        sev = grade(s.share(cost), HIGH, MEDIUM, LOW)
        if sev is None:
            continue
        acc: dict[tuple[str | None, str | None, str], float] = {}
        for b in io:
            key = (b.site, syscall_of(b.frames), b.state)
            acc[key] = acc.get(key, 0.0) + b.ns
        for k in writes:
            key = (k.site, None, "cpu")
            acc[key] = acc.get(key, 0.0) + k.ns
        sites = [
            IoSite(site=site, call=call, state=state, ms=round(ns / MS, 1))
            for (site, call, state), ns in sorted(acc.items(), key=lambda kv: -kv[1])[:6]
        ]
        woken: dict[str, float] = {}
        for b in io:
            for k, v in b.wakers.items():
                woken[k] = woken.get(k, 0.0) + v
        cached = 0
        if ctx.info.has("thread_breakdown", "page_cache_bytes"):
            cached = int(
                ctx.conn.execute(
                    "SELECT coalesce(sum(page_cache_bytes), 0) FROM thread_breakdown WHERE tid = ?", [s.tid]
                ).fetchone()[0]
            )
        top = sites[0].site if sites else None
        calls = sorted({c for (_, c, _) in acc if c})
        out.append(
            ctx.chain(
                s,
                category=CATEGORY,
                severity=sev,
                cost_ns=cost,
                culprit=Culprit(
                    kind="code", pid=s.pid, tid=s.tid, comm=s.time.comm, relation="own_thread", code_site=top
                ),
                summary=(
                    f"Thread {s.tid} (pid {s.pid}) did blocking file I/O itself"
                    + (f" ({', '.join(calls)})" if calls else "")
                    + f": {wait / MS:,.0f} ms waiting for the disk"
                    + (f" and {cpu / MS:,.0f} ms copying into the page cache" if cpu else "")
                    + f", {s.share(cost):.0%} of its steps' time"
                    + (f", at {top}" if top else "")
                    + "."
                ),
                evidence=BlockingIoEvidence(
                    io_wait_ms=round(wait / MS, 1),
                    io_cpu_ms=round(cpu / MS, 1),
                    waits=round(sum(b.intervals for b in io)),
                    d_state_ms=round(sum(b.ns for b in io if b.state == "D") / MS, 1),
                    sites=sites,
                    page_cache_bytes=cached,
                    woken_by={k: round(v / MS, 1) for k, v in sorted(woken.items(), key=lambda kv: -kv[1])},
                ),
                recommendations=[
                    "Take the checkpoint off the training thread: torch.distributed.checkpoint.async_save, or copy the "
                    "state to CPU and write it from a background thread or process"
                    + (f" (the I/O is at {top})." if top else "."),
                    "If the save must be synchronous, skip the fsync per save (fsync once at the end or every Nth "
                    "save), write less often, or write to faster local storage.",
                ],
            )
        )
    return out
