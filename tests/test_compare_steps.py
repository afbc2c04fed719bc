"""Issue 20: steps/s in `tracer compare` when the launch probes were duty-cycled. Hand-built recordings of
tests/tracedb.py's step_loop, then duty-cycled as the recorder does it: launch rows only inside the live windows
(every second live at first, then 22% of a 2.2 s period, so a second holds anything from none of a window
to all of one), op_stats' launch count marked scaled with an error bound, and each second's
live share in thread_breakdown.launch_sampled."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import duckdb
import numpy as np
import pytest
from mcp import Client
from tracedb import MS, S, TraceBuilder, step_loop

from mcp_server.server import build_server
from tracer.analysis.compare import Comparison, compare_traces
from tracer.analysis.compare.steps import periods_per_second
from tracer.analysis.db import open_trace

DURATION_S = 20
LIVE = 0.22  # the sampled fraction
PERIOD_NS = 2_200 * MS  # longer than the recorder's 1 s, so that some seconds see no live window at all
FULL_NS = 2 * S  # the cycler starts live and turns to its fraction once it has measured the probes' cost
ERROR_PCT = 12.5


def loop(path: Path, seed: int, **kw) -> TraceBuilder:
    b = TraceBuilder(duration_s=DURATION_S)
    step_loop(b, seed, **kw)
    b.write(path)
    return b


def live_share(sec: int) -> float:
    """Return the share of second ``sec`` inside a live window (the schedule in the module docstring)."""
    start, end = sec * S, (sec + 1) * S
    covered = max(0, min(end, FULL_NS) - start)
    k = max(0, (start - FULL_NS) // PERIOD_NS)
    while FULL_NS + k * PERIOD_NS < end:
        w0 = FULL_NS + k * PERIOD_NS
        covered += max(0, min(end, w0 + int(LIVE * PERIOD_NS)) - max(start, w0))
        k += 1
    return covered / S


def duty_cycle(src: Path, dst: Path, count_error: float = 0.0) -> None:
    """Copy recording ``src`` to ``dst`` as if its launch probes had been duty-cycled (the module docstring),
    the recorder's launch count off by ``count_error`` (a fraction, within ERROR_PCT)."""
    shutil.copy(src, dst)
    with duckdb.connect(str(dst)) as con:
        con.execute(
            "DELETE FROM cuda_calls WHERE op = 'cudaLaunchKernel' AND ts_ns >= $full "
            "AND (ts_ns - $full) % $period >= $window",
            {"full": FULL_NS, "period": PERIOD_NS, "window": int(LIVE * PERIOD_NS)},
        )
        seen = con.execute("SELECT count(*) FROM cuda_calls WHERE op = 'cudaLaunchKernel'").fetchone()[0]
        calls = con.execute("SELECT sum(calls) FROM op_stats WHERE op = 'cudaLaunchKernel'").fetchone()[0]
        # the recorder's count is the true one (or off by count_error), known to ERROR_PCT
        calls = round(calls * (1 + count_error))
        con.execute(
            "UPDATE op_stats SET calls = ?, sampled_fraction = ?, error_pct = ? WHERE op = 'cudaLaunchKernel'",
            [calls, seen / calls, ERROR_PCT],
        )
        for sec in range(DURATION_S + 1):
            con.execute("UPDATE thread_breakdown SET launch_sampled = ? WHERE sec = ?", [live_share(sec), sec])


@pytest.fixture(scope="module")
def dbs(tmp_path_factory) -> dict[str, tuple[Path, TraceBuilder]]:
    d = tmp_path_factory.mktemp("duty")
    specs = {
        "before": dict(seed=1),  # loss.item() every step
        "fixed": dict(seed=3, sync_every=20),  # read every 20 steps: the fix
        "fixed_rerun": dict(seed=7, sync_every=20),
        "no_sync": dict(seed=5, sync="none"),
    }
    out = {name: (d / f"{name}.duckdb", loop(d / f"{name}.duckdb", **kw)) for name, kw in specs.items()}
    for name in ("fixed", "fixed_rerun", "no_sync"):
        duty_cycle(out[name][0], d / f"{name}_cycled.duckdb")
        out[f"{name}_cycled"] = (d / f"{name}_cycled.duckdb", out[name][1])
    duty_cycle(out["fixed"][0], d / "fixed_cycled_low.duckdb", count_error=-0.05)
    out["fixed_cycled_low"] = (d / "fixed_cycled_low.duckdb", out["fixed"][1])
    return out


