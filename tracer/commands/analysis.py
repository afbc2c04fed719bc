"""`tracer stats|chains|stacks|sql|timeline|breakdown|ranks|steps|waits|compare-processes|compare|export` and
`tracer mcp serve` (registered on the app by tracer.commands.cli).

Each command opens the DB read-only (:func:`tracer.analysis.db.open_trace`), calls one analysis function and renders the
record: rich on stdout, or ``--json``. Errors are :class:`tracer.errors.TracerError`s, printed by
``tracer.commands.cli.main``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from tracer.analysis.arguments import check_args, job_pid
from tracer.errors import UsageError
from tracer.newfile import check_new_file
from tracer.views.console import make_console

DbOption = Annotated[
    Path,
    typer.Option(
        "--db",
        help="Trace DB written by `tracer record`, or a dataset directory from `tracer export --format parquet`.",
    ),
]
# the analyses' --db: one recording as DbOption, or several analysed as one job (tracer.analysis.job)
DbsOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--db",
        help="Trace DB written by `tracer record` (default trace.duckdb), or a dataset directory from `tracer "
        "export --format parquet`. Several recordings of one job (a host each): repeat --db, or pass a directory "
        "of *.duckdb files or a quoted glob ('runs/*.duckdb').",
        show_default=False,
    ),
]
PidOption = Annotated[int | None, typer.Option("--pid", help="Only this process (default: the whole tree).")]
ContainerOption = Annotated[
    str | None,
    typer.Option(
        "--container",
        help="Only this container's job, instead of --pid: a container id (12+ hex digits, as docker ps or crictl ps "
        "show it) or a pod name; its process that made CUDA calls (a node agent's recording).",
    ),
]
RankOption = Annotated[
    int | None,
    typer.Option("--rank", help="Only this rank's process, instead of --pid (a distributed job; see tracer ranks)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON (the MCP tool's output).")]
DEFAULT_DB = Path("trace.duckdb")

out = make_console()
err = make_console(stderr=True)


@contextmanager
def _open(db: Path | list[Path] | None) -> Iterator[Any]:
    """Yield a read-only connection to the trace DB (several: the job they make, whose alignment is said on
    stderr); say on stderr when its recording did not finish.

    A read that fails inside DuckDB (a damaged file, or one changed while read) becomes one clear StoreError.
    """
    import duckdb

    from tracer.analysis.db import open_trace, read_error, recording_state, thinned_note
    from tracer.analysis.job import job_alignment

    dbs = db if isinstance(db, list) else [db or DEFAULT_DB]
    conn = open_trace(dbs[0] if len(dbs) == 1 else dbs)  # one --db: exactly as before
    failed = None
    try:
        state = recording_state(conn)
        if not state.finished:
            err.print(f"[yellow]note:[/] {state.ended}", highlight=False)
        if thinned := thinned_note(conn):
            err.print(f"[yellow]note:[/] {thinned}", highlight=False)
        job = job_alignment(conn)
        if job is not None:
            err.print(f"[dim]{job.note}[/]", highlight=False)
        yield conn
    except duckdb.Error as e:
        failed = read_error(", ".join(str(d) for d in dbs), e)
    finally:
        conn.close()
    if failed is not None:  # raised outside the except block: one error line, no DuckDB traceback
        raise failed


def _print(record, as_json: bool) -> None:
    from tracer.views.render import print_record

    print_record(record, out, as_json=as_json)


def stats(
    db: DbsOption = None,
    pid: PidOption = None,
    rank: RankOption = None,
    container: ContainerOption = None,
    show_all: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Every process, one row each (default: grouped by name, parent, role and rank; the top groups).",
        ),
    ] = False,
    json: JsonOption = False,
) -> None:
    """Show the trace overview: environment, per-op latency (p50/p95/p99/max, tail ratio), processes, host
    peaks.

    Example: tracer stats --db trace.duckdb --pid 12004
    """
    from tracer.analysis.stats import trace_stats
    from tracer.views.render import print_record

    with _open(db) as conn:
        pid = job_pid(conn, pid=pid, rank=rank, container=container)
        check_args(conn, pid=pid)
        print_record(trace_stats(conn, pid=pid, detail=show_all), out, as_json=json, show_all=show_all)


def chains(
    db: DbsOption = None,
    pid: PidOption = None,
    rank: RankOption = None,
    container: ContainerOption = None,
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

    with _open(db) as conn:
        pid = job_pid(conn, pid=pid, rank=rank, container=container)
        check_args(conn, pid=pid, severity=severity, limit=limit)
        _print(compute_chains(conn, pid=pid, severity=severity, limit=limit), json)


def stacks(
    op: Annotated[str, typer.Option("--op", help="CUDA op, e.g. cudaMalloc, cudaStreamSynchronize.")],
    db: DbsOption = None,
    pid: PidOption = None,
    limit: Annotated[int, typer.Option("--limit", help="Show the N most frequent stacks.")] = 10,
    json: JsonOption = False,
) -> None:
    """Show the call stacks of one op, Python file:line -> native -> CUDA, ranked by calls.

    Example: tracer stacks --db trace.duckdb --op cudaMalloc --limit 5
    """
    from tracer.analysis.stacks import UnknownOp, top_stacks

    with _open(db) as conn:
        check_args(conn, pid=pid, limit=limit)
        try:
            res = top_stacks(conn, op, pid=pid, limit=limit)
        except UnknownOp as e:
            raise UsageError(
                str(e), f"Pass one of them with --op, e.g. --op {e.known[0] if e.known else 'cudaMalloc'}"
            ) from None
    _print(res, json)


def sql(
    query: Annotated[str, typer.Argument(help="One read-only statement (SELECT/WITH/DESCRIBE/SHOW/...).")],
    db: DbsOption = None,
    limit: Annotated[int, typer.Option("--limit", help="Return at most N rows.")] = 1000,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Stop the query after S seconds, even inside one long function call.")
    ] = 10.0,
    json: JsonOption = False,
) -> None:
    """Run one read-only SQL statement on the trace DB (no writes, no file or network access).

    The query runs in a worker process under the run_sql limits (README: run_sql limits): the wall clock of
    --timeout, 768 MiB of memory, about 1 MiB of rows, text values cut at 16,384 characters.

    Example: tracer sql --db trace.duckdb "SELECT op, count(*) FROM cuda_calls GROUP BY op"
    """
    if db is not None and len(db) > 1:  # a repeated --db: refused, not the last one queried silently
        raise UsageError(
            f"tracer sql reads one recording, and {len(db)} were given",
            "Query each with its own --db; the other commands (tracer ranks, stats, chains, ...) take a job's "
            "recordings together.",
        )
    one = db[0] if db else DEFAULT_DB
    from tracer.analysis.sql.pool import default_pool

    default_pool().spawn(one)  # the query worker starts while this process imports the rest
    from tracer.analysis.sql.run import run_sql

    _print(run_sql(one, query, limit=limit, timeout_s=timeout), json)


def timeline(
    db: DbsOption = None,
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
        check_args(conn, pid=pid, bucket_s=bucket)
        if around is None:
            _print(buckets(conn, seconds=bucket, pid=pid), json)
        else:
            _print(around_fn(conn, int(around * 1e9), window_ms=window, pid=pid), json)


def export(
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            help="File to write: .json, or .json.gz compressed; '-' writes to stdout (default trace.json). "
            "--format parquet or --per-rank: the directory (created if missing; several hosts' recordings share it).",
        ),
    ] = None,
    db: DbsOption = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="chrome: trace-event JSON (ui.perfetto.dev, chrome://tracing, HTA). parquet: every table as a "
            "hive-partitioned Parquet dataset, DIR/host=<host>/rank=<rank>/<table>_0.parquet (a table without a "
            "pid: under host=<host>/), for DuckDB, Spark or `tracer … --db DIR`.",
        ),
    ] = "chrome",
    start: Annotated[
        float | None, typer.Option("--start", help="Window start, seconds since the recording began.")
    ] = None,
    end: Annotated[float | None, typer.Option("--end", help="Window end, seconds since the recording began.")] = None,
    max_events: Annotated[
        int,
        typer.Option(
            "--max-events",
            help="Most CUDA calls and off-CPU intervals to write, the longest kept first (about 250 bytes each); "
            "0: no limit. What is left out is said on stderr and in the file.",
        ),
    ] = 1_000_000,  # tracer.views.export.DEFAULT_MAX_EVENTS (a test holds them equal; importing it here costs 0.5 s)
    force: Annotated[
        bool,
        typer.Option("--force", help="Overwrite an existing output file (parquet: this host's partition)."),
    ] = False,
    per_rank: Annotated[
        bool,
        typer.Option(
            "--per-rank",
            help="A distributed job: one file per rank, DIR/rank<R>.json, led by its distributedInfo (rank, "
            "world_size), the directory Holistic Trace Analysis loads as a job; a launcher is in no file. "
            "--max-events bounds each file.",
        ),
    ] = False,
    json: Annotated[bool, typer.Option("--json", help="Print what was written as JSON on stdout.")] = False,
) -> None:
    """Write the recording as a timeline for a viewer: CUDA calls, off-CPU slices with who held the CPU,
    each thread's on-CPU samples (its top lines per second), process events, chains and host counters, in the
    trace-event JSON of the PyTorch profiler.

    Open the file in https://ui.perfetto.dev or chrome://tracing, or load it with Holistic Trace Analysis.

    Several --db (a job's recordings, a host each): one timeline on the job's clock (--per-rank: one file per rank,
    lined up across hosts); with --format parquet, each recording as its host's partition.

    With --format parquet: every table, as a Parquet dataset several hosts share (host=/rank= partitions, read
    with DuckDB or given back to any tracer command as --db DIR: several hosts there are the job).

    With --per-rank: one file per rank in a directory every host of the job can export into, for HTA's
    TraceAnalysis(trace_dir=DIR).

    Example: tracer export --db trace.duckdb -o trace.json --start 20 --end 40
    """
    if fmt == "parquet":
        if per_rank:
            raise UsageError("--per-rank applies to --format chrome", "A Parquet dataset is partitioned by rank.")
        _export_parquet(db, output, start, end, force, json)
        return
    from tracer.views.export import FORMATS, export_trace

    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}", f"Use --format {' or '.join((*FORMATS, 'parquet'))}.")
    output = output or ("trace.json" if not per_rank else "")
    if start is not None and start < 0:
        raise UsageError(f"--start {start:g} is before the recording began", "Pass seconds since its start, >= 0.")
    if start is not None and end is not None and end <= start:
        raise UsageError(f"--end {end:g} is not after --start {start:g}", "Pass a window with end > start.")
    if max_events < 0:
        raise UsageError(f"--max-events {max_events} is negative", "Pass a count, or 0 for no limit.")
    if per_rank:
        _export_ranks(db, output, start, end, max_events, force, json)
        return
    path = None if output == "-" else Path(output)
    if path is None and json:
        raise UsageError("--json and -o - both write to stdout", "Write the trace to a file, or drop --json.")
    if path is not None:
        check_new_file(path, force)
    with _open(db) as conn:
        summary = export_trace(conn, path, fmt=fmt, start_s=start, end_s=end, max_events=max_events or None)
    for note in summary.notes:
        err.print(f"[yellow]note:[/] {note}", highlight=False)
    if path is not None:
        n = sum(summary.events.values())
        err.print(
            f"wrote {path}: {n:,} events ({summary.calls_written:,} CUDA calls, {summary.off_cpu_written:,} off-CPU "
            f"intervals, t = {summary.window_start_s:.1f}-{summary.window_end_s:.1f} s). Open it in "
            "https://ui.perfetto.dev or chrome://tracing.",
            highlight=False,
        )
    if json:
        _print(summary, True)


def _export_ranks(
    db: Path, output: str, start: float | None, end: float | None, max_events: int, force: bool, json: bool
) -> None:
    """`tracer export --per-rank`: one Chrome trace per rank into the directory ``output``."""
    if not output or output == "-":
        raise UsageError("--per-rank writes a directory", "Pass it with -o DIR, e.g. -o traces/.")
    directory = Path(output)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory} is not a directory", "Pass a directory with -o DIR.")
    from rich.markup import escape

    from tracer.views.export import export_ranks

    with _open(db) as conn:
        summary = export_ranks(conn, directory, start_s=start, end_s=end, max_events=max_events or None, force=force)
    for f in summary.files:
        for note in f.notes:
            err.print(f"[yellow]note:[/] {Path(f.path).name}: {note}", highlight=False)
    if summary.left_out:
        err.print(
            f"[yellow]note:[/] in no rank's file (no rank): {escape(', '.join(summary.left_out))}; the whole export "
            "(without --per-rank) has them.",
            highlight=False,
        )
    n = sum(sum(f.events.values()) for f in summary.files)
    err.print(
        f"wrote {len(summary.files)} files into {directory} (ranks {', '.join(map(str, summary.ranks))} of "
        f"{summary.world_size}): {n:,} events. Load them with Holistic Trace Analysis, "
        f"TraceAnalysis(trace_dir={str(directory)!r}), or open each in https://ui.perfetto.dev.",
        highlight=False,
    )
    if json:
        _print(summary, True)


def _export_parquet(
    db: list[Path] | None, output: str | None, start: float | None, end: float | None, force: bool, json: bool
) -> None:
    """`tracer export --format parquet`: each recording's tables into the dataset directory ``output``, as its
    host's partition (several --db: a job's hosts, one after the other)."""
    if output is None or output == "-":
        raise UsageError("--format parquet writes a directory", "Pass it with -o DIR, e.g. -o dataset/.")
    if start is not None or end is not None:
        raise UsageError("--start/--end apply to --format chrome", "A Parquet export holds the whole recording.")
    from tracer.analysis.db import recordings
    from tracer.views.export.parquet import export_parquet

    summaries = []
    for one in recordings(db or [DEFAULT_DB]):
        summary = export_parquet(one, Path(output), force=force)
        for note in summary.notes:
            err.print(f"[yellow]note:[/] {note}", highlight=False)
        ranks = ", ".join("none" if r is None else str(r) for r in summary.ranks)
        err.print(
            f"wrote {summary.partition}: {sum(summary.rows.values()):,} rows of {len(summary.rows)} tables in "
            f"{summary.files} files{f' (ranks {ranks})' if ranks else ''}"
            f"{', replacing the earlier export' if summary.replaced else ''}. Query it with "
            f"`tracer stats --db {output}` or DuckDB's read_parquet (see {summary.path}/schema.json).",
            highlight=False,
        )
        summaries.append(summary)
    if json and len(summaries) == 1:
        _print(summaries[0], True)
    elif json:  # one JSON array: each recording's summary
        import json as js

        out.out(js.dumps([js.loads(x.model_dump_json()) for x in summaries], indent=2), highlight=False)


def breakdown(
    db: DbsOption = None,
    pid: PidOption = None,
    rank: RankOption = None,
    container: ContainerOption = None,
    tid: Annotated[
        int | None, typer.Option("--tid", help="Only this thread (default: every thread that made CUDA calls).")
    ] = None,
    bucket: Annotated[
        int, typer.Option("--bucket", help="Bucket width in seconds for the per-bucket rows (0: about 60 buckets).")
    ] = 0,
    json: JsonOption = False,
) -> None:
    """Show where each CUDA thread's time went, the training thread first: on CPU, inside CUDA calls (launch,
    sync incl. synchronous copies, alloc, free, copy), waiting for a CPU and who held it (own process, own
    workers, other processes, the tracer), blocked and who woke it; page faults of every thread of its process;
    per time bucket; and what the tracer itself cost.

    Example: tracer breakdown --db trace.duckdb --bucket 10   ·   tracer breakdown --db trace.duckdb --tid 12006
    """
    from tracer.analysis.breakdown import time_breakdown

    with _open(db) as conn:
        pid = job_pid(conn, pid=pid, rank=rank, container=container)
        check_args(conn, pid=pid, tid=tid, bucket_s=bucket)
        _print(time_breakdown(conn, pid=pid, tid=tid, bucket_s=bucket), json)


def ranks(db: DbsOption = None, json: JsonOption = False) -> None:
    """Show each rank of a distributed job (torchrun, MPI, Slurm: read from the processes' environment) over the
    steps they all ran: its training thread's time by phase (on CPU, asleep, waiting for a CPU, for the GPU, in
    collectives, ...), per step, and the straggler rank the others wait for, with its slow phase.

    Example: tracer ranks --db trace.duckdb   ·   tracer ranks --db trace.duckdb --json
    """
    from tracer.analysis.ranks.report import ranks_report

    with _open(db) as conn:
        _print(ranks_report(conn), json)


TidOption = Annotated[
    int | None, typer.Option("--tid", help="This thread (default: --pid's main CUDA thread, or the training thread).")
]


def steps(
    db: DbsOption = None,
    pid: PidOption = None,
    tid: TidOption = None,
    detail: Annotated[bool, typer.Option("--detail", help="With --json: every step's ms too.")] = False,
    json: JsonOption = False,
) -> None:
    """Show a thread's step times: steps ended by its waits for the GPU (the loop's period), the typical step,
    the slow steps and their period ("every 40th step: +54 ms") with what they spent the extra time on.

    Example: tracer steps --db trace.duckdb   ·   tracer steps --db trace.duckdb --tid 12006 --json --detail
    """
    from tracer.analysis.steps import step_series

    with _open(db) as conn:
        check_args(conn, pid=pid, tid=tid)
        _print(step_series(conn, pid=pid, tid=tid, detail=detail), json)


def waits(db: DbsOption = None, pid: PidOption = None, tid: TidOption = None, json: JsonOption = False) -> None:
    """Show how long a thread's waits were, by who ended them: per waker (a thread, a worker, an interrupt such
    as \\[timer] or \\[block]) its exact wakeups and blocked time, the typical and longest wait, and a histogram.

    Example: tracer waits --db trace.duckdb   ·   tracer waits --db trace.duckdb --tid 12006
    """
    from tracer.analysis.waits import waits as waits_of

    with _open(db) as conn:
        check_args(conn, pid=pid, tid=tid)
        _print(waits_of(conn, pid=pid, tid=tid), json)


def compare_processes(
    pids: Annotated[
        list[int] | None, typer.Option("--pid", help="A process to show; repeat it (default: every CUDA process).")
    ] = None,
    threads_of: Annotated[
        int | None, typer.Option("--threads-of", help="Instead: the threads of this process, busiest first.")
    ] = None,
    db: DbsOption = None,
    json: JsonOption = False,
) -> None:
    """Show processes (by the thread that does their work) or the threads of one process side by side: one column
    each, one row per measure (the breakdown's shares, steps, top waker and CPU holder).

    Example: tracer compare-processes --db trace.duckdb   ·   tracer compare-processes --pid 4011 --pid 4012
    """
    from tracer.analysis.side_by_side import compare_processes as side_by_side

    with _open(db) as conn:
        for p in [*(pids or []), *([threads_of] if threads_of is not None else [])]:
            check_args(conn, pid=p)
        _print(side_by_side(conn, pids=pids or None, threads_of=threads_of), json)


def compare(
    before: Annotated[Path, typer.Argument(help="The recording before the change (a trace DB).")],
    after: Annotated[Path, typer.Argument(help="The recording after it, of the same workload.")],
    json: JsonOption = False,
) -> None:
    """Compare two recordings of the same workload, before and after a change: steps/s, where the training
    thread's time went, per-op calls/s, time and p50/p99, and the causal chains that appeared, went away or
    changed. Each difference is judged against the recordings' own second-to-second variance (the test is named
    in the output); record 10 s or more of the loop on each side.

    Each recording's training thread is found on its own (their pids differ), so there is no --pid.

    Example: tracer compare before.duckdb after.duckdb   ·   tracer compare before.duckdb after.duckdb --json
    """
    from tracer.analysis.compare import compare_traces, names_of

    name_b, name_a = names_of([str(before), str(after)])
    with _open(before) as conn_b, _open(after) as conn_a:
        same = before.resolve() == after.resolve()
        res = compare_traces(conn_b, conn_a, before_name=name_b, after_name=name_a, same_file=same)
    _print(res, json)


mcp_app = typer.Typer(
    help="Serve the trace to an AI assistant over MCP.\n\nExample: tracer mcp serve --db trace.duckdb --http :8090",
    no_args_is_help=True,
)


# rich keeps a help text's line breaks: each paragraph is one line
MCP_SERVE_HELP = "\n\n".join(
    [
        "Serve the recording to an AI assistant over MCP (stdio or streamable HTTP at /mcp).",
        "Tools: get_trace_stats (start here), get_causal_chains, get_time_breakdown, get_step_series, get_waits, "
        "get_stacks, get_thread_stacks, get_thread_dump, get_ranks, compare_processes, compare_traces and run_sql "
        "(read-only SQL); "
        "the schema as the resource trace://schema, and the investigate prompt.",
        "Example: tracer mcp serve --db trace.duckdb --http :8090",
        "Then: claude mcp add --transport http tracer http://127.0.0.1:8090/mcp",
    ]
)


@mcp_app.command("serve", help=MCP_SERVE_HELP)
def mcp_serve(
    db: DbsOption = None,
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
    live: Annotated[
        bool,
        typer.Option(
            "--live",
            help="Serve snapshots of a recording in progress (started by `tracer record --mcp-http`; --db is the "
            "snapshot file, refreshed before each tool call).",
        ),
    ] = False,
) -> None:
    """Serve the recording to an AI assistant over MCP (help: MCP_SERVE_HELP)."""
    from mcp_server.http import parse_listen, read_token, serve_http, serve_stdio
    from tracer.analysis.db import open_trace

    if http and stdio:
        raise UsageError("--http and --stdio are exclusive", "Pick one transport.")
    dbs = db or [DEFAULT_DB]
    if live and len(dbs) > 1:
        raise UsageError("--live serves one recording in progress", "Pass one --db with --live.")
    source: Path | list[Path] = dbs[0] if len(dbs) == 1 else dbs  # several: a job (run_sql refuses it)
    freshen = None
    if live:
        from tracer.live import freshen as live_freshen
        from tracer.live import wait_for_snapshot

        if not wait_for_snapshot(dbs[0]):
            raise UsageError(f"no live snapshot appeared at {dbs[0]}", "--live is started by tracer record --mcp-http.")
        freshen = live_freshen(dbs[0])
    open_trace(source).close()  # fail now, with the reason, rather than on the first tool call
    if http is None:
        serve_stdio(source)
        return
    host, port = parse_listen(http)
    token = read_token(token_file, os.environ.get("TRACER_MCP_TOKEN"))
    serve_http(source, host, port, token=token, allowed_hosts=allow_host or [], log=err, freshen=freshen)


def register(app: typer.Typer) -> None:
    """Add the analysis commands and the `mcp` group to ``app``."""
    for f in (stats, chains, stacks, sql, timeline, breakdown, ranks, steps, waits, compare_processes, compare, export):
        app.command()(f)
    app.add_typer(mcp_app, name="mcp")
