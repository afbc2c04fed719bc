"""tracer/recorder/session.py: what the recorder keeps per process is released once the process has exited and its
rows are written (issue 21), fed events as the drain loop feeds them (no BPF)."""

from __future__ import annotations

import ctypes as ct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import duckdb
import numpy as np

from probes.catalog import OP_IDS
from tracer.recorder import columns, events, finalize
from tracer.recorder.placement import PlacementWatch
from tracer.recorder.procmaps import MapCache, Mapping
from tracer.recorder.proctree import ProcessTree, ProcInfo, Retired
from tracer.recorder.pyruntime import PyRuntimeManager
from tracer.recorder.session import RETIRE_AFTER_NS, Recorder, RecordOptions
from tracer.recorder.stack_resolver import StackResolver
from tracer.recorder.store import Store

START = 7_000_000_000
ROOT = 5_000_000  # above any pid_max (2^22): no /proc entry, whatever runs on this machine
C = events.C


class _NoLoss:
    """The ``lost`` counters of a BPF program that lost nothing."""

    def __getitem__(self, _i: ct.c_int) -> Any:
        return SimpleNamespace(value=0)


def _recorder(db: Path) -> Recorder:
    """A Recorder with its per-process parts as run() builds them, and no BPF."""
    rec = Recorder(RecordOptions(db=db))
    rec.start_mono = START
    rec.bpf = {"lost": _NoLoss()}
    rec.tree = ProcessTree(START)
    rec.tree.procs[ROOT] = ProcInfo(ROOT, 1, "python", "python churn.py", 0)
    rec.maps = MapCache()
    rec.maps.add(ROOT, Mapping(0x400000, 0x500000, 0, "/usr/bin/python3", "/usr/bin/python3"))
    rec.pyrt = PyRuntimeManager(None)
    rec.resolver = StackResolver(
        rec.maps,
        rec.pyrt,
        native_walk=lambda _sid: [],
        put_stack=lambda _sid, _frames: None,
        parent_of=lambda pid: rec.tree.procs[pid].ppid if pid in rec.tree.procs else None,
    )
    rec.store = Store(db, start_mono_ns=START)
    rec.placement = PlacementWatch()
    return rec


def _proc_events(rows: list[tuple[int, int, int, int, dict[str, int]]]) -> np.ndarray:
    ev = np.zeros(len(rows), dtype=events.PROC_DTYPE)
    for i, (kind, pid, ppid, ts, extra) in enumerate(rows):
        ev[i]["kind"], ev[i]["pid"], ev[i]["ppid"], ev[i]["ts_ns"], ev[i]["comm"] = kind, pid, ppid, START + ts, b"w"
        for k, v in extra.items():
            ev[i][k] = v
    return ev


def _stack(ref: int, pid: int) -> bytes:
    h = np.zeros(1, dtype=events.STACK_HEADER_DTYPE)
    h["stack_ref"], h["pid"], h["tid"], h["native_id"] = ref, pid, pid, -1
    return h.tobytes()


def _sizes(rec: Recorder) -> dict[str, int]:
    r, py, m = rec.resolver, rec.pyrt, rec.maps
    return {
        "procs": len(rec.tree.procs),
        "threads": len(rec.tree.threads),
        "maps": len(m._maps) + len(m._refreshed) + len(m._stale),
        "py_targets": len(py.targets),
        "py_parents": len(py.parents),
        "py_codes": len(py._codes),
        "py_pending": len(rec._py_pending),
        "stack_hashes": len(r._frames) + len(r._pending) + len(r._ref_op) + len(r._refs_of) + len(r._ustacks),
        "kernel_names": len(r.handle_names) + len(r._kernels),
        "calls_by_tid": len(rec._calls_by_tid),
        "placement": len(rec.placement._last),
    }


def test_per_process_state_is_released_when_processes_exit(tmp_path: Path) -> None:
    # GIVEN a recorder tracing a root process
    rec = _recorder(tmp_path / "t.duckdb")
    before = _sizes(rec)
    n = 300
    launch = OP_IDS["cudaLaunchKernel"]
    # WHEN the root forks n workers, each exec'd, with a mapping, a stack, Python code objects, a named kernel and
    # CUDA calls of its thread, and each exits
    for i in range(n):
        pid, ts = ROOT + 1 + i, 1_000 * i
        rec._handle_proc(
            _proc_events([(C.PROC_FORK, pid, ROOT, ts, {"child": pid}), (C.PROC_EXEC, pid, 0, ts + 1, {})])
        )
        rec.maps.add(pid, Mapping(0x600000, 0x700000, 0, "/usr/bin/true", "/usr/bin/true"))
        rec.resolver.add_stacks([_stack(0x1000 + 2 * i + 1, pid)])
        rec.resolver.stack_ids(np.array([0x1000 + 2 * i + 1], dtype=np.uint64), np.array([launch]))
        kn = np.zeros(1, dtype=events.KNAME_DTYPE)
        kn["pid"], kn["handle"], kn["name"] = pid, 0x5000, b"kern"
        rec.resolver.add_knames(kn)
        rec.resolver.kernel(pid, 0x6000)
        code = np.zeros(1, dtype=events.CODE_DTYPE)
        code["pid"], code["code"], code["qualname"], code["filename"] = pid, 0x9000, b"step", b"w.py"
        rec.pyrt.add_code_events(code)
        rec._calls_by_tid[pid] = 3
        rec._handle_proc(
            _proc_events(
                [
                    (C.PROC_THREAD_END, pid, 0, ts + 5, {"tid": pid, "aux": START + ts}),
                    (C.PROC_EXIT, pid, 0, ts + 6, {"exit_code": 0}),
                ]
            )
        )
    during = _sizes(rec)
    assert during["procs"] == before["procs"] + n and during["stack_hashes"] > before["stack_hashes"]
    # ...and the recorder retires them once their last events are surely drained
    rec._retire(1_000 * n + RETIRE_AFTER_NS)
    after = _sizes(rec)
    rec.store.close()  # before any assertion: a DuckDB connection left open at exit makes nanobind complain
    # THEN every per-process container is back to its size before
    assert after == before
    # ...and each process and thread has its final row
    with duckdb.connect(str(tmp_path / "t.duckdb"), read_only=True) as con:
        procs = con.execute("SELECT count(*), count(exit_ns), count(DISTINCT pid) FROM processes").fetchone()
        threads = con.execute("SELECT count(*), sum(cuda_calls) FROM threads WHERE exited").fetchone()
    assert procs == (n, n, n) and threads == (n, 3 * n)
    assert rec.tree.target_count() == n + 1


def test_a_retired_process_replaces_its_live_snapshot_row(tmp_path: Path) -> None:
    # GIVEN a live snapshot wrote process 101 while it ran
    store = Store(tmp_path / "t.duckdb", start_mono_ns=START)
    p = ProcInfo(101, 100, "w", "w", 5)
    store.put("processes", columns.process_columns([p]))
    written = finalize.Rewritable(procs={(101, 5)})
    # WHEN it exits and retires
    p.exit_ns, p.exit_code = 50, 0
    try:
        finalize.write_retired(store, Retired(procs=[p]), {}, written)
    finally:
        store.close()
    # THEN its one row is the final one, and the next snapshot will not delete it
    with duckdb.connect(str(tmp_path / "t.duckdb"), read_only=True) as con:
        assert con.execute("SELECT pid, exit_ns FROM processes").fetchall() == [(101, 50)]
    assert written.procs == set()
