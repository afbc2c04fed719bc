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

The scheduler and sampling programs (issue 18), with BPF run-time stats on (the sysctl is restored afterwards):

    recorder       ``tracer record -- gil_thread.py --steps 300`` (100 with --quick) with the defaults: a main
                   thread and a GIL-holding metrics thread that block thousands of times. While it runs, every
                   loaded program's bpf_prog_info is read every 0.5 s through bpf(2) (BPF_PROG_GET_NEXT_ID,
                   BPF_PROG_GET_FD_BY_ID, BPF_OBJ_GET_INFO_BY_FD), kept for the recorder's own programs (the
                   prog_ids in its /proc/PID/fdinfo), the last values per name: run_cnt, run_time_ns / run_cnt.
                   The recording's sched_stats and cpu_samples give the job's blocking switches and samples.
    switch micro   the recorder's programs loaded here (as the variants above, with the Python walk), and two
                   threads of this process handing a byte to each other through pipes. Phases, interleaved: no
                   target (what sched_switch / sched_waking cost every other switch of the machine), target
                   without the off-CPU stack capture, target with it, and with it 30 Python frames deeper (the
                   capture walks the frames); the added time per blocking switch (the program's own tbreak:
                   switches - preemptions).

Added per blocking switch (recorder run): sched_switch + sched_waking run time, less run_cnt x the micro's
no-target cost per hit, over the job's blocking switches: the switch-out with its stack capture, the wakeup and
the switch-in (the job's preemptions' accounting is charged to them too). Per sample: cpu_sample's run time over
the job's samples (the other tasks' ticks return after one map lookup: an upper bound, close). Both over the whole
run, and over its steady seconds (the job's whole seconds but its first and last, the polls interpolated at their
edges): the start-up's first reads of code objects, done once per code object, are left out. The kernel counts a
tail call's run time in the program that made it, so offcpu_stack (tail-called from sched_switch),
py_read_codes_tp / _pe and call_with_stack show run_cnt 0: their time is inside sched_switch's, cpu_sample's and
cuda_return's, and the micro splits the capture out. None of these include the trap or interrupt itself (the
tracepoint call, the perf interrupt): run_time_ns is the BPF body alone. --skip-recorder leaves this part out.

    sudo .venv/bin/python -m bench.probe_cost [--quick] [--calls N] [--skip-recorder]
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import TRACER, WORKLOADS, base_parser, median, need_root, print_table, ratio, spread, write_result

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


# --- the scheduler and sampling programs (issue 18) ------------------------------------------------------------

# bpf(2) commands (include/uapi/linux/bpf.h enum bpf_cmd) and struct bpf_prog_info's offsets: 64-bit, unchanged
# since run_cnt was added (5.1; the struct only grows at its end). Checked at run time: check_prog_info().
BPF_PROG_GET_NEXT_ID, BPF_PROG_GET_FD_BY_ID, BPF_OBJ_GET_INFO_BY_FD = 11, 13, 15
SYS_BPF = {"x86_64": 321, "aarch64": 280}
INFO_LEN = 208  # through run_cnt; the kernel copies min(this, its own size)
INFO_TYPE, INFO_ID, INFO_NAME, INFO_RUN_TIME_NS, INFO_RUN_CNT = 0, 4, 64, 192, 200
NAME_LEN = 16  # BPF_OBJ_NAME_LEN: 15 characters and a NUL; bcc drops a "tracepoint__" prefix first
CHECK_PROG = "pc_offset_check"  # 15 characters: the whole name fits
POLL_S = 0.5
GIL_STEPS, QUICK_GIL_STEPS = 300, 100
SWITCH_ROUNDS, QUICK_SWITCH_ROUNDS = 4_000, 2_000  # pipe round trips per micro phase
SWITCH_REPS, QUICK_SWITCH_REPS = 5, 3
DEEP = 30  # Python frames added under both threads in the deep phase: the capture walks them
SWITCH_PHASES = ("no_target", "target", "target_capture", "target_capture_deep")
# bcc's names for the recorder's programs (prog info names are 15 characters).
SCHED_SWITCH, SCHED_WAKING = "sched__sched_sw", "sched__sched_wa"
TP_SWITCH, TP_WAKING = "tracepoint__sched__sched_switch", "tracepoint__sched__sched_waking"
TAIL_CALLED = ("offcpu_stack", "py_read_codes_t", "py_read_codes_p", "call_with_stack", "py_read_codes")
SHOWN = (SCHED_SWITCH, SCHED_WAKING, "offcpu_stack", "py_read_codes_t", "cpu_sample", "py_read_codes_p")

