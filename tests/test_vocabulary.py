"""One name per thing (issue 23): the recorder's BPF and column builders, every MCP tool's output and the tables
draw their wakers, holder classes, roles and part names from tracer/vocabulary.py.

Ground truth for the waker names: the hand-built checkpoint loop (tests/support/checkpoint.py, with its odd
wakers) has 421 in-call waits ended by the GPU's interrupt ([irq]), 40 sleeps ended by [timer], one by no waker
seen and one by swapper/1, and 10 fsync waits ended by [block], several kinds in the same seconds; the issue's bug
was one name for all of them (the least, [block]). Beside it lie the stacks its thread blocked and ran in (for
get_thread_stacks) and the same loop recorded without checkpoints (before.duckdb, for compare_traces).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import duckdb
import numpy as np
import pytest
from mcp import Client
from tracedb import MAIN_PID, TraceBuilder, builder

from mcp_server.server import build_server
from tests.support.builder import MS, insert_rows
from tests.support.checkpoint import checkpoint_loop
from tracer.analysis.breakdown import time_breakdown
from tracer.analysis.breakdown.holders import HolderClass
from tracer.analysis.db import open_trace
from tracer.analysis.recording import load_recording
from tracer.recorder import columns, events
from tracer.schema import TABLE_BY_NAME
from tracer.vocabulary import (
    HOLDER_CLASSES,
    HOP_ROLES,
    IDLE_WAKER,
    INTERRUPT,
    INTERRUPT_WAKERS,
    PART_NAMES,
    PROCESS_ROLES,
    RECORDED_ROLES,
    THREAD_ROLES,
    UNSEEN_WAKER,
    WAKER_CLASSES,
    WAKER_KINDS,
    waker_name,
)

ROOT = Path(__file__).resolve().parents[1]
# the tools and the arguments that make each one say something
TOOLS: dict[str, dict[str, Any]] = {
    "get_trace_stats": {"detail": True},
    "get_causal_chains": {"limit": 100},
    "get_time_breakdown": {},
    "get_ranks": {},
    "get_stacks": {"op": "cudaMemcpy"},
    "get_step_series": {},
    "get_waits": {},
    "compare_processes": {},
    "get_thread_stacks": {"mode": "off-cpu"},
    "compare_traces": {"before": "before.duckdb"},
}
# the checkpoint loop's stacks outside calls: where it blocks (fsync, sleep) and where it runs (serialising)
FSYNC = [("python", "checkpoint.py", "save", "checkpoint.py", 40), ("native", "libc.so.6", "fsync", None, None)]
SLEEP = [
    ("python", "checkpoint.py", "train_step", "checkpoint.py", 35),
    ("native", "libc.so.6", "nanosleep", None, None),
]
SERIALISE = [("python", "checkpoint.py", "save", "checkpoint.py", 38)]


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    b = TraceBuilder()
    checkpoint_loop(b, odd_wakers=True)
    fsync, sleep, serialise = b.stack(FSYNC), b.stack(SLEEP), b.stack(SERIALISE)
    b.samples(1, serialise, 4, pid=MAIN_PID)
    d = tmp_path_factory.mktemp("vocab")
    p = b.write(d / "ckpt.duckdb")
    blocked = [(fsync, "D", "[block]", 10, 500 * MS), (sleep, "S", "[timer]", 40, 40 * MS)]
    with duckdb.connect(str(p)) as con:
        con.execute("UPDATE session SET sample_hz = 99, offcpu_stacks = true")
        insert_rows(
            con,
            "offcpu_stacks",
            [
                dict(sec=1, pid=MAIN_PID, tid=MAIN_PID, stack_id=sid, state=state, in_call=False, waker_pid=0,
                     waker_comm=waker, intervals=n, blocked_ns=ns)
                for sid, state, waker, n, ns in blocked
            ],
        )  # fmt: skip
    before = TraceBuilder()
    checkpoint_loop(before, every=0)
    before.write(d / "before.duckdb")
    return p


def _walk(x: Any, key: str = "") -> Iterator[tuple[str, Any, Any]]:
    """Yield (key, value, the dict holding it) for every value of a JSON document."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield k, v, x
            yield from _walk(v, k)
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v, key)


