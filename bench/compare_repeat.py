"""Issue 20's "Done when" for `tracer compare`, repeated: does a real fix read beyond noise, near its true size,
every time, and does a no-change pair read within noise every time, with the default overhead budget?

The pair is issue 13's (tests/integration/test_compare_real.py): fixtures/workloads/step_loop.py for 10 s with
5 ms of host work and 5 ms of GPU work per step, 10 launches, a 4-byte DtoH cudaMemcpy (``loss.item()``) after
every step (BEFORE) or every 20 steps (AFTER, the fix: host and GPU work overlap once the host stops waiting).

1. The truth, untraced: BEFORE and AFTER run twice each without the tracer; the faster run of each counts (a
   shared host's load only ever slows a run down), and the true change is after/before - 1 of the workload's own
   rate (its ``step_loop: steps=N ... wall=Xs`` line: steps / wall).
2. Each of N runs records BEFORE, AFTER and BEFORE again (``tracer record --db F --force -- ...``, defaults
   otherwise: the default overhead budget duty-cycles AFTER's launch probes), then ``tracer compare --json`` on
   (BEFORE, AFTER) and on (BEFORE, BEFORE again), the no-change pair.
3. Per run: the fix's delta_pct and verdict; whether the measured change is within ±15% of the truth, judged on
   the steps/s ratio: ``|(1 + delta_pct/100) / (1 + true_pct/100) - 1| <= 0.15``; the no-change pair's verdict.
   The totals are the issue's counts: beyond noise N/N, within ±15% N/N, no-change within noise N/N. Beside
   them, own_pct and same_own_pct: the change of the workload's own printed rate between the traced runs, so a
   no-change pair that other tenants' load made unequal (a real change compare is right to see) can be told
   from a false alarm; totals.within_tolerance_of_own counts the fix's delta within ±15% of its own_pct. A run
   whose recording or comparison fails keeps its error and fails all three checks.

Whether the machine was busy is measured, not assumed: for each run of a workload, the CPU the whole machine used
(/proc/stat) minus what this benchmark and its children used (getrusage), in cores on average, and the steal time
the hypervisor took. A run with more than BUSY_CORES of other load counts as busy.

    sudo .venv/bin/python -m bench.compare_repeat [--runs N] [--quick]
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, TRACER, WORKLOADS, base_parser, build_fixtures, need_root, print_table, write_result

# The Debian interpreter, as the integration tests use: a pyenv shim forks ~40 helpers before the exec.
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
LOOP = ["--duration", "10", "--host-ms", "5", "--kernel-us", "5000", "--launches", "10", "--sync", "memcpy"]
EVERY = 20
BEFORE = [PY, str(WORKLOADS / "step_loop.py"), *LOOP]
AFTER = [*BEFORE, "--sync-every", str(EVERY)]
RUNS, QUICK_RUNS = 10, 2
TRUTH_RUNS = 2  # untraced runs per side; the faster counts
TOLERANCE = 0.15  # the issue's ±15%, on the steps/s ratio
BUSY_CORES = 0.25  # other load, in cores on average over a workload run, above which that run counts as busy
SUMMARY = re.compile(r"step_loop: steps=(\d+) waits=(\d+) wall=([0-9.]+)s")


def parse_step_loop(stderr: str) -> dict[str, float] | None:
    """Return steps, waits, wall_s and steps_per_s from step_loop.py's last line, or None when it has none."""
    found = list(SUMMARY.finditer(stderr))
    if not found:
        return None
    m = found[-1]
    steps, wall = int(m.group(1)), float(m.group(3))
    return {"steps": steps, "waits": int(m.group(2)), "wall_s": wall, "steps_per_s": steps / wall if wall else 0.0}


@dataclass(frozen=True)
class CpuMark:
    """A point in time with the machine's CPU use and this process tree's, to tell our load from other tenants'."""

    t: float
    machine_s: float  # every CPU's non-idle time (user, nice, system, irq, softirq), seconds
    steal_s: float  # time the hypervisor ran someone else on our vCPUs
    ours_s: float  # this process plus its waited-for descendants (tracer, workload, compare)

    @staticmethod
    def now() -> CpuMark:
        """Read /proc/stat and getrusage at this instant."""
        hz = os.sysconf("SC_CLK_TCK")
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (f + [0] * 8)[:8]
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return CpuMark(
            t=time.monotonic(),
            machine_s=(user + nice + system + irq + softirq) / hz,
            steal_s=steal / hz,
            ours_s=s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime,
        )


def other_load(start: CpuMark, end: CpuMark) -> dict[str, float]:
    """Cores used by others (machine minus ours) and stolen, on average between two marks."""
    dt = max(end.t - start.t, 1e-9)
    other = (end.machine_s - start.machine_s) - (end.ours_s - start.ours_s)
    return {"other_cores": round(max(other, 0.0) / dt, 3), "steal_cores": round((end.steal_s - start.steal_s) / dt, 3)}


