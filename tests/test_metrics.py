"""tracer.recorder.metrics: exact histogram buckets from the in-kernel slots, the exposition a scrape gets, the
retention of an exited process's series, and the server's bearer-token check (the real endpoint over a real
recording: tests/integration/test_metrics_real.py)."""

from __future__ import annotations

import random
import urllib.error
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from probes.catalog import CATALOG
from tracer.commands.cli import main
from tracer.hist import slot_bounds, slot_of
from tracer.recorder import events
from tracer.recorder.metrics import (
    BUCKETS_NS,
    FAMILIES,
    PARTS,
    RETAIN_S,
    MetricsServer,
    MetricsState,
    bucket_counts,
    render,
    served_names,
)

OP = {s.op: i for i, s in enumerate(CATALOG)}


def test_every_bound_is_an_in_kernel_bucket_edge():
    for b in BUCKETS_NS:
        assert slot_bounds(slot_of(b))[0] == b  # so no in-kernel bucket straddles a bound


def test_cumulative_counts_are_exact_at_every_bound():
    # GIVEN latencies from 100 ns to 30 s, bucketed as the kernel does
    rng = random.Random(7)
    lat = [int(10 ** rng.uniform(2, 10.5)) for _ in range(5000)] + [300, 2**20 - 1]
    slots, counts = np.unique([slot_of(v) for v in lat], return_counts=True)
    cum = bucket_counts(slots, counts)
    # THEN each bound's count is the calls below it, counted from the latencies themselves, and +Inf is all
    assert cum.tolist() == [sum(v < b for v in lat) for b in BUCKETS_NS] + [len(lat)]


def _totals(rows):
    keys = np.array([(pid, op) for pid, op, *_ in rows], dtype=events.OP_KEY_DTYPE)
    vals = np.zeros(len(rows), dtype=events.OP_TOTAL_DTYPE)
    for i, (_, _, calls, total_ns, nbytes) in enumerate(rows):
        vals[i]["calls"], vals[i]["total_ns"], vals[i]["bytes"] = calls, total_ns, nbytes
    return keys, vals


def _hist(entries):
    """(pid, op, latency_ns, calls) -> op_hist keys and counts."""
    acc = {}
    for pid, op, v, n in entries:
        acc[(pid, op, slot_of(v))] = acc.get((pid, op, slot_of(v)), 0) + n
    keys = np.array(list(acc), dtype=events.HIST_KEY_DTYPE)
    return keys, np.array(list(acc.values()), dtype=events.COUNT_DTYPE)


def _proc(comm, rank=None, container=""):
    return SimpleNamespace(
        comm=comm, dist=SimpleNamespace(rank=rank) if rank is not None else None, container=container
    )


def _scrape(state):
    return {f.name: f for f in text_string_to_metric_families(render(state.snapshot).decode())}


def _state_with_job(now=100.0, alive=(10, 11)):
    sync, copy = OP["cudaStreamSynchronize"], OP["cudaMemcpyAsync"]
    keys, vals = _totals([(10, sync, 5, 5_000_000, 0), (11, sync, 3, 300_000, 0), (10, copy, 2, 20_000, 8192)])
    hk, hv = _hist([(10, sync, 900_000, 4), (10, sync, 1_500_000, 1), (11, sync, 100_000, 3), (10, copy, 10_000, 2)])
    st = MetricsState()
    procs = {10: _proc("python3", rank=0), 11: _proc("python3", rank=1)}
    st.publish(keys, vals, hk, hv, procs, set(alive), now)
    return st, (keys, vals, hk, hv, procs)


def test_a_scrape_holds_every_family_with_help_and_the_exact_counts():
    st, _ = _state_with_job()
    fams = _scrape(st)
    # every family the module declares is served (the gauges and counters without series too), with its help
    for f in FAMILIES:
        name = f.name.removesuffix("_total") if f.type == "counter" else f.name
        assert name in fams and fams[name].documentation, f.name
    samples = [s for s in fams["tracer_cuda_call_duration_seconds"].samples if s.labels.get("rank") == "0"]
    count = {s.labels["op"]: s.value for s in samples if s.name.endswith("_count")}
    assert count == {"cudaStreamSynchronize": 5, "cudaMemcpyAsync": 2}
    le_1ms = [s.value for s in samples if s.labels.get("le") == repr(2**20 / 1e9) and s.labels["op"].endswith("ize")]
    assert le_1ms == [4]  # the four 0.9 ms calls are under 1.048576 ms, the 1.5 ms one is not
    copy = fams["tracer_cuda_copy_bytes"].samples
    assert [(s.labels["op"], s.value) for s in copy] == [("cudaMemcpyAsync", 8192)]  # only copy ops have bytes


