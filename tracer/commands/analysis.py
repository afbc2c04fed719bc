"""`tracer stats|chains|stacks|sql` and `tracer mcp serve` (registered on the app by tracer.cli).

Each command opens the DB read-only (:func:`tracer.db.open_trace`), calls one analysis function and renders
the
record: rich on stdout, or ``--json``. Errors are :class:`tracer.errors.TracerError`s, printed by
``tracer.cli.main``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tracer.errors import UsageError

DbOption = Annotated[Path, typer.Option("--db", help="Trace DB written by `tracer record`.")]
PidOption = Annotated[int | None, typer.Option("--pid", help="Only this process (default: the whole tree).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON (the MCP tool's output).")]
DEFAULT_DB = Path("trace.duckdb")

# wide enough for the per-op table when piped (rich defaults to 80 columns off a terminal)
out = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


def _open(db: Path):  # noqa: ANN202
    from tracer.db import open_trace

    return open_trace(db)


def _print(record, as_json: bool) -> None:  # noqa: ANN001
    from tracer.render import print_record

    print_record(record, out, as_json=as_json)


def stats(db: DbOption = DEFAULT_DB, pid: PidOption = None, json: JsonOption = False) -> None:
    """Show the trace overview: environment, per-op latency (p50/p95/p99/max, tail ratio), processes, host
    peaks.

    Example: tracer stats --db trace.duckdb --pid 12004
    """
    from tracer.analysis.stats import trace_stats

    with _open(db) as conn:
        _print(trace_stats(conn, pid=pid), json)


def chains(
    db: DbOption = DEFAULT_DB,
    pid: PidOption = None,
    severity: Annotated[
        str | None,
        typer.Option("--severity", help="Only chains of this severity: high, medium or low."),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Show at most N chains.")] = 10,
    json: JsonOption = False,
) -> None:
    """Show causal chains, worst first: what was slow, the measured evidence, and numbered fixes.

    Example: tracer chains --db trace.duckdb --severity high
    """
    from tracer.analysis.chains import compute_chains

    if severity is not None and severity.lower() not in ("high", "medium", "low"):
        raise UsageError(f"unknown severity {severity!r}", "Use --severity high, medium or low.")
    with _open(db) as conn:
        _print(compute_chains(conn, pid=pid, severity=severity, limit=limit), json)


def stacks(
    op: Annotated[str, typer.Option("--op", help="CUDA op, e.g. cudaMalloc, cudaStreamSynchronize.")],
    db: DbOption = DEFAULT_DB,
    pid: PidOption = None,
    limit: Annotated[int, typer.Option("--limit", help="Show the N most frequent stacks.")] = 10,
    json: JsonOption = False,
) -> None:
    """Show the call stacks of one op, Python file:line -> native -> CUDA, ranked by calls.

    Example: tracer stacks --db trace.duckdb --op cudaMalloc --limit 5
    """
    from tracer.analysis.stacks import UnknownOp, top_stacks

    with _open(db) as conn:
        try:
            res = top_stacks(conn, op, pid=pid, limit=limit)
        except UnknownOp as e:
            raise UsageError(
                str(e), f"Pass one of them with --op, e.g. --op {e.known[0] if e.known else 'cudaMalloc'}"
            ) from None
    _print(res, json)


def sql(
    query: Annotated[str, typer.Argument(help="One read-only statement (SELECT/WITH/DESCRIBE/SHOW/...).")],
    db: DbOption = DEFAULT_DB,
    limit: Annotated[int, typer.Option("--limit", help="Return at most N rows.")] = 1000,
    timeout: Annotated[float, typer.Option("--timeout", help="Interrupt the query after S seconds.")] = 10.0,
    json: JsonOption = False,
) -> None:
    """Run one read-only SQL statement on the trace DB (no writes, no file or network access).

    Example: tracer sql --db trace.duckdb "SELECT op, count(*) FROM cuda_calls GROUP BY op"
    """
    from tracer.analysis.sql import run_sql

    _print(run_sql(db, query, limit=limit, timeout_s=timeout), json)


def timeline(
    db: DbOption = DEFAULT_DB,
    pid: PidOption = None,
    bucket: Annotated[int, typer.Option("--bucket", help="Bucket width in seconds.")] = 10,
    around: Annotated[
        float | None,
        typer.Option("--around", help="Instead of buckets: every event within --window of this time (s since start)."),
    ] = None,
    window: Annotated[float, typer.Option("--window", help="Half-width of --around, in ms.")] = 5.0,
    json: JsonOption = False,
) -> None:
    """Show when things happened: calls, syncs, off-CPU time and preemptions per time bucket, or a microsecond
    timeline of every call, off-CPU interval and process event around one instant (a stall).

    Example: tracer timeline --db trace.duckdb --bucket 10   ·   tracer timeline --db trace.duckdb --around 42.37
    """
    from tracer.analysis.timeline import around as around_fn
    from tracer.analysis.timeline import buckets

    with _open(db) as conn:
        if around is None:
            _print(buckets(conn, seconds=bucket, pid=pid), json)
        else:
            _print(around_fn(conn, int(around * 1e9), window_ms=window, pid=pid), json)


mcp_app = typer.Typer(
    help="Serve the trace to an AI assistant over MCP.\n\nExample: tracer mcp serve --db trace.duckdb --http :8090",
    no_args_is_help=True,
)


@mcp_app.command("serve")
def mcp_serve(
    db: DbOption = DEFAULT_DB,
    http: Annotated[
        str | None,
        typer.Option(
            "--http",
            help="Serve streamable HTTP at http://HOST:PORT/mcp; ':8090' = 127.0.0.1:8090. A non-loopback "
            "HOST needs a bearer token.",
        ),
    ] = None,
    stdio: Annotated[bool, typer.Option("--stdio", help="Serve over stdin/stdout (the default).")] = False,
    token_file: Annotated[
        Path | None,
        typer.Option("--token-file", help="File holding the bearer token (or set TRACER_MCP_TOKEN)."),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option("--allow-host", help="Extra Host header value clients use (e.g. gpu-box:8090); repeatable."),
    ] = None,
) -> None:
    """Serve get_trace_stats, get_causal_chains, get_stacks and run_sql over MCP (stdio or streamable HTTP).

    Example: tracer mcp serve --db trace.duckdb --http :8090   (then: claude mcp add --transport http tracer
    http://127.0.0.1:8090/mcp)
    """
    from mcp_server.http import parse_listen, read_token, serve_http, serve_stdio
    from tracer.db import open_trace

    if http and stdio:
        raise UsageError("--http and --stdio are exclusive", "Pick one transport.")
    open_trace(db).close()  # fail now, with the reason, rather than on the first tool call
    if http is None:
        serve_stdio(db)
        return
    host, port = parse_listen(http)
    token = read_token(token_file, os.environ.get("TRACER_MCP_TOKEN"))
    serve_http(db, host, port, token=token, allowed_hosts=allow_host or [], log=err)


def register(app: typer.Typer) -> None:
    """Add the analysis commands and the `mcp` group to ``app``."""
    for f in (stats, chains, stacks, sql, timeline):
        app.command()(f)
    app.add_typer(mcp_app, name="mcp")
