"""What makes a comparison less trustworthy, or is worth knowing: the same file twice, different programs,
workloads, machines or recording options, an estimated breakdown, an unfinished or too-short recording."""

from __future__ import annotations

import shlex
from pathlib import PurePath

import duckdb

from tracer.analysis.compare.load import MIN_SECONDS, Side
from tracer.analysis.compare.model import CompareWarning, StepsCompare
from tracer.analysis.compare.steps import Cadence
from tracer.analysis.db import recording_state, session_row

# shared kernel names (or ops) below this Jaccard index: probably two different workloads
SAME_WORKLOAD_MIN = 0.5


def program_of(cmd: str) -> str:
    """Return the program a command line runs: its script (``x.py``, ``-m module``) or its executable's name."""
    try:
        argv = shlex.split(cmd)
    except ValueError:
        argv = cmd.split()
    if not argv:
        return ""
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv):
            return f"-m {argv[i + 1]}"
        if arg.endswith(".py"):
            return PurePath(arg).name
    return PurePath(argv[0]).name


def _command(side: Side) -> str:
    p = side.ctx.info.procs.get(side.ctx.info.main_pid) if side.ctx.info.main_pid is not None else None
    if p is not None:
        row = side.conn.execute("SELECT cmdline FROM processes WHERE pid = ?", [p.pid]).fetchone()
        if row and row[0]:
            return str(row[0])
    return side.ctx.info.target


def _fingerprint(side: Side) -> tuple[str, set[str]]:
    """Return what identifies the workload: the kernel names it launched, else the ops it called."""
    names = {
        r[0] for r in side.conn.execute("SELECT DISTINCT kernel FROM cuda_calls WHERE kernel IS NOT NULL").fetchall()
    }
    if names:
        return "kernels", names
    return "ops", {op for (op, _), o in side.ops.items() if o.calls}


def _session(conn: duckdb.DuckDBPyConnection) -> dict[str, object]:
    cols = ("host", "cpu_model", "cpu_cores", "gpus", "driver", "kernel", "tracer_version", "events_lost", "notes")
    return session_row(conn, cols) or dict.fromkeys(cols)


def _python_frames(side: Side) -> tuple[int, int]:
    row = side.conn.execute("SELECT count(*) FILTER (WHERE kind = 'python'), count(*) FROM stacks").fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def compare_warnings(
    before: Side,
    after: Side,
    same_file: bool,
    cadence_before: Cadence,
    cadence_after: Cadence,
    steps: StepsCompare,
) -> list[CompareWarning]:
    out: list[CompareWarning] = []

    def add(level: str, kind: str, message: str) -> None:
        out.append(CompareWarning(level=level, kind=kind, message=message))

    if same_file:
        add("warning", "same_file", "BEFORE and AFTER are the same file: every difference is zero")
    cmd_before, cmd_after = _command(before), _command(after)
    prog_before, prog_after = program_of(cmd_before), program_of(cmd_after)
    if prog_before and prog_after and prog_before != prog_after:
        add("warning", "different_program", f"different programs: {prog_before} before, {prog_after} after")
    elif cmd_before != cmd_after:
        add("info", "arguments", f"the commands differ: {cmd_before!r} before, {cmd_after!r} after")
    (kind_before, names_before), (kind_after, names_after) = _fingerprint(before), _fingerprint(after)
    if kind_before == kind_after and names_before and names_after:
        shared, either = names_before & names_after, names_before | names_after
        if len(shared) / len(either) < SAME_WORKLOAD_MIN:
            add(
                "warning",
                "different_workload",
                f"the {kind_before} launched differ ({len(shared)} shared of {len(either)}): these look like two "
                "different workloads, so their differences are not only a fix's",
            )
    env_before, env_after = _session(before.conn), _session(after.conn)
    machine = [
        k for k in ("host", "cpu_model", "cpu_cores", "gpus", "driver", "kernel") if env_before[k] != env_after[k]
    ]
    if machine:
        add(
            "warning",
            "different_host",
            "recorded on different machines or set-ups ("
            + ", ".join(f"{k}: {env_before[k]} / {env_after[k]}" for k in machine)
            + "): timings may differ for that alone",
        )
    if env_before["tracer_version"] != env_after["tracer_version"]:
        add(
            "info",
            "tracer_version",
            f"tracer {env_before['tracer_version']} before, {env_after['tracer_version']} after",
        )
    for side, env, c, counted in (
        (before, env_before, cadence_before, steps.before.counted_from),
        (after, env_after, cadence_after, steps.after.counted_from),
    ):
        if c.launch_error > 0:
            steps_too = (
                f"; its steps are counted from its exact {c.marker} calls, so steps/s does not depend on them"
                if counted == "waits"
                else ""
            )
            add(
                "info",
                "different_options",
                f"{side.name}: launch probes were duty-cycled (--overhead-budget): launch counts are scaled, within "
                f"{100 * c.launch_error:.1f}%; the noise judgment includes that bound{steps_too}",
            )
        if env["events_lost"]:
            add("info", "different_options", f"{side.name}: {env['events_lost']:,} call events were lost (rows only)")
    frames_before, frames_after = _python_frames(before), _python_frames(after)
    for side, (python, total), (other_python, _) in (
        (before, frames_before, frames_after),
        (after, frames_after, frames_before),
    ):
        if total and not python and other_python:
            add(
                "warning",
                "different_options",
                f"{side.name} has no Python frames in its stacks (recorded with --no-python-stacks?): chains there "
                "name no Python line, so a chain may seem to change only because its code site is unknown",
            )
    basis_before, basis_after = before.ctx.times.basis, after.ctx.times.basis
    if basis_before != basis_after:
        add(
            "warning",
            "different_basis",
            f"the time breakdown is {basis_before} before and {basis_after} after: an estimate (an older recording) "
            "and an exact breakdown differ by the estimate's error",
        )
    elif basis_before == "estimated":
        add("info", "different_basis", "both breakdowns are estimated (recordings made before the time accounting)")
    for side in (before, after):
        state = recording_state(side.conn)
        if not state.finished:
            add("warning", "unfinished", f"{side.name}: {state.ended}")
        if side.subject is not None and side.short:
            add(
                "warning",
                "too_short",
                f"{side.name}: its training loop spans {side.loop_s:.1f} s, {len(side.seconds)} whole seconds (at "
                f"least {MIN_SECONDS} are needed): too short to tell noise from change; record 10 s or more",
            )
        if side.subject is None:
            add("warning", "steps", f"{side.name}: no thread made CUDA calls, so there is no training loop")
    return out