def test_an_exited_process_series_stay_retain_s_then_go_and_do_not_come_back():
    st, (keys, vals, hk, hv, procs) = _state_with_job(now=100.0)
    # pid 11 exits at 101; its in-kernel totals stay in the maps
    for now, present in ((101.0, True), (101.0 + RETAIN_S - 1, True), (101.0 + RETAIN_S + 1, False), (300.0, False)):
        st.publish(keys, vals, hk, hv, procs, {10}, now)
        pids = {s.labels["pid"] for s in _scrape(st)["tracer_cuda_call_duration_seconds"].samples}
        assert ("11" in pids) == present, now
        assert "10" in pids


def test_thread_time_is_the_training_threads_parts():
    st, (keys, vals, hk, hv, procs) = _state_with_job()
    # pid 10: its main thread 10 made the CUDA calls, its pin-memory thread 12 did not
    bd = {"pid": np.array([10, 10, 10]), "tid": np.array([10, 12, 10])}
    for j, part in enumerate(events.TB_PARTS):
        bd[part] = np.array([1_000_000 * (j + 1), 7_000_000, 1_000_000 * (j + 1)])
    st.add_breakdown(bd, np.array([3, 0, 2]))
    st.publish(keys, vals, hk, hv, procs, {10, 11}, 100.0)
    tt = {s.labels["part"]: s.value for s in _scrape(st)["tracer_thread_time_seconds"].samples}
    assert tt == {p: pytest.approx(2e-3 * (j + 1)) for j, p in enumerate(PARTS)}  # thread 10's two seconds


def test_served_names_are_the_samples_prometheus_selects():
    names = served_names()
    assert {"tracer_cuda_call_duration_seconds_count", "tracer_cuda_call_duration_seconds_bucket"} <= names
    assert {"tracer_cuda_copy_bytes_total", "tracer_thread_time_seconds_total", "tracer_events_lost_total"} <= names
    assert {"tracer_cpu_seconds_total", "tracer_resident_memory_bytes"} <= names
    assert "tracer_cuda_call_duration_seconds" not in names  # a histogram's own name selects nothing


