"""CLI views: exit codes, stdout results only, stderr errors without tracebacks."""

from __future__ import annotations

import json
import os

import duckdb
import pytest
from tracedb import build

from tracer.commands.cli import main
from tracer.procfs import boot_id, process_start_ticks
from tracer.schema import SCHEMA_VERSION


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    p = tmp_path_factory.mktemp("cli") / "c.duckdb"
    build("cpu_contention", p)
    return str(p)


def test_stats_json_and_table(db, capsys):
    assert main(["stats", "--db", db, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["tail_ratio"] for o in out["ops"]] == sorted((o["tail_ratio"] for o in out["ops"]), reverse=True)
    assert "cudaStreamSynchronize" in {o["op"] for o in out["ops"]} and out["chains_by_severity"]["HIGH"] == 1
    assert out["training_thread"]["tid"] == 1000 and out["tracer"]["summary"].startswith("the tracer used")
    assert main(["stats", "--db", db]) == 0
    text = capsys.readouterr().out
    assert "cudaStreamSynchronize" in text and "tail p99/p50" in text and "pt_data_worker" in text


def test_chains_stacks_sql(db, capsys):
    assert main(["chains", "--db", db, "--severity", "high"]) == 0
    assert "stress-ng" in capsys.readouterr().out
    assert main(["chains", "--db", db, "--severity", "urgent"]) == 2
    assert main(["stacks", "--db", db, "--op", "cudaStreamSynchronize", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stacks"][0]["label"] == "train.py:88 train_step"
    assert main(["sql", "--db", db, "SELECT count(*) AS n FROM processes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == [[3]]  # main and two workers


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["stacks", "--op", "nope"], 2, "unknown op 'nope'"),
        (["sql", "DELETE FROM meta"], 2, "not allowed"),
        (["stats", "--pid", "999999"], 2, "pid 999999 is not in this trace; traced pids: 1000, 1001, 1002"),
        (["chains", "--pid", "7"], 2, "pid 7 is not in this trace"),
        (["stacks", "--op", "cudaMalloc", "--pid", "7"], 2, "pid 7 is not in this trace"),
        (["timeline", "--pid", "7"], 2, "pid 7 is not in this trace"),
        (["breakdown", "--pid", "7"], 2, "pid 7 is not in this trace"),
        (["breakdown", "--tid", "77"], 2, "thread 77 is not in this trace"),
        (["breakdown", "--tid", "1000", "--pid", "1001"], 2, "thread 1000 belongs to pid 1000, not 1001"),
        (["breakdown", "--bucket", "-1"], 2, "bucket width -1 s is negative"),
        (["chains", "--limit", "0"], 2, "limit 0 is below 1"),
    ],
)
def test_usage_errors(db, capsys, args, code, needle):
    assert main([*args, "--db", db]) == code
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    "problem,needle",
    [
        ("missing", "no trace DB"),
        ("garbage", "not a DuckDB file"),
        ("newer", f"schema version {SCHEMA_VERSION + 1}"),
        ("recording", "still being recorded"),
    ],
)
def test_db_problems_exit_5(tmp_path, capsys, problem, needle):
    p = tmp_path / "t.duckdb"
    if problem == "garbage":
        p.write_text("not a db")
    elif problem in ("newer", "recording"):
        build("healthy", p)
        c = duckdb.connect(str(p))
        if problem == "newer":
            c.execute(f"UPDATE meta SET value = '{SCHEMA_VERSION + 1}' WHERE key = 'schema_version'")
        else:  # a recording whose recorder is alive: this test process plays the recorder
            c.execute(
                "UPDATE session SET status = 'recording', recorder_pid = ?, recorder_start_ticks = ?, boot_id = ?",
                [os.getpid(), process_start_ticks(os.getpid()), boot_id()],
            )
        c.close()
    for cmd in (
        ["stats"],
        ["chains"],
        ["stacks", "--op", "x"],
        ["sql", "SELECT 1"],
        ["mcp", "serve", "--stdio"],
    ):
        assert main([*cmd, "--db", str(p)]) == 5, cmd
        err = capsys.readouterr().err
        assert "error:" in err and needle in err and "Traceback" not in err


def test_help_has_examples(capsys):
    for cmd in (["stats"], ["chains"], ["stacks"], ["sql"], ["breakdown"], ["mcp", "serve"]):
        assert main([*cmd, "--help"]) == 0
        assert "Example:" in capsys.readouterr().out, cmd


def test_mcp_serve_refuses_public_without_token(db, capsys, monkeypatch):
    monkeypatch.delenv("TRACER_MCP_TOKEN", raising=False)
    assert main(["mcp", "serve", "--db", db, "--http", "0.0.0.0:8090"]) == 2
    assert "without a bearer token" in " ".join(capsys.readouterr().err.split())


def test_breakdown(db, capsys):
    # GIVEN the cpu_contention trace; WHEN tracer breakdown runs
    assert main(["breakdown", "--db", db, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    t = out["threads"][0]
    # THEN the training thread comes first with its parts (they add up), the hog among the holders, 1 s buckets
    assert (out["basis"], out["training_tid"], t["role"], out["bucket_s"]) == ("exact", 1000, "training", 1)
    assert abs(sum(p["share"] for p in t["parts"]) - 1) < 1e-3 and t["check"]["gap_pct"] == 0
    assert t["holders"][0]["comm"] == "stress-ng" and len(t["buckets"]) == 60
    assert main(["breakdown", "--db", db, "--bucket", "10"]) == 0
    text = capsys.readouterr().out
    assert "thread 1000 python3" in text and "runq_other" in text and "stress-ng 4242 [other]" in text
    assert "per bucket" in text and "Tracer: the tracer used" in text


def test_breakdown_of_an_older_recording(tmp_path, capsys):
    from tracedb import builder, downgrade_to_v1

    p = tmp_path / "v1.duckdb"
    builder("cpu_contention").write(p)
    downgrade_to_v1(p)
    assert main(["breakdown", "--db", str(p)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Time breakdown (estimated)" in text and "no breakdown in this recording" in text
    for cmd in (["stats"], ["chains"], ["stacks", "--op", "cudaStreamSynchronize"], ["timeline"]):
        assert main([*cmd, "--db", str(p)]) == 0, cmd
    assert "estimated" in capsys.readouterr().out
