"""The recorder's memory under process churn (issue 21): does `tracer record` give back what it kept for each
process once the process has exited and its rows are written?

`tracer record` (the real CLI, defaults, real eBPF) launches fixtures/workloads/fork_churn.py, which starts
--procs short-lived processes (fork+exec of /bin/true, as fast as the machine allows, or at --rate a second).
Once a second the bench reads VmRSS from /proc/PID/status of the recorder (the `tracer record` Python process)
and of its other children (the guardian; the launched command and its children are the target, not the tracer),
with how many processes the workload has started so far (its ``started N`` lines). Figures: RSS after warm-up
(median of the samples with 10-20% of the processes started), at the end (90-100%), the growth between them, a
least-squares slope per 100 K processes, the peak, and the fork rate. Target: growth <= 20 MiB over 100 K
processes. Also read from the recording: the ``processes`` rows of the children (one each, with its exit), the
fork events and the lifecycle events lost (the session's notes).

    sudo .venv/bin/python -m bench.churn_memory [--quick] [--procs N] [--rate R]
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import duckdb

from bench.common import TRACER, WORKLOADS, base_parser, need_root, print_table, write_result

MIB = 1 << 20
WARMUP_SHARE = 0.10  # RSS is read from here on: start-up and the first processes' one-off costs are behind
TARGET_GROWTH_MIB = 20.0  # over 100 K processes


@dataclass
class Sample:
    t_s: float  # since `tracer record` started
    started: int  # processes the workload had started
    recorder_rss: int  # bytes, the `tracer record` process
    children_rss: int  # bytes, the tracer's other processes (the guardian)


def vm_rss(pid: int) -> int | None:
    """VmRSS of ``pid`` in bytes; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else 0


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's list)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except OSError:
        pass
    return out


def is_workload(pid: int) -> bool:
    try:
        return b"fork_churn.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def summarize(samples: list[Sample], procs: int) -> dict[str, Any]:
    """RSS after warm-up, at the end and the growth, from the once-a-second samples (pure; the smoke test feeds
    it hand-built samples). The recorder's RSS saws up and down by ~20 MiB as DuckDB fills and checkpoints its
    write-ahead log, so each point is the median of a stretch: warm-up is the samples with 10-20% of the processes
    started, the end those with 90-100%; ``slope_per_100k_mib`` is a least-squares fit over every sample from 10%."""
    if not samples:
        return {"warmup": None, "end": None, "growth_mib": None, "slope_per_100k_mib": None, "peak_mib": None}
    after = [s for s in samples if s.started >= WARMUP_SHARE * procs] or samples[-1:]
    warm = [s for s in after if s.started < 2 * WARMUP_SHARE * procs] or after[:1]
    end = [s for s in after if s.started >= 0.9 * procs] or after[-1:]

    def point(ss: list[Sample]) -> dict[str, Any]:
        return {
            "t_s": [round(ss[0].t_s, 1), round(ss[-1].t_s, 1)],
            "started": [ss[0].started, ss[-1].started],
            "recorder_mib": round(statistics.median(s.recorder_rss for s in ss) / MIB, 1),
            "children_mib": round(statistics.median(s.children_rss for s in ss) / MIB, 1),
        }

    w, e = point(warm), point(end)
    slope = None
    xs = [s.started for s in after]
    if len(after) >= 3 and max(xs) > min(xs):
        mx, my = statistics.fmean(xs), statistics.fmean(s.recorder_rss for s in after)
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((s.started - mx) * (s.recorder_rss - my) for s in after)
        slope = round(sxy / sxx * 100_000 / MIB, 1)
    return {
        "warmup": w,
        "end": e,
        "growth_mib": round(e["recorder_mib"] - w["recorder_mib"], 1),
        "growth_with_children_mib": round(
            e["recorder_mib"] + e["children_mib"] - w["recorder_mib"] - w["children_mib"], 1
        ),
        "slope_per_100k_mib": slope,
        "peak_mib": round(max(s.recorder_rss for s in samples) / MIB, 1),
    }


def lost_events(notes: str | None, what: str) -> int:
    """The count of ``what`` the session's notes say were lost to a full ring buffer (0 when none)."""
    m = re.search(rf"^(\d+) {what} lost", notes or "", re.M)
    return int(m.group(1)) if m else 0


