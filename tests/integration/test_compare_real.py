"""Real eBPF, issue 13's "Done when" for compare: two recordings of fixtures/workloads/step_loop.py, one reading the
loss every step (a synchronous 4-byte cudaMemcpy after the step's host work: the GPU idles meanwhile) and one with
the fix the sync_stall chain recommends (read it every 20 steps), and `tracer compare` shows the fix beyond noise:
more steps/s, the training thread's sync part down, the copy's rate down, the chain gone or downgraded; the MCP
tool compare_traces gives the same answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anyio
import pytest
from conftest import PY, expected_ops, record, workload
from mcp import Client

from mcp_server.server import build_server
from tracer.commands.cli import main

pytestmark = pytest.mark.bpf

# 10 s of loop: about 9 whole seconds a side, above compare.MIN_SECONDS; 5 ms of host work and 5 ms of GPU work
LOOP = ["--duration", "10", "--host-ms", "5", "--kernel-us", "5000", "--launches", "10", "--sync", "memcpy"]
EVERY = 20


def record_loops(d: Path, loop: list[str], variants: dict[str, list[str]], timeout: float) -> dict[str, tuple]:
    """Record step_loop.py with ``loop`` plus each variant's options; return {name: (db, counts dir)}."""
    out = {}
    for name, extra in variants.items():
        db, counts = d / f"{name}.duckdb", d / f"{name}-counts"
        counts.mkdir()
        r = record(
            ["--db", str(db), "--", PY, workload("step_loop.py"), *loop, *extra, "--counts-dir", str(counts)],
            timeout=timeout,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = (db, counts)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Record the loop without and with the fix; return {name: (db, counts dir)}."""
    variants = {"before": [], "after": ["--sync-every", str(EVERY)]}
    return record_loops(tmp_path_factory.mktemp("compare_real"), LOOP, variants, timeout=120)


def test_compare_shows_the_fix(pair, capsys):
    (before, counts_b), (after, counts_a) = pair["before"], pair["after"]
    # WHEN tracer compare runs on the two recordings
    assert main(["compare", str(before), str(after), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    # THEN the copies counted are the workload's own (syncs are never sampled)
    ops = {(o["op"], o["layer"]): o for o in c["ops"]}
    memcpy = ops[("cudaMemcpy", "runtime")]
    assert memcpy["calls_before"] == expected_ops(counts_b)["cudaMemcpy"]
    assert memcpy["calls_after"] == expected_ops(counts_a)["cudaMemcpy"]
    # AND its rate fell beyond noise, to a twentieth per step: per second it falls less, since the fixed loop runs
    # up to twice the steps a second (host and GPU work overlap), more when a loaded machine slows the serial loop
    st = c["steps"]
    per_step = {side: memcpy[f"calls_per_s_{side}"] / st[side]["steps_per_s"] for side in ("before", "after")}
    assert memcpy["rate_noise"]["verdict"] == "beyond_noise"
    assert per_step["before"] == pytest.approx(1, rel=0.1) and per_step["after"] < per_step["before"] / (EVERY / 2)
    # AND a step is the 10 launches between two copies of BEFORE (AFTER copies once every 20 steps)
    assert st["detected"] and st["comparable"], st["method"]
    assert st["launches_per_step"] == pytest.approx(10, rel=0.05) and f"once every {EVERY} steps" in st["method"]
    # AND steps/s rose beyond noise: host work and GPU work overlap once the host stops waiting every step
    assert st["after"]["steps_per_s"] > 1.2 * st["before"]["steps_per_s"]
    assert st["noise"]["verdict"] == "beyond_noise" and st["noise"]["ci_lo"] > 0
    # AND the training thread's sync part fell beyond noise
    sync = {p["part"]: p for p in c["training"]["parts"]}["sync"]
    assert sync["before_share"] > 0.25 and sync["delta_points"] < -20
    assert sync["noise"]["verdict"] == "beyond_noise" and sync["noise"]["ci_hi"] < 0
    # AND the per-step sync_stall chain went away or was downgraded
    chain = next(x for x in c["chains"] if x["category"] == "sync_stall")
    assert chain["severity_before"] == "HIGH" and chain["status"] in ("gone", "better"), chain
    assert "step_loop.py" in chain["culprit"]
    assert c["before"]["seconds"] >= 5 and c["after"]["seconds"] >= 5
    assert not [w for w in c["warnings"] if w["kind"] in ("different_program", "different_workload")]
    # AND the text view says so in its headline
    assert main(["compare", str(before), str(after)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "steps/s" in text and "beyond noise" in text and "sync_stall" in text


def test_mcp_compare_traces_on_real_recordings(pair, tmp_path, capsys):
    # GIVEN the two recordings side by side, the fixed one served
    for name in ("before", "after"):
        shutil.copy(pair[name][0], tmp_path / f"{name}.duckdb")

    async def go():
        async with Client(build_server(tmp_path / "after.duckdb")) as client:
            return await client.call_tool("compare_traces", {"before": "before.duckdb"})

    r = anyio.run(go)
    # THEN the tool answers what the CLI prints
    assert not r.is_error, r.content
    assert main(["compare", str(tmp_path / "before.duckdb"), str(tmp_path / "after.duckdb"), "--json"]) == 0
    assert r.structured_content == json.loads(capsys.readouterr().out)


# Issue 20's pair: 1 ms of host work and 1 ms of GPU work per step, 10 launches: ~4,000 launches/s once the host
# stops waiting, which the default overhead budget duty-cycles (the issue saw sampled_fraction 0.22). On a shared
# host two runs of one loop can differ by 2x (measured: 320 and 632 steps/s, the first spending 54% of its time
# waiting for other tenants' CPU), so each verdict is checked against the workload's own step counts, not against
# the change the options were meant to make.
FAST = ["--duration", "20", "--host-ms", "1", "--kernel-us", "1000", "--launches", "10", "--sync", "memcpy"]
FAST_EVERY = 20
CLEAR_CHANGE_PCT = 30  # a true change this large must be beyond noise
SYNC_EVERY = {"before": 1, "after": FAST_EVERY, "rerun": FAST_EVERY}


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """Record the fast loop reading the loss every step, then every 20 steps twice, with the default budget."""
    variants = {name: ["--sync-every", str(every)] for name, every in SYNC_EVERY.items()}
    return record_loops(tmp_path_factory.mktemp("compare_fast"), FAST, variants, timeout=180)


def _agrees_with_the_truth(fast, before: str, after: str, capsys) -> dict:
    """Compare two of the recordings; assert that steps/s is the workload's own on both sides (its launches / 10,
    every launch counted by the stand-in library, over the recorded loop) within 15%, and that the verdict agrees
    with the true change: beyond noise with its sign when it is CLEAR_CHANGE_PCT or more, never the wrong sign.
    Return the comparison."""
    assert main(["compare", str(fast[before][0]), str(fast[after][0]), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    st = c["steps"]
    truth = {}
    for side, name in (("before", before), ("after", after)):
        # a step of the comparison: 10 launches, or one wait when both sides wait as often (then 1 or 20 steps)
        per_step = 10 if st["launches_per_step"] is not None else 10 * SYNC_EVERY[name]
        truth[side] = expected_ops(fast[name][1])["cudaLaunchKernel"] / per_step / c[side]["loop_s"]
        assert st[side]["steps_per_s"] == pytest.approx(truth[side], rel=0.15), (side, truth, st)
    true_pct = 100 * (truth["after"] / truth["before"] - 1)
    if abs(true_pct) >= CLEAR_CHANGE_PCT:
        assert st["noise"]["verdict"] == "beyond_noise", (true_pct, st)
    if st["noise"]["verdict"] == "beyond_noise":
        assert (st["delta_pct"] > 0) == (true_pct > 0), (true_pct, st)
    return c


def test_a_duty_cycled_fix_is_counted_from_its_waits_and_judged_against_the_truth(fast, capsys):
    # GIVEN the pair recorded with the default overhead budget; WHEN compared
    c = _agrees_with_the_truth(fast, "before", "after", capsys)
    # THEN AFTER's steps come from its exact copies, 20 steps each, whatever its launch probes saw
    st = c["steps"]
    assert (st["after"]["counted_from"], st["after"]["steps_per_wait"]) == ("waits", FAST_EVERY), st["method"]
    assert c["headline"][0].startswith("steps/s")


def test_two_duty_cycled_runs_of_the_fix_are_judged_against_the_truth(fast, capsys):
    # GIVEN two recordings of the fix, both duty-cycled; THEN steps/s and its verdict follow the runs' own counts
    c = _agrees_with_the_truth(fast, "after", "rerun", capsys)
    assert (c["steps"]["before"]["counted_from"], c["steps"]["after"]["counted_from"]) == ("waits", "waits")
