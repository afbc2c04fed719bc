"""Call stacks of one CUDA op, ranked by calls: from the Python line through native code to the CUDA API.

Stacks come from the stored ``cuda_calls`` rows (a budgeted sample that always keeps the slow tail), so ``calls``
counts stored rows; ``op_calls_total`` gives the exact count from ``op_stats``. Rows without a captured stack are
grouped as ``(no stack captured)`` with an empty frame list, and ``coverage`` says why calls have none
(:mod:`tracer.analysis.stack_coverage`).
"""

from __future__ import annotations

from typing import Annotated

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.stack_coverage import StackCoverage, stack_coverage

NO_STACK = "(no stack captured)"


class UnknownOp(LookupError):
    """The op was never traced; ``known`` lists the ops that were."""

    def __init__(self, op: str, known: list[str]) -> None:
        super().__init__(f"unknown op {op!r}; traced ops: {', '.join(known) or '(none)'}")
        self.op = op
        self.known = known


class Frame(Record):
    """One frame, outermost first."""

    kind: Annotated[str, Field(description="python | native | cuda")]
    module: Annotated[str, Field(description="shared object (native/cuda) or module file (python)")]
    function: Annotated[str, Field(description="demangled function or Python qualname")]
    file: Annotated[str | None, Field(description="source file when known")]
    line: Annotated[int | None, Field(description="executing line (python) when known")]


class StackStat(Record):
    """One distinct stack of the op and the latency of the calls made through it."""

    stack_id: Annotated[int | None, Field(description="stacks.stack_id; null for the '(no stack captured)' group")]
    label: Annotated[str, Field(description="innermost Python frame as file:line function, or the top frame")]
    calls: Annotated[int, Field(description="stored calls through this stack")]
    avg_us: float
    min_us: float
    max_us: float
    total_bytes: int
    pids: list[int]
    frames: Annotated[list[Frame], Field(description="outermost first: Python -> native -> CUDA")]


class StacksResult(Record):
    """Stacks of one op, most calls first."""

    op: str
    pid: int | None
    op_calls_total: Annotated[int, Field(description="exact calls of the op (op_stats), stored or not")]
    stored_calls: Annotated[int, Field(description="calls with a stored row (the ones ranked here)")]
    distinct_stacks: int
    stacks: list[StackStat]
    coverage: Annotated[
        StackCoverage | None, Field(description="how many calls have a stack, and why the others have none")
    ] = None


def known_ops(conn: duckdb.DuckDBPyConnection) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT op FROM (SELECT op FROM op_stats UNION SELECT DISTINCT op FROM cuda_calls) ORDER BY op"
        ).fetchall()
    ]


def _label(frames: list[Frame]) -> str:
    py = [f for f in frames if f.kind == "python"]
    if py:
        f = py[-1]
        return f"{f.file or f.module}:{f.line} {f.function}"
    return frames[-1].function if frames else NO_STACK


def top_stacks(conn: duckdb.DuckDBPyConnection, op: str, pid: int | None = None, limit: int = 10) -> StacksResult:
    """Return the op's stacks ranked by calls, with latency, bytes, pids and frames.

    Raises:
        UnknownOp: the op was never traced (the error lists the traced ops).
    """
    ops = known_ops(conn)
    if op not in ops:
        raise UnknownOp(op, ops)
    p = {"op": op, "pid": pid}
    total = conn.execute(
        "SELECT coalesce(sum(calls), 0) FROM op_stats WHERE op = $op AND ($pid IS NULL OR pid = $pid)", p
    ).fetchone()
    groups = conn.execute(
        """
        SELECT stack_id, count(*) AS n, avg(dur_ns), min(dur_ns), max(dur_ns), coalesce(sum(bytes), 0),
               list(DISTINCT pid ORDER BY pid)
        FROM cuda_calls WHERE op = $op AND ($pid IS NULL OR pid = $pid)
        GROUP BY stack_id ORDER BY n DESC, stack_id NULLS LAST""",
        p,
    ).fetchall()
    stored = sum(g[1] for g in groups)
    top = groups[: max(limit, 0)]
    ids = [g[0] for g in top if g[0] is not None]
    frames: dict[int, list[Frame]] = {i: [] for i in ids}
    if ids:
        for sid, kind, module, function, file, line in conn.execute(
            "SELECT stack_id, kind, module, function, file, line FROM stacks WHERE list_contains(?, stack_id) "
            "ORDER BY stack_id, depth",
            [ids],
        ).fetchall():
            frames[sid].append(
                Frame(kind=kind or "", module=module or "", function=function or "", file=file, line=line)
            )
    out = []
    for sid, n, avg, mn, mx, b, pids in top:
        fr = frames.get(sid, []) if sid is not None else []
        out.append(
            StackStat(
                stack_id=sid,
                label=_label(fr) if sid is not None else NO_STACK,
                calls=int(n),
                avg_us=round(avg / 1e3, 1),
                min_us=round(mn / 1e3, 1),
                max_us=round(mx / 1e3, 1),
                total_bytes=int(b),
                pids=list(pids),
                frames=fr,
            )
        )
    return StacksResult(
        op=op,
        pid=pid,
        op_calls_total=int(total[0] if total else 0),
        stored_calls=int(stored),
        distinct_stacks=len(groups),
        stacks=out,
        coverage=stack_coverage(conn, op, pid),
    )
