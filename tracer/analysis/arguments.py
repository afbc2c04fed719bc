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


def job_pid(
    conn: duckdb.DuckDBPyConnection,
    *,
    pid: int | None = None,
    rank: int | None = None,
    container: str | None = None,
    info: RecordingInfo | None = None,
) -> int | None:
    """Return the one process a job selector names, for the analyses that take a pid (None: no selector, the
    whole recording): ``pid`` as given; ``rank``, that rank's own process; ``container``, a container id (its
    64 hex digits or a prefix of them, as `docker ps` shows 12) or a pod name (process_placement), resolved to the
    container's process that made CUDA calls. The one place a node recording's job is picked (issue 32): the CLI
    and the MCP tools call it. Raises UsageError for two selectors at once, or one the recording does not hold,
    with what it does hold."""
    given = [n for n, v in (("pid", pid), ("rank", rank), ("container", container)) if v is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} both select a job", "Pass only one of pid, rank and container.")
    if rank is None and container is None:
        return pid
    info = info or load_recording(conn)
    if rank is not None:
        of_rank = sorted(p for p, r in info.rank_pids.items() if r == rank)
        if len(of_rank) != 1:
            ranks = sorted(set(info.rank_pids.values()))
            held = ", ".join(map(str, ranks[:LIST_MAX])) or "(none: no process had a rank)"
            why = "is not in this trace" if not of_rank else f"is held by several processes ({of_rank})"
            raise UsageError(f"rank {rank} {why}; its ranks: {held}", "Pass one of them, or a pid.")
        return of_rank[0]
    assert container is not None
    return _container_pid(conn, info, container.strip())


def _container_pid(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, name: str) -> int:
    shown = echo(name)
    if not info.has("process_placement", "container_id"):
        raise UsageError(
            f"container {shown}: this recording holds no container identity (recorded before issue 32)",
            "Pass a pid instead.",
        )
    rows = conn.execute(
        "SELECT DISTINCT pid, container_id, pod_name FROM process_placement "
        "WHERE container_id IS NOT NULL OR pod_name IS NOT NULL"
    ).fetchall()
    hexid = name.lower()
    pids = sorted({p for p, cid, pod in rows if (len(hexid) >= 4 and (cid or "").startswith(hexid)) or pod == name})
    if not pids:
        boxes = sorted({f"{cid[:12] if cid else '-'} ({pod or 'no pod'})" for _, cid, pod in rows})
        held = ", ".join(boxes[:LIST_MAX]) or "(none: no traced process ran in a container)"
        raise UsageError(
            f"container {shown} is not in this trace; its containers (id (pod)): {held}",
            "Pass a container id (12 or more hex digits) or a pod name from the list, or a pid.",
        )
    calling = _cuda_pids(conn, info)
    cuda = [p for p in pids if p in calling and p in info.procs]
    if len(cuda) == 1:
        return cuda[0]
    if not cuda:
        raise UsageError(
            f"container {shown} holds no process that made a CUDA call (pids {pids[:LIST_MAX]})", "Pass a pid."
        )
    listed = ", ".join(
        f"{p}" + (f" (rank {info.procs[p].rank})" if info.procs[p].rank is not None else "") for p in cuda[:LIST_MAX]
    )
    raise UsageError(f"container {shown} holds several CUDA processes: {listed}", "Pass one of them as pid, or a rank.")


def _cuda_pids(conn: duckdb.DuckDBPyConnection, info: RecordingInfo) -> set[int]:
    """The processes that made a CUDA call (threads' exact counts; the stored calls in an older recording)."""
    if info.has("threads", "cuda_calls"):
        sql = "SELECT DISTINCT pid FROM threads WHERE cuda_calls > 0"
    else:
        sql = "SELECT DISTINCT pid FROM cuda_calls"
    return {r[0] for r in conn.execute(sql).fetchall()}
