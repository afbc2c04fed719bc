"""`tracer flame`: a flame graph of where the job's threads spent their time outside the moments of CUDA calls,
on CPU (samples) or blocked (exact off-CPU stacks), for speedscope or any folded-stacks viewer.

Registered on the app by tracer.commands.cli, like the analysis commands it shares its options with.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from tracer.commands.analysis import DEFAULT_DB, DbsOption, PidOption, _open, err
from tracer.errors import UsageError
from tracer.newfile import check_new_file


def flame(
    output: Annotated[
        str,
        typer.Option(
            "--output", "-o", help="File to write (default flame-on-cpu.speedscope.json / .folded); '-': stdout."
        ),
    ] = "",
    db: DbsOption = None,
    pid: PidOption = None,
    thread: Annotated[int | None, typer.Option("--thread", help="Only this thread (tid).")] = None,
    on_cpu: Annotated[bool, typer.Option("--on-cpu", help="Where CPU time went (samples; the default).")] = False,
    off_cpu: Annotated[bool, typer.Option("--off-cpu", help="Where threads blocked (exact blocked time).")] = False,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="speedscope: JSON for https://www.speedscope.app (one profile per thread); folded: "
            "'frame;frame ns' lines for flamegraph.pl / inferno-flamegraph.",
        ),
    ] = "speedscope",
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output file.")] = False,
) -> None:
    """Write a flame graph of the threads' stacks outside CUDA calls: on CPU or off CPU.

    Off-CPU stacks end in a frame naming what they waited in: off-cpu gil, io (D: uninterruptible), lock, sleep,
    cuda (inside a CUDA call) or other.

    Example: tracer flame --db trace.duckdb --off-cpu --thread 1234 -o blocked.speedscope.json
    """
    from tracer.analysis.thread_stacks import NoStacks, thread_stacks
    from tracer.views.flame import FORMATS, write

    if on_cpu and off_cpu:
        raise UsageError("--on-cpu and --off-cpu exclude each other", "Pick one (one graph per file).")
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}", f"Use --format {' or '.join(FORMATS)}.")
    mode = "off-cpu" if off_cpu else "on-cpu"
    out = output or f"flame-{mode}.{'speedscope.json' if fmt == 'speedscope' else 'folded'}"
    path = None if out == "-" else Path(out)
    if path is not None:
        check_new_file(path, force)
    with _open(db) as conn:
        try:
            result = thread_stacks(conn, mode, pid=pid, tid=thread, limit=None)
        except NoStacks as e:
            raise UsageError(
                str(e), "Record again with this tracer (without --no-sampling / --no-offcpu-stacks)."
            ) from None
    if not result.stacks:
        raise UsageError(f"no {mode} stacks" + (f" for thread {thread}" if thread else ""), "Check --thread / --pid.")
    name = f"{'+'.join(Path(d).name for d in db or [DEFAULT_DB])} {mode}"
    if path is None:
        import sys

        write(result, fmt, sys.stdout, name)
        return
    # through a temporary file renamed at the end: a failed write never leaves half a file
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            n = write(result, fmt, f, name)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    err.print(
        f"wrote {path}: {n:,} stacks, {result.total_ms / 1e3:,.2f} s {mode}"
        + (f" of thread {thread}" if thread else "")
        + (". Open it at https://www.speedscope.app" if fmt == "speedscope" else "."),
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    app.command()(flame)
