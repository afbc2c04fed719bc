"""`tracer record`, `tracer doctor` and `tracer demo`: the commands that run BPF (registered by tracer.commands.cli)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from tracer.views.console import make_console

if TYPE_CHECKING:  # the recorder (bcc, numpy, pyarrow) is imported by the commands that record, not by the CLI
    from tracer.recorder import RecordSummary

err = make_console(stderr=True)
out = make_console()


def print_summary(s: RecordSummary, *, ops_table: bool = True) -> None:
    """Render the closing summary of a recording: per op calls, p50/p99, tail ratio (unless ``ops_table`` is
    False: the demo prints tracer stats next); then the next commands."""
    how = {
        "complete": "duration reached",
        "interrupted": "stopped by Ctrl-C",
        "target_exited": "target exited",
    }
    ms = s.ms_per_process  # what process churn costs (issue 33); None for a job that did not churn
    each = f" ({ms:,.1f} ms of the recorder's CPU each)" if ms is not None else ""
    err.print(
        f"[bold]recorded {s.duration_s:.1f} s[/] ({how.get(s.status, s.status)}): {s.events_traced:,} CUDA calls "
        f"traced, {s.events_stored:,} stored, {s.events_lost:,} lost, {s.processes} processes{each}"
    )
    first = f"first call recorded at {s.first_event_s:.1f} s" if s.first_event_s is not None else "no call recorded"
    steady = f"{s.recording_cpu_pct:.1f}% of a core while recording" if s.recording_cpu_pct is not None else ""
    err.print(
        f"tracer: {s.startup_s:.1f} s start-up, " + (f"{steady}, " if steady else "") + f"{s.flush_s:.1f} s "
        f"finishing; {first}; it used {s.recorder_cpu_s:.1f} s of CPU in all and "
        f"{s.recorder_peak_rss_bytes / 2**20:.0f} MiB; "
        f"{s.holds} hold{'s' if s.holds != 1 else ''} ({s.held_ms:.0f} ms)",
        highlight=False,
    )
    fate = {
        "stopped": "the launched command was still running at --duration: stopped (SIGTERM, then SIGKILL)",
        "left running": "the launched command was left running (--keep-running), no longer traced",
    }
    if s.command_fate in fate:
        err.print(fate[s.command_fate], highlight=False)
    t = Table(title="CUDA calls (exact, every call)", title_justify="left")
    for c in ("op", "layer", "calls", "p50 µs", "p99 µs", "max µs", "p99/p50"):
        t.add_column(c, justify="left" if c in ("op", "layer") else "right")
    for o in s.ops:
        t.add_row(
            o.op,
            o.layer,
            f"{o.calls:,}",
            f"{o.p50_ns / 1e3:.1f}",
            f"{o.p99_ns / 1e3:.1f}",
            f"{o.max_ns / 1e3:.1f}",
            f"{o.tail_ratio:.1f}x",
        )
    if not s.ops:
        out.print("no CUDA calls were traced" + ("" if s.libraries else ": no CUDA library was loaded"))
    elif ops_table:
        out.print(t)
    for n in s.notes:
        err.print(f"[yellow]note:[/] {n}", highlight=False)
    err.print(
        f"\nnext: tracer stats --db {s.db}   ·   tracer chains --db {s.db}   ·   "
        f"tracer mcp serve --db {s.db} --http :8090",
        highlight=False,
    )


def _exit_now() -> None:
    """Exit 0 without the interpreter's teardown, once the DB is closed and the probes detached: nothing is left to
    clean up, and the teardown of bcc's and DuckDB's objects only costs time."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _absolute(p: Path) -> Path:
    """``p`` against the directory the command started in (program.start_cwd: the BPF compile may be running, in a
    thread, inside the kernel headers' directory)."""
    from tracer.recorder import start_cwd

    return p if p.is_absolute() else Path(start_cwd()) / p