_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


def _bpf(cmd: int, attr: Any) -> int:
    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"bpf(2) number unknown on {platform.machine()}")
    r = _libc.syscall(ct.c_long(nr), ct.c_long(cmd), attr, ct.c_long(ct.sizeof(attr)))
    if r < 0:
        e = ct.get_errno()
        raise OSError(e, os.strerror(e))
    return int(r)


def prog_ids() -> list[int]:
    """Every loaded BPF program's id (BPF_PROG_GET_NEXT_ID from 0 until ENOENT)."""
    ids, start = [], 0
    while True:
        attr = ct.create_string_buffer(struct.pack("<I", start), 16)  # start_id, next_id (out), open_flags
        try:
            _bpf(BPF_PROG_GET_NEXT_ID, attr)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return ids
            raise
        start = struct.unpack_from("<I", attr, 4)[0]
        ids.append(start)


def info_by_fd(fd: int) -> dict[str, Any]:
    """The program's type, id, name, run_time_ns and run_cnt (BPF_OBJ_GET_INFO_BY_FD into struct bpf_prog_info)."""
    buf = ct.create_string_buffer(INFO_LEN)
    attr = ct.create_string_buffer(struct.pack("<IIQ", fd, INFO_LEN, ct.addressof(buf)), 16)  # bpf_fd, info_len, info
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    raw = buf.raw
    return {
        "type": struct.unpack_from("<I", raw, INFO_TYPE)[0],
        "id": struct.unpack_from("<I", raw, INFO_ID)[0],
        "name": raw[INFO_NAME : INFO_NAME + NAME_LEN].split(b"\0", 1)[0].decode(errors="replace"),
        "run_time_ns": struct.unpack_from("<Q", raw, INFO_RUN_TIME_NS)[0],
        "run_cnt": struct.unpack_from("<Q", raw, INFO_RUN_CNT)[0],
    }


def prog_info(prog_id: int) -> dict[str, Any] | None:
    """:func:`info_by_fd` of the program with this id (BPF_PROG_GET_FD_BY_ID); None when it is gone."""
    try:
        fd = _bpf(BPF_PROG_GET_FD_BY_ID, ct.create_string_buffer(struct.pack("<I", prog_id), 16))
    except OSError:
        return None
    try:
        return info_by_fd(fd)
    finally:
        os.close(fd)


def fdinfo_prog(pid: int | str, fd: int | str) -> dict[str, int]:
    """prog_id, run_time_ns and run_cnt from /proc/PID/fdinfo/FD (a BPF program or link fd); {} otherwise."""
    try:
        text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
    except OSError:
        return {}
    kv = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: int(kv[k]) for k in ("prog_id", "run_time_ns", "run_cnt") if k in kv and kv[k].strip().isdigit()}


def check_prog_info(so: Path, stats: bool) -> dict[str, Any]:
    """Check the struct offsets on a program of our own: a uprobe on ``bench_noop`` hit 1,000 times must read back
    its own name and id, found among BPF_PROG_GET_NEXT_ID's, and (stats on) run_cnt 1,000 and /proc's run time."""
    from bcc import BPF

    b = BPF(text=f"int {CHECK_PROG}(struct pt_regs *ctx) {{ return 0; }}\n")
    try:
        b.attach_uprobe(name=str(so), sym="bench_noop", fn_name=CHECK_PROG)
        lib = ct.CDLL(str(so))
        lib.bench_loop.argtypes = [ct.c_long]
        lib.bench_loop(ct.c_long(1000))
        fd = b.funcs[CHECK_PROG.encode()].fd
        own, proc = info_by_fd(fd), fdinfo_prog("self", fd)
        by_id = prog_info(own["id"]) if own["id"] in prog_ids() else None
    finally:
        b.cleanup()
    ok = own["name"] == CHECK_PROG and own["id"] == proc.get("prog_id") and by_id is not None
    ok = ok and by_id["name"] == CHECK_PROG
    if stats:
        ok = ok and own["run_cnt"] == 1000 and own["run_time_ns"] == proc.get("run_time_ns")
    if not ok:
        raise RuntimeError(f"struct bpf_prog_info offsets do not match this kernel: read {own}, /proc has {proc}")
    return {"name": own["name"], "run_cnt": own["run_cnt"], "run_time_ns": own["run_time_ns"], "ok": True}