def compare(before: Path, after: Path) -> Comparison:
    with open_trace(before) as b, open_trace(after) as a:
        return compare_traces(b, a, before_name=before.name, after_name=after.name)


def true_steps_per_s(b: TraceBuilder, c: Comparison, which: str) -> float:
    """Return the builder's steps (its launches / 10) per second of the side's loop."""
    launches = sum(1 for r in b.cuda_calls if r["op"] == "cudaLaunchKernel")
    return launches / 10 / getattr(c, which).loop_s


def test_the_schedule_leaves_seconds_empty_and_full(dbs):
    # the simulated sampler is as hostile as the issue's: some seconds see no launch, the first ones all of them
    shares = [live_share(sec) for sec in range(DURATION_S)]
    assert shares[:2] == [1.0, 1.0] and min(shares[2:]) == 0.0 and max(shares[2:]) == pytest.approx(LIVE * 2.2)
    with open_trace(dbs["fixed_cycled"][0]) as con:
        per_sec = dict(
            con.execute(
                "SELECT ts_ns // 1000000000, count(*) FROM cuda_calls WHERE op = 'cudaLaunchKernel' GROUP BY 1"
            ).fetchall()
        )
    assert min(per_sec.get(sec, 0) for sec in range(2, 19)) == 0 and per_sec[1] > 5 * per_sec.get(5, 0)


def test_a_fix_is_beyond_noise_when_the_after_side_was_duty_cycled(dbs):
    # GIVEN the loop reading the loss every step, and the fix reading it every 20 steps recorded duty-cycled
    (p_before, b_before), (p_fixed, b_fixed) = dbs["before"], dbs["fixed_cycled"]
    # WHEN compared
    c = compare(p_before, p_fixed)
    st = c.steps
    # THEN AFTER's steps are counted from its exact copies, 20 steps each, not from its sampled launches
    assert (st.after.counted_from, st.after.steps_per_wait, st.after.steps_error_pct) == ("waits", 20, 0.0)
    assert st.after.launch_error_pct == ERROR_PCT and "exact cudaMemcpy calls (20 steps each)" in st.method
    # AND steps/s is the builder's on both sides, the change beyond noise
    assert st.before.steps_per_s == pytest.approx(true_steps_per_s(b_before, c, "before"), rel=0.01)
    assert st.after.steps_per_s == pytest.approx(true_steps_per_s(b_fixed, c, "after"), rel=0.01)
    assert st.noise.verdict == "beyond_noise" and st.noise.ci_lo > 0 and st.delta_pct > 30
    # AND the headline leads with it, naming the chain that went away
    assert c.headline[0].startswith("steps/s") and "beyond noise" in c.headline[0]
    assert "chain sync_stall" in c.headline[0] and ("gone" in c.headline[0] or "better" in c.headline[0])
    assert not any(h.startswith("chain sync_stall") for h in c.headline[1:])
    # AND the warning about the duty cycle says steps/s does not depend on it
    cycled = [w.message for w in c.warnings if w.kind == "different_options" and "duty-cycled" in w.message]
    assert len(cycled) == 1 and "steps/s does not depend on them" in cycled[0]


def test_a_side_waiting_every_k_steps_gets_its_k_from_the_periods_its_probes_saw_whole(dbs):
    # GIVEN the fix recorded duty-cycled, the recorder's launch count 5% low (within its error bound): scaled, the
    # launches between two waits read 190, 19 steps of 10
    (p_before, _), (p_low, b_low) = dbs["before"], dbs["fixed_cycled_low"]
    # WHEN compared
    c = compare(p_before, p_low)
    st = c.steps
    # THEN each wait is 200 launches, counted in the periods the live probes saw whole: 20 steps, as the loop ran
    assert st.after.launches_per_marker == 200 and st.after.steps_per_wait == 20, st.method
    assert "once every 20 steps" in st.method
    assert st.after.steps_per_s == pytest.approx(true_steps_per_s(b_low, c, "after"), rel=0.01)


