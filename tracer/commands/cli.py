"""The `tracer` command: parses, dispatches, renders. Each command validates, calls one function, renders.

Only :func:`main` catches :class:`tracer.errors.TracerError`: it prints ``error: ...`` and the hint to stderr and
exits with the error's code, with a traceback only under ``-v``.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:
    import click

from tracer import commands as commands_pkg
from tracer.errors import TracerError

app = typer.Typer(
    name="tracer",
    help="Explain why a GPU training job is slow, from the host side: record CUDA calls and what the host did "
    "meanwhile into DuckDB, then investigate (CLI or MCP).\n\nExample: sudo tracer record --pid 1234",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)
_verbose = 0


@app.callback()
def _global(
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More logging on stderr (-vv: debug)."),
) -> None:
    global _verbose
    _verbose = verbose
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def _register(only: str | None = None) -> None:
    """Add the commands; ``only`` (launch.py): "record", the recording commands alone (`tracer record`/`demo`:
    importing the analyses' command modules is half a second the probes would wait for; the recording imports what
    it analyses when it finishes); "dump", `tracer dump` alone (read at once on a hung job)."""
    from tracer.commands import dump as dump_cmds

    if only == "dump":
        dump_cmds.register(app)
        return
    from tracer.commands import record as record_cmds

    record_cmds.register(app)
    if only == "record":
        return
    from tracer.commands import analysis as analysis_cmds

    analysis_cmds.register(app)

    from tracer.commands import flame as flame_cmds

    flame_cmds.register(app)

    dump_cmds.register(app)


class _FlagHelp:
    """typer's rich help prints the value type after every option, ``<bool>`` even after flags that take no value
    (and ``<int>`` after ``-v``); a flag whose metavar is empty prints nothing there."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for p in self.get_params(ctx):  # type: ignore[attr-defined]
            if getattr(p, "is_flag", False) or getattr(p, "count", False):
                p.metavar = ""
        super().format_help(ctx, formatter)  # type: ignore[misc]


class _Command(_FlagHelp, TyperCommand):
    pass


class _Group(_FlagHelp, TyperGroup):
    pass


def _flag_help(t: typer.Typer) -> None:
    """Build every command and group of ``t`` with the flag-aware help above."""
    t.info.cls = _Group
    for c in t.registered_commands:
        if c.cls in (None, TyperCommand):  # a command with a class of its own keeps it
            c.cls = _Command
    for g in t.registered_groups:
        if g.typer_instance is not None:
            _flag_help(g.typer_instance)


_register(only=commands_pkg.ONLY)
_flag_help(app)


# typer 0.29+ raises the exceptions of the click it vendors, not click's own: take their base from typer's
# BadParameter (BadParameter -> UsageError -> ClickException), whichever click typer runs on
_CLICK_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit code (0 on success)."""
    try:
        app(args=argv, standalone_mode=False)
    except TracerError as e:
        err_console.print(f"[bold red]error:[/] {e.message}", highlight=False)
        if e.hint:
            err_console.print(f"  {e.hint}", highlight=False)
        if _verbose:
            err_console.print_exception()
        return e.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except SystemExit as e:  # typer --help / typer.Exit
        return int(e.code or 0)
    except Exception as e:  # click usage errors carry their own exit codes
        if isinstance(e, _CLICK_ERROR):
            e.show()  # type: ignore[attr-defined]
            return e.exit_code  # type: ignore[attr-defined]
        if isinstance(e, typer.Abort):
            return 130
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
