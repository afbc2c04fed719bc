"""Real eBPF, diagnosis from the time breakdown (issue 10): each fixture workload, recorded with the real tracer,
yields the right top cause, culprit and Python line; the healthy and GPU-bound loops yield nothing HIGH; the
training thread's breakdown adds up to its wall time within 2 %; the tracer is never blamed.

Each scenario is one recording (a few to ~20 s of workload), shared by every test that needs it. The machine the
suite runs on is shared: other tenants' processes may take CPU from the workload. Their contention is real and
may legitimately rank high, so "the top cause" is the top cause the job or the test itself brought: a
cpu_contention chain whose culprit is another tenant's process is set aside (the hog a scenario starts is not).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import anyio
import pytest
from _helpers import HOG_NAME, WORKLOADS, Recording, alloc_site_line, assert_root_found, cached, workload
from mcp import Client

from mcp_server.server import build_server
from tracer.analysis.breakdown import time_breakdown
from tracer.analysis.chains import CausalChain, compute_chains
from tracer.analysis.processes import BUSY_CORE_SHARE
from tracer.analysis.recording import load_recording
from tracer.analysis.stats import trace_stats

pytestmark = pytest.mark.bpf

GAP_PCT_MAX = 2.0  # the bound on parts vs the thread's wall time


def site_line(name: str, marker: str) -> int:
    """The line of fixtures/workloads/NAME whose code ends in ``# MARKER``."""
    for i, line in enumerate((WORKLOADS / name).read_text().splitlines(), 1):
        if re.search(rf"\S.*#\s*{marker}\s*$", line):
            return i
    raise AssertionError(f"no # {marker} in {name}")


@dataclass(frozen=True)
class Scenario:
    cmd: list[str]
    top: str | None  # category of the top cause the job brought; None: nothing HIGH at all
    kw: dict = field(default_factory=dict)


def run(name: str, args: str) -> list[str]:
    return workload(name, *args.split())


def step_loop(args: str) -> list[str]:
    return run("step_loop.py", args)


def pinned(name: str, args: str) -> list[str]:
    """``name`` run on CPU 0 only (where the test's hog runs), its children too."""
    return ["taskset", "-c", "0", *run(name, args)]


# Several scenarios per cause, varied by rates, thread and worker counts, and which call syncs.
SCENARIOS: dict[str, Scenario] = {
    # a 3-thread CPU hog pinned on CPU 0 with the training process (the recorder elsewhere)
    "hog3": Scenario(
        pinned("step_loop.py", "--steps 150 --host-where after --host-ms 6 --kernel-us 4000 --sync stream"),
        "cpu_contention",
        dict(hog_seconds=120),
    ),
    # 800 steps (~3 s traced): with 200 they lasted under the 1 s a share is taken of (context.MIN_STEPS_NS) and
    # the hog read ~20%, MEDIUM under load. Untraced, the hog takes the loop from 1.25 s to 2.37 s.
    "hog3_train": Scenario(
        pinned(
            "train.py", "--workers 1 --persistent-workers --epochs 1 --steps 800 --worker-cpu-ms 0.5 --kernel-us 50"
        ),
        "cpu_contention",
        dict(hog_seconds=120),
    ),
    # own workers burning the CPU, pinned to one CPU with the main thread, so that the workers (not other
    # tenants of this shared machine) are who it waits behind
    "own_workers4": Scenario(pinned("oversubscribe.py", "--workers 4 --steps 200"), "cpu_contention"),
    "own_workers6": Scenario(
        pinned("oversubscribe.py", "--workers 6 --steps 150 --worker-ms 20 --host-ms 5"), "cpu_contention"
    ),
    # loss.item(): a 4-byte DtoH copy after the step's kernels, Python work before them
    "item_memcpy": Scenario(step_loop("--steps 300 --host-ms 5 --kernel-us 5000 --sync memcpy"), "sync_stall"),
    "item_dtoh": Scenario(
        step_loop("--steps 300 --host-ms 4 --kernel-us 6000 --launches 20 --sync dtoh"), "sync_stall"
    ),
    # a Python thread of the training process filling a cache with fresh pages
    "storm1": Scenario(run("fault_storm.py", "--steps 100"), "memory_pressure"),
    "storm2_capped": Scenario(
        run("fault_storm.py", "--steps 150 --storm-threads 2 --mb-per-s 400 --chunk-mb 32"),
        "memory_pressure",
    ),
    "alloc": Scenario(run("alloc_stress.py", "--iterations 1000"), "allocation_churn"),
    # 4000 steps: ~2 s of steps, about half of it in cudaMalloc/cudaFree; with 1000 the steps lasted ~0.4 s, and a
    # share is taken of at least 1 s of steps (context.MIN_STEPS_NS), so it read 20% (MEDIUM under load)
    "alloc_small": Scenario(
        run("alloc_stress.py", "--iterations 4000 --size-mb 4 --allocs-per-step 8"), "allocation_churn"
    ),
    "respawn": Scenario(
        # each respawn costs the fork and a first 15 ms batch: ~30% of the loop's wall untraced (0.82 s against
        # 0.58 s with --persistent-workers); with 2 workers and 2 ms batches it was ~12%, MEDIUM, not HIGH
        run("train.py", "--workers 3 --epochs 10 --steps 5 --kernel-us 500 --worker-cpu-ms 15 --respawn-workers"),
        "process_churn",
    ),
    "starved": Scenario(
        run("train.py", "--workers 1 --persistent-workers --epochs 1 --steps 150 --worker-cpu-ms 20 --kernel-us 200"),
        "dataloader_starvation",
    ),
    "launch_bound": Scenario(
        step_loop("--steps 300 --host-where between --launches 50 --kernel-us 100 --host-ms 5 --sync stream"),
        "launch_bound",
    ),
    "gpu_bound": Scenario(
        step_loop("--steps 100 --host-ms 0.5 --host-where after --kernel-us 30000 --sync stream"), None
    ),
    "healthy": Scenario(step_loop("--steps 300 --host-ms 1 --host-where after --kernel-us 8000 --sync stream"), None),
    # the healthy loop after 12 start-up shell commands (`sh -c 'uname -a'`), with no DataLoader: the helpers drew a
    # LOW process_churn chain with DataLoader advice (issue 23)
    "helpers": Scenario(
        step_loop("--helpers 12 --steps 300 --host-ms 1 --host-where after --kernel-us 8000 --sync stream"), None
    ),
}
PROBLEMS = [n for n, s in SCENARIOS.items() if s.top]


