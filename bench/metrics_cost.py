"""What serving `--metrics` costs the recorder (issue 32): the CPU of the tick's snapshot (MetricsState.refresh:
the op_totals/op_hist dumps and the series) and of each scrape's rendering (in the server thread), against the
recorder's CPU while recording.

The recorder runs in this process (real eBPF, RecordOptions as `tracer record --metrics` sets them) over
fixtures/workloads/train.py (DataLoader workers re-forked each epoch, one sync a step); a thread scrapes /metrics
every --interval seconds. Each refresh and render is timed with the CPU clock of the thread that runs it.

    sudo .venv/bin/python -m bench.metrics_cost [--seconds S] [--interval S]
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.common import WORKLOADS, base_parser, need_root, print_table, write_result
from tracer.recorder import metrics
from tracer.recorder.session import Recorder, RecordOptions

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--seconds", type=float, default=30.0, help="workload duration (default 30; --quick: 10)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes (default 1)")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = min(args.seconds, 10.0)
    need_root("bench.metrics_cost")
    cost = {"refresh_s": 0.0, "refreshes": 0, "render_s": 0.0, "renders": 0, "bytes": 0}
    refresh, render = metrics.MetricsState.refresh, metrics.render

    def timed_refresh(self, *a, **kw):
        t = time.thread_time()
        refresh(self, *a, **kw)
        cost["refresh_s"] += time.thread_time() - t
        cost["refreshes"] += 1

    def timed_render(snap):
        t = time.thread_time()
        body = render(snap)
        cost["render_s"] += time.thread_time() - t
        cost["renders"] += 1
        cost["bytes"] = len(body)
        return body

    metrics.MetricsState.refresh = timed_refresh  # type: ignore[method-assign]
    metrics.render = timed_render  # type: ignore[assignment]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(args.interval):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            except OSError:
                pass

    threading.Thread(target=scrape, daemon=True).start()
    cmd = [
        str(ROOT / ".venv" / "bin" / "python"),
        str(WORKLOADS / "train.py"),
        "--duration",
        str(args.seconds),
        "--workers",
        "2",
        "--epochs",
        "1000",
        "--steps",
        "20",
        "--respawn-workers",
    ]
    build = ROOT / "fixtures" / "build"
    with tempfile.TemporaryDirectory() as d:
        opts = RecordOptions(
            db=Path(d) / "t.duckdb",
            command=cmd,
            force=True,
            libs=[str(build / "libcudart.so.12"), str(build / "libcuda.so.1")],
            metrics_listen=("127.0.0.1", port),
        )
        summary = Recorder(opts).run()
    stop.set()
    dur = summary.duration_s
    rec_pct = summary.recording_cpu_pct or 0.0
    served_pct = 100 * (cost["refresh_s"] + cost["render_s"]) / dur
    result = {
        "seconds": round(dur, 1),
        "scrape_interval_s": args.interval,
        "recording_cpu_pct": rec_pct,
        "refreshes": cost["refreshes"],
        "refresh_ms_each": round(1e3 * cost["refresh_s"] / max(1, cost["refreshes"]), 3),
        "renders": cost["renders"],
        "render_ms_each": round(1e3 * cost["render_s"] / max(1, cost["renders"]), 3),
        "body_bytes": cost["bytes"],
        "metrics_cpu_pct": round(served_pct, 3),
    }
    print_table([list(result.values())], list(result))
    print(f"wrote {write_result('metrics_cost', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
