"""`tracer export --per-rank`: one Chrome trace per rank of a distributed job, each led by the ``distributedInfo``
Holistic Trace Analysis reads its rank from, checked by HTA itself loading the directory as a job.

The recording is :func:`tests.test_ranks.job` (3 ranks under torchrun's agent) with, built in so each file's content
is known: a DataLoader worker of rank 1 (it inherits rank 1's environment) with a call and samples, rank 2's samples,
the agent's own call and fork of rank 0 (in no rank's file), rank 0's exec, and rank 2 holding rank 0's CPU during
one of rank 0's calls (the hold belongs to the thread that waited: rank 0's file).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from tracedb import builder

from tests.support.builder import MS, US
from tests.test_ranks import AGENT, JOB, RANK_PIDS, job
from tracer.analysis.db import open_trace
from tracer.commands.cli import main
from tracer.views.export import export_ranks
from tracer.views.export.chrome import HOST_PID, IN_OTHER_FILE, PID_LIMIT

WORKER = 3010  # rank 1's DataLoader worker
HOLD_AT = 500 * MS  # rank 0's call that rank 2 preempts (before the step loop, which starts at 1 s)
# every process of each rank's file
PIDS = {0: {RANK_PIDS[0]}, 1: {RANK_PIDS[1], WORKER}, 2: {RANK_PIDS[2]}}
# HTA's rank regex (hta 0.5, hta/common/trace_file.py:45), and its reading: line by line until a line matches
HTA_RANK = re.compile(r'"rank":\s+(\d+)')


def _job():
    b = job(steps=40)
    b.process(WORKER, "pt_data_worker", ppid=RANK_PIDS[1], first_ns=200 * MS)
    b.processes[-1].update(rank=1, local_rank=1, world_size=3, job_id=JOB)
    b.call(300 * MS, 40 * US, "cudaMemcpyAsync", pid=WORKER, bytes=1 << 20, kind="HtoD")
    line = b.stack([("python", "train.py", "step", "train.py", 45)])
    b.samples(1, line, 30, pid=WORKER)
    b.samples(1, line, 40, pid=RANK_PIDS[2])
    b.call(250 * MS, 30 * US, "cudaGetDeviceCount", pid=AGENT)
    b.event(100 * MS, "fork", AGENT, "pt_elastic", child=RANK_PIDS[0])
    b.event(110 * MS, "exec", RANK_PIDS[0], "python", filename="/usr/bin/python3")
    b.call(HOLD_AT, 2 * MS, "cudaStreamSynchronize", pid=RANK_PIDS[0])
    b.off_cpu(
        HOLD_AT + 200 * US, 1 * MS, pid=RANK_PIDS[0], comm="python", reason="preempted", runq_ns=1 * MS,
        by_pid=RANK_PIDS[2], by_comm="python",
    )  # fmt: skip
    return b


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks")
    b = _job()
    b.write(tmp / "job.duckdb")
    with open_trace(tmp / "job.duckdb") as conn:
        summary = export_ranks(conn, tmp / "out", max_events=None)
    return b, tmp / "out", summary


def _trace(out, rank):
    return json.loads((out / f"rank{rank}.json").read_text())


def test_each_file_leads_with_its_rank_as_hta_reads_it(exported):
    _, out, summary = exported
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank1.json", "rank2.json"]
    assert summary.ranks == [0, 1, 2] and summary.world_size == 3
    for rank in range(3):
        text = (out / f"rank{rank}.json").read_text()
        head = text[: text.index('"traceEvents"')]
        # THEN distributedInfo comes before the events, rank first, spelled with a space after the colon
        assert f'"distributedInfo": {{"rank": {rank}, "world_size": 3' in head
        # AND the first line HTA's regex matches holds that rank
        first = next(ln for ln in text.splitlines() if HTA_RANK.search(ln))
        assert int(HTA_RANK.search(first).group(1)) == rank and first.startswith('"distributedInfo"')
        info = json.loads(text)["distributedInfo"]
        assert info == {
            "rank": rank,
            "world_size": 3,
            "local_rank": rank,
            "host": "gpu-box-1",
            "job_id": JOB,
            "pid": RANK_PIDS[rank],
        }


def test_hta_loads_the_directory_as_the_jobs_ranks(exported):
    """A real consumer: HTA's TraceAnalysis finds each file's rank and parses its rank's CUDA calls."""
    from hta.trace_analysis import TraceAnalysis

    b, out, _ = exported
    t = TraceAnalysis(trace_dir=str(out)).t
    assert sorted(t.traces) == [0, 1, 2]
    assert {r: t.meta_data[r]["distributedInfo"]["rank"] for r in range(3)} == {0: 0, 1: 1, 2: 2}
    sym = t.symbol_table.get_sym_table()
    for rank, pids in PIDS.items():
        df = t.get_trace(rank)
        calls = df[df["cat"].map(lambda i: sym[i]).isin(["cuda_runtime", "cuda_driver"])]
        assert set(calls["pid"]) == pids
        assert len(calls) == sum(r["pid"] in pids for r in b.cuda_calls)


