"""Checks of the analyses' arguments, shared by the CLI (``tracer stats|chains|stacks|timeline|breakdown``) and the
MCP tools, so both refuse the same input with the same words: a pid or thread the recording does not hold, a
severity that does not exist, a bucket or limit out of range.

Raises :class:`tracer.errors.UsageError` (exit code 2 on the CLI; the MCP server turns it into a ``ToolError`` the
model reads and corrects from). The message names what the recording does hold.
"""

from __future__ import annotations

import duckdb

from tracer.analysis.chains.model import SEVERITIES
from tracer.analysis.recording import RecordingInfo, load_recording
from tracer.errors import UsageError, echo

LIST_MAX = 20  # pids / tids named in an error


def check_args(
    conn: duckdb.DuckDBPyConnection,
    *,
    pid: int | None = None,
    tid: int | None = None,
    severity: str | None = None,
    bucket_s: int | None = None,
    limit: int | None = None,
    info: RecordingInfo | None = None,
) -> None:
    """Raise UsageError unless every given argument is valid for the recording behind ``conn``."""
    if severity is not None and severity.upper() not in SEVERITIES:
        raise UsageError(f"unknown severity {echo(severity)}", "Use high, medium or low (or leave it out for all).")
    if bucket_s is not None and bucket_s < 0:
        raise UsageError(f"bucket width {bucket_s} s is negative", "Pass seconds >= 1, or 0 to pick one.")
    if limit is not None and limit < 1:
        raise UsageError(f"limit {limit} is below 1", "Pass a limit of 1 or more.")
    if pid is None and tid is None:
        return
    info = info or load_recording(conn)
    if pid is not None and pid not in info.procs:
        known = info.target_pids()
        listed = ", ".join(map(str, known[:LIST_MAX])) + (f" … ({len(known)} in all)" if len(known) > LIST_MAX else "")
        raise UsageError(
            f"pid {pid} is not in this trace; traced pids: {listed or '(none)'}",
            "Pass one of them, or leave the pid out for the whole tree.",
        )
    if tid is not None:
        tids = _tids(conn, info)
        if tid not in tids:
            listed = ", ".join(f"{t} ({p})" for t, p in list(tids.items())[:LIST_MAX]) or "(none)"
            raise UsageError(
                f"thread {tid} is not in this trace; its threads, those with CUDA calls first (tid (pid)): {listed}",
                "Pass one of them, or leave the tid out for every CUDA thread.",
            )
        if pid is not None and tids[tid] != pid:
            owner = tids[tid]
            raise UsageError(f"thread {tid} belongs to pid {owner}, not {pid}", f"Pass pid {owner} or leave it out.")


def _tids(conn: duckdb.DuckDBPyConnection, info: RecordingInfo) -> dict[int, int]:
    """Return {tid: pid} of the threads an analysis can be asked about: CUDA threads first, in tid order."""
    if info.has("threads") and info.has_breakdown:
        rows = conn.execute("SELECT tid, pid FROM threads ORDER BY cuda_calls = 0, tid").fetchall()
        if rows:
            return dict(rows)
    return dict(conn.execute("SELECT DISTINCT tid, pid FROM cuda_calls ORDER BY tid").fetchall())
