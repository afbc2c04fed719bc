"""tracer.analysis.job: several recordings (a host each) analysed as one job.

The job of :func:`tests.test_ranks.job` (3 ranks in lockstep, rank 2 asleep 20 ms more per step, so ranks 0 and 1
wait for it in the all_reduce) is split into one recording per rank, as three hosts would record it: each host's
rank is pid 3001 (pids collide), each host's agent pid 3000, and each recording starts at its own wall-clock time
(job time 0, -7.3 s and -2.9 s), so its ts_ns count from a different origin. Truth of the alignment: the earliest
recording (1) starts at -7.3 s, so the others start 7.3 s and 4.4 s after it: shifted by 7 and 4 whole seconds,
they are 0.3 s and 0.4 s early; the most two are apart is 0.4 s (recordings 1 and 2), plus their clock reads.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import anyio
import duckdb
import pytest
from mcp import Client

from mcp_server.server import build_server
from tests.support.builder import MS, S, TraceBuilder
from tests.test_ranks import AGENT, COMM_TID, JOB, PER_STEP_MS, RANK_PIDS, job
from tracer.analysis.chains import compute_chains
from tracer.analysis.db import open_trace, recordings, session_row
from tracer.analysis.job import (
    PID_COLUMNS,
    PID_LIST_COLUMNS,
    PID_STRIDE,
    SEC_COLUMNS,
    SESSION_RULES,
    STACK_COLUMNS,
    STACK_STRIDE,
    STARTED_AT_READ_NS,
    TIME_NS_COLUMNS,
    job_alignment,
)
from tracer.analysis.ranks.report import ranks_report
from tracer.commands.cli import main
from tracer.errors import StoreError
from tracer.recorder import clocks
from tracer.schema import APP_ID, CHAINS_RESULT, SCHEMA_VERSION, TABLES

T0 = datetime(2026, 5, 4, 12, 0, 0, tzinfo=timezone.utc)
T0_NS = 1_777_896_000 * S
STARTS_S = (0.0, -7.3, -2.9)  # each recording's start on the job's clock (its wall-clock start - T0)
HOSTS = ("gpu-box-1", "gpu-box-2", "gpu-box-3")
PID = 3001  # every host's rank process
READ_NS = 1_500  # each recording's clock_read_ns


def _split(full: TraceBuilder, rank: int, start_s: float, host: str, precise: bool = True) -> TraceBuilder:
    """Recording of ``rank`` alone, made by a recorder started at ``start_s`` on the job's clock on ``host``."""
    own, shift = RANK_PIDS[rank], int(round(start_s * S))
    pid_of = {own: PID, own + COMM_TID: PID + COMM_TID, AGENT: AGENT}
    b = TraceBuilder(duration_s=full.duration_s - start_s, target=full.target)
    b.process(AGENT, "pt_elastic", ppid=1)
    b.processes[0].update(launcher="torchrun")
    b.process(PID, "python", ppid=AGENT, first_ns=100 * MS - shift)
    b.processes[-1].update(rank=rank, local_rank=0, world_size=3, job_id=JOB)
    b.thread(PID, PID + COMM_TID, "pt_gloo_runloop")
    b.stacks = list(full.stacks)
    for r in full.cuda_calls:
        if r["pid"] == own:
            b.cuda_calls.append(dict(r, pid=PID, tid=pid_of[r["tid"]], ts_ns=r["ts_ns"] - shift))
    for r in full.sched:
        if r["pid"] == own:
            w = {k: pid_of.get(r[k], r[k]) for k in ("waker_pid", "waker_tid")}
            b.sched.append(dict(r, pid=PID, tid=pid_of[r["tid"]], ts_ns=r["ts_ns"] - shift, **w))
    b.session.update(host=host, boot_id=f"boot-{host}", started_at=T0 + timedelta(seconds=start_s))
    if precise:
        b.session.update(realtime_at_start_ns=T0_NS + shift, clock_read_ns=READ_NS)
    return b


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> list[Path]:
    """The job's three recordings, rank r in recording r."""
    d = tmp_path_factory.mktemp("job")
    full = job(slow_rank=2, slow_ms=20)
    return [
        _split(full, r, STARTS_S[r], HOSTS[r]).write(d / f"rank{r}.duckdb") for r in range(3)
    ]  # fmt: skip