def rec(name: str, tmp_path_factory) -> Recording:
    s = SCENARIOS[name]
    return cached(f"diag-{name}", tmp_path_factory, s.cmd, timeout=300, **s.kw)


def chains_of(r: Recording) -> list[CausalChain]:
    with r.conn() as c:
        return compute_chains(c, limit=100).chains


def ours(r: Recording, chains: list[CausalChain]) -> list[CausalChain]:
    """The chains the job or the test brought: another tenant's CPU use is set aside (module docstring), unless
    the test's own hog is among the processes that held the CPU."""
    return [
        ch
        for ch in chains
        if not (
            ch.category == "cpu_contention"
            and ch.evidence.holder_class == "other"
            and r.hog_pid not in {h.pid for h in ch.evidence.holders}
        )
    ]


@pytest.fixture(scope="module", params=PROBLEMS)
def problem(request, tmp_path_factory):
    return request.param, rec(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=list(SCENARIOS))
def any_rec(request, tmp_path_factory):
    return request.param, rec(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    return lambda name: rec(name, tmp_path_factory)


def test_top_cause(problem):
    # GIVEN a real recording of a problem workload; WHEN chains are computed
    name, r = problem
    mine = ours(r, chains_of(r))
    # THEN its top cause is the expected one, HIGH, on the training thread
    assert mine, [(c.category, c.severity, c.share) for c in chains_of(r)]
    top = mine[0]
    assert (top.category, top.severity) == (SCENARIOS[name].top, "HIGH"), [
        (c.category, c.severity, round(c.share, 3), c.summary) for c in mine
    ]
    assert top.basis == "exact" and r.pid in top.pids
    # AND the wait-for graph found the root of the training thread's lost time (issue 28)
    assert_root_found(r.db)


@pytest.mark.parametrize("name", ["healthy", "gpu_bound", "helpers"])
def test_healthy_loops_have_nothing_high(named, name):
    r = named(name)
    high = [c for c in ours(r, chains_of(r)) if c.severity == "HIGH"]
    assert not high, [(c.category, c.share, c.summary) for c in high]
    # the GPU-bound loop says so, for information
    if name == "gpu_bound":
        assert "gpu_bound" in {c.category for c in chains_of(r)}


def test_breakdown_adds_up(any_rec):
    # GIVEN any real recording; WHEN its breakdown is computed
    name, r = any_rec
    with r.conn() as c:
        b = time_breakdown(c)
    # THEN it is exact, and the training thread's parts add up to its wall time within 2 %
    assert b.basis == "exact" and b.threads, b.note
    t = b.threads[0]
    assert t.role == "training" and t.cuda_calls > 0
    assert abs(t.check.gap_pct) <= GAP_PCT_MAX, t.check
    assert abs(t.check.parts_mismatch_ms) <= GAP_PCT_MAX / 100 * t.check.span_ms, t.check
    assert sum(p.share for p in t.parts) == pytest.approx(1.0, abs=2e-3)


def test_the_chains_leave_at_most_a_tenth_of_the_training_threads_time_unexplained(any_rec):
    # GIVEN any fixture's recording; WHEN its chains are computed
    name, r = any_rec
    with r.conn() as c:
        cv = compute_chains(c, limit=100).coverage
    # THEN every part of the training thread's steps of 5% or more is explained by a chain, or listed with where
    # its time went, and the unexplained ones add up to 10% of its steps at most (issue 18)
    assert cv is not None
    unexplained = [p for p in cv.parts if not p.explained_by]
    assert all(p.top_sites for p in unexplained if p.part in ("cpu", "blocked")), unexplained
    assert cv.unexplained_share <= 0.10, [(p.part, p.share, p.explained_by, p.top_sites) for p in cv.parts]


def test_the_tracer_is_never_blamed(any_rec):
    name, r = any_rec
    with r.conn() as c:
        tracer = load_recording(c).tracer_pids
    assert tracer, "the recorder's processes are recorded with role tracer"
    for ch in chains_of(r):
        assert ch.culprit is None or ch.culprit.pid not in tracer, ch
        for rec_ in ch.recommendations:
            assert not any(re.search(rf"\b{p}\b", rec_) for p in tracer), rec_


@pytest.mark.parametrize("name", ["hog3", "hog3_train"])
def test_foreign_hog_is_the_culprit(named, name):
    r = named(name)
    ch = next(c for c in ours(r, chains_of(r)) if c.category == "cpu_contention")
    hog = next(h for h in ch.evidence.holders if h.pid == r.hog_pid)
    assert (hog.comm, hog.holder) == (HOG_NAME, "other") and ch.evidence.holder_class == "other"
    # the culprit is the holder that took the most: the hog, or another tenant on this shared machine
    with r.conn() as c:
        info = load_recording(c)
    top = ch.evidence.holders[0]
    assert (ch.culprit.pid, ch.culprit.relation) == (top.pid, "other_process") and not info.in_tree(top.pid)
    assert hog.runq_ms >= 0.25 * sum(h.runq_ms for h in ch.evidence.holders)
    assert f"renice -n 19 -p {top.pid}" in ch.recommendations[0]


@pytest.mark.parametrize("name", ["own_workers4", "own_workers6"])
def test_own_workers_are_the_culprit(named, name):
    r = named(name)
    ch = ours(r, chains_of(r))[0]
    workers = {row[0] for row in r.q("SELECT pid FROM processes WHERE comm = 'pt_data_worker'")}
    assert ch.evidence.holder_class == "own" and ch.culprit.relation == "own_workers"
    assert ch.culprit.pid in workers and any("num_workers" in x for x in ch.recommendations)


@pytest.mark.parametrize("name,op", [("item_memcpy", "cudaMemcpy"), ("item_dtoh", "cuMemcpyDtoH")])
def test_implicit_sync_names_the_copy_and_its_line(named, name, op):
    r = named(name)
    ch = ours(r, chains_of(r))[0]
    assert ch.op == op and ch.evidence.implicit_syncs == ch.evidence.syncs > 0
    # the line of the copy: the SYNC_SITE line of step_loop.py that calls this op
    call = "cuda.cudaMemcpy(" if op == "cudaMemcpy" else "cuda.cuMemcpyDtoH_v2("
    src = (WORKLOADS / "step_loop.py").read_text().splitlines()
    want = next(i for i, line in enumerate(src, 1) if call in line and line.rstrip().endswith("# SYNC_SITE"))
    assert ch.culprit.code_site.split(" ")[0].endswith(f"step_loop.py:{want}"), ch.culprit


@pytest.mark.parametrize("name", ["storm1", "storm2_capped"])
def test_fault_storm_names_the_thread(named, name):
    r = named(name)
    storm = {int(t) for t in re.findall(r"storm_tid=(\d+)", r.output)}
    ch = ours(r, chains_of(r))[0]
    assert ch.evidence.trigger == "fault_storm" and ch.culprit.kind == "thread"
    assert ch.culprit.tid in storm and ch.culprit.comm == "cache_fill" and ch.culprit.pid == r.pid
    with r.conn() as c:
        b = time_breakdown(c)
    assert b.process_threads[0].tid in storm and b.process_threads[0].cuda_calls == 0


@pytest.mark.parametrize("name", ["alloc", "alloc_small"])
def test_allocation_churn_names_the_line(named, name):
    r = named(name)
    ch = ours(r, chains_of(r))[0]
    assert ch.culprit.code_site.split(" ")[0].endswith(f"alloc_stress.py:{alloc_site_line()}"), ch.culprit


def test_respawn(named):
    r = named("respawn")
    ch = next(c for c in chains_of(r) if c.category == "process_churn")
    assert (ch.evidence.fork_waves, ch.evidence.respawn_waves, ch.evidence.workers_per_wave) == (10, 9, 3)
    assert "persistent_workers=True" in ch.recommendations[0] and ch.culprit.pid == r.pid


def test_starved_loader_names_the_worker(named):
    r = named("starved")
    ch = ours(r, chains_of(r))[0]
    workers = {row[0] for row in r.q("SELECT pid FROM processes WHERE comm = 'pt_data_worker'")}
    assert ch.culprit.pid in workers and ch.evidence.woken_by_workers_ms > 0


def test_launch_bound_names_the_launch_line(named):
    r = named("launch_bound")
    ch = ours(r, chains_of(r))[0]
    assert ch.culprit.code_site.split(" ")[0].endswith(f"step_loop.py:{site_line('step_loop.py', 'LAUNCH_SITE')}")


def test_mcp_time_breakdown_on_a_real_recording(named):
    r = named("item_memcpy")
    with r.conn() as c:
        want = time_breakdown(c).model_dump(mode="json")

    async def go():
        async with Client(build_server(r.db)) as client:
            return await client.call_tool("get_time_breakdown", {})

    got = anyio.run(go)
    assert not got.is_error and got.structured_content == want


# advice that only a torch DataLoader can take
DATALOADER_WORDS = re.compile(r"DataLoader|num_workers|prefetch_factor|persistent_workers|pin_memory")


def test_startup_helpers_make_no_churn_and_no_dataloader_advice(named):
    # GIVEN a loop that ran 12 shell commands at start-up and has no DataLoader
    r = named("helpers")
    with r.conn() as c:
        helpers = c.execute("SELECT count(*) FROM processes WHERE comm IN ('sh', 'uname')").fetchone()[0]
    assert helpers == 24, "the scenario's helpers are recorded (else the test below is empty)"
    # THEN no chain is about churn, and none advises about a DataLoader
    chains = chains_of(r)
    assert "process_churn" not in {c.category for c in chains}, [(c.category, c.summary) for c in chains]
    for ch in chains:
        text = " ".join([ch.summary, *ch.recommendations])
        assert not DATALOADER_WORDS.search(text), (ch.category, text)


ANSWER_BYTES = 4096  # what get_trace_stats may take by default (issue 23)


def test_trace_stats_answer_is_small_and_names_the_busy_threads(any_rec):
    # GIVEN any real recording; WHEN the assistant's first tool answers (its text is this JSON)
    name, r = any_rec
    with r.conn() as c:
        st = trace_stats(c)
        info = load_recording(c)
        busy = [
            (pid, tid)
            for pid, tid in c.execute(
                "SELECT pid, tid FROM thread_breakdown GROUP BY pid, tid HAVING sum(cpu_ns) >= ?",
                [BUSY_CORE_SHARE * info.duration_ns],
            ).fetchall()
            if pid not in info.tracer_pids
        ]
    text = st.model_dump_json()
    # THEN it is under 4 KB
    assert len(text.encode()) < ANSWER_BYTES, f"{name}: {len(text.encode())} bytes"
    # AND every thread on CPU for 5% of the recording is listed or counted, the training thread never left out
    listed = {(b.pid, b.tid) for b in st.busy_threads}
    assert len(listed) + st.more_busy_threads == len(busy) and listed <= set(busy), (listed, busy)
    assert (r.pid, r.pid) in listed or (r.pid, r.pid) not in busy, (r.pid, listed)
