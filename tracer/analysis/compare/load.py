"""One side of a comparison, loaded once: its training loop (the training thread's steps, from the chains'
context), the loop's whole seconds (the samples of the per-second tests), exact per-op totals and histograms,
the stored call rows per op and second, and its causal chains."""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb
import numpy as np

from tracer.analysis.chains import CausalChain, ChainContext, Subject, detect_all
from tracer.analysis.chains.stored import load as stored_answer
from tracer.analysis.stats import OpStat, op_stats
from tracer.hist import OpHistogram

S = 1_000_000_000
MS = 1_000_000
MIN_SECONDS = 5  # whole seconds of loop per side below which a per-second test cannot tell noise from change

OpKey = tuple[str, str]  # (op, layer)


@dataclass
class Loop:
    """A recording's training loop: its span (ns since start) and its whole seconds, the samples of the
    per-second tests. All the step analysis needs of a side, so it can be replayed on recorded series."""

    span: tuple[int, int]
    seconds: list[int]

    @property
    def loop_s(self) -> float:
        return max(self.span[1] - self.span[0], 0) / S

    @property
    def short(self) -> bool:
        return len(self.seconds) < MIN_SECONDS

    def per_s(self, count: float) -> float:
        return count / self.loop_s if self.loop_s > 0 else 0.0

    def series(self, rows: dict[int, float]) -> np.ndarray:
        """Return the per-second values ``rows`` (sec -> value in that second) over the loop's whole seconds, 0
        where a second has none."""
        return np.array([rows.get(sec, 0.0) for sec in self.seconds], dtype=np.float64)

    def present(self, rows: dict[int, float]) -> np.ndarray:
        """Return the per-second values ``rows`` over the loop's whole seconds that have one (a second with no
        value was not measured, as opposed to a measured 0)."""
        return np.array([rows[sec] for sec in self.seconds if sec in rows], dtype=np.float64)


@dataclass
class Side(Loop):
    """What one recording contributes, loaded once."""

    name: str
    conn: duckdb.DuckDBPyConnection
    ctx: ChainContext
    subject: Subject | None
    ops: dict[OpKey, OpStat]
    hists: dict[OpKey, OpHistogram]  # exact latency over every pid
    errors: dict[OpKey, float]  # bound on a duty-cycled op's count error, as a fraction (0: exact)
    chains: list[CausalChain]
    stored: dict[OpKey, tuple[int, int]] = field(default_factory=dict)  # (op, layer) -> (rows, dur)
    by_sec: dict[OpKey, dict[int, tuple[int, int]]] = field(default_factory=dict)


def load_side(conn: duckdb.DuckDBPyConnection, name: str) -> Side:
    ctx = ChainContext.load(conn)
    subject = ctx.training
    span = (subject.start_ns, subject.end_ns) if subject is not None else (0, ctx.info.duration_ns)
    start, end = span
    # only whole seconds of loop: an edge second's breakdown row holds time before or after the loop too
    seconds = list(range(-(-start // S), end // S))
    hists: dict[OpKey, OpHistogram] = {}
    errors: dict[OpKey, float] = {}
    err = "coalesce(max(error_pct), 0)" if ctx.info.has("op_stats", "error_pct") else "0"
    for op, layer, error_pct, stored, mins, maxs in conn.execute(
        f"SELECT op, coalesce(layer, ''), {err}, list(hist), list(min_ns), list(max_ns) FROM op_stats GROUP BY ALL"
    ).fetchall():
        hists[(op, layer)] = OpHistogram.of(zip(stored or [], mins or [], maxs or [], strict=True))
        errors[(op, layer)] = error_pct / 100
    side = Side(
        name=name,
        conn=conn,
        ctx=ctx,
        subject=subject,
        span=span,
        seconds=seconds,
        ops={(o.op, o.layer): o for o in op_stats(conn)},
        hists=hists,
        errors=errors,
        chains=kept.chains if (kept := stored_answer(conn)) is not None else detect_all(ctx),
    )
    for op, layer, n, dur in conn.execute(
        "SELECT op, coalesce(layer, ''), count(*), sum(dur_ns) FROM cuda_calls GROUP BY ALL"
    ).fetchall():
        side.stored[(op, layer)] = (int(n), int(dur or 0))
    for op, layer, sec, n, dur in conn.execute(
        "SELECT op, coalesce(layer, ''), ts_ns // 1000000000, count(*), sum(dur_ns) FROM cuda_calls "
        "WHERE ts_ns >= $a AND ts_ns < $b GROUP BY ALL",
        {"a": start, "b": end},
    ).fetchall():
        side.by_sec.setdefault((op, layer), {})[int(sec)] = (int(n), int(dur or 0))
    return side