def run_cmd(cmd: list[str], timeout: float = 180) -> tuple[subprocess.CompletedProcess[str], dict[str, float]]:
    """Run ``cmd`` to completion (raise if it fails); return it and the other load meanwhile."""
    m0 = CpuMark.now()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    load = {"wall_s": round(time.monotonic() - m0.t, 2), **other_load(m0, CpuMark.now())}
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p, load


def untraced(cmd: list[str]) -> dict[str, Any]:
    """Run the workload without the tracer; return its own figures and the other load."""
    p, load = run_cmd(cmd)
    r = parse_step_loop(p.stderr)
    if r is None:
        raise RuntimeError(f"no step_loop summary line:\n{p.stderr[-2000:]}")
    return {**r, **load}


def truth(runs: int = TRUTH_RUNS) -> dict[str, Any]:
    """The true change: each side's fastest untraced rate (load only adds time), alternating sides so drift hits
    both alike, and after/before - 1 in percent."""
    tries: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for i in range(runs):
        for side, cmd in (("before", BEFORE), ("after", AFTER)):
            r = untraced(cmd)
            tries[side].append(r)
            print(f"truth {i} {side:6s} {r['steps_per_s']:7.1f} steps/s (other load {r['other_cores']:.2f} cores)")
    best = {side: max(r["steps_per_s"] for r in rs) for side, rs in tries.items()}
    return {
        "before_steps_per_s": round(best["before"], 2),
        "after_steps_per_s": round(best["after"], 2),
        "true_pct": round(100 * (best["after"] / best["before"] - 1), 2),
        "tries": tries,
    }


def record(db: Path, cmd: list[str]) -> dict[str, Any]:
    """``tracer record --db db --force -- cmd`` with the defaults; return the workload's own figures under the
    tracer (its stderr passes through) and the other load."""
    p, load = run_cmd([str(TRACER), "record", "--db", str(db), "--force", "--", *cmd])
    own = parse_step_loop(p.stderr) or {}
    return {"traced_steps_per_s": own.get("steps_per_s"), **load}


def compare(before: Path, after: Path) -> dict[str, Any]:
    """``tracer compare BEFORE AFTER --json``; return the parsed comparison."""
    p, _ = run_cmd([str(TRACER), "compare", str(before), str(after), "--json"])
    return json.loads(p.stdout)


def ratio_error(delta_pct: float | None, true_pct: float) -> float | None:
    """How far the measured steps/s ratio is from the true one, relative: (1 + d/100) / (1 + t/100) - 1."""
    if delta_pct is None:
        return None
    return (1 + delta_pct / 100) / (1 + true_pct / 100) - 1


def judge(fix: dict[str, Any], same: dict[str, Any], true_pct: float) -> dict[str, Any]:
    """One run's figures from its two comparisons (pure; the checks the issue counts). A comparison whose check
    fails keeps its whole steps block, to read why."""
    st, sn = fix["steps"], same["steps"]
    err = ratio_error(st["delta_pct"], true_pct)
    r: dict[str, Any] = {
        "delta_pct": st["delta_pct"],
        "verdict": st["noise"]["verdict"],
        "ci": [st["noise"]["ci_lo"], st["noise"]["ci_hi"]],
        "ratio_error": None if err is None else round(err, 4),
        "within_tolerance": err is not None and abs(err) <= TOLERANCE,
        "before_steps_per_s": st["before"]["steps_per_s"],
        "after_steps_per_s": st["after"]["steps_per_s"],
        "counted_from": [st["before"]["counted_from"], st["after"]["counted_from"]],
        "after_launch_error_pct": st["after"]["launch_error_pct"],
        "seconds": [fix["before"]["seconds"], fix["after"]["seconds"]],
        "same_delta_pct": sn["delta_pct"],
        "same_verdict": sn["noise"]["verdict"],
        "same_ci": [sn["noise"]["ci_lo"], sn["noise"]["ci_hi"]],
    }
    if r["verdict"] != "beyond_noise" or not r["within_tolerance"]:
        r["steps"] = st
    if r["same_verdict"] != "within_noise":
        r["same_steps"] = sn
    return r


def totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's three counts over the runs, and the line that states them."""
    n = len(runs)
    beyond = sum(r.get("verdict") == "beyond_noise" for r in runs)
    within = sum(bool(r.get("within_tolerance")) for r in runs)
    same = sum(r.get("same_verdict") == "within_noise" for r in runs)
    own = sum(bool(r.get("within_own")) for r in runs)
    return {
        "runs": n,
        "failed": sum("error" in r for r in runs),
        "beyond_noise": beyond,
        "within_tolerance": within,
        "no_change_within_noise": same,
        "within_tolerance_of_own": own,  # not the issue's count: against the traced runs' own printed rates
        "line": f"beyond_noise {beyond}/{n}, within ±{TOLERANCE:.0%} {within}/{n}, no-change within noise {same}/{n}",
        "done": n > 0 and beyond == within == same == n,
    }


