"""Start-up and teardown of `tracer record`: how long until the probes are live, until the first CUDA call is
recorded, and how long a program that finishes at once keeps the command (and the terminal) waiting.

Per run, from the session row: startup_s (the `tracer record` process's start to the probes being live, compile
and attach included), compile_s, attach_s, first_event_s (start to the first recorded call) and flush_s; and, timed
from outside, the wall time of the whole `tracer record -- PROG` until it returns. PROG is a fixture that makes a
few CUDA calls and exits (late_load.py --delay 0) and /bin/true (no CUDA at all). Medians over the runs; run it on
an idle machine (the target is <= 3 s to the first event there).

    sudo .venv/bin/python -m bench.startup [--quick] [--runs N]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb

from bench.common import TRACER, WORKLOADS, base_parser, build_fixtures, median, need_root, print_table, write_result

PROGRAMS = {
    "cuda_calls": ["/usr/bin/python3", str(WORKLOADS / "late_load.py"), "--delay", "0", "--calls", "5"],
    "true": ["/bin/true"],
}
SESSION = ("startup_s", "compile_s", "attach_s", "first_event_s", "flush_s")


def run_once(name: str, db: Path) -> dict[str, Any]:
    """One `tracer record -- PROG`: its wall time from outside and the phases it recorded."""
    t0 = time.monotonic()
    p = subprocess.run(
        [str(TRACER), "record", "--db", str(db), "--force", "--", *PROGRAMS[name]], capture_output=True, text=True
    )
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"tracer record -- {name} exited {p.returncode}:\n{p.stderr[-2000:]}")
    with duckdb.connect(str(db), read_only=True) as con:
        row = con.execute(f"SELECT {', '.join(SESSION)} FROM session").fetchone()
    return {"program": name, "wall_s": wall, **dict(zip(SESSION, row or (None,) * len(SESSION), strict=True))}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per program and phase (pure; the smoke test feeds it hand-built runs)."""
    out: dict[str, Any] = {"runs": runs}
    for name in PROGRAMS:
        rs = [r for r in runs if r["program"] == name]
        out[name] = {k: median([r[k] for r in rs if r.get(k) is not None]) for k in ("wall_s", *SESSION)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--runs", type=int, default=None, help="runs per program (default 5, --quick 2)")
    args = p.parse_args(argv)
    need_root("bench.startup")
    build_fixtures()
    n = args.runs or (2 if args.quick else 5)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        db = Path(tmp) / "t.duckdb"
        run_once("true", db)  # warm-up: caches (BTF offsets, interpreter layouts, trap cost), page cache
        for i in range(n):
            for name in PROGRAMS:
                r = run_once(name, db)
                runs.append(r)
                print(f"{i} {name:10s} wall {r['wall_s']:.2f} s, first event {r['first_event_s']} s", file=sys.stderr)
    res = summarize(runs)
    print_table(
        [[name, *(res[name][k] for k in ("wall_s", *SESSION))] for name in PROGRAMS], ["program", "wall s", *SESSION]
    )
    print(f"wrote {write_result('startup', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
