"""Cost per hit of each probe kind, as a multiple of the bare uprobe trap measured in the same run.

A tiny C library (built here with gcc) has a no-op function ``bench_noop`` and ``bench_loop(n)``, which calls
it n times; one ctypes call of the loop runs many probe hits with no Python in between. Each variant attaches
its programs to ``bench_noop`` and times the loop; the untraced per-call time is subtracted, and every cost
is divided by the floor (an empty entry uprobe):

    floor          empty entry uprobe (the trap itself)
    pair           empty entry + empty return uprobe
    recorder       the recorder's cuda_entry / cuda_return as cudaMalloc (no stack), attached with uprobe_multi
    recorder_fp    the same with a stack on every call (the native frame-pointer walk and the stack hash;
                   stacks are deduplicated in kernel, so only the first is sent)
    recorder_py    the same with the Python frame walk on every call (with_pyframes)

Where /proc/sys/kernel/bpf_stats_enabled can be set, each program's in-kernel run time per hit is read from
/proc/self/fdinfo (run_time_ns / run_cnt) as well: the BPF body alone, without the trap.

    sudo .venv/bin/python -m bench.probe_cost [--quick] [--calls N]
"""

from __future__ import annotations

import ctypes as ct
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import base_parser, median, need_root, print_table, ratio, spread, write_result

LIB_C = r"""
__attribute__((noinline, used)) int bench_noop(long x) { __asm__ volatile("" ::: "memory"); return (int)x; }
long bench_loop(long n) { long s = 0; for (long i = 0; i < n; i++) s += bench_noop(i); return s; }
"""
EMPTY_BPF = "int empty_entry(struct pt_regs *ctx) { return 0; }\nint empty_return(struct pt_regs *ctx) { return 0; }\n"
CALLS, QUICK_CALLS = 20_000, 5_000
REPS, QUICK_REPS = 5, 3
CHUNK = 2_000  # calls per timed chunk; the ring buffers are drained between chunks (untimed) so none fills
VARIANTS = ("floor", "pair", "recorder", "recorder_fp", "recorder_py")
STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


def build_lib(tmp: Path) -> Path:
    """Compile the no-op library into ``tmp``; return its path."""
    src, so = tmp / "benchnoop.c", tmp / "libbenchnoop.so"
    src.write_text(LIB_C)
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-fno-omit-frame-pointer", "-o", str(so), str(src)], check=True)
    return so


def time_loop(lib: ct.CDLL, calls: int, between: Callable[[], None] | None = None) -> float:
    """Return seconds per call of ``bench_noop``, timing ``calls`` calls in chunks (``between`` runs untimed)."""
    total = 0.0
    done = 0
    while done < calls:
        n = min(CHUNK, calls - done)
        t = time.perf_counter()
        lib.bench_loop(ct.c_long(n))
        total += time.perf_counter() - t
        done += n
        if between:
            between()
    return total / calls


def prog_stats(bpf: Any) -> dict[str, dict[str, int]]:
    """Return {program: {run_cnt, run_time_ns}} read from /proc/self/fdinfo of the loaded program fds."""
    out = {}
    for key, fn in bpf.funcs.items():
        name = key.decode() if isinstance(key, bytes) else key
        try:
            info = Path(f"/proc/self/fdinfo/{fn.fd}").read_text()
        except OSError:
            continue
        kv = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        if "run_cnt" in kv:
            out[name] = {"run_cnt": int(kv["run_cnt"]), "run_time_ns": int(kv["run_time_ns"])}
    return out


def _stats_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, float | None]:
    res: dict[str, float | None] = {}
    for name, a in after.items():
        b = before.get(name, {"run_cnt": 0, "run_time_ns": 0})
        cnt = a["run_cnt"] - b["run_cnt"]
        if cnt:
            res[name] = (a["run_time_ns"] - b["run_time_ns"]) / cnt
    return res