def test_no_change_is_within_noise_when_both_sides_were_duty_cycled(dbs):
    # GIVEN two runs of the fix, both duty-cycled; WHEN compared
    c = compare(dbs["fixed_cycled"][0], dbs["fixed_rerun_cycled"][0])
    # THEN steps/s is within noise, and the interval holds zero
    st = c.steps
    assert (st.before.counted_from, st.after.counted_from) == ("waits", "waits")
    assert st.noise.verdict == "within_noise" and st.noise.ci_lo < 0 < st.noise.ci_hi
    assert c.headline[0].startswith("steps/s") and "within noise" in c.headline[0]


def test_a_side_that_never_waits_counts_its_duty_cycled_launches_per_live_second(dbs):
    # GIVEN a loop that never waits for the GPU, duty-cycled: only its sampled launches count its steps
    (p_before, _), (p_after, b_after) = dbs["before"], dbs["no_sync_cycled"]
    c = compare(p_before, p_after)
    st = c.steps
    assert (st.after.counted_from, st.after.steps_per_wait) == ("launches", None)
    assert st.after.steps_error_pct == ERROR_PCT
    # THEN its steps/s is the builder's, and the +90% is beyond noise despite the launch count's error bound
    assert st.after.steps_per_s == pytest.approx(true_steps_per_s(b_after, c, "after"), rel=0.01)
    assert st.noise.verdict == "beyond_noise" and st.delta_pct > 60
    # AND the interval is wider than the exact pair's by about the sampler's bound, not by the seconds the
    # probes were dark: the same loop unsampled gives an interval narrower by less than twice that bound
    exact = compare(p_before, dbs["no_sync"][0]).steps.noise
    width, exact_width = st.noise.ci_hi - st.noise.ci_lo, exact.ci_hi - exact.ci_lo
    bound = st.after.steps_per_s * ERROR_PCT / 100
    assert exact_width < width < exact_width + 4 * bound


def test_mcp_compare_traces_gives_the_same_verdict(dbs, tmp_path):
    # GIVEN the duty-cycled pair side by side, the fixed one served
    shutil.copy(dbs["before"][0], tmp_path / "before.duckdb")
    shutil.copy(dbs["fixed_cycled"][0], tmp_path / "after.duckdb")

    async def go():
        async with Client(build_server(tmp_path / "after.duckdb")) as client:
            return await client.call_tool("compare_traces", {"before": "before.duckdb"})

    r = anyio.run(go)
    # THEN the tool answers what the analysis says: the verdict, and the steps line leading the headline
    assert not r.is_error, r.content
    want = compare(tmp_path / "before.duckdb", tmp_path / "after.duckdb")
    got = r.structured_content
    assert got["steps"]["noise"] == want.steps.noise.model_dump(mode="json")
    assert got["steps"]["noise"]["verdict"] == "beyond_noise" and got["headline"] == want.headline


def test_periods_per_second_shares_a_period_between_the_seconds_it_spans():
    # GIVEN calls at 0.5, 1.5, 1.75 and 3.0 s: three periods, over 2.5 s
    stamps = np.array([0.5, 1.5, 1.75, 3.0]) * S
    series, rate = periods_per_second(stamps, [0, 1, 2, 3])
    # THEN only seconds 1 and 2 lie between the first and the last call; second 1 holds half of the first period,
    # the second one whole and 0.25 s of the third (1.25 s long); second 2 the rest of the third
    assert series.keys() == {1, 2}
    assert series[1] == pytest.approx(0.5 + 1 + 0.25 / 1.25) and series[2] == pytest.approx(1 / 1.25)
    assert rate == pytest.approx(3 / 2.5)
    # AND fewer than two calls make no period
    assert periods_per_second(np.array([S]), [0, 1]) == ({}, None)
