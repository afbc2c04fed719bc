"""The CLI's help prints bracketed names as written: typer renders help with rich markup, which took the
interrupt wakers "[timer]" and "[block]" in `tracer waits --help` for style tags and printed "such as  or "
(issue 23). A bracketed name in help text is escaped (``\\\\[timer]``)."""

from __future__ import annotations

import re
from typing import Any

import typer
from typer.testing import CliRunner

from tracer.commands.cli import app

# a bracketed word in help text: rich takes it for a tag unless escaped (a backslash before the bracket)
BRACKETED = re.compile(r"\\?\[([a-z_]+)\]")


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every command under ``cmd`` (a click command or group: typer 0.29+ builds them on the click it vendors)."""
    out = [(path, cmd)]
    if hasattr(cmd, "commands"):
        for name, sub in sorted(cmd.commands.items()):
            out += _commands(sub, (*path, name))
    return out


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    return r.output


def test_waits_help_names_the_interrupt_wakers():
    out = _help("waits")
    assert "[timer]" in out and "[block]" in out, out
    assert "such as  or " not in " ".join(out.split())


def test_every_bracketed_name_in_help_text_is_printed():
    # GIVEN every command's help text and every option's  THEN each bracketed name in it reaches the help
    checked = 0
    for path, cmd in _commands(typer.main.get_command(app)):
        texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
        names = {m for t in texts for m in BRACKETED.findall(t)}
        if not names:
            continue
        out = _help(*path)
        for n in names:
            assert f"[{n}]" in out, (path, n, out)
        checked += 1
    assert checked  # tracer waits has some
