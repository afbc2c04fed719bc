"""tracer.views.render on hand-built records: the tables carry the numbers; traced strings are printed, not applied."""

from __future__ import annotations

import json

from rich.console import Console, Group

from tracer.analysis.breakdown import Holder
from tracer.analysis.chains import CausalChain, ChainsResult
from tracer.analysis.chains.model import CpuContentionEvidence, Culprit, Hop, Root
from tracer.analysis.processes import BusyThread, group_processes
from tracer.analysis.sql.result import SqlResult
from tracer.analysis.stacks import Frame, StacksResult, StackStat
from tracer.analysis.stats import ProcessStat
from tracer.views.render import (
    NATIVE_RUN,
    nbytes,
    print_record,
    render_busy_threads,
    render_processes,
    to_json,
    us,
)
from tracer.views.render.chains import _evidence_view, _few, path_lines
from tracer.views.render.stacks import _fold_native


def text_of(record) -> str:
    c = Console(width=200, record=True, file=open("/dev/null", "w"))
    print_record(record, c, as_json=False)
    return c.export_text()


def test_units():
    assert (us(850), us(1200), us(3_400_000), us(5.25)) == ("850µs", "1.2ms", "3.40s", "5.2µs")
    assert nbytes(406e9) == "406.0 GB" and nbytes(None) == "-"


def test_chains_view():
    hog = Holder(pid=4242, comm="[red]stress-ng[/]", holder="other", preemptions=310, runq_ms=5493.0)
    ch = CausalChain(
        id="x-1",
        severity="HIGH",
        category="cpu_contention",
        start_ns=20_000_000_000,
        end_ns=40_000_000_000,
        pids=[12004],
        tid=12004,
        thread_comm="python3",
        share=0.233,
        impact_ms=5493.0,
        basis="exact",
        culprit=Culprit(
            kind="process", pid=4242, tid=None, comm="[red]stress-ng[/]", relation="other_process", code_site=None
        ),
        op="cudaStreamSynchronize",
        op_p50_us=10.0,
        op_p99_us=39_900.0,
        summary="who took the CPU",
        evidence=CpuContentionEvidence(
            holder_class="other",
            runq_ms=5493.0,
            runq_outside_calls_ms=4800.0,
            runq_inside_calls_ms=693.0,
            runq_by_holder_ms={"other": 4800.0},
            holders=[hog],
            cpu_cores=2,
            dataloader_workers=0,
            max_load1=24.0,
            max_cpu_busy_pct=100.0,
        ),
        recommendations=["renice -n 19 -p 4242", "taskset -cp 0-3 12004"],
    )
    result = ChainsResult(
        chains=[ch],
        total=1,
        by_severity={"HIGH": 1, "MEDIUM": 0, "LOW": 0},
        basis="exact",
        note="",
        training_tid=12004,
    )
    out = text_of(result)
    assert "#1 HIGH cpu_contention" in out and "p99 39.9ms" in out
    assert "23.3%" in out  # the share of the thread's time, the ranking key
    assert "1. renice -n 19 -p 4242" in out and "2. taskset" in out
    assert "[red]stress-ng[/]" in out  # markup in traced data is shown literally
    assert "No causal chains" in text_of(
        ChainsResult(chains=[], total=0, by_severity={}, basis="none", note="", training_tid=None)
    )


def test_a_chains_path_is_a_few_lines_ending_at_its_root():
    path = [
        Hop(tid=10, pid=10, comm="python", role="training", edge="start", state="blocked", share=1.0, ms=900.0,
            site="train.py:50 main"),
        Hop(tid=11, pid=10, comm="[b]writer[/b]", role="job_thread", edge="woken_by", state="io", share=0.62,
            ms=558.0, site="ckpt.py:12 write"),
    ]  # fmt: skip
    root = Root(kind="external_wait", detail="writer (11) waited in fsync at ckpt.py:12 write for disk I/O")
    lines = [t.plain for t in path_lines(path, root)]
    assert lines == [
        "path: python (10) [training, blocked] at train.py:50 main",
        "  --woken_by 62%--> [b]writer[/b] (11) [job_thread, io] at ckpt.py:12 write",
        "  => root external_wait: writer (11) waited in fsync at ckpt.py:12 write for disk I/O",
    ]
    assert path_lines([], None) == [] and "root not found" in path_lines(path[:1], None)[-1].plain


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
        StacksResult(op="cudaMalloc", pid=None, op_calls_total=5883, stored_calls=4009, distinct_stacks=1, stacks=[s])
    )
    lines = out.splitlines()
    assert "#1 a.py:74 allocate_batch  4,009 calls  avg 1.0ms" in out and "207.0 GB" in out
    py = next(i for i, line in enumerate(lines) if "a.py:74" in line and "Python" in line)
    cu = next(i for i, line in enumerate(lines) if "CUDA" in line)
    assert py < cu and lines[cu].index("CUDA") > lines[py].index("Python")  # indented deeper, Python first


def test_json_is_the_record():
    r = SqlResult(columns=["a"], column_types=["INTEGER"], rows=[[1]], row_count=1, truncated=False, elapsed_ms=1.0)
    assert json.loads(to_json(r)) == r.model_dump()
    assert "1 rows," in " ".join(text_of(r).split())


