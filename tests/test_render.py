"""tracer.render on hand-built records: the tables carry the numbers; traced strings are printed, not applied."""  # noqa: E501

from __future__ import annotations

import json

from rich.console import Console

from tracer.analysis.chains import CausalChain, ChainsResult
from tracer.analysis.sql import SqlResult
from tracer.analysis.stacks import Frame, StacksResult, StackStat
from tracer.render import nbytes, print_record, to_json, us


def text_of(record) -> str:
    c = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    print_record(record, c, as_json=False)
    return c.export_text()


def test_units():
    assert (us(850), us(1200), us(3_400_000), us(5.25)) == ("850µs", "1.2ms", "3.40s", "5.2µs")
    assert nbytes(406e9) == "406.0 GB" and nbytes(None) == "-"


def test_chains_view():
    ch = CausalChain(
        id="x-1",
        severity="HIGH",
        category="cpu_contention",
        start_ns=20_000_000_000,
        end_ns=40_000_000_000,
        pids=[12004],
        op="cudaStreamSynchronize",
        op_p50_us=10.0,
        op_p99_us=39_900.0,
        impact_ms=5493.0,
        summary="who took the CPU",
        evidence={"runq_ms": 5493.0, "preemptors": [{"pid": 4242, "comm": "[red]stress-ng[/]"}]},
        recommendations=["renice -n 19 -p 4242", "taskset -cp 0-3 12004"],
    )
    out = text_of(ChainsResult(chains=[ch], total=1, by_severity={"HIGH": 1, "MEDIUM": 0, "LOW": 0}))
    assert "#1 HIGH cpu_contention" in out and "p99 39.9ms" in out
    assert "1. renice -n 19 -p 4242" in out and "2. taskset" in out
    assert "[red]stress-ng[/]" in out  # markup in traced data is shown literally
    assert "No causal chains" in text_of(ChainsResult(chains=[], total=0, by_severity={}))


def test_stacks_view():
    frames = [
        Frame(kind="python", module="a.py", function="main", file="a.py", line=114),
        Frame(kind="python", module="a.py", function="allocate_batch", file="a.py", line=74),
        Frame(kind="native", module="libc10_cuda.so", function="c10::malloc", file=None, line=None),
        Frame(kind="cuda", module="libcudart.so.12", function="cudaMalloc", file=None, line=None),
    ]
    s = StackStat(
        stack_id=1,
        label="a.py:74 allocate_batch",
        calls=4009,
        avg_us=1000.0,
        min_us=500.0,
        max_us=2100.0,
        total_bytes=207_000_000_000,
        pids=[1],
        frames=frames,
    )
    out = text_of(
        StacksResult(
            op="cudaMalloc", pid=None, op_calls_total=5883, stored_calls=4009, distinct_stacks=1, stacks=[s]
        )
    )
    lines = out.splitlines()
    assert "#1 a.py:74 allocate_batch  4,009 calls  avg 1.0ms" in out and "207.0 GB" in out
    py = next(i for i, line in enumerate(lines) if "a.py:74" in line and "Python" in line)
    cu = next(i for i, line in enumerate(lines) if "CUDA" in line)
    assert py < cu and lines[cu].index("CUDA") > lines[py].index("Python")  # indented deeper, Python first


def test_json_is_the_record():
    r = SqlResult(
        columns=["a"], column_types=["INTEGER"], rows=[[1]], row_count=1, truncated=False, elapsed_ms=1.0
    )
    assert json.loads(to_json(r)) == r.model_dump()
    assert "1 rows," in " ".join(text_of(r).split())
