"""tracer.errors: what an error may show of its input (echo) and of the server's directories (redact), the one
rule the MCP tools and run_sql's query workers both apply (issue 30: errors named the server's paths)."""

from __future__ import annotations

import os
from pathlib import Path

from tracer.errors import echo, hidden_directories, redact


def test_echo_quotes_a_short_value_whole_and_cuts_a_long_one():
    assert echo("cudaMalloc") == "'cudaMalloc'"
    long = echo("y" * 1_000_000)
    assert long.startswith("'" + "y" * 80 + "'…") and long.endswith("(1,000,000 characters)") and len(long) < 120


def test_a_served_file_is_named_relative_and_the_directory_is_not_named(tmp_path: Path):
    runs = tmp_path / "runs"
    runs.mkdir()
    hidden = hidden_directories([runs])
    text = redact(f"cannot open {runs}/a.duckdb; {runs} is full; {runs}.old and {runs}x are other files", hidden)
    assert text == (
        f"cannot open a.duckdb; the served directory is full; {tmp_path}/runs.old and {tmp_path}/runsx are other files"
    )


def test_a_link_to_the_directory_is_hidden_by_both_names(tmp_path: Path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    hidden = hidden_directories([tmp_path / "link"])
    assert redact(f"{tmp_path}/link/a.duckdb and {real}/b.duckdb", hidden) == "a.duckdb and b.duckdb"


def test_the_deeper_directory_goes_first_and_home_becomes_tilde(tmp_path: Path):
    inner = tmp_path / "a" / "b"
    hidden = hidden_directories([tmp_path, inner])
    assert hidden[0] == str(inner)  # else /x/a/b/f would read a/b/f
    assert redact(f"{inner}/f.duckdb", hidden) == "f.duckdb"
    home = os.path.expanduser("~")
    assert redact(f"{home}/.cache/x", ()) == "~/.cache/x"


def test_the_root_is_never_hidden():
    assert hidden_directories(["/"]) == ()
