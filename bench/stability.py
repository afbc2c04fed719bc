"""Issue 28's stability: a diagnosis that flips between recordings of the same job is not one a user can act on, so
each fixture's test must hold over repeated recordings. This runs each diagnosis fixture's own test (its chain's
root and advice checked against the fixture's untraced truth) in RUNS fresh pytest sessions: every session records
every fixture again (tests/integration/_helpers.py caches a recording for one session only), and counts, per test,
the sessions it passed in.

The tests are the issue's fixtures and the two workloads whose answer flipped before (workers re-forked every
epoch, in test_diagnosis_real's ``test_top_cause``; a host-bound batch-building loop, the tokenizer of the issue),
and the healthy loops, which must get no HIGH chain. A test that fails keeps the last lines of its failure in the
result.

    sudo .venv/bin/python -m bench.stability [--runs N] [--match SUBSTR] [--quick]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, base_parser, need_root, print_table, write_result

RUNS, QUICK_RUNS = 5, 1
# each an issue-28 fixture's test, or a workload whose top chain once flipped between recordings
TESTS = [
    "tests/integration/test_placement_real.py::test_confined_by_taskset",
    "tests/integration/test_placement_real.py::test_throttled_by_a_cgroup_quota",
    "tests/integration/test_loader_roots.py::test_storage_bound_workers_root_at_the_service",
    "tests/integration/test_loader_roots.py::test_cpu_bound_workers_on_full_cores_root_at_cpu_capacity",
    "tests/integration/test_two_hop_real.py",
    "tests/integration/test_gc_pause_real.py::test_gc_pause_is_the_cause_with_the_allocating_line",
    "tests/integration/test_torch_loader.py::test_workers_waiting_on_storage_root_at_the_service",
    "tests/integration/test_torch_loader.py::test_a_starved_loop_names_the_workers_python_transform_line",
    "tests/integration/test_stack_chains_real.py::test_host_bound_loop_names_the_batch_building_line",
    "tests/integration/test_diagnosis_real.py::test_top_cause",
    "tests/integration/test_diagnosis_real.py::test_healthy_loops_have_nothing_high",
]
QUICK_TESTS = TESTS[:1]
RESULT = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", re.M)


def session(tests: list[str], basetemp: Path) -> tuple[dict[str, str], str]:
    """Run ``tests`` in one fresh pytest session; return {test id: outcome} and the output's tail."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--basetemp={basetemp}", *tests],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "CI": "true"},  # a test that cannot run fails rather than skips
    )
    return {m.group(1): m.group(2) for m in RESULT.finditer(out.stdout)}, out.stdout[-3000:]


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, help=f"fresh sessions (default {RUNS}; --quick {QUICK_RUNS})")
    p.add_argument("--match", help="only the tests whose id contains this (and the result named stability_MATCH)")
    a = p.parse_args(argv)
    need_root("bench.stability (the tests record with BPF)")
    runs = a.runs or (QUICK_RUNS if a.quick else RUNS)
    tests = QUICK_TESTS if a.quick else TESTS
    if a.match:
        tests = [t for t in tests if a.match in t]
        if not tests:
            raise SystemExit(f"no test of bench.stability matches {a.match!r}")
    passed: dict[str, int] = {}
    failures: dict[str, list[str]] = {}
    t0 = time.monotonic()
    for i in range(runs):
        with tempfile.TemporaryDirectory(prefix="stability-") as tmp:
            outcomes, tail = session(tests, Path(tmp))
        if not outcomes:
            raise SystemExit(f"run {i + 1}: pytest ran no test:\n{tail}")
        for test, outcome in outcomes.items():
            passed[test] = passed.get(test, 0) + (outcome == "PASSED")
            if outcome != "PASSED":
                failures.setdefault(test, []).append(f"run {i + 1}: {outcome}\n{tail[-1500:]}")
        print(
            f"run {i + 1}/{runs}: {sum(o == 'PASSED' for o in outcomes.values())} of {len(outcomes)} passed "
            f"({time.monotonic() - t0:.0f} s)",
            file=sys.stderr,
        )
    table = [[t.split("tests/integration/")[-1], f"{n}/{runs}"] for t, n in sorted(passed.items())]
    print_table(table, ["test", "passed"])
    write_result(
        "stability_" + re.sub(r"\W+", "_", a.match) if a.match else "stability",
        {
            "runs": runs,
            "passed": passed,
            "all_held": all(n == runs for n in passed.values()),
            "failures": failures,
            "load1_after": round(os.getloadavg()[0], 2),
            "quick": a.quick,
        },
        a.out,
    )
    return 0 if all(n == runs for n in passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