def record(
    ctx: typer.Context,
    pid: Annotated[
        int | None, typer.Option("--pid", "-p", help="Attach to this running process and its children.")
    ] = None,
    db: Annotated[Path, typer.Option("--db", help="DuckDB file to write.")] = Path("trace.duckdb"),
    duration: Annotated[float | None, typer.Option("--duration", "-d", help="Stop after S seconds.")] = None,
    lib: Annotated[
        list[str] | None, typer.Option("--lib", help="Extra libcudart, libcuda or libnccl file to probe (repeatable).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --db file.")] = False,
    max_events: Annotated[
        int,
        typer.Option(
            "--max-events",
            help="Stored call rows per second before the busiest ops are sampled (counts stay exact).",
        ),
    ] = 20_000,
    max_db_size: Annotated[
        str | None,
        typer.Option(
            "--max-db-size",
            metavar="SIZE",
            help="Keep the DB file (with its .wal) under SIZE: bytes, or K/M/G/T (powers of 1024), e.g. 500M or 2G; "
            "at least 4M. Near it, the oldest detail rows (cuda_calls, sched, offcpu_stacks, cpu_samples) are "
            "dropped by whole time ranges; op_stats, thread_breakdown and the other per-second tables stay exact "
            "over the whole run, and dropped_rows counts what went. Default: no cap (about 10 MB a minute on "
            "a busy job).",
        ),
    ] = None,
    no_python: Annotated[bool, typer.Option("--no-python-stacks", help="Do not walk Python frames.")] = False,
    sample_hz: Annotated[
        int,
        typer.Option(
            "--sample-hz",
            help="On-CPU samples per second of each job thread's CPU time, with their Python lines (cpu_samples; "
            "`tracer flame --on-cpu`). Default 99.",
        ),
    ] = 99,
    no_sampling: Annotated[bool, typer.Option("--no-sampling", help="Take no on-CPU samples.")] = False,
    no_offcpu_stacks: Annotated[
        bool,
        typer.Option(
            "--no-offcpu-stacks",
            help="Do not capture where job threads block (offcpu_stacks; `tracer flame --off-cpu`); their blocked "
            "time is still accounted, without a stack.",
        ),
    ] = False,
    overhead_budget: Annotated[
        float,
        typer.Option(
            "--overhead-budget",
            help="Percent of one CPU the probes may cost the job. Above it, launch probes are attached in time "
            "slices and launch counts are scaled (and marked so); syncs, allocations and copies stay exact.",
        ),
    ] = 2.0,
    launch_probes: Annotated[
        str,
        typer.Option(
            "--launch-probes",
            help="driver: one uprobe per launch, on libcuda (runtime launches keep their runtime name); both: "
            "also probe the runtime's launch functions; auto: both until a few hundred runtime launches were seen "
            "to reach libcuda, then driver.",
        ),
    ] = "auto",
    mcp_http: Annotated[
        str | None,
        typer.Option(
            "--mcp-http",
            help="Serve the recording in progress over MCP at http://HOST:PORT/mcp (':8090' = loopback), as "
            "`tracer mcp serve` does for a finished one: each tool call answers over what has been flushed so "
            "far, from a snapshot the recorder takes when asked. It stops with the recording.",
        ),
    ] = None,
    mcp_token_file: Annotated[
        Path | None,
        typer.Option(
            "--mcp-token-file",
            help="Bearer token file for a non-loopback --mcp-http or --metrics (or TRACER_MCP_TOKEN).",
        ),
    ] = None,
    metrics: Annotated[
        str | None,
        typer.Option(
            "--metrics",
            metavar="[HOST]:PORT",
            help="Serve Prometheus metrics of the recording in progress at http://HOST:PORT/metrics (':9464' = "
            "loopback): exact CUDA call histograms and counts, copy bytes, the training thread's time by part, lost "
            "events, the recorder's own CPU and memory (docs/node-agent.md). A non-loopback address needs the "
            "bearer token of --mcp-token-file or TRACER_MCP_TOKEN. It stops with the recording.",
        ),
    ] = None,
    chains_every: Annotated[
        float,
        typer.Option(
            "--chains-every",
            metavar="SECONDS",
            help="With --metrics: compute the causal chains over the recording so far at most every SECONDS, and "
            "only when new calls were stored, for tracer_chain_active (in a child process at low priority); 0 "
            "turns it off.",
        ),
    ] = 60.0,
    keep_running: Annotated[
        bool,
        typer.Option(
            "--keep-running",
            help="With --duration and a launched command: leave the command running when the recording ends "
            "(default: stop it, SIGTERM then SIGKILL after 5 s, as nsys does).",
        ),
    ] = False,
) -> None:
    """Record CUDA calls and host activity of a process tree into a DuckDB file.

    Attach to a running job (no restart, no code change):  sudo tracer record --pid 1234 --duration 60

    Or launch and trace a command:  sudo tracer record --db run.duckdb -- python train.py --epochs 2

    Ask an assistant while it runs:  sudo tracer record --pid 1234 --mcp-http :8090

    Feed Prometheus while it runs:  sudo tracer record --pid 1234 --metrics :9464

    Node agent, every CUDA process of the host (no --pid, no command), until stopped:
    sudo tracer record --db node.duckdb --max-db-size 2G --metrics :9464

    With no target it traces each process that maps libcudart, libcuda or libnccl, now or from its first load of
    one (docs/node-agent.md). Stops on Ctrl-C, at --duration, or (with a target) when every traced process has
    exited; each way writes the same final
    summary. A launched command still running at --duration is stopped (SIGTERM, then SIGKILL after 5 s) unless
    --keep-running; an attached --pid job is never touched, and runs on at full speed once the tracer is gone
    (if the tracer is killed, a guardian process continues anything it had paused). One recording per file: an
    existing --db is refused unless --force.
    """
    from tracer.recorder import Recorder, RecordOptions, parse_size

    command = list(ctx.args) or None
    max_db_bytes = parse_size(max_db_size) if max_db_size is not None else None  # a bad SIZE: a usage error
    opts = RecordOptions(
        db=_absolute(db),
        pid=pid,
        command=[str(_absolute(Path(command[0]))), *command[1:]] if command and "/" in command[0] else command,
        duration=duration,
        libs=[str(_absolute(Path(p))) for p in lib or []],
        force=force,
        max_events_per_s=max_events,
        max_db_bytes=max_db_bytes,
        python_stacks=not no_python,
        sample_hz=0 if no_sampling else sample_hz,
        offcpu_stacks=not no_offcpu_stacks,
        overhead_budget=overhead_budget,
        launch_probes=launch_probes,
        keep_command=keep_running,
        mcp_http=mcp_http,
        mcp_token_file=_absolute(mcp_token_file) if mcp_token_file else None,
    )
    if chains_every < 0:
        from tracer.errors import UsageError

        raise UsageError(f"--chains-every {chains_every:g} is negative", "Pass SECONDS >= 0 (0 turns it off).")
    opts.chains_every_s = chains_every
    if metrics is not None:
        opts.metrics_token, opts.metrics_listen = _listen_token(metrics, opts.mcp_token_file, "--metrics")
    live = sys.stderr.isatty()

    def status(msg: str) -> None:
        if live:  # one line, redrawn in place: never wider than the terminal
            err.print(f"[dim]{msg}[/]", end="\r", highlight=False, no_wrap=True, crop=True, overflow="ellipsis")
        elif "waiting" in msg or msg.startswith("finishing"):
            err.print(msg, highlight=False)

    _check_mcp_http(mcp_http, opts.mcp_token_file)
    recorder = Recorder(opts, on_status=status)
    recorder.check()
    err.print(f"recording into {db} … (Ctrl-C to stop)", highlight=False)
    summary = recorder.run()
    status("finishing: computing the causal chains…")
    diagnose(summary)
    print_summary(summary)
    _exit_now()


