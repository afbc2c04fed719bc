"""`--max-db-size` under a long recording (issue 21): does the file with its WAL stay under the cap, at every
moment, checkpoints included, however long the recording runs?

A real recording is made first: `tracer record` (real eBPF) of fixtures/workloads/train.py --persistent-workers,
every call stored and every launch traced, uncapped (~380 KB of rows a second on the 2-vCPU VM). Its time-placed
rows are then replayed through the recorder's own ``Store`` under each cap, in 0.6 s slices as the writer flushes
them, PASSES times over (each pass shifted in time after the last), so a 20 s recording stands for minutes; a
thread samples the file + WAL every 2 ms, and the causal chains are written at the end as ``tracer record`` does.
Figures per cap: the peak (bytes and share of the cap), the final size, the rows thinned, the replay's CPU. Target:
peak <= cap for every cap. A replay is faster than the job it replays (no BPF, no workload), so it writes more a
second than a recording would: a harder case, not an easier one.

    sudo .venv/bin/python -m bench.size_cap [--quick] [--caps 4M,5M,6M,12M] [--passes N]
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from bench.common import TRACER, WORKLOADS, base_parser, need_root, print_table, write_result
from tracer.analysis.chains import store_chains
from tracer.recorder.sizecap import disk_bytes, parse_size
from tracer.recorder.store import Store
from tracer.schema import TABLES

SLICE_NS = 600_000_000  # what the store's writer flushes at once (FLUSH_S)
NS = 1_000_000_000
UNTIMED_SKIP = {"meta", "dropped_rows", "causal_chains"}  # written by the Store itself, or at the end


def record_source(db: Path, seconds: int) -> None:
    """Record train.py for ``seconds``, every call stored, uncapped."""
    cmd = [str(TRACER), "record", "--db", str(db), "--max-events", "10000000", "--overhead-budget", "100", "--",
           sys.executable, str(WORKLOADS / "train.py"), "--persistent-workers", "--steps", "10000000",
           "--duration", str(seconds)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=seconds + 120)


def _timed_tables() -> dict[str, str]:
    """Each table with a time column, and that column (ts_ns, or the second of a per-second row)."""
    out: dict[str, str] = {}
    for t in TABLES:
        col = next((c for c in ("ts_ns", "sec") if c in t.column_names), None)
        if col and t.name not in UNTIMED_SKIP:
            out[t.name] = col
    return out


def replay(src: Path, dst: Path, cap: int, passes: int) -> dict[str, Any]:
    """Replay ``src`` through a Store capped at ``cap``; return the peak and final sizes and what was thinned."""
    timed = _timed_tables()
    with duckdb.connect(str(src), read_only=True) as s:
        data = {t: s.sql(f"SELECT * FROM {t}").to_arrow_table() for t in timed}
        untimed = [t.name for t in TABLES if t.name not in timed and t.name not in UNTIMED_SKIP]
        rest = {t: s.sql(f"SELECT * FROM {t}").to_arrow_table() for t in untimed}
    rest = {t: tb for t, tb in rest.items() if tb.num_rows}
    pos = {t: tb.column(c).to_numpy(zero_copy_only=False) * (NS if c == "sec" else 1) for (t, tb), c in
           zip(data.items(), timed.values(), strict=True)}  # fmt: skip
    end_ns = max((int(p.max()) for p in pos.values() if len(p)), default=0) + SLICE_NS
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], disk_bytes(dst))

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    store = Store(dst, force=True, max_bytes=cap)
    try:
        for n in range(passes):
            shift = n * end_ns
            for lo in range(0, end_ns, SLICE_NS):
                for t, col in timed.items():
                    keep = (pos[t] >= lo) & (pos[t] < lo + SLICE_NS)
                    if not keep.any():
                        continue
                    part = data[t].filter(pa.array(keep))
                    cols = {c: part.column(c) for c in part.column_names}
                    if shift:
                        step = shift // NS if col == "sec" else shift
                        cols[col] = pc.add(cols[col], pa.scalar(step, type=cols[col].type))
                    store.put(t, cols)
                store.sync()
        for t, tb in rest.items():
            store.put(t, {c: tb.column(c) for c in tb.column_names})
        assert store.thinner is not None
        note = store.thinner.note()
        dropped = {t: d.rows for t, d in store.thinner.dropped.items()}
        store.close()
        store_chains(dst)
    finally:
        done.set()
        watcher.join()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    final = disk_bytes(dst)
    return {
        "cap_bytes": cap,
        "passes": passes,
        "replayed_s": round(passes * end_ns / NS, 1),
        "peak_bytes": max(peak[0], final),
        "peak_share": round(max(peak[0], final) / cap, 3),
        "final_bytes": final,
        "rows_dropped": dropped,
        "cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 2),
        "note": note,
    }


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--caps", default=None, help="comma-separated caps (default 4M,5M,6M,12M; --quick 5M)")
    p.add_argument("--passes", type=int, default=None, help="replays of the recording (default 6, --quick 2)")
    p.add_argument("--seconds", type=int, default=20, help="the recording's length (default 20)")
    args = p.parse_args(argv)
    need_root("bench.size_cap")
    caps = [parse_size(c) for c in (args.caps or ("5M" if args.quick else "4M,5M,6M,12M")).split(",")]
    passes = args.passes or (2 if args.quick else 6)
    with tempfile.TemporaryDirectory(prefix="bench-size-cap-") as tmp:
        src = Path(tmp) / "source.duckdb"
        record_source(src, args.seconds)
        source_bytes = disk_bytes(src)
        runs = [replay(src, Path(tmp) / f"capped-{cap}.duckdb", cap, passes) for cap in caps]
    res = {"source_bytes": source_bytes, "source_seconds": args.seconds, "runs": runs}
    res["all_under_cap"] = all(r["peak_bytes"] <= r["cap_bytes"] for r in runs)
    print_table(
        [
            [
                f"{r['cap_bytes'] / 2**20:g} MiB",
                r["replayed_s"],
                r["peak_bytes"] / 2**20,
                r["peak_share"],
                r["final_bytes"] / 2**20,
                r["rows_dropped"].get("cuda_calls", 0),
                r["cpu_s"],
            ]
            for r in runs
        ],
        ["cap", "replayed s", "peak MiB", "peak/cap", "final MiB", "calls dropped", "CPU s"],
    )
    print(f"wrote {write_result('size_cap', res, args.out)}")
    return 0 if res["all_under_cap"] else 1


if __name__ == "__main__":
    sys.exit(main())