def own_change(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """The change of the workload's own printed steps/s between two traced runs, %: what compare should find
    when the load around them differed (None when a run printed no rate)."""
    b, a = before.get("traced_steps_per_s"), after.get("traced_steps_per_s")
    return round(100 * (a / b - 1), 2) if a and b else None


def one_run(i: int, d: Path, true_pct: float) -> dict[str, Any]:
    """Record BEFORE, AFTER, BEFORE again into ``d``; compare the fix and the no-change pair; return the run."""
    dbs = {name: d / f"{name}.duckdb" for name in ("before", "after", "before2")}
    recs = {name: record(dbs[name], AFTER if name == "after" else BEFORE) for name in dbs}
    r = {"run": i, **judge(compare(dbs["before"], dbs["after"]), compare(dbs["before"], dbs["before2"]), true_pct)}
    r["recordings"] = recs
    # what the workload itself did under the tracer: a no-change pair a neighbour slowed is a real change
    r["own_pct"] = own_change(recs["before"], recs["after"])
    r["same_own_pct"] = own_change(recs["before"], recs["before2"])
    # compare against what the recordings really did: tells compare's own error from a neighbour's load
    own_err = None if r["own_pct"] is None else ratio_error(r["delta_pct"], r["own_pct"])
    r["within_own"] = own_err is not None and abs(own_err) <= TOLERANCE
    r["busy"] = any(x["other_cores"] > BUSY_CORES for x in recs.values())
    print(
        f"run {i}: {_pct(r['delta_pct'])} {r['verdict']} (its own {_pct(r['own_pct'])}, ratio error "
        f"{r['ratio_error']}); no-change {_pct(r['same_delta_pct'])} {r['same_verdict']} (its own "
        f"{_pct(r['same_own_pct'])}); other load {max(x['other_cores'] for x in recs.values()):.2f} cores",
        file=sys.stderr,
    )
    return r


def tree() -> dict[str, Any]:
    """The checkout measured: HEAD and the paths changed since (others edit the tree while this runs)."""

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.rstrip()

    return {"head": git("rev-parse", "--short", "HEAD"), "dirty": git("status", "--porcelain").splitlines()}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--runs", type=int, default=None, help=f"runs (default {RUNS}, --quick {QUICK_RUNS})")
    args = p.parse_args(argv)
    need_root("bench.compare_repeat")
    build_fixtures()
    n = args.runs or (QUICK_RUNS if args.quick else RUNS)
    load_start = os.getloadavg()
    tree_at_start = tree()
    t = truth()
    print(f"truth: {t['before_steps_per_s']:.1f} -> {t['after_steps_per_s']:.1f} steps/s, {t['true_pct']:+.1f}%")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        d = Path(tmp)
        for i in range(n):
            try:
                r = one_run(i + 1, d, t["true_pct"])
            except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
                # a failed recording or comparison fails the run's three checks; the error says whose fault it was
                r = {"run": i + 1, "error": str(e)[-3000:]}
                print(f"run {i + 1}: FAILED: {str(e)[-500:]}", file=sys.stderr)
            runs.append(r)
    tot = totals(runs)
    busy_truth = any(x["other_cores"] > BUSY_CORES for rs in t["tries"].values() for x in rs)
    machine = {
        "uname_r": os.uname().release,
        "nproc": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "busy_runs": sum(bool(r.get("busy")) for r in runs),
        "busy_truth": busy_truth,
        "busy": busy_truth or any(r.get("busy") for r in runs),
        "busy_rule": f"a workload run with more than {BUSY_CORES} cores of other load (machine CPU minus ours)",
    }
    cols = ("delta_pct", "own_pct", "verdict", "ratio_error", "within_tolerance", "same_delta_pct", "same_own_pct")
    print_table(
        [[r["run"], *(r.get(k) for k in cols), r.get("same_verdict", "FAILED"), r.get("busy")] for r in runs],
        ["run", "delta %", "own %", "verdict", "ratio err", "±15%", "same %", "own %", "same verdict", "busy"],
    )
    print(f"truth {t['true_pct']:+.1f}%; {tot['line']}; machine busy: {machine['busy']}")
    res = {
        "pair": {"before": BEFORE, "after": AFTER},
        "tolerance": TOLERANCE,
        "tolerance_rule": "|(1 + delta_pct/100) / (1 + true_pct/100) - 1| <= tolerance (on the steps/s ratio)",
        "truth": t,
        "tree": tree_at_start,
        "totals": tot,
        "load": machine,
        "runs": runs,
        "quick": args.quick,
    }
    print(f"wrote {write_result('compare_repeat', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
