"""`tracer dump`: what every thread of a process tree is doing now (Python frames, kernel state, rank), read
without stopping any process. A thin view over tracer.snapshot."""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer

from tracer.errors import TargetError


def _ms(ns: int | None) -> str:
    return "?" if ns is None else f"{ns / 1e6:.0f} ms" if ns < 10**10 else f"{ns / 1e9:.0f} s"


def dump(
    pid: Annotated[int, typer.Option("--pid", "-p", help="The process whose tree to read (children included).")],
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON list: per thread tid, pid, name, rank, state, "
            "syscall, wchan, idle_ns, native, frames [{function, file, line}] "
            "innermost first (comparable to py-spy dump --json).",
        ),
    ] = False,  # fmt: skip
) -> None:
    """Show what every thread of PID and its children is doing now: Python stack (innermost last here, first in
    --json), kernel state (running, or sleeping in which system call on which wait channel, off CPU for how long:
    since the scheduler last ran it) and rank. The processes are never stopped: their memory is read as it runs,
    so a stack may be torn (marked partial)."""
    from rich.console import Console

    from tracer.snapshot.dump import Dumper

    if not os.path.exists(f"/proc/{pid}"):
        raise TargetError(f"no process {pid}")
    if not os.access(f"/proc/{pid}/mem", os.R_OK):
        raise TargetError(f"cannot read process {pid}'s memory: run as root or as its owner")
    threads = Dumper().tree(pid)
    if as_json:
        typer.echo(json.dumps([t.as_json() for t in threads], indent=1))
        return
    con = Console(highlight=False)
    for t in threads:
        rank = f" rank {t.rank}" if t.rank is not None else ""
        where = f" in {t.syscall}" if t.syscall else ""
        wchan = f" on {t.wchan}" if t.wchan else ""
        since = f", off CPU {_ms(t.idle_ns)}" if t.idle_ns else ""
        con.print(f"[bold]Thread {t.tid}[/] ({t.name}) pid {t.pid}{rank}: {t.state}{where}{wchan}{since}")
        for f in reversed(t.frames):
            con.print(f"    {f.function} ({f.file}:{f.line})")
        if t.native:
            con.print(f"    [dim]native: {t.native}[/]")
        if t.partial:
            con.print("    [dim](stack torn by a concurrent change: partial)[/]")


def register(app: typer.Typer) -> None:
    app.command()(dump)
