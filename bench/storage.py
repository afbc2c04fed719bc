"""Bytes per stored CUDA call and DB growth per minute, from a real recording of fixtures/workloads/train.py.

Records train.py at the reference mix (bench.overhead's arguments, about 5 K launches/s and 200 syncs/s) with
``tracer record`` for a fixed number of steps, then measures each table's share of the file by copying it alone
into a fresh DuckDB file (size minus an empty file's). ``bytes_per_call`` is the cuda_calls table alone over its
rows; sched, stacks and the rest are reported separately, and ``db_bytes_per_min`` extrapolates the whole file
to one minute of recording at the measured call rate.

    sudo .venv/bin/python -m bench.storage [--quick]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb

from bench.common import TRACER, base_parser, build_fixtures, need_root, print_table, write_result
from bench.overhead import parse_train_summary, train_cmd

STEPS, EPOCHS = 200, 5
QUICK_STEPS, QUICK_EPOCHS = 200, 2


def table_bytes(db: Path, work: Path) -> dict[str, dict[str, int]]:
    """Return {table: {rows, bytes}}: each table copied alone into a fresh file, minus an empty file's size."""
    empty = work / "empty.duckdb"
    c = duckdb.connect(str(empty))
    c.execute("CHECKPOINT")
    c.close()
    base = empty.stat().st_size
    src = duckdb.connect(str(db), read_only=True)
    try:
        tables = [
            r[0]
            for r in src.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' ORDER BY 1"
            ).fetchall()
        ]
    finally:
        src.close()
    out: dict[str, dict[str, int]] = {}
    for t in tables:
        one = work / f"t_{t}.duckdb"
        c = duckdb.connect(str(one))
        try:
            c.execute(f"ATTACH '{db}' AS src (READ_ONLY)")
            c.execute(f'CREATE TABLE "{t}" AS SELECT * FROM src."{t}"')  # names come from the DB's catalog
            n = c.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]
            c.execute("DETACH src")
            c.execute("CHECKPOINT")
        finally:
            c.close()
        out[t] = {"rows": int(n), "bytes": max(0, one.stat().st_size - base)}
        one.unlink()
    return out


def summarize(db_bytes: int, tables: dict[str, dict[str, int]], duration_s: float) -> dict[str, Any]:
    """Bytes per call and per minute from the table sizes of a recording lasting ``duration_s``."""
    calls = tables.get("cuda_calls", {"rows": 0, "bytes": 0})
    rows = calls["rows"]
    other = {k: v for k, v in tables.items() if k != "cuda_calls"}
    per_min = 60.0 / duration_s if duration_s else None
    return {
        "db_bytes": db_bytes,
        "cuda_calls_rows": rows,
        "bytes_per_call": calls["bytes"] / rows if rows else None,
        "db_bytes_per_call": db_bytes / rows if rows else None,
        "calls_per_s": rows / duration_s if duration_s else None,
        "db_bytes_per_min": db_bytes * per_min if per_min else None,
        "cuda_calls_bytes_per_min": calls["bytes"] * per_min if per_min else None,
        "other_tables_bytes": sum(v["bytes"] for v in other.values()),
        "tables": tables,
        "duration_s": duration_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    args = p.parse_args(argv)
    need_root("bench.storage")
    build_fixtures()
    steps, epochs = (QUICK_STEPS, QUICK_EPOCHS) if args.quick else (STEPS, EPOCHS)
    with tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp:
        db = Path(tmp) / "trace.duckdb"
        cmd = [str(TRACER), "record", "--db", str(db), "--force", "--", *train_cmd(epochs, steps)]
        t0 = time.monotonic()
        pr = subprocess.run(cmd, capture_output=True, text=True)
        if pr.returncode:
            sys.exit(f"tracer record failed ({pr.returncode}):\n{pr.stderr[-2000:]}")
        train = parse_train_summary(pr.stderr)
        con = duckdb.connect(str(db), read_only=True)
        duration = con.execute("SELECT duration_s FROM session").fetchone()[0]
        con.close()
        # the workload's own wall time is the span calls were made in; the session adds start-up and flush
        res = summarize(db.stat().st_size, table_bytes(db, Path(tmp)), train["wall_s"])
        res.update(session_duration_s=duration, record_wall_s=time.monotonic() - t0, workload=train)
    print(
        f"{res['cuda_calls_rows']:,} calls in {res['duration_s']:.1f} s ({res['calls_per_s']:,.0f}/s); "
        f"DB {res['db_bytes']:,} bytes"
    )
    print_table(
        [
            [t, v["rows"], v["bytes"], v["bytes"] / v["rows"] if v["rows"] else None]
            for t, v in sorted(res["tables"].items(), key=lambda kv: -kv[1]["bytes"])
        ],
        ["table", "rows", "bytes", "bytes/row"],
    )
    print(
        f"bytes per call (cuda_calls only): {res['bytes_per_call']:.1f}; whole DB per call: "
        f"{res['db_bytes_per_call']:.1f}; DB per minute at this rate: {res['db_bytes_per_min'] / 2**20:.1f} MiB"
    )
    print(f"wrote {write_result('storage', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
