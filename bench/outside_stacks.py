"""What the stacks outside calls cost (issue 18): the off-CPU capture per blocking switch.

Two threads of one process ping-pong a byte over two pipes, pinned to one CPU, so each round trip is two blocking
switches (and two wakeups). µs per round trip untraced, traced without the stacks outside calls (the time
accounting alone) and traced with the off-CPU capture: the last two's difference / 2 is the capture's cost per
blocking switch (a Python walk, the hash, the aggregate's update).

An on-CPU sample runs the same capture (cuda.bpf.c capture_stack, minus the native walk for a Python stack) from
the timer interrupt, ~100 times a second per busy CPU at the default 99 Hz: ~0.01% of a CPU at this cost, far
below what a wall-clock comparison can resolve on a shared VM (a 1.5 s loop varies by tens of ms between runs),
so it is not timed here.

Figures are medians over --runs alternating runs; on a VM other tenants add noise, so read the medians.

    sudo .venv/bin/python -m bench.outside_stacks [--quick] [--runs N]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import TRACER, base_parser, median, need_root, print_table, write_result

PINGPONG = """
import os, sys, threading, time
n = int(sys.argv[1])
r1, w1 = os.pipe(); r2, w2 = os.pipe()
def peer():
    for _ in range(n):
        os.read(r1, 1); os.write(w2, b"x")
t = threading.Thread(target=peer); t.start()
t0 = time.perf_counter()
for _ in range(n):
    os.write(w1, b"x"); os.read(r2, 1)
dt = time.perf_counter() - t0
t.join()
print(f"result={dt / n * 1e6:.3f}", file=sys.stderr)
"""
RESULT = re.compile(r"result=([0-9.]+)")


def run(code: str, arg: int, tracer_args: list[str] | None, db: Path) -> float:
    """Run ``code`` on CPU 1 (traced when ``tracer_args`` is not None); return its result."""
    cmd = ["taskset", "-c", "1", sys.executable, "-c", code, str(arg)]
    if tracer_args is not None:
        cmd = [str(TRACER), "record", "--db", str(db), "--force", *tracer_args, "--", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(RESULT.findall(p.stderr)[-1])


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--runs", type=int, default=None, help="alternating runs (default 5, --quick 2)")
    args = p.parse_args(argv)
    need_root("bench.outside_stacks")
    runs = args.runs or (2 if args.quick else 5)
    trips = 20_000 if args.quick else 50_000
    variants = {
        "untraced": None,
        "accounting": ["--no-sampling", "--no-offcpu-stacks"],
        "offcpu": ["--no-sampling"],
    }
    rt: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as d:
        db = Path(d) / "b.duckdb"
        for i in range(runs):
            for name, targs in variants.items():
                rt[name].append(run(PINGPONG, trips, targs, db))
            print(f"run {i}: round trip µs {[round(rt[v][-1], 2) for v in rt]}", file=sys.stderr)
    acc, off = median(rt["accounting"]), median(rt["offcpu"])
    per_switch = (off - acc) / 2 if acc is not None and off is not None else None
    figures = {
        "round_trip_us": {v: median(x) for v, x in rt.items()},
        "offcpu_us_per_blocking_switch": per_switch,
        "runs": runs,
    }
    print_table(
        [(v, median(x)) for v, x in rt.items()] + [("off-CPU capture, per blocking switch", per_switch)],
        ("round trip (two blocking switches)", "µs"),
    )
    print(f"wrote {write_result('outside_stacks', figures, args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
