"""Overhead of `tracer record` on a fixture training loop: untraced vs traced steps/s, alternating A/B.

The workload is fixtures/workloads/train.py at roughly the reference mix (about 5 K cudaLaunchKernel/s and
200 cudaStreamSynchronize/s with 4 DataLoader workers); its own summary line (``steps=N ... wall=Xs``, timed
inside the process from start to end) gives steps/s, so the recorder's start-up and flush are not counted.
Runs alternate untraced/traced so drift hits both sides alike; the figure to read is ``ratio_default``
(traced / untraced steps/s, 1.0 = no overhead). Absolute numbers are VM numbers (a uprobe hit costs ~12-16 µs
here, 1-2 µs on bare metal): compare ratios only.

    sudo .venv/bin/python -m bench.overhead [--quick] [--runs N]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb

from bench.common import (
    TRACER,
    WORKLOADS,
    base_parser,
    build_fixtures,
    median,
    need_root,
    print_table,
    ratio,
    spread,
    write_result,
)

# 25 launches + 1 sync per step; 25 x 200 µs of fake device time makes a step ~5 ms, so ~200 steps/s,
# ~5 K launches/s, ~200 syncs/s. train.py allocates once per run (cudaMalloc 1), so the 50 allocations/s of
# the reference mix are not reached: see ALLOC_NOTE.
TRAIN_ARGS = ["--workers", "4", "--launches-per-step", "25", "--persistent-workers", "--kernel-us", "200",
              "--batch-kb", "64", "--worker-cpu-ms", "2"]
STEPS, EPOCHS = 200, 3
QUICK_STEPS, QUICK_EPOCHS = 200, 1
ALLOC_NOTE = ("train.py makes one cudaMalloc per run and no per-step allocations, so the reference mix's "
              "50 allocations/s is not reproduced (launch and sync rates are)")
SUMMARY = re.compile(r"train: epochs=(\d+) steps=(\d+) launches=(\d+) .*?wall=([0-9.]+)s")


def parse_train_summary(stderr: str) -> dict[str, float]:
    """Return steps, launches, wall_s and steps_per_s from train.py's stderr summary line.

    Raises:
        ValueError: no summary line (the workload failed).
    """
    m = SUMMARY.search(stderr)
    if not m:
        raise ValueError(f"no train.py summary line in its stderr:\n{stderr[-2000:]}")
    steps, launches, wall = int(m.group(2)), int(m.group(3)), float(m.group(4))
    return {"steps": steps, "launches": launches, "wall_s": wall, "steps_per_s": steps / wall if wall else 0.0}


def train_cmd(steps: int, epochs: int) -> list[str]:
    return ["python3", str(WORKLOADS / "train.py"), *TRAIN_ARGS, "--steps", str(steps), "--epochs", str(epochs)]


def has_option(option: str) -> bool:
    """Whether `tracer record --help` lists ``option``."""
    out = subprocess.run([str(TRACER), "record", "--help"], capture_output=True, text=True,
                         env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    return option in out.stdout + out.stderr


def run_once(cmd: list[str], traced: bool, db: Path, extra: list[str] | None = None) -> dict[str, Any]:
    """Run the workload once, untraced or under `tracer record`; return its parsed summary (+ session row)."""
    full = [str(TRACER), "record", "--db", str(db), "--force", *(extra or []), "--", *cmd] if traced else cmd
    t0 = time.monotonic()
    p = subprocess.run(full, capture_output=True, text=True)
    outer = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    r: dict[str, Any] = {"traced": traced, **parse_train_summary(p.stderr), "outer_wall_s": outer}
    if traced:
        con = duckdb.connect(str(db), read_only=True)
        try:
            row = con.execute("SELECT events_traced, events_stored, events_lost FROM session").fetchone()
            r["events_traced"], r["events_stored"], r["events_lost"] = row if row else (None, None, None)
        finally:
            con.close()
    return r


def summarize(runs: list[dict[str, Any]], budget_supported: bool) -> dict[str, Any]:
    """Medians, spread and ratios of a list of run records (pure; the smoke test feeds it hand-built runs)."""
    un = [r["steps_per_s"] for r in runs if not r["traced"] and not r.get("budget")]
    tr = [r["steps_per_s"] for r in runs if r["traced"] and not r.get("budget")]
    bu = [r["steps_per_s"] for r in runs if r.get("budget")]
    um, tm = median(un), median(tr)
    # per-pair ratios show whether the median ratio is stable or one side drifted
    pairs = [t / u for u, t in zip(un, tr, strict=False) if u]
    steps_s = um or 0.0
    res: dict[str, Any] = {
        "untraced_steps_per_s": um,
        "traced_steps_per_s": tm,
        "ratio_default": ratio(tm, um),
        "ratio_budget_1": ratio(median(bu), um) if budget_supported and bu else None,
        "spread": {"untraced": spread(un), "traced": spread(tr), "pair_ratios": spread(pairs)},
        "pair_ratios": pairs,
        "untraced_rates_per_s": {
            "launches": steps_s * 25, "syncs": steps_s, "allocations": 0.0,
        },
        "runs": runs,
    }
    if not budget_supported:
        res["notes"] = ["`tracer record` has no --overhead-budget option yet: ratio_budget_1 is null"]
    return res


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--runs", type=int, default=None, help="A/B pairs (default 5, --quick 2)")
    args = p.parse_args(argv)
    need_root("bench.overhead")
    build_fixtures()
    pairs = args.runs or (2 if args.quick else 5)
    steps, epochs = (QUICK_STEPS, QUICK_EPOCHS) if args.quick else (STEPS, EPOCHS)
    cmd = train_cmd(steps, epochs)
    budget = has_option("--overhead-budget")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        db = Path(tmp) / "trace.duckdb"
        run_once(cmd, False, db)  # warm-up: page cache, fixture libs
        for i in range(pairs):
            for traced in (False, True):
                r = run_once(cmd, traced, db)
                r["pair"] = i
                runs.append(r)
                print(f"pair {i} {'traced  ' if traced else 'untraced'} {r['steps_per_s']:8.1f} steps/s",
                      file=sys.stderr)
            if budget:
                r = run_once(cmd, True, db, ["--overhead-budget", "1"])
                r.update(pair=i, budget=True)
                runs.append(r)
    res = summarize(runs, budget)
    res["workload"] = {"cmd": cmd, "steps": steps * epochs}
    res.setdefault("notes", []).append(ALLOC_NOTE)
    print_table(
        [["untraced", res["untraced_steps_per_s"], res["spread"]["untraced"]["rel"]],
         ["traced (default)", res["traced_steps_per_s"], res["spread"]["traced"]["rel"]]],
        ["run", "steps/s (median)", "rel. spread"],
    )
    print(f"ratio_default = {res['ratio_default']:.3f}   ratio_budget_1 = {res['ratio_budget_1']}")
    for n in res["notes"]:
        print(f"note: {n}")
    print(f"wrote {write_result('overhead', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
