"""tracer.analysis.db.session_row, the one reader of the session row: by name, tolerant of an older recording's
missing columns, with DuckDB computing the expressions; and its readers on such a recording."""

from __future__ import annotations

import duckdb
import pytest
from tracedb import build, builder, downgrade_to_v1

from tracer.analysis.breakdown import time_breakdown
from tracer.analysis.db import open_trace, session_row
from tracer.analysis.stats import environment
from tracer.views.export.rows import session_info, session_span

STARTED_UNIX_NS = 1_777_896_000 * 10**9  # the builder's start: 2026-05-04 12:00:00 UTC


@pytest.fixture(scope="module")
def v1(tmp_path_factory):
    # GIVEN a recording made before schema v2: its session row lacks the recorder's identity and cost
    p = tmp_path_factory.mktemp("v1") / "v1.duckdb"
    b = builder("healthy")
    b.session.update(recorder_cpu_s=1.5, recorder_pid=4321)
    b.write(p)
    return downgrade_to_v1(p)


def test_columns_by_name_in_the_order_asked(tmp_path):
    build("healthy", tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        row = session_row(c, ("target", "duration_s", "events_lost", "host"))
    assert list(row.items()) == [
        ("target", "python train.py"),
        ("duration_s", 60.0),
        ("events_lost", 0),
        ("host", "gpu-box-1"),
    ]


def test_a_column_an_older_recording_lacks_reads_none(v1):
    with open_trace(v1) as c:
        row = session_row(c, ("recorder_cpu_s", "status", "recorder_pid", "no_such_column"))
    # THEN the lacking columns read None (the values written before the downgrade are gone), the rest as stored
    assert row == {"recorder_cpu_s": None, "status": "complete", "recorder_pid": None, "no_such_column": None}


def test_expressions_are_computed_by_duckdb_after_the_columns(tmp_path):
    build("healthy", tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        row = session_row(c, ("duration_s",), {"start_ns": "epoch_ns(started_at)", "twice": "2 * duration_s"})
    assert list(row.items()) == [("duration_s", 60.0), ("start_ns", STARTED_UNIX_NS), ("twice", 120.0)]


def test_no_session_row_is_none_and_names_are_checked(tmp_path):
    build("healthy", tmp_path / "t.duckdb")
    with duckdb.connect(str(tmp_path / "t.duckdb")) as c:
        c.execute("DELETE FROM session")
        assert session_row(c, ("status",)) is None
        # a name is spliced into the query's column pattern: anything but an identifier is refused
        with pytest.raises(ValueError):
            session_row(c, ("status|.*",))


def test_readers_of_an_older_recording_see_what_it_has(v1):
    with open_trace(v1) as c:
        env = environment(c)
        cost = time_breakdown(c).tracer
        header, (length_ns, start_ns) = session_info(c), session_span(c)
    assert (env.started_at, env.duration_s, env.status, env.gpus) == (
        "2026-05-04T12:00:00Z",
        60.0,
        "complete",
        "NVIDIA A10",
    )
    # the tracer's CPU is then the host samples' (v1 has no recorder_cpu_s, nor host_samples.tracer_cpu_ms)
    assert (cost.cpu_ms, cost.holds, cost.peak_rss_bytes) == (None, None, None)
    assert header["host"] == "gpu-box-1" and list(header)[-1] == "events_lost"
    assert (length_ns, start_ns) == (60 * 10**9, STARTED_UNIX_NS)
