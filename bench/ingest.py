"""How fast the user-space path turns call events into DB rows, and what an end-to-end run stores and loses.

Part 1 (no BPF, one core): synthetic ``call_event`` records (tracer/recorder/events.py CALL_DTYPE, the launch-heavy
reference mix), laid out as the kernel's ring buffer lays them out (8-byte headers, 8-byte aligned), are pushed
through the real path in drain-sized batches: ``ringbuf.read_records`` (what ``DirectRing.drain`` does with the
mapped ring), the recorder's call path (``StackResolver.kernels`` and ``stack_ids``, ``rows.call_columns``) and
``tracer.recorder.store.Store`` (the writer thread's Arrow appends), ending with ``Store.sync``. Reports events/s and
the
recorder's CPU seconds per 100 K events (process CPU, writer thread included), with a per-stage split.

Part 2 (root): a C program calls the stand-in ``cudaFree(NULL)`` in a tight loop from 2 threads under
``tracer record``; op_stats.calls (exact, counted in BPF) is compared with the stored cuda_calls rows and
session.events_lost. Run once with sampling off (--max-events huge: calls = rows + lost unless the recorder
drops something silently) and once with the default budget (the rest is sampled out by design).

    .venv/bin/python -m bench.ingest --no-e2e      # part 1 only, no root
    sudo .venv/bin/python -m bench.ingest [--quick]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from bench.common import FIXTURE_LIBS, TRACER, base_parser, build_fixtures, print_table, write_result
from probes.catalog import OP_NAMES
from tracer.recorder.columns import call_columns
from tracer.recorder.events import CALL_DTYPE
from tracer.recorder.procmaps import MapCache
from tracer.recorder.ringbuf import read_records, stride_of
from tracer.recorder.stack_resolver import StackResolver
from tracer.recorder.store import Store

# The reference mix per second: 5000 launches, 200 syncs, 200 async copies, 50 allocations (+ 50 frees).
MIX = {"cudaLaunchKernel": 5000, "cudaStreamSynchronize": 200, "cudaMemcpyAsync": 200, "cudaMalloc": 50, "cudaFree": 50}
# Events per batch: one 200 ms drain (tracer.recorder.session.DRAIN_S) at 25 K events/s.
BATCH = 5_000
N_EVENTS, QUICK_EVENTS = 1_000_000, 200_000
E2E_PER_THREAD, QUICK_E2E_PER_THREAD = 200_000, 50_000

HAMMER_C = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
extern int cudaFree(void *p);
static long n;
static void *work(void *a) { for (long i = 0; i < n; i++) cudaFree(0); return a; }
int main(int argc, char **argv) {
    n = atol(argv[1]);
    pthread_t t[2];
    struct timespec s, e;
    clock_gettime(CLOCK_MONOTONIC, &s);
    for (int i = 0; i < 2; i++) pthread_create(&t[i], 0, work, 0);
    for (int i = 0; i < 2; i++) pthread_join(t[i], 0);
    clock_gettime(CLOCK_MONOTONIC, &e);
    fprintf(stderr, "hammer: calls=%ld wall=%.6f\n", 2 * n, (e.tv_sec - s.tv_sec) + (e.tv_nsec - s.tv_nsec) / 1e9);
    return 0;
}
"""


def synth_events(n: int, seed: int = 1) -> np.ndarray:
    """Return ``n`` call_event records in the reference mix, one process, 4 threads, no stacks."""
    rng = np.random.default_rng(seed)
    names = list(MIX)
    p = np.array([MIX[k] for k in names], dtype=float)
    op_ids = np.array([OP_NAMES.index(k) for k in names], dtype=np.uint16)
    ev = np.zeros(n, dtype=CALL_DTYPE)
    which = rng.choice(len(names), size=n, p=p / p.sum())
    ev["op"] = op_ids[which]
    ev["ts_ns"] = 10**9 + np.arange(n, dtype=np.uint64) * 180_000 // 1000  # ~5.5 K events/s spacing
    ev["dur_ns"] = rng.integers(3_000, 12_000, size=n)
    ev["pid"] = 4242
    ev["tid"] = 4242 + rng.integers(0, 4, size=n)
    launch = ev["op"] == OP_NAMES.index("cudaLaunchKernel")
    ev["func"][launch] = 0x7F0000001000 + 0x40 * rng.integers(0, 3, size=int(launch.sum()))
    ev["stream"] = 0x5000
    ev["bytes"] = np.where(ev["op"] == OP_NAMES.index("cudaMalloc"), 1 << 20, 0)
    ev["kind"][ev["op"] == OP_NAMES.index("cudaMemcpyAsync")] = 1
    return ev