def setup_variant(name: str, so: Path) -> tuple[Any, list[str], Callable[[], None] | None]:
    """Load and attach the programs of one variant; return (bpf, program names timed, drain callback)."""
    from bcc import BPF

    if name in ("floor", "pair"):
        b = BPF(text=EMPTY_BPF)
        b.attach_uprobe(name=str(so), sym="bench_noop", fn_name="empty_entry")
        if name == "pair":
            b.attach_uretprobe(name=str(so), sym="bench_noop", fn_name="empty_return")
        return b, ["empty_entry", "empty_return"], None

    from probes.catalog import OP_NAMES
    from tracer.recorder.links import attach_multi
    from tracer.recorder.program import ProgramOptions, compile_program, configure_ops, load_programs
    from tracer.recorder.targets import exported_offsets

    py = name == "recorder_py"
    b = compile_program(ProgramOptions(with_pyframes=py))
    progs = load_programs(b, py)
    configure_ops(b)
    op = OP_NAMES.index("cudaMalloc")
    cfg = b["op_cfg"][ct.c_int(op)]
    cfg.sample_every, cfg.slow_ns = 1, 0
    cfg.stack_every = 1 if name in ("recorder_fp", "recorder_py") else 0
    b["op_cfg"][ct.c_int(op)] = cfg
    if py:
        from tracer.recorder.pyruntime import PyRuntimeManager

        if PyRuntimeManager(b).configure(os.getpid()) is None:
            raise RuntimeError("this Python is not walkable by tracer.recorder.pyruntime")
    b["cfg"][ct.c_int(0)] = ct.c_uint64(time.monotonic_ns())  # CFG_START_NS
    b["targets"][ct.c_uint32(os.getpid())] = ct.c_uint8(1)
    counts = {"calls": 0}

    def on_call(_c: int, _d: int, _s: int) -> None:
        counts["calls"] += 1

    b["calls"].open_ring_buffer(on_call)
    b["stacks_rb"].open_ring_buffer(lambda _c, _d, _s: None)
    b["ustack_rb"].open_ring_buffer(lambda _c, _d, _s: None)
    off = exported_offsets(str(so))["bench_noop"]
    links = [
        attach_multi(progs.ret, str(so), [off], [op], retprobe=True),
        attach_multi(progs.entry, str(so), [off], [op], retprobe=False),
    ]
    b._bench_links = links  # type: ignore[attr-defined]  # kept alive with the BPF object
    b._bench_counts = counts  # type: ignore[attr-defined]
    return b, ["cuda_entry", "cuda_return", "call_with_stack", "py_read_codes"], b.ring_buffer_consume


def lost_counts(b: Any) -> list[int] | None:
    try:
        return [int(b["lost"][ct.c_int(i)].value) for i in range(8)]
    except Exception:
        return None


def compute(per_call_s: dict[str, list[float]]) -> dict[str, Any]:
    """Turn per-call times (s, 'untraced' and each variant) into added µs per hit and ratios to the floor."""
    base = median(per_call_s.get("untraced", [])) or 0.0
    added = {k: (median(v) - base) * 1e6 for k, v in per_call_s.items() if k != "untraced" and v}
    floor = added.get("floor")
    return {
        "untraced_ns_per_call": base * 1e9,
        "added_us_per_call": added,
        "ratio_to_floor": {k: ratio(v, floor) for k, v in added.items()},
        "spread": {k: spread(v) for k, v in per_call_s.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--calls", type=int, default=None, help=f"probe hits per timing (default {CALLS:,})")
    args = p.parse_args(argv)
    need_root("bench.probe_cost")
    calls = args.calls or (QUICK_CALLS if args.quick else CALLS)
    reps = QUICK_REPS if args.quick else REPS
    stats_prev = None
    try:
        stats_prev = STATS_SYSCTL.read_text().strip()
        STATS_SYSCTL.write_text("1")
    except OSError:
        stats_prev = None
    per_call: dict[str, list[float]] = {"untraced": []}
    bpf_ns: dict[str, dict[str, float | None]] = {}
    notes: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
            so = build_lib(Path(tmp))
            lib = ct.CDLL(str(so))
            lib.bench_loop.argtypes = [ct.c_long]
            lib.bench_loop.restype = ct.c_long
            time_loop(lib, calls)  # warm-up
            per_call["untraced"] = [time_loop(lib, calls) for _ in range(reps)]
            for v in VARIANTS:
                try:
                    b, names, between = setup_variant(v, so)
                except Exception as e:  # e.g. no BTF / Python walk unsupported: report, keep going
                    notes.append(f"{v}: not measured: {e}")
                    print(f"{v}: not measured: {e}", file=sys.stderr)
                    continue
                try:
                    time_loop(lib, min(calls, CHUNK), between)  # warm-up: first hits fault pages in
                    before = prog_stats(b)
                    per_call[v] = [time_loop(lib, calls, between) for _ in range(reps)]
                    bpf_ns[v] = {k: x for k, x in _stats_delta(before, prog_stats(b)).items() if k in names}
                    if between:
                        between()
                        lost = lost_counts(b)
                        if lost and any(lost):
                            notes.append(f"{v}: ring-buffer losses {lost}")
                finally:
                    for link in getattr(b, "_bench_links", []):
                        link.close()
                    b.cleanup()
                print(f"{v:12s} {median(per_call[v]) * 1e6:8.2f} µs/call", file=sys.stderr)
    finally:
        if stats_prev is not None:
            STATS_SYSCTL.write_text(stats_prev)
    res = compute(per_call)
    res.update(calls=calls, reps=reps, bpf_run_ns_per_hit=bpf_ns, bpf_stats=stats_prev is not None, notes=notes)
    rows = [
        [
            k,
            res["added_us_per_call"].get(k),
            res["ratio_to_floor"].get(k),
            sum(x for x in bpf_ns.get(k, {}).values() if x and x > 1) / 1e3 if bpf_ns.get(k) else None,
        ]
        for k in VARIANTS
    ]
    print(f"untraced: {res['untraced_ns_per_call']:.1f} ns/call")
    print_table(rows, ["variant", "added µs/hit", "x floor", "BPF run µs/hit"])
    for n in notes:
        print(f"note: {n}")
    print(f"wrote {write_result('probe_cost', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
