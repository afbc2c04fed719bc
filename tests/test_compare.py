"""tracer.analysis.compare on hand-built recordings of tests/tracedb.py's step_loop (the fixture workload as a
scenario, with per-step noise from a seed): a fix shows beyond noise, two runs of one workload do not, ops on one
side only, older recordings, short ones, other workloads; `tracer compare` and the MCP tool compare_traces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anyio
import duckdb
import numpy as np
import pytest
from mcp import Client
from tracedb import MAIN_PID, S, TraceBuilder, build, downgrade_to_v1, step_loop

from mcp_server.server import build_server
from tracer.analysis.compare import (
    MIN_SECONDS,
    Comparison,
    compare_traces,
    mean_diff_interval,
)
from tracer.analysis.db import open_trace
from tracer.commands.cli import main

DURATION_S = 20


def loop(path: Path, seed: int, duration_s: float = DURATION_S, **kw) -> TraceBuilder:
    """Write a step_loop recording to ``path``; return its builder (the rows are the expected values)."""
    b = TraceBuilder(duration_s=duration_s)
    step_loop(b, seed, **kw)
    b.write(path)
    return b


@pytest.fixture(scope="module")
def dbs(tmp_path_factory) -> dict[str, tuple[Path, TraceBuilder]]:
    d = tmp_path_factory.mktemp("compare")
    specs = {
        "before": dict(seed=1),  # loss.item() every step: the GPU idles while the host works
        "rerun": dict(seed=2),  # the same workload again
        "fixed": dict(seed=3, sync_every=100),  # the fix the sync_stall chain recommends: read it every N steps
        "stream": dict(seed=4, sync="stream"),  # the same cadence, another wait
        "no_sync": dict(seed=5, sync="none"),
    }
    return {name: (d / f"{name}.duckdb", loop(d / f"{name}.duckdb", **kw)) for name, kw in specs.items()}


def compare(before: Path, after: Path) -> Comparison:
    with open_trace(before) as b, open_trace(after) as a:
        return compare_traces(b, a, before_name=before.name, after_name=after.name)


def verdicts(c: Comparison) -> list[tuple[str, str]]:
    """Return (what, verdict) of every difference the comparison judged."""
    out = [("steps", c.steps.noise.verdict)]
    out += [(f"part {p.part}", p.noise.verdict) for p in (c.training.parts if c.training else [])]
    for o in c.ops:
        for k in ("rate", "time", "p50", "p99"):
            out.append((f"{o.op} {k}", getattr(o, f"{k}_noise").verdict))
    return out


def whole_seconds_parts(b: TraceBuilder, first_s: int, end_s: int) -> dict[str, int]:
    """Return the main thread's parts (ns) summed over whole seconds [first_s, end_s) from the builder's rows."""
    acc: dict[str, int] = {}
    for r in b.breakdown_rows():
        if r["tid"] == MAIN_PID and first_s <= r["sec"] < end_s:
            for k, v in r.items():
                if k.endswith("_ns"):
                    acc[k[:-3]] = acc.get(k[:-3], 0) + v
    return acc


def test_a_fix_that_removes_the_sync_stall_shows_beyond_noise(dbs):
    # GIVEN a loop reading the loss every step (a synchronous 4-byte copy), and the same loop reading it every
    # 100 steps
    (p_before, b_before), (p_fixed, b_fixed) = dbs["before"], dbs["fixed"]
    # WHEN they are compared
    c = compare(p_before, p_fixed)
    # THEN a step is the 10 launches between two waits of BEFORE, and steps/s rose beyond noise
    st = c.steps
    assert (st.detected, st.comparable, st.launches_per_step) == (True, True, 10.0)
    assert "once every 100 steps" in st.method
    memcpys = sum(1 for r in b_before.cuda_calls if r["op"] == "cudaMemcpy")
    assert st.before.steps == memcpys and st.before.markers == memcpys
    # AND AFTER's steps are counted from its exact copies, 100 steps each (issue 20: not from its launches / 10),
    # at the builder's rate: its launches / 10 over its loop
    launches_fixed = sum(1 for r in b_fixed.cuda_calls if r["op"] == "cudaLaunchKernel")
    memcpys_fixed = sum(1 for r in b_fixed.cuda_calls if r["op"] == "cudaMemcpy")
    assert (st.after.counted_from, st.after.steps_per_wait, st.after.steps_error_pct) == ("waits", 100, 0)
    assert st.after.steps == 100 * memcpys_fixed
    assert st.after.steps_per_s == pytest.approx(launches_fixed / 10 / c.after.loop_s, rel=0.01)
    assert st.after.steps_per_s > 1.5 * st.before.steps_per_s
    assert st.noise.verdict == "beyond_noise" and st.noise.ci_lo > 0
    # AND the training thread's sync part fell beyond noise, by what the builder's rows say
    parts = {p.part: p for p in c.training.parts}
    sync = parts["sync"]
    assert sync.noise.verdict == "beyond_noise" and sync.noise.ci_hi < 0 and sync.delta_points < -40
    first, end = int(-(-c.before.loop_start_s // 1)), int((c.before.loop_start_s + c.before.loop_s) // 1)
    want = whole_seconds_parts(b_before, first, end)
    assert sync.before_ms == pytest.approx(want["sync"] / 1e6, abs=1e-3)
    assert sync.before_share == pytest.approx(want["sync"] / want["wall"], abs=1e-4)
    assert sync.before_ms_per_step > 4 and sync.after_ms_per_step < 0.2
    assert parts["cpu"].noise.verdict == "beyond_noise" and parts["cpu"].delta_points > 40
    # AND the sync_stall chain went away
    ch = {x.category: x for x in c.chains}["sync_stall"]
    assert (ch.status, ch.severity_before, ch.severity_after) == ("gone", "HIGH", None)
    assert "train.py:92" in ch.culprit
    # AND the copy's rate fell beyond noise, with its exact counts
    ops = {o.op: o for o in c.ops}
    assert ops["cudaMemcpy"].calls_before == memcpys and ops["cudaMemcpy"].rate_noise.verdict == "beyond_noise"
    assert ops["cudaMemcpy"].p50_noise.verdict == "within_noise"  # each wait is as long; there are fewer
    assert any(h.startswith("steps/s") and "beyond noise" in h for h in c.headline)
    assert any(h.startswith("sync:") for h in c.headline) and any("sync_stall" in h and "gone" in h for h in c.headline)
    assert c.tests > 10 and "bootstrap" in c.noise_test and "Bonferroni" in c.noise_test


def test_two_runs_of_one_workload_are_within_noise(dbs):
    # GIVEN two recordings of one loop with different per-step noise; WHEN compared
    c = compare(dbs["before"][0], dbs["rerun"][0])
    # THEN nothing is beyond noise, and the intervals the tests gave hold zero
    assert [v for v in verdicts(c) if v[1] == "beyond_noise"] == []
    assert c.headline[0].startswith("steps/s") and c.headline[1:] == ["no difference beyond noise"]
    assert c.steps.noise.ci_lo < 0 < c.steps.noise.ci_hi
    for p in c.training.parts:
        if p.part in ("cpu", "sync"):
            assert p.noise.ci_lo < 0 < p.noise.ci_hi, p
    assert [(x.category, x.status) for x in c.chains] == [("sync_stall", "unchanged")]
    assert not [w for w in c.warnings if w.level == "warning"]


def test_ops_only_on_one_side(dbs):
    # GIVEN the same loop waiting in a synchronous copy, then in cudaStreamSynchronize
    c = compare(dbs["before"][0], dbs["stream"][0])
    ops = {o.op: o for o in c.ops}
    # THEN the copies are before only, the stream sync after only, each with its exact count
    assert ops["cudaMemcpy"].presence == "before_only" and ops["cuMemcpyDtoH"].presence == "before_only"
    s = ops["cudaStreamSynchronize"]
    assert s.presence == "after_only" and s.calls_before == 0 and s.calls_after > 1000
    assert s.p50_us_before is None and s.p50_noise.verdict == "not_tested" and s.rate_noise.verdict == "beyond_noise"
    assert any("cudaStreamSynchronize (runtime) only after" in h for h in c.headline)
    # AND a step is still one wait each side (the same launches per wait): steps/s within noise
    assert c.steps.comparable and "cudaMemcpy (before) / cudaStreamSynchronize (after)" in c.steps.method
    assert c.steps.noise.verdict == "within_noise"
    # AND the same kernels: no different-workload warning
    assert "different_workload" not in {w.kind for w in c.warnings}


def test_a_side_that_never_waits_counts_steps_in_launches(dbs):
    c = compare(dbs["before"][0], dbs["no_sync"][0])
    assert c.steps.comparable and c.steps.launches_per_step == 10.0 and "never waits" in c.steps.method
    assert c.steps.after.marker is None and c.steps.after.steps == c.steps.after.launches / 10
    # neither side waiting: no step can be seen, and the comparison says so
    c = compare(dbs["no_sync"][0], dbs["no_sync"][0])
    assert not c.steps.detected and "none could be detected" in c.steps.method
    assert c.steps.noise.verdict == "not_tested"


def test_older_recordings_use_the_estimated_breakdown(dbs, tmp_path):
    # GIVEN the before/fixed pair as recordings made before the time accounting (schema v1)
    old = {}
    for name in ("before", "fixed"):
        old[name] = tmp_path / f"{name}.duckdb"
        shutil.copy(dbs[name][0], old[name])
        downgrade_to_v1(old[name])
    c = compare(old["before"], old["fixed"])
    # THEN both sides are estimated, said so, and the fix still shows
    assert (c.before.basis, c.after.basis) == ("estimated", "estimated")
    assert [w.level for w in c.warnings if w.kind == "different_basis"] == ["info"]
    sync = {p.part: p for p in c.training.parts}["sync"]
    assert sync.noise.verdict == "beyond_noise" and sync.delta_points < -40
    assert {x.category: x.status for x in c.chains}["sync_stall"] == "gone"
    # AND an old recording against a new one is warned about
    c = compare(old["before"], dbs["fixed"][0])
    assert [w.level for w in c.warnings if w.kind == "different_basis"] == ["warning"]


def test_too_short_to_tell(tmp_path):
    # GIVEN two loops of 4 s: fewer than MIN_SECONDS whole seconds each
    a, b = tmp_path / "a.duckdb", tmp_path / "b.duckdb"
    loop(a, 1, duration_s=4)
    loop(b, 3, duration_s=4, sync_every=100)
    c = compare(a, b)
    assert c.before.seconds < MIN_SECONDS
    # THEN the per-second tests say too_short (however large the change), and a warning says why
    assert c.steps.noise.verdict == "too_short"
    assert {p.noise.verdict for p in c.training.parts} == {"too_short"}
    assert "too_short" in {w.kind for w in c.warnings}
    assert c.steps.after.steps_per_s > c.steps.before.steps_per_s  # the numbers are still there


def test_other_workloads_machines_and_options_are_warned(dbs, tmp_path):
    # GIVEN train.py's healthy loop (other kernels, another program) recorded on another machine
    other = tmp_path / "other.duckdb"
    b = TraceBuilder()
    from tracedb import SCENARIOS

    SCENARIOS["healthy"](b)
    b.session.update(host="gpu-box-2", cpu_cores=8)
    b.write(other)
    c = compare(dbs["before"][0], other)
    kinds = {w.kind: w for w in c.warnings}
    assert kinds["different_program"].message == "different programs: step_loop.py before, train.py after"
    assert "different workloads" in kinds["different_workload"].message
    assert "gpu-box-1 / gpu-box-2" in kinds["different_host"].message
    # AND duty-cycled launch counts widen the launch rate's interval by their error bound
    cycled = tmp_path / "cycled.duckdb"
    shutil.copy(dbs["rerun"][0], cycled)
    with duckdb.connect(str(cycled)) as con:
        con.execute("UPDATE op_stats SET sampled_fraction = 0.5, error_pct = 10 WHERE op = 'cudaLaunchKernel'")
    exact = {o.op: o for o in compare(dbs["before"][0], dbs["rerun"][0]).ops}["cudaLaunchKernel"]
    scaled = compare(dbs["before"][0], cycled)
    launch = {o.op: o for o in scaled.ops}["cudaLaunchKernel"]
    assert launch.error_pct_after == 10.0 and launch.rate_noise.verdict == "within_noise"
    width = launch.rate_noise.ci_hi - launch.rate_noise.ci_lo
    assert width > (exact.rate_noise.ci_hi - exact.rate_noise.ci_lo) + 0.1 * launch.calls_per_s_after
    assert any(w.kind == "different_options" and "duty-cycled" in w.message for w in scaled.warnings)


def test_bootstrap_interval_is_reproducible_and_covers_the_difference():
    rng = np.random.default_rng(0)
    a, b = rng.normal(10, 1, 30), rng.normal(12, 1, 30)
    lo, hi = mean_diff_interval(a, b, 0.99)
    assert (lo, hi) == mean_diff_interval(a, b, 0.99)  # seeded: the CLI and MCP give one answer
    assert lo < b.mean() - a.mean() < hi and lo > 0
    # a constant series has no spread: the interval is the difference itself
    assert mean_diff_interval(np.full(8, 3.0), np.full(8, 5.0), 0.99) == (2.0, 2.0)


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_compare_table_and_json(dbs, capsys):
    before, fixed = str(dbs["before"][0]), str(dbs["fixed"][0])
    assert main(["compare", before, fixed]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Compare before.duckdb → fixed.duckdb" in text and "beyond noise" in text
    assert "sync_stall gone HIGH → -" in text and "Noise (" in text and "bootstrap" in text
    assert main(["compare", before, fixed, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == compare(dbs["before"][0], dbs["fixed"][0]).model_dump(mode="json")


def test_cli_compare_same_file(dbs, capsys):
    p = str(dbs["before"][0])
    assert main(["compare", p, p, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["warnings"][0]["kind"] == "same_file" and got["headline"][-1] == "no difference beyond noise"
    assert all(x["delta_points"] == 0 for x in got["training"]["parts"])


@pytest.mark.parametrize(
    "problem,code,needle",
    [
        ("missing", 5, "no trace DB at"),
        ("garbage", 5, "not a DuckDB file"),
        ("foreign", 5, "not a cuda-host-tracer trace DB"),
        ("one_argument", 2, "Missing argument"),
    ],
)
def test_cli_compare_bad_inputs(dbs, tmp_path, capsys, problem, code, needle):
    p = tmp_path / "x.duckdb"
    if problem == "garbage":
        p.write_text("not a db")
    elif problem == "foreign":
        duckdb.connect(str(p)).execute("CREATE TABLE t (a INT)").close()
    args = ["compare", str(dbs["before"][0])] + ([] if problem == "one_argument" else [str(p)])
    assert main(args) == code
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_cli_compare_help_teaches(capsys):
    assert main(["compare", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Example: tracer compare before.duckdb after.duckdb" in " ".join(out.split())


# ---------------------------------------------------------------------------------------------- MCP
@pytest.fixture(scope="module")
def served(dbs, tmp_path_factory) -> Path:
    """A directory of recordings: the served one (after.duckdb), its baseline, and a DuckDB file of another app."""
    d = tmp_path_factory.mktemp("served")
    shutil.copy(dbs["before"][0], d / "before.duckdb")
    shutil.copy(dbs["fixed"][0], d / "after.duckdb")
    duckdb.connect(str(d / "foreign.duckdb")).execute("CREATE TABLE t (a INT)").close()
    (d / "notes.txt").write_text("not a recording")
    return d


def call(db: Path, args: dict):
    async def go():
        async with Client(build_server(db)) as c:
            tools = {t.name: t for t in (await c.list_tools()).tools}
            return tools["compare_traces"], await c.call_tool("compare_traces", args)

    return anyio.run(go)


def test_mcp_compare_traces_equals_the_analysis(served):
    tool, r = call(served / "after.duckdb", {"before": "before.duckdb"})
    a = tool.annotations
    assert (a.read_only_hint, a.open_world_hint) == (True, False) and "Next" in tool.description
    assert "beyond_noise" in str(tool.output_schema) and tool.input_schema.get("required") is None
    assert not r.is_error, r.content
    want = compare(served / "before.duckdb", served / "after.duckdb").model_dump(mode="json")
    assert r.structured_content == want
    # the served recording is the side left out: as BEFORE, named by after=
    _, r = call(served / "before.duckdb", {"after": "after.duckdb"})
    assert r.structured_content == want
    # or two recordings of the directory, both named
    _, r = call(served / "after.duckdb", {"before": "before.duckdb", "after": "after.duckdb"})
    assert r.structured_content == want


@pytest.mark.parametrize(
    "args,needle",
    [
        ({}, "name the other recording"),
        ({"before": "../before.duckdb"}, "is not a recording's file name"),
        ({"before": "/etc/passwd"}, "is not a recording's file name"),
        ({"before": "notes.txt"}, "is not a recording's file name"),
        ({"before": ".before.duckdb"}, "is not a recording's file name"),
        ({"before": "nope.duckdb"}, "no recording 'nope.duckdb' here; recordings here: after.duckdb, before.duckdb"),
        ({"before": "foreign.duckdb"}, "not a cuda-host-tracer trace DB"),
        ({"before": "x" * 100_000 + ".duckdb"}, "is not a recording's file name"),
    ],
)
def test_mcp_compare_traces_refuses_what_is_not_a_recording_here(served, args, needle):
    _, r = call(served / "after.duckdb", args)
    assert r.is_error and needle in r.content[0].text and len(r.content[0].text) < 2_000


def test_mcp_tool_lists_known_scenarios_unchanged(tmp_path):
    # the other tools still answer on a server that has compare_traces (a regression guard for the shared module)
    build("healthy", tmp_path / "h.duckdb")
    _, r = call(tmp_path / "h.duckdb", {"before": "h.duckdb"})
    assert not r.is_error and r.structured_content["warnings"][0]["kind"] == "same_file"
    assert r.structured_content["before"]["loop_s"] > 50 * S / 1e9


def test_a_foreign_hog_shows_in_the_parts_and_its_chain_is_not_the_jobs(tmp_path):
    # GIVEN train.py's loop on a quiet host, then with a CPU hog (stress-ng) taking its CPU for 20 of 60 s
    quiet, hogged = tmp_path / "quiet.duckdb", tmp_path / "hogged.duckdb"
    build("healthy", quiet)
    build("cpu_contention", hogged)
    c = compare(quiet, hogged)
    # THEN waiting for a CPU held by another process rose beyond noise
    parts = {p.part: p for p in c.training.parts}
    assert parts["runq_other"].noise.verdict == "beyond_noise" and parts["runq_other"].delta_points > 5
    assert any(h.startswith("runq_other:") for h in c.headline)
    # AND the cpu_contention chain appeared, marked as another process's doing, and kept out of the headline
    ch = next(x for x in c.chains if x.category == "cpu_contention" and "stress-ng" in x.culprit)
    assert ch.status == "appeared" and "another process on the host" in ch.note
    assert not any("cpu_contention" in h for h in c.headline)
