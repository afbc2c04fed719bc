"""Call stacks of one op (``tracer stacks``): each distinct stack with its calls and frames."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.text import Text

from tracer.analysis.stacks import Frame, StacksResult
from tracer.views.render.cells import nbytes, us

KIND_LABEL = {"python": "Python", "native": "native", "cuda": "CUDA"}
NATIVE_RUN = 6  # a run of more native frames than this (interpreter start-up, ctypes) shows its ends only


def _fold_native(frames: Sequence[Frame]) -> list[Frame | int]:
    """Return ``frames`` with each run of more than NATIVE_RUN native frames cut to its two outermost and two
    innermost frames around the count of those left out: the Python lines and the CUDA call stay whole."""
    out: list[Frame | int] = []
    run: list[Frame] = []
    for f in [*frames, None]:
        if f is not None and f.kind == "native":
            run.append(f)
            continue
        out += [*run[:2], len(run) - 4, *run[-2:]] if len(run) > NATIVE_RUN else run
        run = []
        if f is not None:
            out.append(f)
    return out


def render_stacks(res: StacksResult) -> RenderableType:
    parts: list[RenderableType] = [
        Text(
            f"{res.op}: {res.op_calls_total:,} calls in total, {res.stored_calls:,} stored, {res.distinct_stacks} "
            f"distinct stacks" + (f" (pid {res.pid})" if res.pid is not None else ""),
            style="bold",
        )
    ]
    if res.coverage is not None:
        cov = Text(res.coverage.summary + "\n", "dim")
        for m in res.coverage.missing:
            cov.append(f"  {m.calls:,} {m.reason.replace('_', ' ')}: {m.why}\n", "dim")
        parts.append(cov)
    for i, s in enumerate(res.stacks, 1):
        body = Text()
        body.append(f"#{i} {s.label}", "bold")
        body.append(
            f"  {s.calls:,} calls  avg {us(s.avg_us)}  min {us(s.min_us)}  max {us(s.max_us)}"
            + (f"  {nbytes(s.total_bytes)}" if s.total_bytes else "")
            + f"  pids {', '.join(map(str, s.pids))}\n"
        )
        prev = None
        for depth, f in enumerate(_fold_native(s.frames)):
            if isinstance(f, int):
                body.append("   " + "  " * depth + f"⋮ {f} native frames (--json for all)\n", "dim")
                continue
            if prev is not None and prev != f.kind:
                body.append("   " + "  " * depth + "↓\n", "dim")
            where = f"{f.file}:{f.line}" if f.file else f.module
            body.append("   " + "  " * depth)
            body.append(f"{KIND_LABEL.get(f.kind, f.kind):7}", "cyan" if f.kind == "python" else "dim")
            body.append(f" {where}  ")
            body.append(f"{f.function}\n", "bold" if f.kind == "python" else "")
            prev = f.kind
        parts.append(body)
    if len(res.stacks) < res.distinct_stacks:
        parts.append(Text(f"and {res.distinct_stacks - len(res.stacks)} more stacks (tracer stacks --limit N)", "dim"))
    return Group(*parts)