def owned_prog_ids(pid: int) -> set[int]:
    """The ids of the programs a process holds (prog and link fds in its /proc/PID/fdinfo)."""
    ids = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fdinfo")
    except OSError:
        return ids
    for fd in fds:
        i = fdinfo_prog(pid, fd).get("prog_id")
        if i:
            ids.add(i)
    return ids


def by_name(last: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Sum the programs' last stats per name (15-character names can repeat: sched_process_exec / _exit)."""
    out: dict[str, dict[str, Any]] = {}
    for x in sorted(last.values(), key=lambda x: x["id"]):
        o = out.setdefault(x["name"], {"programs": 0, "type": x["type"], "run_cnt": 0, "run_time_ns": 0})
        o["programs"] += 1
        o["run_cnt"] += x["run_cnt"]
        o["run_time_ns"] += x["run_time_ns"]
    for o in out.values():
        o["ns_per_hit"] = o["run_time_ns"] / o["run_cnt"] if o["run_cnt"] else None
    return out


def job_counts(db: Path) -> dict[str, Any]:
    """The job's blocking switches (sched_stats switches - preemptions) and on-CPU samples in the recording, in all
    and per second of the session (``per_sec``: {sec: [blocking switches, samples]}), and the session's start."""
    import duckdb

    out: dict[str, Any] = {}
    con = duckdb.connect(str(db), read_only=True)
    try:
        for key, sql in (
            ("target_switches", "SELECT sum(switches) FROM sched_stats"),
            ("target_preemptions", "SELECT sum(preemptions) FROM sched_stats"),
            ("offcpu_intervals", "SELECT sum(intervals) FROM offcpu_stacks"),
            ("target_samples", "SELECT sum(samples) FROM cpu_samples"),
            ("start_mono_ns", "SELECT start_mono_ns FROM session"),
        ):
            try:
                v = con.execute(sql).fetchone()
                out[key] = int(v[0]) if v and v[0] is not None else None
            except duckdb.Error:
                out[key] = None
        per_sec: dict[int, list[int]] = {}
        for sec, sw, pre in con.execute(
            "SELECT sec, sum(switches), sum(preemptions) FROM sched_stats GROUP BY sec"
        ).fetchall():
            per_sec.setdefault(int(sec), [0, 0])[0] = int(sw - pre)
        for sec, n in con.execute("SELECT sec, sum(samples) FROM cpu_samples GROUP BY sec").fetchall():
            per_sec.setdefault(int(sec), [0, 0])[1] = int(n)
        out["per_sec"] = dict(sorted(per_sec.items()))
    finally:
        con.close()
    sw, pre = out.get("target_switches"), out.get("target_preemptions")
    out["target_blocking_switches"] = sw - pre if sw is not None and pre is not None else None
    return out


def _at(series: list[tuple[int, dict[str, tuple[int, int]]]], name: str, t: int) -> tuple[float, float] | None:
    """(run_cnt, run_time_ns) of a program at monotonic time ``t``, interpolated between two polls."""
    pts = [(ts, v[name]) for ts, v in series if name in v]
    for (t0, a), (t1, b) in zip(pts, pts[1:], strict=False):
        if t0 <= t <= t1:
            f = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
            return a[0] + f * (b[0] - a[0]), a[1] + f * (b[1] - a[1])
    return None


def steady(series: list[tuple[int, dict[str, tuple[int, int]]]], job: dict[str, Any]) -> dict[str, Any] | None:
    """The programs' run counts and times over the job's whole seconds between its first and its last (start-up,
    with the first reads of its code objects, left out), and its blocking switches and samples in them."""
    secs, start = list(job.get("per_sec") or {}), job.get("start_mono_ns")
    if len(secs) < 3 or start is None:
        return None
    a, b = secs[1], secs[-2]
    ta, tb = start + a * 1_000_000_000, start + (b + 1) * 1_000_000_000
    progs = {}
    for name in (SCHED_SWITCH, SCHED_WAKING, "cpu_sample"):
        va, vb = _at(series, name, ta), _at(series, name, tb)
        if va is None or vb is None:
            return None
        progs[name] = {"run_cnt": vb[0] - va[0], "run_time_ns": vb[1] - va[1]}
    rows = [job["per_sec"][s] for s in secs if a <= s <= b]
    return {
        "secs": [a, b],
        "target_blocking_switches": sum(r[0] for r in rows),
        "target_samples": sum(r[1] for r in rows),
        "programs": progs,
    }


def record_run(tmp: Path, steps: int) -> dict[str, Any]:
    """``tracer record`` gil_thread.py with the defaults, polling the recorder's programs' stats every 0.5 s."""
    db, log = tmp / "rec.duckdb", tmp / "record.log"
    cmd = [str(TRACER), "record", "--db", str(db), "--", sys.executable, str(WORKLOADS / "gil_thread.py")]
    cmd += ["--steps", str(steps)]
    mine: set[int] = set()
    last: dict[int, dict[str, Any]] = {}
    series: list[tuple[int, dict[str, tuple[int, int]]]] = []  # (CLOCK_MONOTONIC ns, {name: (run_cnt, ns)})
    polls, loaded = 0, 0
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            mine |= owned_prog_ids(proc.pid)
            ids = prog_ids()
            loaded = max(loaded, len(ids))
            now: dict[str, tuple[int, int]] = {}
            for i in ids:
                if i in mine and (x := prog_info(i)) is not None:
                    last[i] = x
                    if x["name"] in (SCHED_SWITCH, SCHED_WAKING, "cpu_sample"):
                        c, t = now.get(x["name"], (0, 0))
                        now[x["name"]] = (c + x["run_cnt"], t + x["run_time_ns"])
            if now:
                series.append((time.monotonic_ns(), now))
            polls += 1
            time.sleep(POLL_S)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"tracer record exited {proc.returncode}: {' / '.join(tail)}")
    job = job_counts(db)
    return {
        "workload": f"gil_thread.py --steps {steps}",
        "wall_s": wall,
        "polls": polls,
        "programs_loaded_max": loaded,
        "programs": by_name(last),
        "job": job,
        "steady": steady(series, job),
    }


