"""Chains that apply (issue 23): every detector runs over recordings that lack its subject and says nothing, and no
chain's advice names something the recording does not have.

Ground truth: each scenario's docstring (tests/support/scenarios.py, tests/support/absent.py) says what it holds;
:data:`HAS` lists the causes it has. Some hold beyond their own cause: the loop's per-step sync leaves the GPU idle
about 2 ms of each 100 ms step once no batch wait fills that gap (``sync_stall``, LOW, 2.2 %; the scenarios with
a batch wait of 0.5 ms there fall under the 2 % floor); a loop waiting for the GPU 50 % or more of its steps is
``gpu_bound`` (informational); launch_bound's thread runs ~1 ms of Python between its idle sync and its next
launch every 20 ms step (``host_python``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from tracedb import MAIN_PID, SCENARIOS, builder

from tests.support.absent import HELPER_PID, HELPERS, helpers_builder, without_dataloader
from tests.support.builder import TraceBuilder
from tracer.analysis.chains import DETECTORS, CausalChain, ChainContext
from tracer.analysis.chains.applies import has_dataloader, helper_pids
from tracer.analysis.db import open_trace

GPU = "gpu_bound"
IDLE_GAP = "sync_stall"
# the causes each recording has (its docstring); every other detector must stay silent on it
HAS: dict[str, set[str]] = {
    "healthy": {GPU},
    "cpu_contention": {"cpu_contention", GPU},
    "process_churn": {"process_churn", GPU},
    "memory_pressure": {"memory_pressure", GPU},
    "allocation_churn": {"allocation_churn"},
    "sync_stall": {"sync_stall"},
    "fault_storm": {"memory_pressure"},
    "dataloader_starvation": {"dataloader_starvation", IDLE_GAP},
    # 20 launches of 0.95 ms each: the first comes ~1 ms of Python after the (idle) sync, the GPU waiting
    "launch_bound": {"launch_bound", "host_python"},
    "gpu_bound": {GPU},
    "startup_helpers": {IDLE_GAP, GPU},
    "healthy_without_dataloader": {IDLE_GAP, GPU},
    "cpu_contention_without_dataloader": {"cpu_contention", IDLE_GAP, GPU},
    "memory_pressure_without_dataloader": {"memory_pressure", IDLE_GAP, GPU},
    "fault_storm_without_dataloader": {"memory_pressure", IDLE_GAP},
    "gpu_bound_without_dataloader": {IDLE_GAP, GPU},
}
BUILDERS: dict[str, Callable[[], TraceBuilder]] = {
    **{name: (lambda n=name: builder(n)) for name in SCENARIOS},
    "startup_helpers": helpers_builder,
    **{
        f"{n}_without_dataloader": (lambda n=n: without_dataloader(n))
        for n in ("healthy", "cpu_contention", "memory_pressure", "fault_storm", "gpu_bound")
    },
}
# advice that only a torch DataLoader can take
DATALOADER_WORDS = re.compile(r"DataLoader|num_workers|prefetch_factor|persistent_workers|pin_memory")


@pytest.fixture(scope="module")
def recordings(tmp_path_factory) -> Callable[[str], tuple[dict[str, list[CausalChain]], bool, Path]]:
    """name -> ({detector's module: its chains}, the recording has DataLoader workers, its path); built once."""
    cache: dict[str, tuple[dict[str, list[CausalChain]], bool, Path]] = {}
    d = tmp_path_factory.mktemp("apply")

    def get(name: str) -> tuple[dict[str, list[CausalChain]], bool, Path]:
        if name not in cache:
            p = d / f"{name}.duckdb"
            BUILDERS[name]().write(p)
            with open_trace(p) as c:
                ctx = ChainContext.load(c)
                by = {det.__module__.rsplit(".", 1)[-1]: det(ctx) for det in DETECTORS}
                cache[name] = (by, has_dataloader(ctx), p)
        return cache[name]

    return get


def test_the_table_covers_every_scenario_and_detector():
    # GIVEN the scenarios and detectors  THEN each is in the table: a new one cannot skip this test
    assert set(HAS) == set(BUILDERS) and set(SCENARIOS) <= set(HAS)
    names = {d.__module__.rsplit(".", 1)[-1] for d in DETECTORS}
    assert set().union(*HAS.values()) <= names and "straggler_rank" in names


@pytest.mark.parametrize("name", sorted(HAS))
def test_a_detector_is_silent_on_a_recording_without_its_subject(recordings, name):
    # GIVEN a recording and the causes it holds  WHEN every detector runs on it
    by, _, _ = recordings(name)
    # THEN only the detectors of those causes return chains, each of its own category
    spoke = {det for det, chains in by.items() if chains}
    assert spoke <= HAS[name], {d: [c.summary for c in by[d]] for d in spoke - HAS[name]}
    assert all(c.category == det for det, chains in by.items() for c in chains)
    # AND each cause it holds is found (the silence above is not a detector that never speaks)
    assert spoke == HAS[name]


@pytest.mark.parametrize("name", sorted(n for n in HAS if "dataloader" not in n or "without" in n))
def test_no_dataloader_advice_without_dataloader_workers(recordings, name):
    # GIVEN a recording, WHEN every detector runs  THEN DataLoader advice comes only with DataLoader workers
    by, has_dl, _ = recordings(name)
    text = [t for chains in by.values() for c in chains for t in (c.summary, *c.recommendations)]
    if has_dl:
        return
    bad = [t for t in text if DATALOADER_WORDS.search(t)]
    assert not bad, bad


def test_the_no_dataloader_variants_have_none(recordings):
    # GIVEN the variants built to have no DataLoader  THEN they really have none (else the test above is empty)
    for name in HAS:
        if name.endswith("_without_dataloader") or name == "startup_helpers":
            assert recordings(name)[1] is False, name
    assert recordings("healthy")[1] is True


def test_startup_helpers_are_commands_waited_for_not_workers(recordings):
    # GIVEN pid 1000 waits 0.6 s for each of three bash commands it forked at start-up, one wave each
    by, _, p = recordings("startup_helpers")
    with open_trace(p) as c:
        ctx = ChainContext.load(c)
        # THEN each bash is a helper (it ended the thread's wait by exiting), and no churn, no starved loader
        assert helper_pids(ctx, MAIN_PID) == {HELPER_PID + i for i in range(len(HELPERS))}
    assert not by["process_churn"] and not by["dataloader_starvation"]


def test_a_dataloader_worker_is_never_a_helper(recordings):
    # GIVEN process_churn: DataLoader workers that exit at every epoch's end (their exit wakes the main thread too)
    _, _, p = recordings("process_churn")
    with open_trace(p) as c:
        assert helper_pids(ChainContext.load(c), MAIN_PID) == frozenset()
