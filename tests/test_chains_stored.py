"""tracer.analysis.chains.stored: the answer ``tracer record`` stores at a recording's end is served, filtered as
a computed one is, and only while it is still the answer: the same analysis code, the same rows, one recording."""

from __future__ import annotations

import duckdb
import pytest
from tracedb import build

import tracer.analysis.chains as chains_mod
from tracer.analysis.chains import compute_chains, store_chains, stored
from tracer.analysis.compare.load import load_side
from tracer.analysis.db import open_trace
from tracer.analysis.db.jobs import open_job


def _not_run(*_a, **_k):
    raise AssertionError("the detectors ran: the stored answer was not served")


@pytest.fixture()
def db(tmp_path):
    """A recording with several chains (a CPU hog), before its end's store_chains."""
    path = tmp_path / "hog.duckdb"
    build("cpu_contention", path)
    return path


def _fresh(path, **kw):
    with open_trace(path) as c:
        return compute_chains(c, **kw).model_dump()


def test_the_stored_answer_is_the_computed_one_and_runs_no_detector(db, monkeypatch):
    expected = [_fresh(db), _fresh(db, severity="high"), _fresh(db, limit=1), _fresh(db, severity="low", limit=0)]
    assert expected[0]["chains"], "the fixture must have chains for this test to mean anything"
    store_chains(db)
    monkeypatch.setattr(chains_mod, "detect_all", _not_run)
    got = [_fresh(db), _fresh(db, severity="high"), _fresh(db, limit=1), _fresh(db, severity="low", limit=0)]
    assert got == expected


def test_causal_chains_rows_are_still_written_and_limited(db):
    total = len(chains_mod.select(_chains(db), None, 1000).chains)
    assert store_chains(db, limit=1) == 1
    with duckdb.connect(str(db), read_only=True) as c:
        assert c.execute("SELECT count(*) FROM causal_chains").fetchone()[0] == 1
        kept = stored.load(c)
    assert kept is not None and len(kept.chains) == total  # the whole answer, not the rows' limit


def _chains(path):
    with open_trace(path) as c:
        return chains_mod.compute_all(c)


def test_rows_added_after_the_end_recompute_it(db, monkeypatch):
    store_chains(db)
    with duckdb.connect(str(db)) as c:
        c.execute("INSERT INTO process_events BY NAME SELECT 1 AS ts_ns, 'exit' AS kind, 1 AS pid")
    monkeypatch.setattr(chains_mod, "detect_all", _not_run)
    with open_trace(db) as c, pytest.raises(AssertionError, match="detectors ran"):
        compute_chains(c)


def test_another_analysis_version_recomputes_it(db, monkeypatch):
    store_chains(db)
    monkeypatch.setattr(stored, "analysis_version", lambda: "another")
    monkeypatch.setattr(chains_mod, "detect_all", _not_run)
    with open_trace(db) as c, pytest.raises(AssertionError, match="detectors ran"):
        compute_chains(c)


def test_a_pid_filter_computes(db, monkeypatch):
    store_chains(db)
    monkeypatch.setattr(chains_mod, "detect_all", _not_run)
    with open_trace(db) as c, pytest.raises(AssertionError, match="detectors ran"):
        compute_chains(c, pid=c.execute("SELECT min(pid) FROM processes").fetchone()[0])


def test_a_job_of_recordings_with_stored_answers_computes_its_own(tmp_path, monkeypatch):
    paths = [tmp_path / "a.duckdb", tmp_path / "b.duckdb"]
    for p in paths:
        build("cpu_contention", p)
        store_chains(p)
    with open_job(paths) as c:
        assert stored.load(c) is None
        assert (
            c.execute(
                "SELECT count(*) FROM duckdb_views() WHERE view_name = 'chains_result' AND database_name = "
                "current_database()"
            ).fetchone()[0]
            == 0
        )


def test_compare_reads_the_stored_chains(db, monkeypatch):
    expected = _chains(db).chains
    store_chains(db)
    monkeypatch.setattr("tracer.analysis.compare.load.detect_all", _not_run)
    with open_trace(db) as c:
        assert load_side(c, "a").chains == expected