def ingest(events: np.ndarray, db: Path, batch: int = BATCH) -> dict[str, Any]:
    """Push ``events`` through ring read -> the recorder's call path -> Store; return timings and rows."""
    resolver = StackResolver(
        MapCache(), None, native_walk=lambda _i: [], put_stack=lambda _s, _f: None, parent_of=lambda _p: None
    )
    store = Store(db, force=True)

    def handle_calls(ev: np.ndarray) -> None:
        kernels, notes = resolver.kernels(ev)
        ids = resolver.stack_ids(ev["stack_ref"], ev["op"])
        store.put("cuda_calls", call_columns(ev, 0, kernels, notes, ids))

    # the ring's bytes: each record an 8-byte header (its length) and the event, padded to the stride
    stride = stride_of(CALL_DTYPE)
    ring = np.zeros(len(events) * stride, dtype=np.uint8)
    recs = ring.reshape(len(events), stride)
    recs[:, :4] = np.frombuffer(np.uint32(CALL_DTYPE.itemsize).tobytes(), dtype=np.uint8)
    recs[:, 8 : 8 + CALL_DTYPE.itemsize] = events.view(np.uint8).reshape(len(events), CALL_DTYPE.itemsize)
    t_drain = t_handle = 0.0
    c0, w0 = time.process_time(), time.perf_counter()
    for lo in range(0, len(events), batch):
        t1 = time.perf_counter()
        ev, _ = read_records(ring, lo * stride, min(batch, len(events) - lo), CALL_DTYPE)
        t2 = time.perf_counter()
        handle_calls(ev)
        t3 = time.perf_counter()
        t_drain, t_handle = t_drain + t2 - t1, t_handle + t3 - t2
    t = time.perf_counter()
    store.sync()
    t_sync = time.perf_counter() - t
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    rows = store.rows_written.get("cuda_calls", 0)
    store.close()
    n = len(events)
    return {
        "events": n,
        "rows_stored": rows,
        "wall_s": wall,
        "cpu_s": cpu,
        "events_per_s": n / wall if wall else None,
        "cpu_s_per_100k_events": cpu / n * 100_000 if n else None,
        "stage_s": {"ring_read": t_drain, "handle_calls": t_handle, "store_sync": t_sync},
        "stage_us_per_event": {
            k: v / n * 1e6
            for k, v in {
                "ring_read": t_drain,
                "handle_calls": t_handle,
                "store_sync_tail": t_sync,
            }.items()
        },
        "batch_events": batch,
    }


def build_hammer(tmp: Path) -> Path:
    src, exe = tmp / "hammer.c", tmp / "hammer"
    src.write_text(HAMMER_C)
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-pthread",
            "-o",
            str(exe),
            str(src),
            f"-L{FIXTURE_LIBS}",
            "-lcudart",
            f"-Wl,-rpath,{FIXTURE_LIBS}",
        ],
        check=True,
    )
    return exe


def run_hammer(exe: Path, per_thread: int, db: Path | None, extra: list[str]) -> dict[str, Any]:
    """Run the hammer untraced (db None) or under `tracer record`; return its rate and, traced, the DB counts."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(FIXTURE_LIBS))
    cmd = [str(exe), str(per_thread)]
    if db is not None:
        cmd = [str(TRACER), "record", "--db", str(db), "--force", "--no-python-stacks", *extra, "--", *cmd]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    outer = time.monotonic() - t0
    m = re.search(r"hammer: calls=(\d+) wall=([0-9.]+)", p.stderr)
    if p.returncode or not m:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    calls, wall = int(m.group(1)), float(m.group(2))
    r: dict[str, Any] = {"calls_made": calls, "wall_s": wall, "calls_per_s": calls / wall, "outer_wall_s": outer}
    if db is None:
        return r
    con = duckdb.connect(str(db), read_only=True)
    try:
        traced = con.execute("SELECT coalesce(sum(calls), 0) FROM op_stats WHERE op = 'cudaFree'").fetchone()[0]
        rows = con.execute("SELECT count(*) FROM cuda_calls WHERE op = 'cudaFree'").fetchone()[0]
        lost, stored, duration = con.execute("SELECT events_lost, events_stored, duration_s FROM session").fetchone()
    finally:
        con.close()
    r.update(
        op_stats_calls=int(traced),
        cuda_calls_rows=int(rows),
        events_lost=int(lost),
        unaccounted=int(traced) - int(rows) - int(lost),
        loss_fraction=int(lost) / int(traced) if traced else None,
        stored_events_per_s=int(rows) / wall if wall else None,
        recording_s=duration,
    )
    return r


def end_to_end(per_thread: int) -> dict[str, Any]:
    build_fixtures()
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        exe = build_hammer(Path(tmp))
        db = Path(tmp) / "trace.duckdb"
        out = {"per_thread": per_thread, "threads": 2, "function": "cudaFree(NULL) in fixtures/build/libcudart"}
        out["untraced"] = run_hammer(exe, per_thread, None, [])
        out["unsampled"] = run_hammer(exe, per_thread, db, ["--max-events", str(10**9)])
        out["default_budget"] = run_hammer(exe, per_thread, db, [])
        return out


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--events", type=int, default=None, help=f"synthetic events (default {N_EVENTS:,})")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end part (needs root)")
    args = p.parse_args(argv)
    n = args.events or (QUICK_EVENTS if args.quick else N_EVENTS)
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        res: dict[str, Any] = {"synthetic": ingest(synth_events(n), Path(tmp) / "ingest.duckdb")}
    s = res["synthetic"]
    print(
        f"synthetic: {s['events']:,} events  {s['events_per_s']:,.0f} events/s  "
        f"{s['cpu_s_per_100k_events']:.3f} CPU s / 100K events"
    )
    print_table([[k, v] for k, v in s["stage_us_per_event"].items()], ["stage", "µs/event"])
    res["events_per_s"] = s["events_per_s"]
    res["cpu_s_per_100k_events"] = s["cpu_s_per_100k_events"]
    res["end_to_end"] = None
    if not args.no_e2e:
        if os.geteuid() != 0:
            sys.exit("the end-to-end part needs root: run with sudo, or pass --no-e2e")
        e = end_to_end(QUICK_E2E_PER_THREAD if args.quick else E2E_PER_THREAD)
        res["end_to_end"] = e
        rows = [
            [
                k,
                e[k]["calls_per_s"],
                e[k].get("op_stats_calls"),
                e[k].get("cuda_calls_rows"),
                e[k].get("events_lost"),
                e[k].get("unaccounted"),
                e[k].get("loss_fraction"),
            ]
            for k in ("untraced", "unsampled", "default_budget")
        ]
        print_table(rows, ["run", "calls/s", "op_stats.calls", "rows", "lost", "unaccounted", "loss"])
    print(f"wrote {write_result('ingest', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