def _check_mcp_http(spec: str | None, token_file: Path | None) -> None:
    """Refuse a bad --mcp-http before anything is attached: an address that does not parse, or a non-loopback
    one without a bearer token."""
    if spec is not None:
        _listen_token(spec, token_file, "--mcp-http")


def _listen_token(spec: str, token_file: Path | None, flag: str) -> tuple[str | None, tuple[str, int]]:
    """Return (the bearer token, (host, port)) of a ``[HOST]:PORT`` server option: the token is required on a
    non-loopback address (the MCP server's rule, shared by --mcp-http and --metrics), None on loopback."""
    from mcp_server.http import is_loopback, parse_listen, read_token

    host, port = parse_listen(spec)
    if is_loopback(host):
        return None, (host, port)
    token = read_token(token_file, os.environ.get("TRACER_MCP_TOKEN"))
    if not token:
        from tracer.errors import UsageError

        raise UsageError(
            f"{flag} on non-loopback address {host} needs a bearer token",
            f"Set TRACER_MCP_TOKEN or pass --mcp-token-file FILE, or bind to loopback with {flag} :PORT.",
        )
    return token, (host, port)


def diagnose(summary: RecordSummary) -> None:
    """Write the causal chains into the finished recording (its ``causal_chains`` table), a step after the
    recorder: a failure is a note on the summary, and the recording stays valid without its diagnosis."""
    from tracer.analysis.chains import store_chains

    try:
        store_chains(summary.db)
    except Exception as e:  # any analysis bug: the recording itself is complete
        summary.notes.append(f"causal chain analysis failed: {e}")


