"""tracer_chain_active (issue 32): the chain watch computes the causal chains over a snapshot of the recording in a
child process (tracer/live.py ChainWatch, tracer/commands/chain_watch.py), no more often than asked and only when
new calls were stored, and the metrics serve each active (category, severity) as 1, then 0 once it is not.

Oracle: a built trace whose sync_stall chain is HIGH (tests/test_chains_sync_stall.py checks that chain)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import duckdb
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tests.support.scenarios import build
from tracer.commands.chain_watch import active_chains
from tracer.live import ChainWatch
from tracer.recorder.metrics import MetricsState, render


def _db(tmp_path: Path) -> Path:
    p = tmp_path / "t.duckdb"
    build("sync_stall", p)
    return p


def _set_end(db: Path, end_ns: int) -> None:
    with duckdb.connect(str(db)) as c:
        c.execute("UPDATE session SET flushed_ns = ?", [end_ns])


def _chain_end(db: Path) -> int:
    from tracer.analysis.chains import compute_chains
    from tracer.analysis.db import open_trace

    with open_trace(db) as c:
        return max(x.end_ns for x in compute_chains(c, limit=100).chains if x.category == "sync_stall")


def test_a_chain_is_active_while_its_range_ended_within_the_window(tmp_path):
    db = _db(tmp_path)
    end = _chain_end(db)
    # GIVEN the data ends 10 s after the chain's range  THEN it is active over a 60 s window
    _set_end(db, end + 10_000_000_000)
    assert ("sync_stall", "HIGH") in active_chains(str(db), 60.0)
    # GIVEN the data goes on 10 minutes past it  THEN it is no longer active
    _set_end(db, end + 600_000_000_000)
    assert ("sync_stall", "HIGH") not in active_chains(str(db), 60.0)


def test_the_metrics_serve_an_active_chain_as_1_then_0():
    st = MetricsState()
    st.set_chains([("sync_stall", "HIGH"), ("cpu_contention", "MEDIUM")])
    st.publish(*_no_calls(), {}, set(), 1.0)
    assert _chains(st) == {("sync_stall", "HIGH"): 1, ("cpu_contention", "MEDIUM"): 1}
    # WHEN the next computation finds only the MEDIUM one  THEN the HIGH series stays, at 0 (an alert resolves)
    st.set_chains([("cpu_contention", "MEDIUM")])
    st.publish(*_no_calls(), {}, set(), 2.0)
    assert _chains(st) == {("sync_stall", "HIGH"): 0, ("cpu_contention", "MEDIUM"): 1}


def _no_calls():
    from tracer.recorder import events

    return (
        np.zeros(0, events.OP_KEY_DTYPE),
        np.zeros(0, events.OP_TOTAL_DTYPE),
        np.zeros(0, events.HIST_KEY_DTYPE),
        np.zeros(0, events.COUNT_DTYPE),
    )


def _chains(st: MetricsState) -> dict[tuple[str, str], float]:
    fams = {f.name: f for f in text_string_to_metric_families(render(st.snapshot).decode())}
    return {(s.labels["category"], s.labels["severity"]): s.value for s in fams["tracer_chain_active"].samples}


def test_the_watch_computes_in_a_child_only_when_due_and_new_calls_were_stored(tmp_path):
    db = _db(tmp_path)
    _set_end(db, _chain_end(db) + 1_000_000_000)
    snapshots: list[Path] = []
    published: list[list[tuple[str, str]]] = []

    def snapshot(path: Path, on_done) -> None:  # the store's writer thread's part: a copy, then on_done
        snapshots.append(path)
        shutil.copyfile(db, path)
        on_done()

    w = ChainWatch(30.0, snapshot, published.append)
    w.start()
    try:
        # GIVEN calls were stored  WHEN the tick comes  THEN one snapshot is taken and the child's answer published
        w.tick(stored_calls=100, now=1000.0)
        end = time.monotonic() + 60
        while not published and time.monotonic() < end:
            time.sleep(0.05)
            w.tick(stored_calls=100, now=1000.5)  # same count: no new request meanwhile
        assert published and ("sync_stall", "HIGH") in published[0]
        assert len(snapshots) == 1
        # WHEN new calls are stored before every_s has passed  THEN nothing is computed
        w.tick(stored_calls=200, now=1010.0)
        # AND when every_s has passed with no new call  THEN nothing either (an idle node computes nothing)
        w.tick(stored_calls=100, now=1040.0)
        assert len(snapshots) == 1
        # AND with new calls after every_s  THEN the next computation is asked for
        w.tick(stored_calls=300, now=1040.0)
        assert len(snapshots) == 2
    finally:
        w.stop()
    # THEN stopping ends the child and removes the snapshot
    assert w.proc is not None and w.proc.poll() is not None and not w.dir.exists()