def test_each_file_holds_only_its_ranks_processes(exported):
    b, out, _ = exported
    for rank, pids in PIDS.items():
        events = _trace(out, rank)["traceEvents"]
        labels = {e["pid"]: e["args"]["labels"] for e in events if e["name"] == "process_labels"}
        for e in events:
            if e["pid"] in pids or e["pid"] == HOST_PID:
                continue
            # another rank's process only as a holder of this rank's CPU, labelled so, on its hold lane
            assert e["tid"] >= PID_LIMIT or e["name"] in ("process_name", "process_labels", "process_sort_index"), e
            assert labels[e["pid"]] == IN_OTHER_FILE, e
        # every stored call of the rank's processes, and no other process's
        calls = Counter(e["pid"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver"))
        assert calls == Counter(r["pid"] for r in b.cuda_calls if r["pid"] in pids)
        off = Counter(e["pid"] for e in events if e.get("cat") == "sched" and e["name"].startswith("off-CPU"))
        assert off == Counter(r["pid"] for r in b.sched if r["pid"] in pids)
        sampled = {e["pid"] for e in events if e.get("cat") == "cpu_samples"}
        assert sampled == {r["pid"] for r in b.cpu_samples if r["pid"] in pids}
        assert all(e["pid"] in pids for e in events if e.get("cat") == "process")
    # the worker's samples in rank 1's file, rank 2's in its own; rank 0's exec in its file, the agent's fork in none
    assert {e["pid"] for e in _trace(out, 1)["traceEvents"] if e.get("cat") == "cpu_samples"} == {WORKER}
    assert {e["pid"] for e in _trace(out, 2)["traceEvents"] if e.get("cat") == "cpu_samples"} == {RANK_PIDS[2]}
    assert [e["name"] for e in _trace(out, 0)["traceEvents"] if e.get("cat") == "process"] == ["exec"]
    # rank 2 held rank 0's CPU: the hold is in rank 0's file (whose thread waited), on rank 2's labelled track
    holds = [e for e in _trace(out, 0)["traceEvents"] if e["name"] == "held the CPU"]
    assert [e["pid"] for e in holds] == [RANK_PIDS[2]]
    assert not any(e["name"] == "held the CPU" for r in (1, 2) for e in _trace(out, r)["traceEvents"])


def test_the_launcher_is_in_no_file_and_is_said(exported, tmp_path, capsys):
    _, out, summary = exported
    assert summary.left_out == [f"pt_elastic ({AGENT})"]
    assert not any(AGENT == e["pid"] for r in range(3) for e in _trace(out, r)["traceEvents"])
    db = tmp_path / "job.duckdb"
    _job().write(db)
    assert main(["export", "--db", str(db), "--per-rank", "-o", str(tmp_path / "d")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"pt_elastic ({AGENT})" in err and "wrote 3 files" in err and "ranks 0, 1, 2 of 3" in err


def test_max_events_bounds_each_file(tmp_path, capsys):
    db = tmp_path / "job.duckdb"
    b = _job()
    b.write(db)
    argv = ["export", "--db", str(db), "--per-rank", "-o", str(tmp_path / "d"), "--max-events", "7", "--json"]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    for f, rank in zip(s["files"], s["ranks"], strict=True):
        pids = PIDS[rank]
        assert f["calls_in_window"] == sum(r["pid"] in pids for r in b.cuda_calls)
        assert f["calls_written"] + f["off_cpu_written"] == 7 and f["notes"]


def test_cli_overwrites_only_with_force(tmp_path, capsys):
    db = tmp_path / "job.duckdb"
    _job().write(db)
    d = tmp_path / "d"
    d.mkdir()
    (d / "rank1.json").write_text("mine")
    assert main(["export", "--db", str(db), "--per-rank", "-o", str(d)]) == 2
    assert "--force" in capsys.readouterr().err and (d / "rank1.json").read_text() == "mine"
    assert sorted(p.name for p in d.iterdir()) == ["rank1.json"]
    assert main(["export", "--db", str(db), "--per-rank", "-o", str(d), "--force"]) == 0
    assert _trace(d, 1)["distributedInfo"]["rank"] == 1


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "--per-rank writes a directory"),
        (["-o", "-"], "--per-rank writes a directory"),
        (["--format", "parquet", "-o", "DIR"], "--per-rank applies to --format chrome"),
    ],
)
def test_cli_usage_errors(tmp_path, capsys, args, needle):
    db = tmp_path / "job.duckdb"
    _job().write(db)
    argv = ["export", "--db", str(db), "--per-rank", *(str(tmp_path / "d") if a == "DIR" else a for a in args)]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()


def test_a_recording_without_ranks_is_a_usage_error(tmp_path, capsys):
    db = tmp_path / "one.duckdb"
    builder("cpu_contention").write(db)
    assert main(["export", "--db", str(db), "--per-rank", "-o", str(tmp_path / "d")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error: the recording has no ranks" in err and "without --per-rank" in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()


def test_the_whole_export_is_unchanged_by_the_rank_filter(tmp_path):
    """Without --per-rank every process is written (the rank filter is off)."""
    from tracer.views.export import export_trace

    b = _job()
    b.write(tmp_path / "job.duckdb")
    with open_trace(tmp_path / "job.duckdb") as conn:
        export_trace(conn, tmp_path / "all.json", max_events=None)
    trace = json.loads((tmp_path / "all.json").read_text())
    assert "distributedInfo" not in trace
    calls = Counter(e["pid"] for e in trace["traceEvents"] if e.get("cat") in ("cuda_runtime", "cuda_driver"))
    assert calls == Counter(r["pid"] for r in b.cuda_calls)