# -- output that scales (issue 13): grouped processes, short lists, folded native frames ---------------------------


def proc(pid, comm, role, calls=0, off=0.1, worst=1.0, exit_s=None, code=None):
    return ProcessStat(
        pid=pid,
        ppid=1,
        comm=comm,
        role=role,
        cuda_calls=calls,
        context_switches=10,
        preemptions=3,
        off_cpu_s=off,
        runq_s=off / 2,
        worst_stall_ms=worst,
        first_s=0.0,
        exit_s=exit_s,
        exit_code=code,
    )


def table_text(renderable, width=120) -> str:
    c = Console(width=width, record=True, file=open("/dev/null", "w"))
    c.print(renderable)
    return c.export_text()


# a respawning loader: 1 main, 184 workers (one failed), then 9 one-off helpers with distinct names
RESPAWN = (
    [proc(100, "python3", "main", calls=22_825, off=17.2, worst=5831.0, exit_s=25.5, code=0)]
    + [
        proc(
            200 + i, "pt_data_worker", "dataloader_worker", off=0.25, worst=100.0 + i, exit_s=14.0, code=256 * (i == 7)
        )
        for i in range(184)
    ]
    + [proc(900 + i, f"helper{i}", "child", off=0.01) for i in range(9)]
)


def test_process_table_shows_the_groups_then_what_was_left_out():
    groups = group_processes(RESPAWN)[:6]
    out = table_text(render_processes(groups, more="5 more groups, 5 processes (detail=True)"))
    rows = [line for line in out.splitlines() if line.startswith(("python3", "pt_data_worker", "helper"))]
    assert len(rows) == 6
    worker = next(line for line in rows if line.startswith("pt_data_worker"))
    assert " 184 " in worker and "200…" in worker and "46.00s" in worker and "1 failed" in worker
    assert "and 5 more groups, 5 processes (tracer stats --all)" in out
    assert "processes grouped by (comm, parent, role, rank); one row each: tracer stats --all" in out


def test_busy_threads_say_how_many_were_left_out():
    b = BusyThread(
        pid=7, tid=7, comm="py", process_comm="py", role="rank", core_share=0.9, cuda_calls=1, headline="cpu 90%"
    )
    assert "and 3 more busy threads: tracer stats --all" in table_text(render_busy_threads([b], more=3))
    assert "more" not in table_text(render_busy_threads([b]))


def test_process_table_all_has_one_row_per_process():
    out = table_text(render_processes([], every=RESPAWN), width=160)
    assert sum(line.startswith("pt_data_worker") for line in out.splitlines()) == 184
    assert "more" not in out and "grouped" not in out


def test_numbers_are_never_cut_in_the_process_table():
    # the widest real names at 120 columns: rich narrows comm/role, never a number
    many = [proc(4_194_000, "a-very-long-process-name", "dataloader_worker", calls=123_456_789, off=12345.67)]
    out = table_text(render_processes(group_processes(many * 2)), width=120)
    for number in ("246,913,578", "24691.34s", "12345.67s", "4194000…"):
        assert number in out, out


def test_long_evidence_lists_and_pids_say_how_many_in_all():
    evidence = {
        "wave_times_s": [float(i) for i in range(49)],
        "forks": 147,
        "worst_call_ms": 21.2,
        "stalls": [{"wave_s": i, "slow_calls": 10 + i} for i in range(12)],
    }
    out = " ".join(table_text(Group(*_evidence_view(evidence))).split())
    assert "wave_times_s: 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, … (49 in all)" in out and "48.0" not in out
    assert "forks 147 · worst_call_ms 21.2" in out
    assert "wave_s=4, slow_calls=14" in out and "wave_s=5," not in out and "… (12 in all)" in out
    assert _few(list(range(1000, 1017)), 6) == "1000, 1001, 1002, 1003, 1004, 1005, … (17 in all)"
    assert _few([1, 2], 6) == "1, 2"


def test_long_native_runs_are_folded_python_and_cuda_frames_kept():
    native = [Frame(kind="native", module="python3.11", function=f"f{i}", file=None, line=None) for i in range(11)]
    frames = [
        *native,
        Frame(kind="python", module="t.py", function="step", file="t.py", line=94),
        Frame(kind="cuda", module="libcudart", function="cudaStreamSynchronize", file=None, line=None),
    ]
    folded = _fold_native(frames)
    assert folded[:2] == native[:2] and folded[2] == 7 and folded[3:5] == native[-2:] and folded[5:] == frames[11:]
    short = native[:NATIVE_RUN] + frames[11:]
    assert _fold_native(short) == short
    s = StackStat(
        stack_id=1, label="t.py:94 step", calls=1, avg_us=1, min_us=1, max_us=1, total_bytes=0, pids=[1], frames=frames
    )
    out = text_of(StacksResult(op="x", pid=None, op_calls_total=1, stored_calls=1, distinct_stacks=4, stacks=[s]))
    assert "⋮ 7 native frames" in out and "f4" not in out and "f10" in out and "t.py:94" in out
    assert "and 3 more stacks" in out
