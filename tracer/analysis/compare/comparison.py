"""The entry point: two recordings loaded, their steps, training thread, ops and chains compared, the tests
counted then made, the warnings and the headline written."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePath

import duckdb

from tracer.analysis.compare.chains import compare_chains
from tracer.analysis.compare.load import S, Side, load_side
from tracer.analysis.compare.model import CompareWarning, Comparison, RecordingRef
from tracer.analysis.compare.ops import compare_ops
from tracer.analysis.compare.statistics import ALPHA, NOISE_TEST, NoiseTests
from tracer.analysis.compare.steps import Cadence, cadence, compare_steps
from tracer.analysis.compare.text import headline
from tracer.analysis.compare.training import compare_training
from tracer.analysis.compare.warnings import compare_warnings
from tracer.analysis.gcpause import gc_paused
from tracer.analysis.stats import environment


def _reference(side: Side) -> RecordingRef:
    env = environment(side.conn)
    subject = side.subject
    return RecordingRef(
        name=side.name,
        target=env.target,
        started_at=env.started_at,
        duration_s=env.duration_s,
        status=env.status,
        basis=side.ctx.times.basis,
        training_pid=subject.pid if subject else None,
        training_tid=subject.tid if subject else None,
        training_comm=subject.time.comm if subject else "",
        loop_start_s=round(side.span[0] / S, 3),
        loop_s=round(side.loop_s, 3),
        seconds=len(side.seconds),
    )


def _load(conn: duckdb.DuckDBPyConnection, name: str) -> tuple[Side, Cadence]:
    """Return one side and its training thread's cadence, read on its own connection."""
    side = load_side(conn, name)
    return side, cadence(side)


@gc_paused()
def compare_traces(
    before: duckdb.DuckDBPyConnection,
    after: duckdb.DuckDBPyConnection,
    *,
    before_name: str = "before",
    after_name: str = "after",
    same_file: bool = False,
) -> Comparison:
    """Return BEFORE and AFTER compared: steps/s, the training thread's parts, per-op deltas, chains gained,
    lost or changed, and for each difference whether it is beyond the recordings' own noise.

    Args:
        before_name, after_name: how the sides are named in the result (their files).
        same_file: the two connections read one file (the result says so).
    """
    # the sides load in parallel: each is its own connection, and their queries run while the other side's Python
    # holds the interpreter (2.6 -> 2.4 s on two hour-long 200 K-process recordings, issue 21)
    if before is after:  # one connection is never used from two threads
        first, second = _load(before, before_name), _load(after, after_name)
    else:
        with ThreadPoolExecutor(2) as pool:
            later = pool.submit(_load, after, after_name)
            first, second = _load(before, before_name), later.result()
    (side_before, cadence_before), (side_after, cadence_after) = first, second
    launch_error = (cadence_before.launch_error, cadence_after.launch_error)
    tests = NoiseTests()
    for counting in (True, False):  # count the tests (the Bonferroni divisor), then make them
        tests.counting = counting
        steps = compare_steps(side_before, side_after, cadence_before, cadence_after, tests)
        training = compare_training(side_before, side_after, steps, tests, launch_error)
        ops = compare_ops(side_before, side_after, tests)
    warnings = compare_warnings(side_before, side_after, same_file, cadence_before, cadence_after, steps)
    if steps.detected and not steps.comparable:
        warnings.append(CompareWarning(level="warning", kind="steps", message=f"steps: {steps.method}"))
    c = Comparison(
        before=_reference(side_before),
        after=_reference(side_after),
        headline=[],
        noise_test=NOISE_TEST,
        alpha=ALPHA,
        tests=tests.count,
        steps=steps,
        training=training,
        ops=ops,
        chains=compare_chains(side_before, side_after),
        warnings=warnings,
    )
    return c.model_copy(update={"headline": headline(c)})


def names_of(paths: Sequence[str]) -> tuple[str, str]:
    """Return how two recording paths are named in a comparison: their file names, or the paths when the names
    are equal."""
    first, second = (PurePath(p).name for p in paths)
    return (first, second) if first != second else (str(paths[0]), str(paths[1]))
