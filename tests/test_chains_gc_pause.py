"""chains.gc_pause: the training thread's time inside CPython's garbage collector, a root of its own (issue 28)."""

from __future__ import annotations

import random

import duckdb
import pytest

from tests.support.builder import MAIN_PID, MIB, MS, US, S, TraceBuilder
from tests.support.scenarios import TRAIN_STACK, Step, _base
from tracer.analysis.chains import ChainContext, compute_chains
from tracer.analysis.chains.context import MEDIUM_SHARE, grade
from tracer.analysis.chains.gc_pause import explained_by_gc, gc_ns_by_sec
from tracer.analysis.db import open_trace

# the allocating line: a step's log kept in a growing list (the innermost frame of the collections' stacks)
LOG_STACK = [*TRAIN_STACK[:2], ("python", "train.py", "log_step", "train.py", 57)]
FULL_EVERY = 5  # a full collection every 5th step
FULL_NS = 60 * MS  # each walks the whole heap
YOUNG_NS = 100 * US  # a young collection every step


def gc_loop(b: TraceBuilder) -> None:
    """The shared 100 ms loop (scenarios._base) whose host work also runs the collector: a young collection each
    step and a full one of FULL_NS every FULL_EVERY steps, the host work lengthened by it, at train.py:57."""
    site = b.stack(LOG_STACK)

    def shape(st: Step) -> None:
        if st.i % FULL_EVERY == 0:
            st.python_ns += FULL_NS  # 80 ms of host work: the sync waits less for the GPU

    def gap(st: Step, a: int, end: int) -> None:
        b.gc(a + 1 * MS, YOUNG_NS, 0, site, collected=3)
        if st.i % FULL_EVERY == 0:
            b.gc(a + 2 * MS, FULL_NS, 2, site, collected=10)

    b.duration_s = 30
    _base(b, random.Random(3), shape=shape, python_gap=gap)


def chains_of(tmp_path, b: TraceBuilder, drop_gc: bool = False):
    b.write(tmp_path / "t.duckdb")
    if drop_gc:  # a recording made before gc_collections existed
        with duckdb.connect(str(tmp_path / "t.duckdb")) as c:
            c.execute("DROP TABLE gc_collections")
    with open_trace(tmp_path / "t.duckdb") as c:
        return compute_chains(c, limit=100)


def test_gc_pause_is_the_interpreter_root_with_the_allocating_line(tmp_path):
    b = TraceBuilder()
    gc_loop(b)
    res = chains_of(tmp_path, b)
    (ch,) = [c for c in res.chains if c.category == "gc_pause"]
    steps = len([r for r in b.cuda_calls if r["op"] == "cudaStreamSynchronize"])
    fulls = (steps + FULL_EVERY - 1) // FULL_EVERY
    gc_ns = fulls * FULL_NS + steps * YOUNG_NS
    assert ch.tid == MAIN_PID and ch.impact_ms == round(gc_ns / MS, 1)
    assert ch.severity == "MEDIUM" and ch.share >= MEDIUM_SHARE  # 3.6 s of 30 s: 12%
    ev = ch.evidence
    assert ev.by_generation == {"0": steps, "2": fulls} and ev.max_ms == FULL_NS / MS and ev.p99_ms == FULL_NS / MS
    assert ev.triggered_at[0].site == "train.py:57 log_step" and ev.triggered_at[0].share == 1.0
    assert ch.culprit.code_site == "train.py:57 log_step"
    assert ch.root is not None and ch.root.kind == "interpreter" and ch.root.site == "train.py:57 log_step"
    assert ch.root.stack[0] == "train.py:57 log_step"  # innermost first
    assert ch.path[0].tid == MAIN_PID and ch.path[0].role == "training"
    assert "gc.freeze()" in ch.recommendations[0] and "gc.disable()" in ch.recommendations[1]
    assert f"every {FULL_EVERY} steps" in ch.recommendations[1] and "every rank" in ch.recommendations[1]
    # the collector's time is CPU time of the thread: coverage credits it to gc_pause
    cpu = next(p for p in res.coverage.parts if p.part == "cpu")
    assert "gc_pause" in cpu.explained_by