def test_the_job_names_the_straggler_rank_on_its_host(three):
    # GIVEN three recordings of one rank each, whose pids collide and whose clocks start 7.3 s and 2.9 s apart
    # WHEN the ranks are analysed over the job
    with open_trace(three) as c:
        rep = ranks_report(c)
        (ch,) = [x for x in compute_chains(c, limit=100).chains if x.category == "straggler_rank"]
    # THEN the straggler is rank 2, recording 2's pid 3001, on its host
    ev = rep.straggler
    assert ev is not None and (ev.rank, ev.phase, ev.job_id) == (2, "asleep", JOB)
    assert ev.pid == 2 * PID_STRIDE + PID and decode_pid(ev.pid) == (2, PID)
    assert f"Rank 2 (pid {2 * PID_STRIDE + PID}, host gpu-box-3)" in ch.summary
    assert [(r.rank, decode_pid(r.pid), r.straggler) for r in rep.ranks] == [
        (0, (0, PID), False),
        (1, (1, PID), False),
        (2, (2, PID), True),
    ]
    # AND its excess is the built 20 ms per step, within the single-host tolerance plus what 0.4 s of misalignment
    # moves across the window's ends (a share of a step)
    assert ev.phase_excess_ms_per_step == pytest.approx(20, abs=2 * PER_STEP_MS)
    assert sorted(w.rank for w in ev.waiting) == [0, 1]
    # AND the note says how well the clocks line up: 0.4 s of whole-second rounding plus two reads
    assert "3 recordings (3 hosts) as one job, aligned by wall clock to ±400 ms" in rep.note


def test_pids_are_keyed_by_recording(three):
    with open_trace(three) as c:
        rows = c.execute("SELECT pid, ppid, recording, host FROM processes ORDER BY pid").fetchall()
    # THEN each host's agent and rank are distinct processes, decoded to (recording, pid), with their host
    assert rows == [
        (i * PID_STRIDE + pid, i * PID_STRIDE + ppid, i, HOSTS[i])
        for i in range(3)
        for pid, ppid in ((AGENT, 1), (PID, AGENT))
    ]
    assert {decode_pid(r[0]) for r in rows} == {(i, p) for i in range(3) for p in (AGENT, PID)}


