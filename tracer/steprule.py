"""The one step rule (issue 31), shared by the analyses (tracer/analysis/steps.py, over stored calls) and the
recorder's live ``tracer_steps_total`` (tracer/recorder/metrics.py, over the calls as they are drained).

A step ends where the training thread waits for the GPU (the catalog's ``waits_for_gpu`` calls; the runtime ones
only when the thread makes any: a runtime wait and the driver call inside it are one wait). A loop that waits more
than once a step repeats the same sequence of (op, call site): the waits per step is the shortest period of that
sequence (:func:`markers_per_step`), and the step ends with its last wait.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from probes.catalog import CATALOG

MAX_PER_STEP = 16  # waits per step tried when looking for the loop's period
PERIOD_MATCH = 0.9  # share of the sequence a period must repeat
# op ids (catalog indexes) that wait for the GPU, and which of them are the runtime's
WAIT_OP_IDS: frozenset[int] = frozenset(i for i, s in enumerate(CATALOG) if s.waits_for_gpu)
RUNTIME_OP_IDS: frozenset[int] = frozenset(i for i, s in enumerate(CATALOG) if s.layer_name == "runtime")


def markers_per_step(keys: Sequence[Hashable] | np.ndarray) -> int:
    """Return the shortest period (1..MAX_PER_STEP) with which the sequence of wait sites repeats; 1 when none
    does (each wait is then a step). ``keys``: one per wait, equal for equal (op, call site); an integer array is
    compared as it is (a long recording's millions of waits), anything else is numbered first."""
    if isinstance(keys, np.ndarray):
        codes = keys
    else:
        ids: dict[Hashable, int] = {}
        codes = np.array([ids.setdefault(k, len(ids)) for k in keys], dtype=np.int64)
    n = len(codes)
    for k in range(1, min(MAX_PER_STEP, n // 2) + 1):
        same = int(np.count_nonzero(codes[: n - k] == codes[k:]))
        if same >= PERIOD_MATCH * (n - k):
            return k
    return 1
