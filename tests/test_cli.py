"""tracer.commands.cli: flags render without a value type in --help; results keep their numbers when piped; --all."""

from __future__ import annotations

import pytest
from tracedb import build

from tracer.commands.cli import main


@pytest.fixture(scope="module")
def churn(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("cli") / "churn.duckdb"
    build("process_churn", p)
    return str(p)


@pytest.mark.parametrize("cmd", [[], ["stats"], ["export"], ["record"], ["mcp", "serve"]])
def test_flags_show_no_value_type(cmd, capsys):
    assert main([*cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--help" in out and "<bool>" not in out, out
    if cmd == []:
        assert "<int>" not in out  # -v counts, it takes no value


def test_options_that_take_a_value_still_show_its_type(capsys):
    assert main(["export", "--help"]) == 0
    out = capsys.readouterr().out
    assert "<float>" in out and "<int>" in out and "Example:" in out


def test_stats_groups_the_respawned_workers(churn, capsys):
    assert main(["stats", "--db", churn]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("python3", "pt_data_worker"))]
    # process_churn: the main process and 6 epochs x 4 workers
    assert len(rows) == 2 and " 24 " in rows[1] and "20 exited" in rows[1]  # the last epoch's 4 outlive it
    assert "processes grouped by (comm, parent, role, rank); one row each: tracer stats --all" in " ".join(out.split())


def test_stats_all_has_a_row_per_process(churn, capsys):
    assert main(["stats", "--db", churn, "--all"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("pt_data_worker") for line in out.splitlines()) == 24
    assert "grouped" not in out


def test_piped_stats_keep_their_numbers(churn, capsys, monkeypatch):
    # capsys' stdout is no terminal: the table is laid out wide, numbers are whole
    assert main(["stats", "--db", churn]) == 0
    out = capsys.readouterr().out
    assert "…," not in out and "cudaStreamSynchronize" in out and "pt_data_worker" in out


@pytest.mark.parametrize("argv", [["export", "--bogus"], ["stats", "--pid", "x"], ["nosuchcommand"]])
def test_usage_errors_exit_2_without_a_traceback(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("No such" in err or "Invalid value" in err), err


def test_a_db_path_that_cannot_be_written_is_refused_before_recording_is_announced(tmp_path, capsys):
    # GIVEN --db in a directory that does not exist  WHEN `tracer record` runs  THEN it exits 5 with what to do,
    # and never said it was recording into it
    assert main(["record", "--db", str(tmp_path / "nowhere" / "t.duckdb"), "--", "true"]) == 5
    err = capsys.readouterr().err
    assert "no directory" in err and "mkdir -p" in err and "--db" in err, err
    assert "recording into" not in err and "Traceback" not in err
