"""Latency of each MCP tool's analysis function on a trace DB of >= 1 M cuda_calls rows (median of 5 runs).

The DB comes from bench/synthetic.py ``generate_large`` (one process, four ops, a CPU hog, a stack per op, and the
per-second time accounting today's recorder writes), ended as `tracer record` ends a recording: its causal chains
computed once and stored (tracer.analysis.chains.stored), which the tools then serve. It is opened read-only as the
MCP server opens it. Timed:
``trace_stats`` (get_trace_stats; target <= 100 ms), ``top_stacks`` (get_stacks; <= 300 ms), ``compute_chains``
(get_causal_chains; <= 1 s) and ``run_sql`` (run_sql, a GROUP BY over cuda_calls). ``trace_stats_estimated`` times
get_trace_stats again on the same calls recorded without time accounting (a recording from before schema v2),
where the breakdown is estimated on every call. ``trace_stats_computed`` and ``compute_chains_computed`` time the
two on the DB before its chains were stored: what they cost where the stored answer does not serve (a live snapshot,
a pid filter, a job of several recordings; bench/scaling times the same at an hour's size). The targets are printed
next to the medians, never asserted.

    .venv/bin/python -m bench.queries [--quick] [--rows N] [--db PATH]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import base_parser, median, print_table, spread, write_result
from bench.synthetic import generate_large
from tracer.analysis.chains import store_chains

ROWS, QUICK_ROWS = 1_000_000, 1_000_000
RUNS = 5
TARGETS_MS = {
    "trace_stats": 100.0,
    "top_stacks": 300.0,
    "compute_chains": 1000.0,
    "run_sql": None,
    "trace_stats_estimated": None,
    "trace_stats_computed": None,
    "compute_chains_computed": None,
}
SQL = "SELECT op, count(*) AS calls, avg(dur_ns) AS mean_ns, max(dur_ns) AS max_ns FROM cuda_calls GROUP BY op"


def generate(path: Path, rows: int, accounting: bool = True) -> Path:
    """Write the synthetic DB of ``rows`` calls (``accounting``: with per-thread time accounting); return it."""
    return generate_large(path, rows, accounting=accounting)


def tools(conn: Any) -> dict[str, Callable[[], Any]]:
    from tracer.analysis.chains import compute_chains
    from tracer.analysis.sql.run import run_sql
    from tracer.analysis.stacks import top_stacks
    from tracer.analysis.stats import trace_stats

    return {
        "trace_stats": lambda: trace_stats(conn),
        "top_stacks": lambda: top_stacks(conn, "cudaStreamSynchronize"),
        "compute_chains": lambda: compute_chains(conn),
        "run_sql": lambda: run_sql(conn, SQL),
    }


def measure(db: Path, runs: int = RUNS, only: set[str] | None = None) -> dict[str, Any]:
    """Open ``db`` read-only and time each tool (those in ``only``) ``runs`` times after one warm-up; return ms
    figures."""
    from tracer.analysis.db import open_trace

    conn = open_trace(db)
    try:
        rows = conn.execute("SELECT count(*) FROM cuda_calls").fetchone()[0]
        out: dict[str, Any] = {}
        for name, fn in tools(conn).items():
            if only is not None and name not in only:
                continue
            t = time.perf_counter()
            fn()
            first = (time.perf_counter() - t) * 1e3
            ms = []
            for _ in range(runs):
                t = time.perf_counter()
                fn()
                ms.append((time.perf_counter() - t) * 1e3)
            target = TARGETS_MS[name]
            out[name] = {
                "median_ms": median(ms),
                "first_ms": first,
                "runs_ms": ms,
                "spread": spread(ms),
                "target_ms": target,
                "within_target": None if target is None else statistics.median(ms) <= target,
            }
        return {"cuda_calls_rows": int(rows), "tools": out}
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--rows", type=int, default=None, help=f"cuda_calls rows to generate (default {ROWS:,})")
    p.add_argument("--db", type=Path, default=None, help="time an existing trace DB instead of generating one")
    args = p.parse_args(argv)
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    with tempfile.TemporaryDirectory(prefix="bench-queries-") as tmp:
        db = args.db
        gen_s = None
        computed = None
        if db is None:
            t = time.perf_counter()
            db = generate(Path(tmp) / "large.duckdb", rows)
            gen_s = time.perf_counter() - t
            computed = measure(db, only={"trace_stats", "compute_chains"})["tools"]
            store_chains(db)  # as `tracer record` ends a recording
        res = measure(db)
        for name, fig in (computed or {}).items():
            res["tools"][f"{name}_computed"] = {**fig, "target_ms": None, "within_target": None}
        res["db_bytes"] = db.stat().st_size
        if args.db is None:
            old = measure(generate(Path(tmp) / "v1.duckdb", rows, accounting=False), only={"trace_stats"})
            res["tools"]["trace_stats_estimated"] = {**old["tools"]["trace_stats"], "target_ms": None}
            res["tools"]["trace_stats_estimated"]["within_target"] = None
    res["generate_s"] = gen_s
    res["runs"] = RUNS
    print(f"{res['cuda_calls_rows']:,} cuda_calls rows")
    print_table(
        [[k, v["median_ms"], v["first_ms"], v["target_ms"], v["within_target"]] for k, v in res["tools"].items()],
        ["tool", "median ms", "first ms", "target ms", "within"],
    )
    print(f"wrote {write_result('queries', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