def test_collections_outside_the_steps_do_not_count(tmp_path):
    """Full collections while the dataset index is built, before the first step, cost the steps nothing."""
    b = TraceBuilder(duration_s=30)
    site = b.stack(LOG_STACK)

    def shape(st: Step) -> None:
        st.skip = st.i < 10  # the first second builds the index

    _base(b, random.Random(3), shape=shape)
    for k in range(15):
        b.gc(k * FULL_NS, FULL_NS, 2, site)
    assert not [c for c in chains_of(tmp_path, b).chains if c.category == "gc_pause"]


def test_older_recording_without_the_table(tmp_path):
    b = TraceBuilder()
    gc_loop(b)
    res = chains_of(tmp_path, b, drop_gc=True)
    assert not [c for c in res.chains if c.category == "gc_pause"] and res.coverage is not None


def test_other_threads_collections_are_not_the_training_threads(tmp_path):
    b = TraceBuilder()
    gc_loop(b)
    for g in b.gc_collections:
        g["tid"] = MAIN_PID + 77  # another thread of the process
    assert not [c for c in chains_of(tmp_path, b).chains if c.category == "gc_pause" and c.tid == MAIN_PID]


HEAP_NS = 40 * MS  # a full collection each step while the heap grows


def growing_heap(b: TraceBuilder) -> None:
    """The training thread builds a large heap in t = 10..20 s: it faults in 512 MiB of fresh pages a second itself
    (a fault storm of its own, by memory_pressure's rule), and each step's host work runs a HEAP_NS full
    collection walking it."""
    site = b.stack(LOG_STACK)
    hot = range(10 * S, 20 * S)

    def shape(st: Step) -> None:
        if st.t0 in hot:
            st.python_ns += HEAP_NS

    def gap(st: Step, a: int, end: int) -> None:
        if st.t0 in hot:
            b.gc(a + 1 * MS, HEAP_NS, 2, site)

    _base(b, random.Random(5), shape=shape, python_gap=gap)
    for sec in range(10, 20):
        b.faults(sec * S, MAIN_PID, faults=131_072, page_alloc_bytes=512 * MIB)


def test_a_growing_heap_is_the_collector_not_memory(tmp_path):
    b = TraceBuilder()
    growing_heap(b)
    # without the collector's record, the thread's extra CPU in its own fault storm reads as memory_pressure
    (mp,) = [c for c in chains_of(tmp_path, b, drop_gc=True).chains if c.category == "memory_pressure"]
    assert mp.evidence.trigger == "fault_storm" and mp.culprit.tid == MAIN_PID and mp.evidence.faulting_cpu_ms > 0
    res = chains_of(tmp_path, b)
    (gc,) = [c for c in res.chains if c.category == "gc_pause"]
    assert gc.severity == "MEDIUM" and gc.impact_ms == 100 * HEAP_NS / MS
    assert res.chains[0].category == "gc_pause"
    assert not [c for c in res.chains if c.category == "memory_pressure" and c.explained_by is None]


