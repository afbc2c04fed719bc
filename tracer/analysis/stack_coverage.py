"""Why calls of an op have no stack, said plainly: each call of the op is in exactly one of with a stack, not
seen (the probes were off: duty cycle), seen but not stored (the row budget), stored without a stack walk (the
stack budget), or stored with a walk that was lost (issue 23: 78-97 % of launches showed "(no stack captured)"
with no reason given).

The recorder's policy is the probe catalog's (``probes/catalog.py``): a call at or above its class's ``SLOW_NS``
is always stored and always walked; of the others a stored call of class C is walked 1 in ``STACK_EVERY[C]``
(the first N of an op on each CPU, then 1 in N at random; 1 for every class but launches). So:

- not seen = calls x (1 - sampled_fraction): ``op_stats`` counts a duty-cycled launch op scaled up from the
  windows its probes were live;
- not stored = what was seen less the stored rows;
- a stored call without a stack that the policy walks (a slow call, or any call of an op walked 1 in 1) lost its
  walk (the stack's ring buffer was full, or it could not be resolved): ``lost_walk``;
- the other stored calls without a stack were not walked: ``stack_budget``.
"""

from __future__ import annotations

from typing import Annotated

import duckdb
from pydantic import Field

from probes.catalog import SLOW_NS, STACK_EVERY, OpClass
from tracer.analysis import Record
from tracer.analysis.taxonomy import spec

REASONS: dict[str, str] = {
    "duty_cycle": "not seen: the launch probes were attached only part of the time (overhead budget), and the count "
    "is scaled from the windows they were",
    "row_budget": "seen and counted, but no row stored (--max-events): only stored calls carry a stack",
    "stack_budget": "stored without a stack walk: the recorder walks 1 stored call in {every} of this op (after the "
    "first {every} per CPU; every call >= {slow_us:g} us); stacks are deduplicated, so each call site shows up",
    "lost_walk": "walked but the stack was lost (its ring buffer was full, or it could not be resolved): the policy "
    "walks every such call",
}


class MissingStacks(Record):
    """Calls of the op without a stack, for one reason."""

    reason: Annotated[str, Field(description="duty_cycle | row_budget | stack_budget | lost_walk")]
    calls: Annotated[int, Field(description="calls for this reason (duty_cycle: estimated from the scaling)")]
    why: str


class StackCoverage(Record):
    """How many calls of the op have a stack, and why the others have none; the parts add up to ``calls``."""

    calls: Annotated[int, Field(description="every call of the op (op_stats; scaled when duty-cycled)")]
    with_stack: Annotated[int, Field(description="stored calls with a stack")]
    share: Annotated[float, Field(description="with_stack / calls")]
    missing: Annotated[list[MissingStacks], Field(description="the calls without a stack, by reason, most first")]
    summary: Annotated[str, Field(description="one line")]


def stack_coverage(conn: duckdb.DuckDBPyConnection, op: str, pid: int | None = None) -> StackCoverage:
    """Return how many calls of ``op`` (of ``pid``) have a stack and why the others have none."""
    p = {"op": op, "pid": pid}
    total, seen = conn.execute(
        "SELECT coalesce(sum(calls), 0), coalesce(sum(calls * coalesce(sampled_fraction, 1.0)), 0) FROM op_stats "
        "WHERE op = $op AND ($pid IS NULL OR pid = $pid)",
        p,
    ).fetchone()
    s = spec(op)
    cls = s.op_class if s else OpClass.OTHER
    slow_ns, every = SLOW_NS.get(cls, 1_000_000), STACK_EVERY.get(cls, 1)
    stored, walked, slow_bare, bare = conn.execute(
        "SELECT count(*), count(stack_id), count(*) FILTER (WHERE stack_id IS NULL AND dur_ns >= $slow), "
        "count(*) FILTER (WHERE stack_id IS NULL) FROM cuda_calls WHERE op = $op AND ($pid IS NULL OR pid = $pid)",
        {**p, "slow": slow_ns},
    ).fetchone()
    total = max(int(total), int(stored))
    seen = min(max(round(seen), int(stored)), total)
    lost = int(bare) if every <= 1 else int(slow_bare)
    counts = {
        "duty_cycle": total - seen,
        "row_budget": seen - int(stored),
        "stack_budget": int(bare) - lost,
        "lost_walk": lost,
    }
    missing = [
        MissingStacks(reason=r, calls=n, why=REASONS[r].format(every=every, slow_us=slow_ns / 1e3))
        for r, n in sorted(counts.items(), key=lambda kv: -kv[1])
        if n > 0
    ]
    share = walked / total if total else 0.0
    summary = f"{op}: {int(walked):,} of {total:,} calls have a stack ({share:.1%})" + (
        "; without: " + ", ".join(f"{m.calls:,} {m.reason.replace('_', ' ')}" for m in missing) if missing else ""
    )
    return StackCoverage(calls=total, with_stack=int(walked), share=round(share, 4), missing=missing, summary=summary)
