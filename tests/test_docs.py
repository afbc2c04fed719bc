"""The docs cannot drift (issue 31): docs/cli.md is the CLI's real --help, every MCP tool and prompt is in
docs/mcp.md, every link between the pages resolves, and the README is a newcomer's page in the agreed order whose
commands parse, and whose analysis commands run, against a recording."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import anyio
import typer
from mcp import Client
from typer.testing import CliRunner

from mcp_server.server import build_server
from tests.support.scenarios import build
from tracer.commands.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 150
# the README's sections, in the order a newcomer reads them
README_ORDER = (
    "## Requirements",
    "## Set up, test",
    "## The demo",
    "## Record",
    "## Investigate",
    "## Ask an assistant",
)
LINK = re.compile(r"\]\(([^)#]+\.md)\)")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _make_cli():
    return _load("make_cli")


def test_the_command_reference_is_the_cli_s_own_help():
    make_cli = _make_cli()
    assert (DOCS / "cli.md").read_text(encoding="utf-8") == make_cli.render(), (
        "docs/cli.md is stale: run .venv/bin/python docs/make_cli.py"
    )


def test_the_example_outputs_are_what_the_commands_print_now():
    # the examples are regenerated from the scenario recordings: a change to what a command prints shows here
    assert (DOCS / "examples.md").read_text(encoding="utf-8") == _load("make_examples").render(), (
        "docs/examples.md is stale: run .venv/bin/python docs/make_examples.py"
    )


def test_every_command_and_option_is_in_the_command_reference():
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    for path in _make_cli().commands(typer.main.get_command(app)):
        cmd = typer.main.get_command(app)
        for p in path:
            cmd = cmd.commands[p]
        assert f"## `tracer{''.join(' ' + p for p in path)}`" in text, path
        for param in cmd.params:
            if param.param_type_name == "option" and not getattr(param, "hidden", False):
                assert any(o in text for o in param.opts), (path, param.opts)


def test_every_mcp_tool_and_prompt_is_in_the_mcp_page(tmp_path):
    build("healthy", tmp_path / "t.duckdb")

    async def go():
        async with Client(build_server(tmp_path / "t.duckdb")) as c:
            return (await c.list_tools()).tools, (await c.list_prompts()).prompts

    tools, prompts = anyio.run(go)
    text = (DOCS / "mcp.md").read_text(encoding="utf-8")
    missing = [t.name for t in [*tools, *prompts] if f"`{t.name}`" not in text]
    assert not missing, f"docs/mcp.md does not name: {missing}"


def test_every_link_between_the_pages_resolves():
    for page in [README, *DOCS.glob("*.md")]:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            assert (page.parent / target).resolve().is_file(), f"{page.name} links to missing {target}"


def test_the_readme_is_short_and_in_the_newcomer_s_order():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    assert lines[0].startswith("# ") and not lines[1].strip() and lines[2].strip(), "a title, then what it is"
    at = [text.find(h + "\n") for h in README_ORDER]
    assert all(i > 0 for i in at), dict(zip(README_ORDER, at, strict=True))
    assert at == sorted(at), dict(zip(README_ORDER, at, strict=True))
    # the set-up block holds exactly what CI runs
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith(("#", "set", "cd"))]
    setup = text[at[1] :].split("```sh\n", 1)[1].split("```", 1)[0]
    # (the same programs: CI may add quiet flags)
    assert [ln.split("#")[0].split()[0] for ln in setup.splitlines()][:2] == [ln.split()[0] for ln in ci]


def _readme_commands() -> list[list[str]]:
    """The `tracer ...` command lines of the README's sh blocks, as argv after `tracer` (sudo and comments
    dropped)."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(encoding="utf-8"), re.S):
        for line in block.splitlines():
            argv = shlex.split(line.split("#", 1)[0])
            if argv[:1] == ["sudo"]:
                argv = argv[1:]
            if argv[:1] == ["tracer"]:
                out.append(argv[1:])
    return out


def test_every_readme_command_parses_and_the_analysis_ones_run(tmp_path):
    db = tmp_path / "trace.duckdb"
    build("dataloader_starvation", db)
    commands = _readme_commands()
    assert len(commands) >= 6, commands
    group = typer.main.get_command(app)
    for argv in commands:
        cmd, rest = group, list(argv)
        while hasattr(cmd, "commands") and rest and rest[0] in cmd.commands:
            cmd = cmd.commands[rest.pop(0)]
        assert not hasattr(cmd, "commands"), argv
        # the options parse as the CLI parses them (an unknown option or a bad value raises)
        cmd.make_context(
            "tracer", [a for a in rest if a != "--"] if "--" not in rest else rest, resilient_parsing=False
        )
        if {"--db"} <= set(rest) and argv[0] not in {"record", "mcp", "demo"}:
            args = [str(db) if a == "trace.duckdb" else a for a in argv]
            r = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
            assert r.exit_code == 0, (argv, r.output)
            assert r.output.strip(), argv
