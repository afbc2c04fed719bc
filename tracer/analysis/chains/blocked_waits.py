"""The training threads' blocked time of one kind (GIL, lock, I/O), read from the off-CPU stacks: what the
detectors that name a waiting line share."""

from __future__ import annotations

from collections.abc import Iterator

from tracer.analysis.chains.context import HIGH_SHARE, LOW_SHARE, MEDIUM_SHARE, ChainContext, Subject, grade
from tracer.analysis.stack_time import StackTime, blocked_stacks


def graded_waits(ctx: ChainContext, kind: str) -> Iterator[tuple[Subject, list[StackTime], float, str]]:
    """Yield (subject, its blocked stacks of ``kind`` within its steps, their ns, severity) for each subject
    whose waits of that kind grade LOW or worse; nothing for a recording without off-CPU stacks."""
    if not ctx.info.has("offcpu_stacks"):
        return
    for s in ctx.subjects:
        waits = [b for b in blocked_stacks(ctx.conn, s.tid, ctx.in_steps(s)) if b.kind == kind]
        cost = sum(b.ns for b in waits)
        sev = grade(s.share(cost), HIGH_SHARE, MEDIUM_SHARE, LOW_SHARE)
        if sev is not None:
            yield s, waits, cost, sev