def _call(db: Path, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    async def go():
        async with Client(build_server(db)) as c:
            return await c.call_tool(tool, args)

    r = anyio.run(go)
    assert not r.is_error, r.content
    return r.structured_content


def _check_document(doc: dict[str, Any]) -> list[str]:
    """Return every value of ``doc`` that names a waker, a holder class, a role or a part outside the vocabulary."""
    bad = []
    for k, v, holder in _walk(doc):
        if k == "holder" and v not in WAKER_CLASSES:
            bad.append(f"holder {v!r}")
        if k == "holder" and v == INTERRUPT:
            name = holder.get("comm", holder.get("waker"))
            if name not in INTERRUPT_WAKERS:
                bad.append(f"interrupt waker named {name!r}")
        if k == "waker" and holder.get("pid") == 0 and v not in INTERRUPT_WAKERS:
            bad.append(f"waker {v!r}")
        if k == "part" and v not in PART_NAMES:
            bad.append(f"part {v!r}")
        if k in ("ms", "share") and isinstance(v, dict) and not set(v) <= set(PART_NAMES):
            bad.append(f"bucket parts {sorted(set(v) - set(PART_NAMES))}")
        if k == "role" and v not in (*PROCESS_ROLES, *THREAD_ROLES, *HOP_ROLES):
            bad.append(f"role {v!r}")
        if k == "thread_role" and v not in THREAD_ROLES:
            bad.append(f"thread_role {v!r}")
        if k == "runq_by_holder_ms" and not set(v) <= set(HOLDER_CLASSES):
            bad.append(f"runq holders {sorted(v)}")
    return bad


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_speaks_the_vocabulary(db, tool):
    # GIVEN the checkpoint loop with every kind of interrupt waker  WHEN the tool answers over MCP
    doc = _call(db, tool, TOOLS[tool])
    # THEN every waker, holder class, role and part it names is in the vocabulary
    assert not _check_document(doc), _check_document(doc)


def test_the_stack_and_comparison_tools_have_names_to_check(db):
    # GIVEN the loop's stacks and the loop without checkpoints beside it  THEN get_thread_stacks lists the blocked
    # stacks and compare_traces the training thread's parts: the check above reads real answers, not empty ones
    stacks = _call(db, "get_thread_stacks", TOOLS["get_thread_stacks"])["stacks"]
    assert [(x["wait"], x["site"]) for x in stacks] == [
        ("io", "checkpoint.py:40 save"),
        ("sleep", "checkpoint.py:35 train_step"),
    ]
    parts = {v for k, v, _ in _walk(_call(db, "compare_traces", TOOLS["compare_traces"])) if k == "part"}
    assert {"cpu", "sync", "blocked"} <= parts <= set(PART_NAMES)


@pytest.mark.parametrize("scenario", ["fault_storm", "cpu_contention", "process_churn", "dataloader_starvation"])
def test_the_tools_speak_it_on_the_scenarios_too(tmp_path, scenario):
    # GIVEN scenarios with holders of every class, workers and chains  WHEN the tools answer
    p = tmp_path / f"{scenario}.duckdb"
    builder(scenario).write(p)
    for tool in ("get_time_breakdown", "get_causal_chains", "get_waits", "compare_processes", "get_trace_stats"):
        doc = _call(p, tool, {"limit": 100} if tool == "get_causal_chains" else {})
        # THEN they name things as the vocabulary does
        assert not _check_document(doc), (tool, _check_document(doc))


def test_interrupt_kinds_are_wakers_of_their_own(db):
    # GIVEN waits ended by [irq] (in calls), [timer] and [block], in the same seconds
    with open_trace(db) as c:
        wakers = {w.comm: w for w in time_breakdown(c, tid=MAIN_PID).threads[0].wakers}
    # THEN the breakdown names each kind as thread_wakers does, with its own count (not one [block] row for all)
    assert {"[irq]", "[timer]", "[block]"} <= set(wakers)
    assert (wakers["[irq]"].wakeups, wakers["[timer]"].wakeups, wakers["[block]"].wakeups) == (421, 40, 10)
    assert wakers["[block]"].blocked_ms == pytest.approx(500.0) and wakers["[irq]"].in_call_ms > 0
    # AND no waker seen, and the idle task, have names of their own too (never "?")
    assert (wakers[UNSEEN_WAKER].wakeups, wakers[IDLE_WAKER].wakeups) == (1, 1)
    assert all(w.holder == INTERRUPT for w in wakers.values())


def test_waker_names_for_pid_0():
    assert [waker_name(0, c) for c in ("[timer]", "", None, "swapper/3")] == [
        "[timer]",
        UNSEEN_WAKER,
        UNSEEN_WAKER,
        IDLE_WAKER,
    ]
    assert waker_name(None, None) == UNSEEN_WAKER and waker_name(1234, "pt_data_worker") == "pt_data_worker"


def test_the_bpf_names_interrupt_kinds_as_the_vocabulary():
    # GIVEN probes/sched.bpf.c  THEN its IRQ_* codes and the names it writes are the vocabulary's
    src = (ROOT / "probes" / "sched.bpf.c").read_text()
    codes = {name: int(v) for name, v in re.findall(r"#define IRQ_(TIMER|SOFT|HARD|NET|BLOCK) (\d+)", src)}
    named = dict(re.findall(r"irq == IRQ_(\w+)\)\s*__builtin_memcpy\(o->waker_comm, \"(\[\w+\])\"", src))
    fallback = re.findall(r"else\s*__builtin_memcpy\(o->waker_comm, \"(\[\w+\])\"", src)
    assert len(codes) == 5 and len(named) == 4 and len(fallback) == 1
    by_code = {codes[k]: v for k, v in named.items()} | {codes["HARD"]: fallback[0]}
    assert by_code == WAKER_KINDS


def test_the_recorder_writes_wakers_from_the_vocabulary():
    # GIVEN drained wake aggregates: a task, a timer interrupt, a block interrupt, and a wakeup never seen
    keys = np.zeros(4, dtype=events.WAKE_KEY_DTYPE)
    vals = np.zeros(4, dtype=events.WAKE_VAL_DTYPE)
    keys["waker_irq"] = [0, 1, 5, 0]
    vals["waker_pid"] = [4242, 0, 0, 0]
    vals["waker_comm"] = [b"pt_data_worker", b"", b"whatever", b""]
    # THEN thread_wakers names them as the readers do
    got = columns.waker_columns(columns.Aggregates(keys, vals))["waker_comm"]
    assert got == ["pt_data_worker", WAKER_KINDS[1], WAKER_KINDS[5], UNSEEN_WAKER]


def test_the_tables_and_the_classes_are_the_vocabulary(db):
    # GIVEN the schema  THEN thread_breakdown's parts are the vocabulary's, in order, and the class literal is it
    cols = TABLE_BY_NAME["thread_breakdown"].column_names
    assert [c.removesuffix("_ns") for c in cols if c.removesuffix("_ns") in PART_NAMES] == list(PART_NAMES)
    assert HolderClass.__args__ == WAKER_CLASSES  # type: ignore[attr-defined]
    # AND a recording's roles: as written, and as every analysis reports them
    with open_trace(db) as c:
        assert {r for (r,) in c.execute("SELECT DISTINCT role FROM processes").fetchall()} <= set(RECORDED_ROLES)
        info = load_recording(c)
        assert {info.process_role(p) for p in info.procs} <= set(PROCESS_ROLES)
