"""chains.sync_stall: syncs counted from the catalog (synchronous copies included, never by name), the cost is
the host work the GPU could have overlapped, the culprit is the line of the sync."""

from __future__ import annotations

import pytest
from tracedb import ITEM_STACK, MAIN_PID, MS, US, TraceBuilder, builder

from tracer.analysis.chains import compute_chains
from tracer.analysis.chains.sync_stall import CATEGORY, MIN_SYNCS
from tracer.analysis.db import open_trace


def stalls(tmp_path, b):
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        return [x for x in compute_chains(c, limit=100).chains if x.category == CATEGORY]


def test_implicit_sync_through_a_small_dtoh_copy(tmp_path):
    (ch,) = stalls(tmp_path, builder("sync_stall"))
    ev = ch.evidence
    # 600 cudaMemcpy DtoH (the driver copy inside each one is the same wait: counted once)
    assert (ev.syncs, ev.implicit_syncs, [o.op for o in ev.ops]) == (600, 600, ["cudaMemcpy"])
    assert ev.ops[0].implicit_sync and ch.op == "cudaMemcpy" and ch.culprit.code_site == "train.py:92 train_step"
    # the GPU idles 45 ms after each copy while the thread prepares the next step: about half its time
    assert ev.idle_gap_after_sync_us == pytest.approx(51_000, rel=0.1) and ch.severity == "HIGH"
    assert ch.share == pytest.approx(min(ev.sync_ms, ev.host_ms) / (ev.sync_ms + ev.host_ms), abs=0.01)
    assert ".item()" in ch.recommendations[0] and "train.py:92" in ch.recommendations[0]


def _loop(op: str, layer: str | None = None, host_before_ms: float = 30, gpu_ms: float = 30) -> TraceBuilder:
    b = TraceBuilder(duration_s=20)
    b.process(MAIN_PID, "python3")
    sid = b.stack(ITEM_STACK)
    step = int((host_before_ms + gpu_ms + 0.1) * MS)
    for i in range(int(20e9 // step)):
        t = i * step + int(host_before_ms * MS)
        b.call(t, 8 * US, "cudaLaunchKernel")
        b.call(t + 20 * US, int(gpu_ms * MS), op, layer=layer, stack_id=sid, off_cpu_ns=int(gpu_ms * MS) - 40 * US)
    return b


@pytest.mark.parametrize("op", ["cudaDeviceSynchronize", "cuStreamSynchronize", "cuMemcpyDtoH", "cudaEventSynchronize"])
def test_every_op_that_waits_for_the_gpu(tmp_path, op):
    b = _loop(op)
    (ch,) = stalls(tmp_path, b)
    n = len(b.cuda_calls) // 2
    assert ch.op == op and ch.severity == "HIGH" and ch.evidence.syncs == n
    assert ch.evidence.implicit_syncs == (n if op == "cuMemcpyDtoH" else 0)


def test_an_async_copy_is_not_a_sync(tmp_path):
    assert stalls(tmp_path, _loop("cudaMemcpyAsync")) == []


def test_enqueueing_right_after_the_sync_costs_little(tmp_path):
    # GIVEN a GPU-bound loop: it waits 60 ms for the GPU but launches the next step 0.5 ms after the sync
    b = _loop("cudaStreamSynchronize", host_before_ms=0.5, gpu_ms=60)
    found = stalls(tmp_path, b)
    # THEN the sync costs ~0.6 ms of idle GPU per step: no chain, whatever the share waiting
    assert found == [] and len(b.cuda_calls) // 2 >= MIN_SYNCS


def test_idle_gap_after_sync_is_the_median_gap_less_its_off_cpu_time():
    """The gap between a sync's return and the next enqueue, less the thread's off-CPU time inside it, checked
    against a direct sum of each gap's overlap with each off-CPU interval, on random calls stored out of order."""
    from types import SimpleNamespace

    import duckdb
    import numpy as np

    from tracer.analysis.chains.sync_stall import idle_gap_after_sync

    rng = np.random.default_rng(28)
    found = 0
    for _ in range(40):
        con = duckdb.connect()
        con.execute("CREATE TABLE cuda_calls (ts_ns BIGINT, dur_ns BIGINT, tid INTEGER, op VARCHAR)")
        con.execute("CREATE TABLE sched (ts_ns BIGINT, dur_ns BIGINT, tid INTEGER)")
        calls, t = [], 0
        for _ in range(int(rng.integers(1, 50))):
            t += int(rng.integers(1, 1000))
            d = int(rng.integers(1, 800))
            calls.append((t, d, 1, str(rng.choice(["cudaStreamSynchronize", "cudaLaunchKernel", "cudaMemcpy2D"]))))
            t += d
        offs, t = [], 0
        for _ in range(int(rng.integers(0, 30))):
            t += int(rng.integers(1, 2000))
            d = int(rng.integers(1, 1500))
            offs.append((t, d, 1))
            t += d
        con.executemany("INSERT INTO cuda_calls VALUES (?, ?, ?, ?)", [calls[i] for i in rng.permutation(len(calls))])
        if offs:
            con.executemany("INSERT INTO sched VALUES (?, ?, ?)", [offs[i] for i in rng.permutation(len(offs))])
        # another thread's rows are not this thread's
        con.execute("INSERT INTO cuda_calls VALUES (5, 1, 2, 'cudaStreamSynchronize'), (9, 1, 2, 'cudaLaunchKernel')")
        ctx = SimpleNamespace(conn=con, ops={(1, "cudaLaunchKernel"), (1, "cudaStreamSynchronize")})
        gaps = []
        seq = [c for c in calls if c[3] != "cudaMemcpy2D"]  # neither a sync nor an enqueue here: not in the pairs
        for (ts, d, _, op), (nts, _, _, nop) in zip(seq, seq[1:], strict=False):
            a, b = ts + d, nts
            if op == "cudaStreamSynchronize" and nop == "cudaLaunchKernel" and b > a:
                off = sum(max(0, min(b, s + sd) - max(a, s)) for s, sd, _ in offs)
                gaps.append(max(b - a - off, 0))
        got = idle_gap_after_sync(ctx, 1, ["cudaStreamSynchronize"])
        # GIVEN the calls in any stored order  THEN the median of each gap less its off-CPU time; none when no
        # sync is followed by an enqueue
        assert got == (float(np.median(gaps)) if gaps else None)
        found += bool(gaps)
    assert found >= 20  # the random recordings had gaps to measure
