"""tracer.views.console: the width rule for terminals and pipes, and messages rich never breaks."""

from __future__ import annotations

import io

from rich.table import Table

from tracer.views.console import PIPED_WIDTH, make_console


def test_piped_without_columns_lays_out_wide(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert make_console().width == PIPED_WIDTH


def test_columns_is_honoured_when_piped(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert make_console().width == 100


def test_a_piped_table_keeps_its_numbers(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    monkeypatch.setattr("sys.stdout", buf)
    t = Table(*[f"column {i}" for i in range(8)])
    t.add_row(*[f"{10**9 + i:,}" for i in range(8)])
    make_console().print(t)
    # at rich's default 80 columns these would be cut to '1,000,…'
    assert all(f"{10**9 + i:,}" in buf.getvalue() for i in range(8))


def test_messages_on_stderr_are_not_broken(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    monkeypatch.setattr("sys.stderr", buf)
    line = "next: tracer stats --db /a/rather/long/path/to/the/recording/of/the/job/trace.duckdb " * 3
    make_console(stderr=True).print(line.strip(), highlight=False)
    assert buf.getvalue() == line.strip() + "\n"