def doctor() -> None:
    """Check whether this machine can trace, and say what is missing and how to fix it.

    Example: sudo tracer doctor
    """
    from tracer.recorder import check_environment, checks, cuda_libraries, verify_program

    ok = True
    for c in checks():
        good = c.ok or not c.required
        ok &= good
        mark = "[green]ok[/]" if c.ok else "[red]missing[/]" if c.required else "[yellow]missing[/]"
        err.print(f"  {mark}  {c.name}" + ("" if c.ok else f"  → {c.fix}"))
    if ok:
        check_environment()
        problem = verify_program()
        ok = problem is None
        err.print(
            "  [green]ok[/]  BPF program compiles, loads and verifies"
            if ok
            else f"  [red]failed[/]  BPF program load: {problem}"
        )
    err.print(f"  CUDA libraries in the usual places: {', '.join(cuda_libraries()) or 'none'}")
    raise typer.Exit(0 if ok else 3)


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def demo(
    db: Annotated[Path, typer.Option("--db", help="Where to write the demo recording.")] = Path("demo.duckdb"),
    seconds: Annotated[float, typer.Option("--seconds", help="How long the demo job runs.")] = 12.0,
) -> None:
    """Record a fixture training job with the usual host-side problems, then print the investigation.

    The job (fixtures/workloads/train.py on the stand-in CUDA libraries) re-forks its DataLoader workers every
    epoch and syncs every step; the demo prints what `tracer stats`, `tracer chains` and `tracer stacks` show.

    Example: sudo tracer demo
    """
    from tracer.analysis.chains import compute_chains
    from tracer.analysis.db import open_trace
    from tracer.analysis.stacks import top_stacks
    from tracer.analysis.stats import trace_stats
    from tracer.errors import EnvironmentProblem
    from tracer.recorder import Recorder, RecordOptions
    from tracer.views.render import print_record

    lib = FIXTURES / "build" / "libcudart.so.12"
    if not lib.exists():
        raise EnvironmentProblem("the stand-in CUDA libraries are not built", "run ./setup.sh")
    cmd = [
        sys.executable,
        str(FIXTURES / "workloads" / "train.py"),
        "--duration",
        str(seconds),
        "--workers",
        "3",
        "--epochs",
        "1000",
        "--steps",
        "20",
        "--respawn-workers",
        "--worker-cpu-ms",
        "8",
    ]
    db = _absolute(db)
    err.print(f"[bold]demo:[/] recording {' '.join(cmd[1:3])} for {seconds:.0f} s into {db}", highlight=False)
    opts = RecordOptions(db=db, command=cmd, force=True, libs=[str(lib), str(lib.with_name("libcuda.so.1"))])
    summary = Recorder(opts).run()
    diagnose(summary)
    print_summary(summary, ops_table=False)
    with open_trace(db) as conn:
        out.rule("tracer stats")
        print_record(trace_stats(conn), out, as_json=False)
        out.rule("tracer chains")
        # the worst two chains and the top stack fit two screens; the views say how many more there are
        print_record(compute_chains(conn, limit=2), out, as_json=False)
        out.rule("tracer stacks --op cudaStreamSynchronize")
        print_record(top_stacks(conn, "cudaStreamSynchronize", limit=1), out, as_json=False)
    err.print(f"\nask an assistant: tracer mcp serve --db {db} --http :8090", highlight=False)
    _exit_now()


def register(app: typer.Typer) -> None:
    """Add the recording commands to ``app``."""
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": False})(record)
    app.command()(doctor)
    app.command()(demo)
