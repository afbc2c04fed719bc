"""Where in its step a rank spends its extra time: between which two CUDA calls, named by their code lines.

Stacks are taken at CUDA calls only, so a sleep or a collective between two calls has no stack of its own; but a
training step makes the same calls from the same lines every step, so the time between two consecutive calls of
a thread, keyed by the two calls' ops, says which stretch of the step it lies in; the stretch is named by the
code sites that hold most of its time among the calls that have a stack (launch stacks may be sampled).

Only calls that are not nested in another call of the thread count (a runtime call's driver call is not a stretch
of the step), and only stored calls (``cuda_calls`` within the recorder's budget: a busy thread's stored calls
are a sample, whose gaps are then longer). The straggler's extra time is in the stretch where its gaps exceed the
other ranks' median most; the others' wait is in the stretch where their gaps exceed the straggler's most (a
collective between a launch and the next sync).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

import duckdb

Key = tuple[str, str]  # the op of the call a stretch starts after, the op of the call it ends at
Named = list[tuple[Key, "int | None", "int | None", float]]  # (stretch, stack before, stack after, ns)


@dataclass(frozen=True)
class Stretch:
    """The stretch of a step between two CUDA calls, and extra time found there."""

    after_site: str | None  # 'file:line function' of the call the stretch starts after
    after_op: str
    before_site: str | None  # ... and of the call it ends at
    before_op: str
    extra_ns: float  # over the whole window: the rank's gaps there above the comparison

    def text(self) -> str:
        a = f"{self.after_op} at {self.after_site}" if self.after_site else self.after_op
        b = f"{self.before_op} at {self.before_site}" if self.before_site else self.before_op
        return f"between {a} and {b}"


def gaps(
    conn: duckdb.DuckDBPyConnection, tids: list[int], start_ns: int, end_ns: int
) -> tuple[dict[int, dict[Key, float]], dict[int, Named]]:
    """Return {tid: {stretch: total ns between its two calls}} over the stored calls in [start_ns, end_ns), and
    {tid: [(stretch, stack before, stack after, ns)]} to name the stretches by."""
    rows = conn.execute(
        """
        WITH c AS (SELECT tid, ts_ns, dur_ns, op, stack_id,
                          max(ts_ns + dur_ns) OVER (PARTITION BY tid ORDER BY ts_ns
                                                    ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_end
                   FROM cuda_calls WHERE list_contains($tids, tid) AND ts_ns >= $a AND ts_ns < $b),
        top AS (SELECT * FROM c WHERE prev_end IS NULL OR ts_ns >= prev_end),
        n AS (SELECT tid, op, stack_id, lead(op) OVER w AS nop, lead(stack_id) OVER w AS nstack,
                     lead(ts_ns) OVER w - (ts_ns + dur_ns) AS gap FROM top
              WINDOW w AS (PARTITION BY tid ORDER BY ts_ns))
        SELECT tid, op, stack_id, nop, nstack, sum(gap) FROM n WHERE nop IS NOT NULL AND gap > 0 GROUP BY ALL""",
        {"tids": tids, "a": start_ns, "b": end_ns},
    ).fetchall()
    totals: dict[int, dict[Key, float]] = {}
    named: dict[int, Named] = {}
    for tid, op, sid, nop, nsid, ns in rows:
        d = totals.setdefault(int(tid), {})
        d[(op, nop)] = d.get((op, nop), 0.0) + float(ns or 0)
        named.setdefault(int(tid), []).append(((op, nop), sid, nsid, float(ns or 0)))
    return totals, named


def name(
    key: Key, extra_ns: float, named: dict[int, Named], tids: list[int], frame_of: Callable[[int], str | None]
) -> Stretch:
    """Return stretch ``key`` named by the code sites of its calls that hold the most of its time in ``tids``."""
    after: dict[str, float] = {}
    before: dict[str, float] = {}
    for tid in tids:
        for k, sid, nsid, ns in named.get(tid, ()):
            if k != key:
                continue
            if sid is not None and (site := frame_of(sid)):
                after[site] = after.get(site, 0.0) + ns
            if nsid is not None and (site := frame_of(nsid)):
                before[site] = before.get(site, 0.0) + ns

    def top(d: dict[str, float]) -> str | None:
        return max(d, key=lambda s: (d[s], s)) if d else None

    return Stretch(after_site=top(after), after_op=key[0], before_site=top(before), before_op=key[1], extra_ns=extra_ns)


def straggler_stretch(totals: dict[int, dict[Key, float]], slow: int, others: list[int]) -> tuple[Key, float] | None:
    """Return the stretch where thread ``slow``'s gaps exceed the ``others``' median most, and that excess."""
    best: tuple[float, Key] | None = None
    for key, ns in totals.get(slow, {}).items():
        extra = ns - median(totals.get(t, {}).get(key, 0.0) for t in others) if others else ns
        if extra > 0 and (best is None or (extra, key) > best):
            best = (extra, key)
    return (best[1], best[0]) if best else None


def wait_stretch(totals: dict[int, dict[Key, float]], slow: int, others: list[int]) -> tuple[Key, float] | None:
    """Return the stretch where the ``others``' gaps exceed thread ``slow``'s most (their median excess)."""
    mine = totals.get(slow, {})
    best: tuple[float, Key] | None = None
    for key in {k for t in others for k in totals.get(t, {})}:
        extra = median(totals.get(t, {}).get(key, 0.0) for t in others) - mine.get(key, 0.0)
        if extra > 0 and (best is None or (extra, key) > best):
            best = (extra, key)
    return (best[1], best[0]) if best else None