def test_times_shift_by_whole_seconds_and_the_bound_is_reported(three):
    with open_trace(three) as c:
        al = job_alignment(c)
        # the per-second tables and ts_ns move together: a call's second is still its ts_ns // 1 s
        firsts = c.execute(
            "SELECT pid // $stride, min(ts_ns) FROM cuda_calls GROUP BY ALL ORDER BY ALL", {"stride": PID_STRIDE}
        ).fetchall()
        secs = c.execute(
            "SELECT pid // $stride, min(sec) FROM thread_breakdown GROUP BY ALL ORDER BY ALL", {"stride": PID_STRIDE}
        ).fetchall()
        s = session_row(
            c, ("duration_s", "host", "cpu_cores", "events_traced", "status"), {"t": "epoch_ns(started_at)"}
        )
    assert al is not None
    assert [(r.recording, r.shift_s, r.residual_ms, r.clock) for r in al.recordings] == [
        (0, 7, 300.0, "realtime"),
        (1, 0, 0.0, "realtime"),
        (2, 4, 400.0, "realtime"),
    ]
    assert al.bound_ms == pytest.approx(400 + 2 * READ_NS / 1e6)
    # THEN recording i's first call, at job time t (its own ts_ns t - start_i), reads t - start_i + shift_i
    full = job(slow_rank=2, slow_ms=20)
    first = {r: min(x["ts_ns"] for x in full.cuda_calls if x["pid"] == RANK_PIDS[r]) for r in range(3)}
    shifts = (7, 0, 4)
    assert firsts == [(r, first[r] - round(STARTS_S[r] * S) + shifts[r] * S) for r in range(3)]
    # AND its threads' first second (each rank process is first seen at job time 0.1 s) moved with them
    assert [sec for _, sec in secs] == [(100 * MS - round(STARTS_S[r] * S)) // S + shifts[r] for r in range(3)]
    # AND the job's session row: its earliest start, its span, its hosts, each host's CPUs once, summed counts
    assert s["t"] == T0_NS - round(7.3 * S)
    assert s["host"] == "gpu-box-1, gpu-box-2, gpu-box-3" and s["cpu_cores"] == 3 * 16 and s["status"] == "complete"
    assert s["duration_s"] == pytest.approx(
        max(full.duration_s - st + k for st, k in zip(STARTS_S, shifts, strict=True))
    )
    assert s["events_traced"] == sum(1 for x in full.cuda_calls if x["pid"] in RANK_PIDS)


def test_an_older_recording_aligns_by_started_at(tmp_path):
    # GIVEN two recordings without realtime_at_start_ns (older recorders): started_at, microseconds, 7.3 s apart
    full = job(slow_rank=2, slow_ms=20)
    paths = [_split(full, r, (0.0, 7.3)[r], HOSTS[r], precise=False).write(tmp_path / f"{r}.duckdb") for r in (0, 1)]
    with open_trace(paths) as c:
        al = job_alignment(c)
    # THEN recording 1 is shifted 7 s, 0.3 s off, with the nominal bound of a started_at read on each side
    assert al is not None and [(r.shift_s, r.residual_ms, r.clock) for r in al.recordings] == [
        (0, 0.0, "started_at"),
        (7, 300.0, "started_at"),
    ]
    assert al.bound_ms == pytest.approx(300 + 2 * STARTED_AT_READ_NS / 1e6)


def test_a_single_recording_is_no_job(three):
    with open_trace(three[0]) as c:
        assert job_alignment(c) is None and ranks_report(c).note.startswith("1 rank process")
        assert c.execute("SELECT max(pid) FROM processes").fetchone()[0] == PID


# --- every column -------------------------------------------------------------------------------------------

_LITERAL = {
    "INTEGER": "4242",
    "BIGINT": "4242",
    "UBIGINT": "4242",
    "DOUBLE": "1.5",
    "VARCHAR": "'x'",
    "BOOLEAN": "true",
    "TIMESTAMPTZ": "TIMESTAMPTZ '2026-05-04 12:00:00+00'",
    "INTEGER[]": "[4242, 0]",
    "JSON": "'{\"a\": 1}'",
}


def _every_column_db(path: Path, start_ns: int) -> Path:
    """A recording with one row in every table, each column set (4242 in every integer), started at ``start_ns``."""
    with duckdb.connect(str(path)) as c:
        for t in TABLES:
            c.execute(t.ddl())
        c.execute("INSERT INTO meta VALUES ('app', ?), ('schema_version', ?)", [APP_ID, str(SCHEMA_VERSION)])
        for t in TABLES:
            if t.name == "meta":
                continue
            vals = [_LITERAL.get(col.type, "[]") for col in t.columns]
            if t.name == "session":
                special = {
                    "session_id": "1",
                    "status": "'complete'",
                    "target": "'pid 4242'",
                    "realtime_at_start_ns": str(start_ns),
                    "clock_read_ns": "1000",
                    "started_at": f"make_timestamptz({start_ns // 1000})",
                }
                vals = [special.get(col.name, v) for col, v in zip(t.columns, vals, strict=True)]
            c.execute(f"INSERT INTO {t.name} VALUES ({', '.join(vals)})")
    return path


def _text_rows(c: duckdb.DuckDBPyConnection, table: str, cols: list[str], source: str) -> list[dict[str, str]]:
    sel = ", ".join(f"CAST({col} AS VARCHAR)" for col in cols)
    return [dict(zip(cols, r, strict=True)) for r in c.execute(f"SELECT {sel} FROM {source}").fetchall()]


def test_every_pid_time_and_stack_column_is_moved_and_nothing_else(tmp_path):
    # GIVEN two recordings with one row in every table, every integer 4242, the second started 7.3 s later
    a = _every_column_db(tmp_path / "a.duckdb", T0_NS)
    b = _every_column_db(tmp_path / "b.duckdb", T0_NS + 7_300 * MS)
    with open_trace([a, b]) as c, duckdb.connect(str(b), read_only=True) as raw:
        for t in TABLES:
            if t.name in ("meta", CHAINS_RESULT):  # a job computes its own chains (test_chains_stored)
                continue
            cols = t.column_names
            view = _text_rows(c, t.name, cols, t.name)
            orig = _text_rows(raw, t.name, cols, t.name)[0]
            # recording 0 is the earliest: unchanged
            assert view[0] == _text_rows(c, t.name, cols, f"rec0.main.{t.name}")[0], t.name
            # THEN recording 1's row: pids + 10,000,000 (pid 0 kept), stack ids + 10**12, instants + 7 s, sec + 7
            want = dict(orig)
            for col in PID_COLUMNS.get(t.name, ()):
                want[col] = str(4242 + PID_STRIDE)
            for col in PID_LIST_COLUMNS.get(t.name, ()):
                want[col] = f"[{4242 + PID_STRIDE}, 0]"
            for col in STACK_COLUMNS.get(t.name, ()):
                want[col] = str(4242 + STACK_STRIDE)
            for col in TIME_NS_COLUMNS.get(t.name, ()):
                want[col] = str(4242 + 7 * S)
            for col in SEC_COLUMNS.get(t.name, ()):
                want[col] = str(4242 + 7)
            if t.name == "session":
                want["target"] = f"pid {4242 + PID_STRIDE}"
            assert view[1] == want, t.name


# A column that names a process or thread but holds no pid: each one decided (a new one fails the test below).
NOT_PID = {
    ("session", "recorder_start_ticks"),
    ("session", "sample_hz"),
    ("processes", "first_ns"),
    ("processes", "rank"),
    ("nccl_comms", "rank"),
    ("thread_snapshots", "rank"),
    ("gc_collections", "dur_ns"),
    ("gc_collections", "stack_id"),  # a stack id (STACK_COLUMNS), whose meaning names the thread
    ("thread_breakdown", "wall_ns"),
    ("thread_breakdown", "runq_self_ns"),
    ("thread_breakdown", "runq_tree_ns"),
    ("thread_breakdown", "runq_other_ns"),
    ("thread_breakdown", "faults"),
    ("thread_breakdown", "page_alloc_bytes"),
    ("thread_breakdown", "page_cache_bytes"),
    ("thread_wakers", "wakeups"),
    ("cuda_calls", "off_cpu_ns"),
    ("sched", "ts_ns"),
    ("preemptors", "preemptions"),
}
_PID_NAME = re.compile(r"(^|_)(pid|tid|ppid)s?$|^child$")
_PID_DOC = re.compile(r"\b(pids?|tids?|process|processes|thread|parent)\b", re.I)


def test_every_pid_like_column_is_keyed_by_recording():
    # GIVEN the schema: a column named like a pid, or an integer one whose meaning names a process or thread
    covered = {(t, c) for m in (PID_COLUMNS, PID_LIST_COLUMNS) for t, cols in m.items() for c in cols}
    for t in TABLES:
        for col in t.columns:
            integer = col.type.startswith(("INTEGER", "BIGINT"))
            if _PID_NAME.search(col.name) or (integer and _PID_DOC.search(col.doc)):
                # THEN the job moves it, or it is known to hold no pid
                assert ((t.name, col.name) in covered) != ((t.name, col.name) in NOT_PID), (t.name, col.name)
    assert covered <= {(t.name, c) for t in TABLES for c in t.column_names}


# the one *_ns column whose meaning mentions ts_ns without being an instant on the session's clock
NOT_INSTANT = {("session", "start_mono_ns")}
_INSTANT = re.compile(r"ts_ns|since session start|^when\b|^start\b|^end\b|first seen|exit time|up to which")


def test_every_instant_column_is_shifted_and_no_duration():
    shifted = {(t, c) for m in (TIME_NS_COLUMNS, SEC_COLUMNS) for t, cols in m.items() for c in cols}
    for t in TABLES:
        for col in t.columns:
            if col.name.endswith("_ns") or col.name == "sec":
                instant = bool(_INSTANT.search(col.doc)) and (t.name, col.name) not in NOT_INSTANT
                assert ((t.name, col.name) in shifted) == instant, (t.name, col.name)


def test_every_session_column_has_a_rule_for_the_job():
    (session,) = [t for t in TABLES if t.name == "session"]
    assert set(SESSION_RULES) == set(session.column_names)


# --- which files, and the front ends ------------------------------------------------------------------------


def test_recordings_from_paths_a_directory_and_a_glob(three, tmp_path):
    d = three[0].parent
    assert recordings(d) == sorted(three)
    assert recordings(str(d / "rank*.duckdb")) == sorted(three)
    # a file named twice (a path and a glob) is one recording
    assert recordings([three[1], d / "rank[12].duckdb"]) == [three[1], three[2]]
    with pytest.raises(StoreError, match="no recording matches"):
        recordings(str(d / "nope*.duckdb"))
    # a directory without recordings is itself (opening it says why)
    assert recordings(tmp_path) == [tmp_path]


def test_cli_ranks_over_several_db(three, capsys):
    d = three[0].parent
    assert main(["ranks", *(a for p in three for a in ("--db", str(p))), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in out["ranks"] if r["straggler"]] == [2]
    # the same job from its directory, and from a glob
    for spec in (str(d), str(d / "rank*.duckdb")):
        assert main(["ranks", "--db", spec, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["straggler"]["pid"] == 2 * PID_STRIDE + PID
    assert main(["stats", "--db", str(d)]) == 0
    assert "3 recordings (3 hosts) as one job" in capsys.readouterr().out
    # tracer sql reads one file: two are refused, not the last one queried
    assert main(["sql", "--db", str(three[0]), "--db", str(three[1]), "SELECT 1"]) == 2
    assert "tracer sql reads one recording" in capsys.readouterr().err


def test_a_dataset_several_hosts_exported_into_is_the_job(three, tmp_path, capsys):
    # GIVEN the three hosts' recordings exported into one Parquet dataset (one --db each, one command)
    ds = tmp_path / "ds"
    assert main(["export", "--format", "parquet", *(a for p in three for a in ("--db", str(p))), "-o", str(ds)]) == 0
    assert sorted(d.name for d in ds.iterdir() if d.is_dir()) == [f"host={h}" for h in HOSTS]
    capsys.readouterr()
    # WHEN the dataset is analysed  THEN it is the job, as from the files: pids keyed by host, clocks lined up
    assert main(["ranks", "--db", str(ds), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    with open_trace(three) as c:
        want = json.loads(ranks_report(c).model_dump_json())
    assert rep["straggler"]["pid"] == 2 * PID_STRIDE + PID and rep["straggler"]["rank"] == 2
    assert rep == want


def test_an_export_of_the_job_is_on_the_jobs_clock(three, tmp_path, capsys):
    # GIVEN the job's recordings, whose clocks start 7.3 s and 2.9 s apart  WHEN exported one file per rank
    out = tmp_path / "traces"
    assert main(["export", *(a for p in three for a in ("--db", str(p))), "--per-rank", "-o", str(out)]) == 0
    firsts = {}
    for r in range(3):
        doc = json.loads((out / f"rank{r}.json").read_text())
        assert doc["distributedInfo"]["rank"] == r
        firsts[r] = min(e["ts"] for e in doc["traceEvents"] if e.get("name") == "cudaMemcpyAsync") / 1e6
    # THEN the ranks' first steps line up as they ran (in lockstep, at 1 s of the job), within the alignment's
    # bound (0.4 s), not 7.3 s apart as each recording's own clock has them
    assert max(firsts.values()) - min(firsts.values()) <= 0.4 + 1e-3, firsts


def test_mcp_serves_a_job_and_refuses_run_sql_on_it(three):
    async def go():
        async with Client(build_server(three)) as cl:
            stats = await cl.call_tool("get_trace_stats", {})
            ranks = await cl.call_tool("get_ranks", {})
            sql = await cl.call_tool("run_sql", {"query": "SELECT 1"})
            return stats, ranks, sql

    stats, ranks, sql = anyio.run(go)
    assert stats.structured_content["job"].startswith("3 recordings (3 hosts) as one job")
    assert ranks.structured_content["straggler"]["rank"] == 2
    assert sql.is_error and "run_sql reads one recording" in sql.content[0].text


def test_start_clocks_keep_the_tightest_pair(monkeypatch):
    # GIVEN monotonic reads whose first pair is 50 ns apart and the second 10 ns
    mono = iter([1000, 1050, 2000, 2010])
    real = iter([7_000, 8_000])
    monkeypatch.setattr(clocks.time, "monotonic_ns", lambda: next(mono))
    monkeypatch.setattr(clocks.time, "time_ns", lambda: next(real))
    # THEN the second pair is kept, with its gap as the bound
    assert clocks.read_start_clocks(2) == clocks.StartClocks(mono_ns=2000, realtime_ns=8_000, read_ns=10)


def decode_pid(pid: int) -> tuple[int, int]:
    """(recording index, its own pid) of a pid as a job reads it: the encoding the job's views apply, undone."""
    return (pid // PID_STRIDE, pid % PID_STRIDE) if pid > 0 else (0, pid)
