"""Time `tracer dump` (the snapshot, without the CLI's start-up) on a process with 100 threads, each a few
Python frames deep and blocked in a lock acquire. Issue 29's target: under 1 s. Also the whole command,
``tracer dump --pid P --json`` (the CLI's start-up included), end to end. Writes bench/results/dump.json.

Usage: .venv/bin/python bench/dump.py [--threads N] [--python PATH] [--runs N]"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CHILD = """
import sys, threading, time
lock = threading.Lock(); lock.acquire()
def deep(n):
    if n == 0:
        lock.acquire()
    deep(n - 1)
for _ in range(int(sys.argv[1]) - 1):
    threading.Thread(target=deep, args=(5,), daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=100)
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    sys.path.insert(0, ".")
    from bench.common import median, spread, write_result
    from tracer.snapshot.dump import Dumper

    proc = subprocess.Popen([a.python, "-c", CHILD, str(a.threads)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        snap_ms: list[float] = []
        cli_ms: list[float] = []
        counts: tuple[int, int] = (0, 0)
        for run in range(a.runs):
            t0 = time.perf_counter()
            threads = Dumper().tree(proc.pid)  # a fresh Dumper: the cold cost, ELF analysis included
            dt = time.perf_counter() - t0
            with_py = sum(1 for t in threads if t.frames)
            counts = (len(threads), with_py)
            snap_ms.append(dt * 1000)
            print(f"run {run}: {len(threads)} threads ({with_py} with Python frames) in {dt * 1000:.0f} ms")
        tracer = os.path.join(os.path.dirname(sys.executable), "tracer")
        for run in range(a.runs):
            t0 = time.perf_counter()
            r = subprocess.run([tracer, "dump", "--pid", str(proc.pid), "--json"], capture_output=True, text=True)
            dt = time.perf_counter() - t0
            assert r.returncode == 0, r.stderr
            cli_ms.append(dt * 1000)
            print(f"cli {run}: tracer dump --json in {dt * 1000:.0f} ms")
        load = os.getloadavg()[0]
        path = write_result(
            "dump",
            {
                "threads": counts[0],
                "with_python_frames": counts[1],
                "snapshot_ms": {"median": median(snap_ms), **spread(snap_ms), "runs": snap_ms},
                "cli_ms": {"median": median(cli_ms), **spread(cli_ms), "runs": cli_ms},
                "target_ms": 1000,
                "within_target": max(snap_ms) <= 1000,
                "load_avg_1m": load,
            },
        )
        print(f"snapshot median {median(snap_ms):.0f} ms, cli median {median(cli_ms):.0f} ms, load {load:.1f}: {path}")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
