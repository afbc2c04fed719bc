"""tracer/recorder/columns.py: the column builders, on hand-built record batches (no BPF)."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa

from probes.catalog import OP_IDS
from tracer.recorder import columns, events
from tracer.recorder.proctree import ProcInfo, ThreadInfo
from tracer.recorder.store import Store

START = 1_000_000_000_000


def test_call_columns_take_names_masks_and_relative_times() -> None:
    ev = np.zeros(2, dtype=events.CALL_DTYPE)
    ev["ts_ns"] = [START + 10, START + 20]
    ev["op"] = [OP_IDS["cudaMemcpy"], OP_IDS["cudaLaunchKernel"]]
    ev["kind"] = [2, 255]
    ev["bytes"] = [4, 99]
    cols = columns.call_columns(ev, START, [None, "k"], [None, None], [None, 3])
    t = pa.table({k: v if isinstance(v, pa.Array) else pa.array(v) for k, v in cols.items()})
    assert t["ts_ns"].to_pylist() == [10, 20]
    assert t["op"].to_pylist() == ["cudaMemcpy", "cudaLaunchKernel"]
    assert t["kind"].to_pylist() == ["DtoH", None]
    assert t["bytes"].to_pylist() == [4, None]  # a launch carries no byte count
    assert t["kernel"].to_pylist() == [None, "k"] and t["stack_id"].to_pylist() == [None, 3]


def _tb(rows_: list[tuple[int, int, int, dict[str, int]]]) -> columns.Aggregates:
    keys = np.zeros(len(rows_), dtype=events.TB_KEY_DTYPE)
    vals = np.zeros(len(rows_), dtype=events.TB_VAL_DTYPE)
    for i, (tid, sec, pid, parts) in enumerate(rows_):
        keys[i] = (tid, sec)
        vals[i]["pid"] = pid
        for name, v in parts.items():
            vals[i]["v"][events.TB_COLUMNS[name]] = v
    return columns.Aggregates(keys, vals)


def test_breakdown_parts_add_up_and_launches_seen_part_time_are_scaled_from_cpu() -> None:
    # GIVEN a second with 100 ms seen in launches while the launch probes were live 25% of it
    tb = _tb(
        [
            (
                7,
                3,
                5,
                {"cpu_ns": 600_000_000, "launch_ns": 100_000_000, "sync_ns": 200_000_000, "blocked_ns": 100_000_000},
            )
        ]
    )
    cols = columns.breakdown_columns(tb, lambda sec: 0.25 if sec == 3 else 1.0)
    # THEN launches are estimated at 400 ms, the 300 ms moved out of cpu_ns, and the parts still add up
    assert cols["launch_ns"][0] == 400_000_000 and cols["cpu_ns"][0] == 300_000_000
    assert cols["wall_ns"][0] == 1_000_000_000
    assert cols["launch_sampled"][0] == 0.25


def test_breakdown_never_moves_more_than_the_cpu_time() -> None:
    tb = _tb([(7, 0, 5, {"cpu_ns": 10, "launch_ns": 100})])
    cols = columns.breakdown_columns(tb, lambda sec: 0.1)
    assert cols["cpu_ns"][0] == 0 and cols["launch_ns"][0] == 110 and cols["wall_ns"][0] == 110


def test_sched_stats_come_from_the_same_rows() -> None:
    tb = _tb(
        [(7, 0, 5, {"runq_self_ns": 5, "runq_other_ns": 7, "blocked_ns": 11, "call_off_cpu_ns": 13, "call_runq_ns": 3})]
    )
    cols = columns.sched_stats_columns(tb)
    assert cols["runq_ns"][0] == 5 + 7 + 3
    assert cols["off_cpu_ns"][0] == 5 + 7 + 11 + 13


def test_op_stats_scale_cycled_launches_per_process_only() -> None:
    keys = np.zeros(2, dtype=events.OP_KEY_DTYPE)
    keys[0], keys[1] = (9, OP_IDS["cudaLaunchKernel"]), (9, OP_IDS["cudaStreamSynchronize"])
    vals = np.zeros(2, dtype=events.OP_TOTAL_DTYPE)
    vals["calls"] = [50, 10]
    hk = np.zeros(0, dtype=events.HIST_KEY_DTYPE)
    cols, summary = columns.op_stats_columns(
        columns.Aggregates(keys, vals),
        columns.Aggregates(hk, np.zeros(0, dtype=events.COUNT_DTYPE)),
        {9: columns.LaunchScale(0.25, 3.0)},
    )
    assert cols["calls"] == [200, 10] and cols["sampled_fraction"] == [0.25, 1.0] and cols["error_pct"] == [3.0, 0.0]
    assert [s.op for s in summary] == ["cudaLaunchKernel", "cudaStreamSynchronize"]


def test_process_and_thread_columns_keep_roles_and_spans() -> None:
    procs = [ProcInfo(2, 1, "python", "python t.py", 5), ProcInfo(1, 0, "tracer", "", 0, role="tracer")]
    cols = columns.process_columns(procs)
    assert cols["pid"] == [1, 2] and cols["role"] == ["tracer", "target"]
    threads = [ThreadInfo(2, 2, "python", 5, 50, True), ThreadInfo(2, 3, "live", 6)]  # no end: not written
    tcols = columns.thread_columns(threads, {2: 11})
    assert tcols["tid"] == [2] and tcols["cuda_calls"] == [11] and tcols["end_ns"] == [50]


def test_proc_event_columns_leave_thread_ends_to_the_threads_table() -> None:
    ev = np.zeros(3, dtype=events.PROC_DTYPE)
    ev["kind"] = [events.C.PROC_FORK, events.C.PROC_THREAD_END, events.C.PROC_EXIT]
    ev["ts_ns"] = START
    ev["pid"], ev["ppid"], ev["child"], ev["exit_code"] = [5, 5, 5], [4, 0, 0], [5, 0, 0], [0, 0, 256]
    cols = columns.proc_event_columns(ev, START)
    assert cols["kind"] == ["fork", "exit"]
    assert cols["ppid"].to_pylist() == [4, None] and cols["exit_code"].to_pylist() == [None, 256]


def test_a_stack_line_no_source_file_has_is_stored_as_unknown(tmp_path) -> None:
    # GIVEN a Python frame whose line came from a table read while its code object was freed (any 64-bit value)
    frames = [
        ("py", "m", "f", "a.py", 12, False),
        ("py", "m", "g", "a.py", 2**40, False),
        ("py", "m", "h", "a.py", 0, True),
    ]
    # WHEN its stack is written through the store
    s = Store(tmp_path / "t.duckdb")
    s.put("stacks", columns.stack_columns(7, frames))
    s.close()
    # THEN the recording keeps the stack, the impossible lines as unknown, instead of failing the whole batch
    with duckdb.connect(str(tmp_path / "t.duckdb"), read_only=True) as c:
        rows = c.execute("SELECT depth, line FROM stacks WHERE stack_id = 7 ORDER BY depth").fetchall()
    assert rows == [(0, 12), (1, None), (2, None)]