def _nested(depth: int, fn: Callable[[], None]) -> None:
    if depth:
        _nested(depth - 1, fn)
    else:
        fn()


def _pingpong(rounds: int, depth: int = 0) -> None:
    """Two threads hand a byte back and forth through two pipes: each blocks in read() every round, ``depth``
    Python frames deeper than the loop's own."""
    import threading

    r1, w1 = os.pipe()
    r2, w2 = os.pipe()

    def echo() -> None:
        for _ in range(rounds):
            os.read(r1, 1)
            os.write(w2, b"x")

    def serve() -> None:
        for _ in range(rounds):
            os.write(w1, b"x")
            os.read(r2, 1)

    t = threading.Thread(target=_nested, args=(depth, echo), name="pingpong")
    t.start()
    try:
        _nested(depth, serve)
    finally:
        t.join()
        for fd in (r1, w1, r2, w2):
            os.close(fd)


def _blocking_switches(b: Any, pid: int) -> int:
    """The process's blocking switch-outs so far, from the program's own accounting (tbreak)."""
    from tracer.recorder import events

    c = events.C
    return sum(int(v.v[c.TB_SWITCHES]) - int(v.v[c.TB_PREEMPTIONS]) for _k, v in b["tbreak"].items() if v.pid == pid)


def switch_micro(reps: int, rounds: int) -> dict[str, Any]:
    """The recorder's programs loaded here, with the Python walk; pipe ping-pong in three interleaved phases."""
    from tracer.recorder import events
    from tracer.recorder.program import ProgramOptions, compile_program, configure_ops, load_programs
    from tracer.recorder.pyruntime import PyRuntimeManager
    from tracer.recorder.session import SCHED_KEEP_NS, SCHED_SAMPLE_EVERY

    c = events.C
    pid = os.getpid()
    b = compile_program(ProgramOptions(with_pyframes=True))
    try:
        load_programs(b, True)
        configure_ops(b)
        if PyRuntimeManager(b).configure(pid) is None:
            raise RuntimeError("this Python is not walkable by tracer.recorder.pyruntime")
        cfg = b["cfg"]
        for idx, val in (
            (c.CFG_START_NS, time.monotonic_ns()),
            (c.CFG_SCHED_KEEP_NS, SCHED_KEEP_NS),
            (c.CFG_SCHED_EVERY, SCHED_SAMPLE_EVERY),
        ):
            cfg[ct.c_int(idx)] = ct.c_uint64(val)
        for ring in ("sched_rb", "stacks_rb", "ustack_rb", "codes_rb", "calls", "maps_rb", "proc_rb", "knames_rb"):
            b[ring].open_ring_buffer(lambda _c, _d, _s: None)
        per: dict[str, dict[str, list[float]]] = {
            p: {"switch": [], "waking": [], "blocking": []} for p in SWITCH_PHASES
        }
        _pingpong(rounds // 4)  # warm-up: first stacks and code objects
        _pingpong(rounds // 4, DEEP)
        for _ in range(reps):
            for phase in SWITCH_PHASES:
                if phase == "no_target":
                    b["targets"].clear()
                else:
                    b["targets"][ct.c_uint32(pid)] = ct.c_uint8(1)
                cfg[ct.c_int(c.CFG_OFFCPU_STACKS)] = ct.c_uint64(int(phase.startswith("target_capture")))
                b.ring_buffer_consume()
                s0, n0 = prog_stats(b), _blocking_switches(b, pid)
                _pingpong(rounds, DEEP if phase.endswith("_deep") else 0)
                s1, n1 = prog_stats(b), _blocking_switches(b, pid)
                for key, tp in (("switch", TP_SWITCH), ("waking", TP_WAKING)):
                    a, z = s0.get(tp, {}), s1.get(tp, {})
                    per[phase][key].append(
                        (z.get("run_time_ns", 0) - a.get("run_time_ns", 0), z.get("run_cnt", 0) - a.get("run_cnt", 0))
                    )
                per[phase]["blocking"].append(n1 - n0)
        lost = lost_counts(b)
    finally:
        b.cleanup()
    return summarize_micro(per, rounds, reps, lost)


def summarize_micro(per: dict[str, dict[str, list[Any]]], rounds: int, reps: int, lost: Any) -> dict[str, Any]:
    """ns per hit of sched_switch / sched_waking in each phase, and the added µs per blocking switch over the
    no-target phases' cost per hit (median over the repetitions)."""
    base = {key: median([t / n for t, n in per["no_target"][key] if n]) or 0.0 for key in ("switch", "waking")}
    out: dict[str, Any] = {"rounds": rounds, "reps": reps, "no_target_ns_per_hit": base, "phases": {}}
    for phase in SWITCH_PHASES:
        d = per[phase]
        added = []
        for (ts, ns), (tw, nw), nb in zip(d["switch"], d["waking"], d["blocking"], strict=True):
            if nb > 0:
                added.append((ts - ns * base["switch"] + tw - nw * base["waking"]) / nb / 1e3)
        out["phases"][phase] = {
            "switch_ns_per_hit": median([t / n for t, n in d["switch"] if n]),
            "waking_ns_per_hit": median([t / n for t, n in d["waking"] if n]),
            "switch_hits": median([n for _t, n in d["switch"]]),
            "blocking_switches": median(d["blocking"]),
            "added_us_per_blocking_switch": median(added) if phase != "no_target" else None,
            "added_spread": spread(added) if phase != "no_target" else None,
        }
    ph = out["phases"]
    cap, acc = ph["target_capture"]["added_us_per_blocking_switch"], ph["target"]["added_us_per_blocking_switch"]
    deep = ph["target_capture_deep"]["added_us_per_blocking_switch"]
    out["capture_us_per_blocking_switch"] = cap - acc if cap is not None and acc is not None else None
    out["capture_deep_us_per_blocking_switch"] = deep - acc if deep is not None and acc is not None else None
    out["deep_frames"] = DEEP
    out["lost"] = lost
    return out


def _added(
    progs: dict[str, dict[str, Any]], blocking: int | None, samples: int | None, base: dict[str, float] | None
) -> tuple[float | None, float | None]:
    """µs per blocking switch (sched_switch + sched_waking time less their hits at the no-target cost) and per
    sample (cpu_sample time over the job's samples)."""
    sw, wk, smp = progs.get(SCHED_SWITCH), progs.get(SCHED_WAKING), progs.get("cpu_sample")
    per_switch = per_sample = None
    if sw and wk and blocking and base:
        t = sw["run_time_ns"] + wk["run_time_ns"]
        t -= (sw["run_cnt"] * base["switch"] + wk["run_cnt"] * base["waking"]) * 1e3
        per_switch = t / blocking / 1e3
    if smp and samples:
        per_sample = smp["run_time_ns"] / samples / 1e3
    return per_switch, per_sample


def derive(rec: dict[str, Any] | None, micro: dict[str, Any] | None) -> dict[str, Any]:
    """The headline figures, µs: added per blocking switch of the job and per on-CPU sample, from the recorder run
    (sched_switch and sched_waking's time less what their hits would cost with no target, the micro's no-target
    ns per hit, over the job's blocking switches; cpu_sample's time over the job's samples, an upper bound: the
    other tasks' ticks are in it, but they return after one map lookup), over the whole run and its steady
    seconds, and the micro's split."""
    out: dict[str, Any] = {}
    base = {k: v / 1e3 for k, v in micro["no_target_ns_per_hit"].items()} if micro else None
    if rec:
        progs, job = rec["programs"], rec["job"]
        for key, name in (("sched_switch", SCHED_SWITCH), ("sched_waking", SCHED_WAKING), ("cpu_sample", "cpu_sample")):
            p = progs.get(name)
            out[f"{key}_us_per_hit"] = p["ns_per_hit"] / 1e3 if p and p["ns_per_hit"] else None
        out["added_us_per_blocking_switch"], out["added_us_per_sample"] = _added(
            progs, job.get("target_blocking_switches"), job.get("target_samples"), base
        )
        st = rec.get("steady")
        if st:
            out["steady_secs"] = st["secs"]
            out["steady_added_us_per_blocking_switch"], out["steady_added_us_per_sample"] = _added(
                st["programs"], st["target_blocking_switches"], st["target_samples"], base
            )
        out["tail_called_run_cnt"] = {n: progs[n]["run_cnt"] for n in TAIL_CALLED if n in progs}
    if micro and base:
        ph = micro["phases"]
        out["micro_added_us_per_blocking_switch"] = ph["target_capture"]["added_us_per_blocking_switch"]
        out["micro_added_us_per_blocking_switch_no_capture"] = ph["target"]["added_us_per_blocking_switch"]
        out["micro_capture_us_per_blocking_switch"] = micro["capture_us_per_blocking_switch"]
        out["micro_capture_deep_us_per_blocking_switch"] = micro["capture_deep_us_per_blocking_switch"]
        out["no_target_sched_switch_us_per_hit"] = base["switch"]
        out["no_target_sched_waking_us_per_hit"] = base["waking"]
    out["excludes"] = "the trap / interrupt itself (tracepoint dispatch, perf interrupt): BPF run time only"
    return out


def sched_part(tmp: Path, so: Path, quick: bool, stats: bool, notes: list[str]) -> dict[str, Any]:
    """Issue 18's figures: the real recorder's per-program stats, the switch micro, and what they derive."""
    res: dict[str, Any] = {}
    if not stats:
        notes.append("sched: bpf_stats_enabled could not be set: no run-time stats")
        return res
    try:
        res["prog_info_check"] = check_prog_info(so, stats)
    except Exception as e:
        notes.append(f"sched: {e}")
        return res
    rec = micro = None
    try:
        rec = record_run(tmp, QUICK_GIL_STEPS if quick else GIL_STEPS)
        res["recorder"] = rec
    except Exception as e:
        notes.append(f"sched: recorder run: {e}")
        print(f"recorder run: {e}", file=sys.stderr)
    try:
        micro = switch_micro(
            QUICK_SWITCH_REPS if quick else SWITCH_REPS, QUICK_SWITCH_ROUNDS if quick else SWITCH_ROUNDS
        )
        res["switch_micro"] = micro
        if micro.get("lost") and any(micro["lost"]):
            notes.append(f"switch micro: losses {micro['lost']}")
    except Exception as e:
        notes.append(f"sched: switch micro: {e}")
        print(f"switch micro: {e}", file=sys.stderr)
    res["derived"] = derive(rec, micro)
    return res


def print_sched(res: dict[str, Any]) -> None:
    rec, micro, d = res.get("recorder"), res.get("switch_micro"), res.get("derived", {})
    if rec:
        print(
            f"\nrecorder programs ({rec['workload']}, {rec['polls']} polls; BPF body alone, tail calls inside callers):"
        )
        rows = []
        for name, p in sorted(rec["programs"].items(), key=lambda kv: -kv[1]["run_time_ns"]):
            if name in SHOWN or p["run_time_ns"] > 0:
                ns = p["ns_per_hit"]
                rows.append([name, p["programs"], p["run_cnt"], ns / 1e3 if ns else None, p["run_time_ns"] / 1e6])
        print_table(rows, ["program", "n", "run_cnt", "µs/hit", "total ms"])
        print("job: " + ", ".join(f"{k} {v}" for k, v in rec["job"].items() if k not in ("per_sec", "start_mono_ns")))
    if micro:
        print(f"\nswitch micro ({micro['reps']} x {micro['rounds']:,} round trips a phase, medians):")
        rows = [
            [
                k,
                v["switch_ns_per_hit"],
                v["waking_ns_per_hit"],
                v["blocking_switches"],
                v["added_us_per_blocking_switch"],
            ]
            for k, v in micro["phases"].items()
        ]
        print_table(rows, ["phase", "switch ns/hit", "waking ns/hit", "blocking", "added µs/blocking"])
    if d:
        print("\nadded in-kernel µs (BPF run time; the trap / interrupt itself is not included):")
        rows = [
            ["per blocking switch (recorder run)", d.get("added_us_per_blocking_switch")],
            ["per blocking switch (recorder run, steady seconds)", d.get("steady_added_us_per_blocking_switch")],
            ["per sample (recorder run, upper bound)", d.get("added_us_per_sample")],
            ["per sample (recorder run, steady seconds)", d.get("steady_added_us_per_sample")],
            ["per blocking switch (micro, shallow stack)", d.get("micro_added_us_per_blocking_switch")],
            ["  without the off-CPU stack capture (micro)", d.get("micro_added_us_per_blocking_switch_no_capture")],
            ["  the capture alone (micro)", d.get("micro_capture_us_per_blocking_switch")],
            [
                f"  the capture, {DEEP} Python frames deeper (micro)",
                d.get("micro_capture_deep_us_per_blocking_switch"),
            ],
            ["sched_switch per hit, every switch (recorder run)", d.get("sched_switch_us_per_hit")],
            ["sched_switch per hit, no target (micro)", d.get("no_target_sched_switch_us_per_hit")],
            ["cpu_sample per hit, every tick (recorder run)", d.get("cpu_sample_us_per_hit")],
        ]
        print_table(rows, ["figure", "µs"])


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--calls", type=int, default=None, help=f"probe hits per timing (default {CALLS:,})")
    p.add_argument(
        "--skip-recorder", action="store_true", help="leave out the scheduler / sampling part (tracer record, micro)"
    )
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
    sched: dict[str, Any] = {}
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
            if not args.skip_recorder:
                sched = sched_part(Path(tmp), so, args.quick, stats_prev is not None, notes)
    finally:
        if stats_prev is not None:
            STATS_SYSCTL.write_text(stats_prev)
    res = compute(per_call)
    res.update(calls=calls, reps=reps, bpf_run_ns_per_hit=bpf_ns, bpf_stats=stats_prev is not None)
    if sched:
        res["sched_sampling"] = sched
    res["notes"] = notes
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
    if sched:
        print_sched(sched)
    for n in notes:
        print(f"note: {n}")
    print(f"wrote {write_result('probe_cost', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
