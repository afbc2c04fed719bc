"""The `tracer` command: parses, dispatches, renders. Each command validates, calls one function, renders.

Only :func:`main` catches :class:`tracer.errors.TracerError`: it prints ``error: ...`` and the hint to stderr and
exits with the error's code, with a traceback only under ``-v``.
"""

from __future__ import annotations

import logging
import sys

import typer
from rich.console import Console

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


def _register() -> None:
    from tracer.commands import record as record_cmds

    record_cmds.register(app)

    from tracer.commands import analysis as analysis_cmds

    analysis_cmds.register(app)


_register()


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
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            return e.exit_code
        if isinstance(e, click.exceptions.Abort):
            return 130
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