def test_the_cost_is_the_collectors_cpu_not_its_waits(tmp_path):
    """A collection preempted for half its time costs its CPU half; the wait for a CPU is cpu_contention's. A
    recording made before off_cpu_ns existed counts the whole duration."""
    b = TraceBuilder()
    gc_loop(b)
    for g in b.gc_collections:
        if g["generation"] == 2:
            g.update(off_cpu_ns=FULL_NS // 2, runq_ns=FULL_NS // 2)
    steps = len([r for r in b.cuda_calls if r["op"] == "cudaStreamSynchronize"])
    fulls = (steps + FULL_EVERY - 1) // FULL_EVERY
    (ch,) = [c for c in chains_of(tmp_path, b).chains if c.category == "gc_pause"]
    assert ch.impact_ms == round((fulls * FULL_NS // 2 + steps * YOUNG_NS) / MS, 1)
    b.write(tmp_path / "t.duckdb")
    with duckdb.connect(str(tmp_path / "t.duckdb")) as c:
        c.execute("ALTER TABLE gc_collections DROP COLUMN off_cpu_ns")
    with open_trace(tmp_path / "t.duckdb") as c:
        (old,) = [x for x in compute_chains(c, limit=100).chains if x.category == "gc_pause"]
    assert old.impact_ms == round((fulls * FULL_NS + steps * YOUNG_NS) / MS, 1)


def test_a_collection_crossing_seconds_is_spread_over_them(tmp_path):
    """The collector's CPU per second (memory_pressure's baseline subtracts it) follows each collection's overlap
    with the second: a 458 ms full collection starting late in a second booked whole to it left that second's CPU
    outside the collector negative, and a fault storm's share read 4.0 (CI, issue 28's gc fixture)."""
    b = TraceBuilder()
    gc_loop(b)
    b.gc_collections.clear()
    b.gc(20 * S + 900 * MS, 400 * MS, 2)  # 100 ms in second 20, 300 ms in 21
    b.gc(22 * S + 500 * MS, 2 * S, 2, off_cpu_ns=1 * S)  # 2 s across 22..24, half of it off CPU
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        got = gc_ns_by_sec(ChainContext.load(c, None), MAIN_PID)
    assert got == {20: 100 * MS, 21: 300 * MS, 22: 250 * MS, 23: 500 * MS, 24: 250 * MS}


def host_bound_gc(b: TraceBuilder, gc_ms: int) -> None:
    """A host-bound 100 ms loop: 2 ms of Python, a sync until the GPU is done 10 ms in, then ~90 ms of host work
    until the next step's launches (the builder's CPU time between calls), in which a ``gc_ms`` full collection
    runs at train.py:57: what host_python and sync_stall blame is that host work."""
    site = b.stack(LOG_STACK)

    def shape(st: Step) -> None:
        st.python_ns, st.gpu_end_ns = 2 * MS, 10 * MS

    def gap(st: Step, a: int, end: int) -> None:
        b.gc(st.t0 + 12 * MS, gc_ms * MS, 2, site)

    b.duration_s = 30
    _base(b, random.Random(3), shape=shape, python_gap=gap)


def _detected(tmp_path, b: TraceBuilder) -> tuple[list, object]:
    """host_python and sync_stall chains as detected, before any ranking rule, and the gc_pause chain."""
    from tracer.analysis.chains import gc_pause, host_python, sync_stall

    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        ctx = ChainContext.load(c)
        (g,) = gc_pause.detect(ctx)
        return [*host_python.detect(ctx), *sync_stall.detect(ctx)], g


@pytest.mark.parametrize("gc_ms", [40, 80])
def test_a_chain_keeps_only_the_part_of_its_time_that_is_not_the_collector(tmp_path, gc_ms):
    # GIVEN ~92 ms of host work a step, 40 or 80 ms of it the collector (issue 28: the 0.5 rule left host_python
    # whole and HIGH beside gc_pause at 44%, and hid all of it at 87%, a MEDIUM's worth of Python besides)
    b = TraceBuilder()
    host_bound_gc(b, gc_ms)
    symptoms, g = _detected(tmp_path, b)
    (hp,) = [c for c in symptoms if c.category == "host_python"]
    gc_truth = sum(x["dur_ns"] for x in b.gc_collections if x["ts_ns"] < g.end_ns)  # the last one is past the steps
    assert g.impact_ms * MS == gc_truth
    rest = 1 - gc_truth / (hp.evidence.cpu_ms * MS)
    (after,) = [c for c in explained_by_gc([hp, g]) if c.category == "host_python"]
    # THEN it keeps the rest of its time, graded on it, and says where the collector's part went
    assert after.explained_by is None and after.impact_ms == pytest.approx(hp.impact_ms * rest, abs=0.5)
    assert after.share == pytest.approx(hp.share * rest, abs=1e-3)
    assert after.severity == grade(hp.share * rest) == ("HIGH" if gc_ms == 40 else "MEDIUM")
    assert g.id in after.summary


def test_a_chain_whose_time_is_all_the_collectors_yields(tmp_path):
    # GIVEN 90 of the ~92 ms of host work a step the collector's
    b = TraceBuilder()
    host_bound_gc(b, 90)
    symptoms, g = _detected(tmp_path, b)
    assert {c.category for c in symptoms} >= {"host_python"}
    # THEN every one of them yields to gc_pause: nothing gradable is left of it
    for c in explained_by_gc([*symptoms, g]):
        if c.category != "gc_pause":
            assert c.explained_by == g.id, (c.category, c.share, c.summary)


GC_NATIVE = ("native", "libpython3.13.so.1.0", "gc_collect_main", None, None)


def sampled_gc_loop(b: TraceBuilder, collector_frames: bool = True) -> int:
    """gc_loop with its collections not probed (an interpreter with neither USDT probes nor the collector's symbol)
    but sampled at 99 Hz: each second's CPU outside calls as samples, the collector's part of it in a stack whose
    leaf is gc_collect_main under train.py:57. Return the collector's time inside the steps, ns (the truth)."""
    gc_loop(b)
    rows = [r for r in b.breakdown_rows() if r["tid"] == MAIN_PID]
    in_gc: dict[int, int] = {}
    for g in b.gc_collections:
        in_gc[g["ts_ns"] // S] = in_gc.get(g["ts_ns"] // S, 0) + g["dur_ns"]
    gc_stack = b.stack([*LOG_STACK, GC_NATIVE] if collector_frames else LOG_STACK)
    plain = b.stack(TRAIN_STACK)
    for r in rows:
        total = round(99 * r["cpu_ns"] / S)
        mine = round(99 * in_gc.get(r["sec"], 0) / S)
        b.samples(r["sec"], gc_stack, mine)
        b.samples(r["sec"], plain, total - mine)
    truth = sum(g["dur_ns"] for g in b.gc_collections)
    b.gc_collections.clear()
    return truth


def test_without_probed_collections_the_samples_in_the_collector_give_it(tmp_path):
    # GIVEN the collector's time only in the on-CPU samples (issue 28: an interpreter without USDT probes or the
    # collector's symbol got no gc_pause at all)
    b = TraceBuilder()
    truth = sampled_gc_loop(b)
    res = chains_of(tmp_path, b)
    (ch,) = [c for c in res.chains if c.category == "gc_pause"]
    cpu = sum(r["cpu_ns"] for r in b.breakdown_rows() if r["tid"] == MAIN_PID)
    # THEN gc_pause comes from them: about the collector's time (the samples round each second to 1/99 of its CPU),
    # at the allocating line, with no count or generation claimed
    assert ch.evidence.source == "samples" and ch.severity == "MEDIUM"
    assert ch.impact_ms * MS == pytest.approx(truth, rel=0.05), (ch.impact_ms, truth / MS, cpu / MS)
    assert ch.root.kind == "interpreter" and ch.root.site == "train.py:57 log_step"
    assert ch.evidence.collections == 0 and ch.evidence.by_generation == {} and "no count or generation" in ch.summary
    assert "gc.freeze()" in ch.recommendations[0]


def test_samples_outside_the_collector_are_no_gc_pause(tmp_path):
    b = TraceBuilder()
    sampled_gc_loop(b, collector_frames=False)
    assert not [c for c in chains_of(tmp_path, b).chains if c.category == "gc_pause"]