def run(procs: int, rate: float, db: Path) -> dict[str, Any]:
    """One `tracer record -- fork_churn.py`, sampled once a second; returns the samples' summary and the
    recording's own figures."""
    cmd = [
        str(TRACER),
        "record",
        "--db",
        str(db),
        "--force",
        "--",
        "/usr/bin/python3",
        str(WORKLOADS / "fork_churn.py"),
        "--procs",
        str(procs),
        "--progress",
        "500",
        *(["--rate", str(rate)] if rate else []),
    ]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = [0]
    churn_line: list[str] = []
    err_tail: list[str] = []

    def follow_stdout() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("started "):
                started[0] = int(line.split()[1])

    def follow_stderr() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            if line.startswith("fork_churn:"):
                churn_line.append(line.strip())
            err_tail.append(line)
            del err_tail[:-40]

    readers = [threading.Thread(target=f, daemon=True) for f in (follow_stdout, follow_stderr)]
    for r in readers:
        r.start()
    samples: list[Sample] = []
    workload_seen = False
    while p.poll() is None:
        time.sleep(1.0)
        rss = vm_rss(p.pid)
        kids = children(p.pid)
        work = [k for k in kids if is_workload(k)]
        workload_seen = workload_seen or bool(work)
        if rss is None or (workload_seen and not work):
            break  # the workload has exited: the recorder's final flush follows, not churn any more
        others = sum(vm_rss(k) or 0 for k in kids if k not in work)
        samples.append(Sample(time.monotonic() - t0, started[0], rss, others))
    rc = p.wait()
    for r in readers:
        r.join(timeout=5)
    if rc != 0:
        raise RuntimeError(f"tracer record exited {rc}:\n{''.join(err_tail)}")
    out = summarize(samples, procs)
    out["samples"] = [asdict(s) for s in samples]
    m = re.search(r"procs=(\d+) seconds=([\d.]+) rate=(\d+)/s", churn_line[0] if churn_line else "")
    out["workload"] = (
        {"procs": int(m.group(1)), "seconds": float(m.group(2)), "rate_per_s": int(m.group(3))} if m else None
    )
    db_bytes = db.stat().st_size + sum(f.stat().st_size for f in db.parent.glob(db.name + ".wal"))
    with duckdb.connect(str(db), read_only=True) as con:
        s = con.execute("SELECT recorder_peak_rss_bytes, recorder_cpu_s, duration_s, notes FROM session").fetchone()
        rows, exited = con.execute(
            "SELECT count(*), count(exit_ns) FROM processes WHERE role = 'target' AND comm = 'true'"
        ).fetchone() or (0, 0)
        forks = con.execute("SELECT count(*) FROM process_events WHERE kind = 'fork'").fetchone()
    out["recording"] = {
        "peak_rss_mib": round((s[0] or 0) / MIB, 1) if s else None,
        "recorder_cpu_s": s[1] if s else None,
        "duration_s": s[2] if s else None,
        "notes": s[3] if s else None,
        "process_rows_true": rows,
        "process_rows_true_exited": exited,
        "fork_events": forks[0] if forks else None,
        "lifecycle_events_lost": lost_events(s[3] if s else None, "lifecycle events"),
        # DuckDB keeps the blocks it wrote in its buffer pool (duckdb_memory()'s BASE_TABLE grows about as the file
        # does): part of the recorder's growth is the recording itself
        "db_mib": round(db_bytes / MIB, 1),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--procs", type=int, default=None, help="processes to churn (default 100,000, --quick 10,000)")
    p.add_argument("--rate", type=float, default=0.0, help="starts a second (default 0: as fast as it goes)")
    args = p.parse_args(argv)
    need_root("bench.churn_memory")
    procs = args.procs or (10_000 if args.quick else 100_000)
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
        res = run(procs, args.rate, Path(tmp) / "t.duckdb")
    res["procs"] = procs
    res["target_growth_mib_per_100k"] = TARGET_GROWTH_MIB
    w, e = res["warmup"], res["end"]
    wl = res["workload"] or {}
    print_table(
        [
            [
                procs,
                wl.get("rate_per_s"),
                w and w["recorder_mib"],
                e and e["recorder_mib"],
                res["growth_mib"],
                res["slope_per_100k_mib"],
                res["peak_mib"],
                e and e["children_mib"],
                res["recording"]["process_rows_true_exited"],
                res["recording"]["lifecycle_events_lost"],
            ]
        ],
        [
            "procs",
            "forks/s",
            "RSS warm MiB",
            "RSS end MiB",
            "growth MiB",
            "fit MiB/100 K",
            "peak MiB",
            "guardian MiB",
            "exited rows",
            "events lost",
        ],
    )
    print(f"wrote {write_result('churn_memory', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
