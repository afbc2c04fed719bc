"""CLI views: exit codes, stdout results only, stderr errors without tracebacks."""

from __future__ import annotations

import json

import duckdb
import pytest
from tracedb import build

from tracer.cli import main
from tracer.schema import SCHEMA_VERSION


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    p = tmp_path_factory.mktemp("cli") / "c.duckdb"
    build("cpu_contention", p)
    return str(p)


def test_stats_json_and_table(db, capsys):
    assert main(["stats", "--db", db, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ops"][0]["op"] == "cudaStreamSynchronize" and out["chains_by_severity"]["HIGH"] == 1
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
    assert json.loads(capsys.readouterr().out)["rows"] == [[3]]


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["stacks", "--op", "nope"], 2, "unknown op 'nope'"),
        (["sql", "DELETE FROM meta"], 2, "not allowed"),
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
        c.execute(
            f"UPDATE meta SET value = '{SCHEMA_VERSION + 1}' WHERE key = 'schema_version'"
            if problem == "newer"
            else "UPDATE session SET status = 'recording'"
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
    for cmd in (["stats"], ["chains"], ["stacks"], ["sql"], ["mcp", "serve"]):
        assert main([*cmd, "--help"]) == 0
        assert "Example:" in capsys.readouterr().out, cmd


def test_mcp_serve_refuses_public_without_token(db, capsys, monkeypatch):
    monkeypatch.delenv("TRACER_MCP_TOKEN", raising=False)
    assert main(["mcp", "serve", "--db", db, "--http", "0.0.0.0:8090"]) == 2
    assert "without a bearer token" in " ".join(capsys.readouterr().err.split())
