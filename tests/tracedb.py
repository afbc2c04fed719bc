"""The hand-built recordings the analysis tests use, under the one name two dozen test files import.

The code lives in ``tests/support``: :mod:`~tests.support.builder` (rows in, a recording with exact aggregates
out), :mod:`~tests.support.scenarios` (the scenarios the analyses must recognise), :mod:`~tests.support.step_loop`
(the comparison tests' workload) and :mod:`~tests.support.schema_v1` (a recording from before schema v2). The
benchmarks' million-row recording is ``bench/synthetic.py``.
"""

from tests.support.builder import MAIN_PID, MS, TRACER_PID, US, S, TraceBuilder, insert_rows, parts_total
from tests.support.scenarios import (
    ALLOC_STACK,
    HOG_PID,
    ITEM_STACK,
    PYTHON_NS,
    SCENARIOS,
    STORM_TID,
    Step,
    _base,
    add_tracer,
    build,
    builder,
)
from tests.support.schema_v1 import downgrade_to_v1
from tests.support.step_loop import step_loop

__all__ = [
    "ALLOC_STACK",
    "HOG_PID",
    "ITEM_STACK",
    "MAIN_PID",
    "MS",
    "PYTHON_NS",
    "S",
    "SCENARIOS",
    "STORM_TID",
    "Step",
    "TRACER_PID",
    "TraceBuilder",
    "US",
    "_base",
    "add_tracer",
    "build",
    "builder",
    "downgrade_to_v1",
    "insert_rows",
    "parts_total",
    "step_loop",
]
