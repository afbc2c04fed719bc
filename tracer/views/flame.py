"""Flame graphs of the stacks outside calls (``tracer flame``): speedscope's JSON file format and Brendan Gregg's
folded stacks, the two inputs every flame-graph viewer reads.

- speedscope (https://www.speedscope.app, ``speedscope FILE``): one ``sampled`` profile per thread, weights in
  nanoseconds, frames with their file and line, in the format its schema
  (https://www.speedscope.app/file-format-schema.json) defines.
- folded (flamegraph.pl, inferno-flamegraph, speedscope too): one line per stack, ``frame;frame;frame ns``.

Blocked stacks end in a frame that says what they waited in (``[off-cpu gil]``, ``[off-cpu io D]``), so a
GIL wait and a disk wait at one Python line are two towers.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from tracer import __version__
from tracer.analysis.thread_stacks import StackFrame, ThreadStack, ThreadStacksResult

FORMATS = ("speedscope", "folded")
SPEEDSCOPE_SCHEMA = "https://www.speedscope.app/file-format-schema.json"
NO_STACK = "(no stack captured)"


def _frame(f: StackFrame) -> dict[str, Any]:
    if f.kind == "python":
        out: dict[str, Any] = {"name": f.function or "?", "file": f.file or f.module or "?"}
        if f.line is not None:
            out["line"] = int(f.line)
        return out
    return {"name": f"{f.function or '?'} [{f.module or '?'}]"}


def _leaf(s: ThreadStack) -> dict[str, Any] | None:
    if s.state == "cpu":
        return None
    return {"name": f"[off-cpu {s.wait}{' D' if s.state == 'D' else ''}]"}


def _key(d: dict[str, Any]) -> tuple:
    return (d["name"], d.get("file"), d.get("line"))


def speedscope(result: ThreadStacksResult, name: str) -> dict[str, Any]:
    """Return the speedscope document of ``result``: one sampled profile per thread, heaviest thread first."""
    frames: list[dict[str, Any]] = []
    index: dict[tuple, int] = {}

    def idx(d: dict[str, Any]) -> int:
        k = _key(d)
        if k not in index:
            index[k] = len(frames)
            frames.append(d)
        return index[k]

    by_thread: dict[int, list[ThreadStack]] = {}
    for s in result.stacks:
        by_thread.setdefault(s.tid, []).append(s)
    profiles = []
    for stacks in sorted(by_thread.values(), key=lambda v: -sum(s.ms for s in v)):
        samples, weights = [], []
        for s in stacks:
            chain = [idx(_frame(f)) for f in s.frames] or [idx({"name": NO_STACK})]
            leaf = _leaf(s)
            if leaf is not None:
                chain.append(idx(leaf))
            samples.append(chain)
            weights.append(round(s.ms * 1e6))
        total = sum(weights)
        profiles.append(
            {
                "type": "sampled",
                "name": f"{stacks[0].thread} [pid {stacks[0].pid}] {result.mode}",
                "unit": "nanoseconds",
                "startValue": 0,
                "endValue": total,
                "samples": samples,
                "weights": weights,
            }
        )
    return {
        "$schema": SPEEDSCOPE_SCHEMA,
        "shared": {"frames": frames},
        "profiles": profiles,
        "name": name,
        "activeProfileIndex": 0,
        "exporter": f"cuda-host-tracer {__version__}",
    }


def _folded_name(f: StackFrame) -> str:
    if f.kind == "python":
        return f"{f.function or '?'} ({(f.file or '?').rsplit('/', 1)[-1]}:{f.line})"
    return f"{f.function or '?'} [{(f.module or '?')}]"


def folded(result: ThreadStacksResult) -> list[str]:
    """Return folded-stack lines: ``thread;frame;...;frame ns`` (the thread as the root frame)."""
    acc: dict[str, int] = {}
    for s in result.stacks:
        parts = [s.thread, *((_folded_name(f) for f in s.frames) if s.frames else [NO_STACK])]
        leaf = _leaf(s)
        if leaf is not None:
            parts.append(leaf["name"])
        key = ";".join(p.replace(";", ",") for p in parts)
        acc[key] = acc.get(key, 0) + round(s.ms * 1e6)
    return [f"{k} {v}" for k, v in acc.items() if v > 0]


def write(result: ThreadStacksResult, fmt: str, out: TextIO, name: str) -> int:
    """Write ``result`` in ``fmt`` (speedscope | folded) to ``out``; return the stacks written."""
    if fmt == "speedscope":
        json.dump(speedscope(result, name), out)
        return len(result.stacks)
    if fmt == "folded":
        lines = folded(result)
        out.write("\n".join(lines) + ("\n" if lines else ""))
        return len(lines)
    raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
