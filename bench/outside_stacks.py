"""What the stacks outside calls cost (issue 18): the off-CPU capture per blocking switch, and the on-CPU sampler
per sample.

- Per blocking switch: two threads of one process ping-pong a byte over two pipes, pinned to one CPU, so each
  round trip is two blocking switches (and two wakeups). µs per round trip untraced, traced without the stacks
  outside calls (the time accounting alone) and traced with the off-CPU capture: the last two's difference /2
  is the capture's cost per blocking switch (a Python walk, the hash, the aggregate's update).
- Per sample: a pure-Python loop of fixed work, timed untraced, traced --no-sampling, and traced at
  --sample-hz 999 (~1000 samples a second of its CPU): the difference / the samples taken (cpu_samples) is
  the cost per sample.

Figures are medians over --runs alternating runs; on a VM other tenants add noise, so read the medians.

    sudo .venv/bin/python -m bench.outside_stacks [--quick] [--runs N]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import duckdb

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
SPIN = """
import sys, time
n = int(sys.argv[1])
t0 = time.perf_counter()
acc = 0
for i in range(n):
    acc = (acc * 1103515245 + i) & 0xFFFFFFFF
print(f"result={time.perf_counter() - t0:.4f}", file=sys.stderr)
"""
RESULT = re.compile(r"result=([0-9.]+)")


def run(code: str, arg: int, tracer_args: list[str] | None, db: Path) -> tuple[float, int]:
    """Run ``code`` on CPU 1 (traced when ``tracer_args`` is not None); return its result and the samples taken."""
    cmd = ["taskset", "-c", "1", sys.executable, "-c", code, str(arg)]
    if tracer_args is not None:
        cmd = [str(TRACER), "record", "--db", str(db), "--force", *tracer_args, "--", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    value = float(RESULT.findall(p.stderr)[-1])
    samples = 0
    if tracer_args is not None and "--no-sampling" not in tracer_args:
        with duckdb.connect(str(db), read_only=True) as con:
            samples = int(con.execute("SELECT coalesce(sum(samples), 0) FROM cpu_samples").fetchone()[0])
    return value, samples


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--runs", type=int, default=None, help="alternating runs (default 5, --quick 2)")
    args = p.parse_args(argv)
    need_root("bench.outside_stacks")
    runs = args.runs or (2 if args.quick else 5)
    trips, spins = (20_000, 5_000_000) if args.quick else (50_000, 20_000_000)
    variants = {
        "untraced": None,
        "accounting": ["--no-sampling", "--no-offcpu-stacks"],
        "offcpu": ["--no-sampling"],
        "sampled_999": ["--no-offcpu-stacks", "--sample-hz", "999"],
    }
    rt: dict[str, list[float]] = {v: [] for v in variants}
    spin: dict[str, list[float]] = {v: [] for v in variants}
    samples: list[int] = []
    with tempfile.TemporaryDirectory() as d:
        db = Path(d) / "b.duckdb"
        for i in range(runs):
            for name, targs in variants.items():
                if name != "sampled_999":
                    rt[name].append(run(PINGPONG, trips, targs, db)[0])
                if name != "offcpu":
                    s, n = run(SPIN, spins, targs, db)
                    spin[name].append(s)
                    if n:
                        samples.append(n)
            print(f"run {i}: round trip µs {[round(rt[v][-1], 2) for v in rt if rt[v]]}", file=sys.stderr)
    acc, off = median(rt["accounting"]), median(rt["offcpu"])
    per_switch = (off - acc) / 2 if acc is not None and off is not None else None
    base, smp = median(spin["accounting"]), median(spin["sampled_999"])
    per_sample = (smp - base) / median(samples) * 1e6 if base and smp and samples else None
    figures = {
        "round_trip_us": {v: median(x) for v, x in rt.items() if x},
        "offcpu_us_per_blocking_switch": per_switch,
        "spin_s": {v: median(x) for v, x in spin.items() if x},
        "samples_at_999hz": median(samples),
        "us_per_sample": per_sample,
        "runs": runs,
    }
    print_table(
        [
            ("off-CPU capture, per blocking switch", per_switch),
            ("on-CPU sample", per_sample),
            ("round trip untraced / accounting / +offcpu", f"{median(rt['untraced']):.2f} / {acc:.2f} / {off:.2f}"),
        ],
        ("cost", "µs"),
    )
    print(f"wrote {write_result('outside_stacks', figures, args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