def _get(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_server_checks_the_bearer_token():
    st, _ = _state_with_job()
    srv = MetricsServer("127.0.0.1", 0, st, token="s3cret")
    srv.start()
    try:
        base = f"http://127.0.0.1:{srv.port}"
        assert _get(f"{base}/metrics")[0] == 401
        assert _get(f"{base}/metrics", "wrong")[0] == 401
        code, body = _get(f"{base}/metrics", "s3cret")
        assert code == 200 and "tracer_cuda_call_duration_seconds_count" in body
        assert _get(f"{base}/other", "s3cret")[0] == 404
    finally:
        srv.stop()


def test_the_server_binds_ipv6_loopback():
    import socket

    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 on this machine")
    st, _ = _state_with_job()
    srv = MetricsServer("::1", 0, st)
    srv.start()
    try:
        code, body = _get(f"http://[::1]:{srv.port}/metrics")
        assert code == 200 and "# HELP tracer_cpu_seconds_total" in body
    finally:
        srv.stop()


@pytest.mark.parametrize("flag", ["--metrics", "--mcp-http"])
def test_a_non_loopback_address_without_a_token_is_refused(flag, capsys, monkeypatch):
    monkeypatch.delenv("TRACER_MCP_TOKEN", raising=False)
    assert main(["record", flag, "0.0.0.0:9464", "--", "true"]) != 0
    err = capsys.readouterr().err
    assert f"{flag} on non-loopback address 0.0.0.0 needs a bearer token" in err and "Traceback" not in err


def test_the_token_is_required_off_loopback_only(monkeypatch, tmp_path):
    from tracer.commands.record import _listen_token

    monkeypatch.setenv("TRACER_MCP_TOKEN", "from-env")
    assert _listen_token(":9464", None, "--metrics") == (None, ("127.0.0.1", 9464))  # loopback: no token asked
    assert _listen_token("[::1]:9464", None, "--metrics") == (None, ("::1", 9464))
    assert _listen_token("0.0.0.0:9464", None, "--metrics") == ("from-env", ("0.0.0.0", 9464))
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert _listen_token("10.0.0.1:9464", f, "--metrics") == ("from-file", ("10.0.0.1", 9464))


def test_labels_follow_the_process_until_its_first_cuda_call_then_stay():
    sync = OP["cudaStreamSynchronize"]
    no_keys, no_vals = _totals([])
    hk, hv = _hist([])
    st = MetricsState()
    # a launched command is first a fork of the recorder: its thread time shows before its exec
    bd = {"pid": np.array([10]), "tid": np.array([10]), **{p: np.array([1000]) for p in events.TB_PARTS}}
    st.add_breakdown(bd, np.array([0]))
    st.publish(no_keys, no_vals, hk, hv, {10: _proc("tracer")}, {10}, 1.0)
    keys, vals = _totals([(10, sync, 1, 1000, 0)])
    hk, hv = _hist([(10, sync, 1000, 1)])
    st.publish(keys, vals, hk, hv, {10: _proc("python3", rank=3)}, {10}, 2.0)  # exec'd, then its first call
    st.publish(keys, vals, hk, hv, {10: _proc("renamed", rank=3)}, {10}, 3.0)  # a later rename: same series
    (s,) = st.snapshot.ops
    assert s.labels == ("cudaStreamSynchronize", "runtime", "10", "python3", "3", "")


def _waits(st, pid, tid, ops_sites):
    ops = np.array([OP[o] for o, _ in ops_sites])
    st.add_waits(np.full(len(ops), pid), np.full(len(ops), tid), ops, [s for _, s in ops_sites])


def test_steps_count_one_per_period_of_the_wait_sequence_once_it_is_settled():
    # GIVEN a training thread whose step waits twice (a loss read, then a stream sync), each runtime wait with its
    # driver twin inside, and a second thread of the process with a few stray syncs
    step = [("cudaMemcpy", 7), ("cuMemcpyDtoH", 0), ("cudaStreamSynchronize", 9), ("cuStreamSynchronize", 0)]
    st = MetricsState()
    keys, vals = _totals([(10, OP["cudaMemcpy"], 1, 1000, 0)])
    hk, hv = _hist([(10, OP["cudaMemcpy"], 1000, 1)])
    procs = {10: _proc("python3")}
    _waits(st, 10, 10, step * 20)  # 40 waits of the runtime: the period may still change
    _waits(st, 10, 12, [("cudaDeviceSynchronize", 3)] * 5)
    st.publish(keys, vals, hk, hv, procs, {10}, 1.0)
    # THEN nothing is served while the period is unsettled (a counter must never go down)
    assert "tracer_steps" not in _scrape(st) or not _scrape(st)["tracer_steps"].samples
    # WHEN it has waited SETTLE_WAITS times (24 steps of 2 runtime waits = 48)
    _waits(st, 10, 10, step * 4)
    st.publish(keys, vals, hk, hv, procs, {10}, 2.0)
    # THEN it counts its steps, the stray syncs' thread aside, with the analyses' rule (2 waits a step)
    ((s,),) = [_scrape(st)["tracer_steps"].samples]
    assert (s.name, s.value, s.labels["pid"]) == ("tracer_steps_total", 24, "10")
    # AND a short job's steps are served once it exited, whatever the count
    _waits(st, 11, 11, [("cudaStreamSynchronize", 1)] * 5)
    keys, vals = _totals([(10, OP["cudaMemcpy"], 1, 1000, 0), (11, OP["cudaStreamSynchronize"], 5, 5000, 0)])
    st.publish(keys, vals, hk, hv, {**procs, 11: _proc("python3")}, {10}, 3.0)
    got = {s.labels["pid"]: s.value for s in _scrape(st)["tracer_steps"].samples}
    assert got == {"10": 24, "11": 5}
