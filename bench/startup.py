"""Start-up of `tracer record`: how long until the probes are live, cold (first run: bcc compiles the BPF program)
and warm (the compiled program from the cache, tracer/recorder/bpfcache.py), launching a program or attaching to one.

Per run, from the session row: startup_s (the `tracer record` process's start to the probes being live), compile_s
(the program's own preparation in the prewarm thread: compile or cache load, and the verifier; it overlaps the
imports), startup_cpu_s (the recorder's CPU seconds until then: less noisy than wall time on a shared machine),
attach_s, first_event_s and flush_s; and, timed from outside, the wall time of the whole command.
The targets: /bin/true (`record -- true`), a fixture that makes a few CUDA calls and exits (late_load.py --delay 0),
and `record --pid` of a running train.py --persistent-workers (--duration 2). Cold runs use a new empty cache
directory each ($TRACER_BPF_CACHE), warm ones a directory filled by a first run.

Apart, in this process: the compile alone, cold and warm (median wall and CPU seconds of compile + load, the CPU
time being less noisy than wall time on a shared machine). Medians over the runs.

    sudo .venv/bin/python -m bench.startup [--quick] [--runs N] [--programs true,cuda_calls,pid_train]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb

from bench.common import TRACER, WORKLOADS, base_parser, build_fixtures, median, need_root, print_table, write_result

PY = "/usr/bin/python3"
PROGRAMS = {
    "true": ["--", "/bin/true"],
    "cuda_calls": ["--", PY, str(WORKLOADS / "late_load.py"), "--delay", "0", "--calls", "5"],
    "pid_train": ["--duration", "2"],  # + --pid of the running train.py
}
TRAIN = [PY, str(WORKLOADS / "train.py"), "--workers", "2", "--persistent-workers", "--duration", "600"]
TRAIN_WARMUP_S = 2.0  # train.py's imports (torch) and worker start before it loops
MODES = ("cold", "warm")
SESSION = ("startup_s", "startup_cpu_s", "compile_s", "attach_s", "first_event_s", "flush_s")


def run_once(name: str, mode: str, db: Path, cache: Path, pid: int | None) -> dict[str, Any]:
    """One `tracer record`: its wall time from outside and the phases it recorded."""
    args = [str(TRACER), "record", "--db", str(db), "--force"]
    if pid is not None:
        args += ["--pid", str(pid)]
    env = {**os.environ, "TRACER_BPF_CACHE": str(cache)}
    t0 = time.monotonic()
    p = subprocess.run([*args, *PROGRAMS[name]], capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"tracer record ({name}) exited {p.returncode}:\n{p.stderr[-2000:]}")
    with duckdb.connect(str(db), read_only=True) as con:
        row = con.execute(f"SELECT {', '.join(SESSION)} FROM session").fetchone()
    phases = dict(zip(SESSION, row or (None,) * len(SESSION), strict=True))
    return {"program": name, "mode": mode, "wall_s": wall, **phases}


def run_attached(mode: str, db: Path, cache: Path) -> dict[str, Any]:
    """`record --pid` of a train.py started for this run (in its loop by then), stopped after: a job that runs only
    while it is measured, so the other runs have the machine's cores to themselves."""
    train = subprocess.Popen(TRAIN, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(TRAIN_WARMUP_S)
        return run_once("pid_train", mode, db, cache, train.pid)
    finally:
        train.terminate()
        train.wait()


def compile_once(cache: Path) -> dict[str, float]:
    """The program's compile (or cache load) and load, in this process: wall and CPU seconds."""
    from tracer.recorder.program import ProgramOptions, _prepare

    os.environ["TRACER_BPF_CACHE"] = str(cache)
    try:
        p = _prepare(ProgramOptions(with_pyframes=True))
    finally:
        del os.environ["TRACER_BPF_CACHE"]
    p.bpf.cleanup()
    return {"wall_s": p.seconds, "cpu_s": p.cpu_s}


def summarize(runs: list[dict[str, Any]], compiles: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians per mode, program and phase, and of the compiles (pure; the smoke test feeds it hand-built runs)."""
    out: dict[str, Any] = {"runs": runs, "compiles": compiles}
    for mode in MODES:
        out[mode] = {}
        for name in PROGRAMS:
            rs = [r for r in runs if r["program"] == name and r.get("mode", "warm") == mode]
            if rs:
                out[mode][name] = {k: median([r[k] for r in rs if r.get(k) is not None]) for k in ("wall_s", *SESSION)}
        cs = compiles.get(mode, [])
        out[mode]["compile_alone"] = {k: median([c[k] for c in cs]) for k in ("wall_s", "cpu_s")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--runs", type=int, default=None, help="runs per program and mode (default 5, --quick 2)")
    p.add_argument(
        "--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {', '.join(PROGRAMS)} (default all)"
    )
    args = p.parse_args(argv)
    programs = [x for x in args.programs.split(",") if x]
    if not programs or any(x not in PROGRAMS for x in programs):
        p.error(f"--programs: choose among {', '.join(PROGRAMS)}")
    need_root("bench.startup")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops its train.py (finally)
    build_fixtures()
    n = args.runs or (2 if args.quick else 5)
    runs: list[dict[str, Any]] = []
    compiles: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        db, warm = Path(tmp) / "t.duckdb", Path(tmp) / "warm-cache"
        run_once("true", "warm", db, warm, None)  # fills the warm cache; caches (BTF, trap cost), page cache
        for i in range(n):
            for mode in MODES:
                for name in programs:
                    cache = warm if mode == "warm" else Path(tmp) / f"cold-{i}-{name}"
                    if name == "pid_train":
                        r = run_attached(mode, db, cache)
                    else:
                        r = run_once(name, mode, db, cache, None)
                    runs.append(r)
                    print(
                        f"{i} {mode} {name:10s} start-up {r['startup_s']:.2f} s (compile {r['compile_s']:.2f}), "
                        f"wall {r['wall_s']:.2f} s",
                        file=sys.stderr,
                    )
                compiles[mode].append(compile_once(warm if mode == "warm" else Path(tmp) / f"cold-c{i}"))
    res = summarize(runs, compiles)
    rows = [[mode, name, *(res[mode][name][k] for k in ("wall_s", *SESSION))] for mode in MODES for name in programs]
    print_table(rows, ["cache", "program", "wall s", *SESSION])
    for mode in MODES:
        c = res[mode]["compile_alone"]
        print(f"compile + load alone, {mode}: {c['wall_s']:.2f} s wall, {c['cpu_s']:.2f} s CPU")
    print(f"wrote {write_result('startup', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
