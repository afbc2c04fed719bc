"""The node agent's own CPU and memory with no CUDA process to trace (issue 32: <= 1% of a core).

Isolated (the figure checked): the agent as `tracer record --metrics` with no target runs it, in this process, every
probe and tracepoint attached, over --seconds, with no process allowed to join (the start's /proc scan finds none,
the kernel's join at a CUDA library's open is off), scraped every --scrape-interval s (Prometheus's usual 15 s).
Its CPU is the recorder's own steady CPU (RecordSummary.recording_cpu_pct). On a machine shared with other CUDA
jobs, "no CUDA process running" cannot be arranged otherwise: the agent would trace them.

--host (context): the agent as a separate process over the host's real CUDA jobs, its CPU (with its guardian's)
read from /proc in windows of --window s, scraped at each window's ends; a window is idle when both scrapes show
no traced process alive and nothing changed (no call, no exit).

The in-kernel filtering on the host's openat, mmap, exec and scheduler tracepoints is charged to the processes that
trigger them, not to the agent.

    sudo .venv/bin/python -m bench.agent_idle [--seconds S] [--host] [--quick]
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.common import TRACER, base_parser, need_root, print_table, write_result
from tracer import procfs

TARGET_PCT = 1.0  # % of one core, with nothing to trace (issue 32)


def _tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of ``root`` and its living children."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in [root, *procfs.children(root)]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def _rss_bytes(pid: int) -> int:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) * 1024 if m else 0


def _state(port: int, seen: set[str]) -> tuple[int, int, float]:
    """(traced processes alive, exited ones still reported, CUDA calls counted) from a scrape of /metrics; the
    pids with calls go into ``seen``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body = r.read().decode()
    alive = re.search(r'tracer_processes\{state="alive"\} ([0-9.e+]+)', body)
    gone = re.search(r'tracer_processes\{state="exited"\} ([0-9.e+]+)', body)
    counts = re.findall(r'tracer_cuda_call_duration_seconds_count\{[^}]*pid="(\d+)"[^}]*\} ([0-9.e+]+)', body)
    seen.update(pid for pid, _ in counts)
    return (
        int(float(alive.group(1))) if alive else 0,
        int(float(gone.group(1))) if gone else 0,
        sum(float(n) for _, n in counts),
    )


def _isolated(seconds: float, scrape_s: float) -> dict:
    """The agent (RecordOptions as `tracer record --metrics` with no target sets them), in this process, with
    every probe and tracepoint attached but no process allowed to join: the /proc scan finds none and the kernel's
    join at a CUDA library's open is off. What it spends is its idle cost, whatever other CUDA jobs run on the
    host. A thread scrapes /metrics every ``scrape_s``."""
    import ctypes as ct

    from tracer.recorder import events, targets
    from tracer.recorder.session import Recorder, RecordOptions

    configure = Recorder._configure_bpf

    def no_join(self: Recorder) -> None:
        configure(self)
        self.bpf["cfg"][ct.c_int(events.C.CFG_ALL_CUDA)] = ct.c_uint64(0)

    Recorder._configure_bpf = no_join  # type: ignore[method-assign]
    targets.cuda_processes = lambda exclude=(): []  # type: ignore[assignment]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(scrape_s):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            except OSError:
                pass

    threading.Thread(target=scrape, daemon=True).start()
    with tempfile.TemporaryDirectory() as d:
        opts = RecordOptions(db=Path(d) / "node.duckdb", duration=seconds, metrics_listen=("127.0.0.1", port))
        summary = Recorder(opts).run()
    stop.set()
    return {
        "seconds": round(summary.duration_s, 1),
        "scrape_interval_s": scrape_s,
        "agent_cpu_pct_of_core": summary.recording_cpu_pct,
        "agent_peak_rss_mib": round(summary.recorder_peak_rss_bytes / 2**20, 1),
        "processes_traced": summary.processes,
    }


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--seconds", type=float, default=120.0, help="measured time (default 120; --quick: 20)")
    p.add_argument("--scrape-interval", type=float, default=15.0, help="isolated run: seconds between scrapes")
    p.add_argument("--window", type=float, default=5.0, help="host run: seconds per window (default 5)")
    p.add_argument("--host", action="store_true", help="also run the agent over this host's real CUDA jobs")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = min(args.seconds, 20.0)
    need_root("bench.agent_idle")
    iso = _isolated(args.seconds, args.scrape_interval)
    pct = iso["agent_cpu_pct_of_core"]
    figures: dict = {"isolated": iso, "target_pct": TARGET_PCT, "within_target": pct is not None and pct <= TARGET_PCT}
    print_table([list(iso.values())], list(iso))
    if args.host:
        figures["host"] = _host(args)
    figures["load_avg_1m"] = os.getloadavg()[0]
    path = write_result("agent_idle", figures, args.out)
    print(f"wrote {path}")
    return 0 if figures["within_target"] else 1


def _host(args) -> dict:
    """The agent as a separate process over this host's real CUDA jobs, in windows (see the module docstring)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="agent-idle-"))
    agent = subprocess.Popen(
        [str(TRACER), "record", "--db", str(tmp / "node.duckdb"), "--metrics", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    windows: list[tuple[float, float, bool]] = []  # (seconds, agent CPU seconds, idle)
    seen: set[str] = set()
    rss = 0
    try:
        assert agent.stderr is not None
        for line in agent.stderr:
            if "tracing every CUDA process" in line:
                break
        else:
            raise SystemExit(f"the agent exited before attaching ({agent.wait()})")
        err = agent.stderr
        threading.Thread(target=lambda: [None for _ in err], daemon=True).start()  # keep the pipe drained
        time.sleep(2.0)  # the attach's own work (the /proc scan, the first snapshot) settles
        state0, c0, t0 = _state(port, seen), _tree_cpu_s(agent.pid), time.monotonic()
        end = t0 + args.seconds
        while time.monotonic() < end:
            time.sleep(args.window)
            state1, c1, t1 = _state(port, seen), _tree_cpu_s(agent.pid), time.monotonic()
            windows.append((t1 - t0, c1 - c0, state0 == state1 and state1[0] == 0))
            state0, c0, t0 = state1, c1, t1
        rss = _rss_bytes(agent.pid)
    finally:
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(timeout=120)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    idle_s = sum(w[0] for w in windows if w[2])
    idle_cpu = sum(w[1] for w in windows if w[2])
    all_s, all_cpu = sum(w[0] for w in windows), sum(w[1] for w in windows)
    pct = 100.0 * idle_cpu / idle_s if idle_s else float("nan")
    return {
        "seconds": round(all_s, 1),
        "window_s": args.window,
        "windows": len(windows),
        "idle_windows": sum(w[2] for w in windows),
        "idle_seconds": round(idle_s, 1),
        "agent_cpu_pct_of_core_idle": round(pct, 3) if idle_s else None,
        "agent_cpu_pct_of_core_all_windows": round(100.0 * all_cpu / all_s, 3) if all_s else None,
        "agent_rss_mib": round(rss / 2**20, 1),
        "cuda_processes_seen": len(seen),
    }


if __name__ == "__main__":
    raise SystemExit(main())
