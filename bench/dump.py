"""Time `tracer dump` (the snapshot, without the CLI's start-up) on a process with 100 threads, each a few
Python frames deep and blocked in a lock acquire. Issue 29's target: under 1 s.

Usage: .venv/bin/python bench/dump.py [--threads N] [--python PATH]"""

from __future__ import annotations

import argparse
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
    from tracer.snapshot.dump import Dumper

    proc = subprocess.Popen([a.python, "-c", CHILD, str(a.threads)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        for run in range(a.runs):
            t0 = time.perf_counter()
            threads = Dumper().tree(proc.pid)  # a fresh Dumper: the cold cost, ELF analysis included
            dt = time.perf_counter() - t0
            with_py = sum(1 for t in threads if t.frames)
            print(f"run {run}: {len(threads)} threads ({with_py} with Python frames) in {dt * 1000:.0f} ms")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
