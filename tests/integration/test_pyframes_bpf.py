"""Real eBPF: probes/pyframes.h walks the Python stack of pyfix_nested.py at a uprobe on libc labs, and
tracer/recorder/pyruntime.py resolves it to the exact frames and executing lines, for every installed interpreter, in
the main thread, a thread, and a forked child that exits right after its call.

Run alone for timings: ``.venv/bin/python tests/integration/test_pyframes_bpf.py`` prints BPF ns per hit of
the walk (from run_time_ns/run_cnt in the program's fdinfo, kernel.bpf_stats_enabled=1) for a ~5 and a ~30
frame stack."""

from __future__ import annotations

import ctypes as ct
import os
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# after the sys.path insert above (this file also runs as a script)
from tests.support.interpreters import DEBIAN_PYTHON, PYENV_VERSIONS, pyenv_python  # noqa: E402
from tests.support.need import need, need_root  # noqa: E402
from tracer.recorder import pyruntime  # noqa: E402
from tracer.recorder.cpython import pycfg  # noqa: E402

FIXTURE = Path(__file__).with_name("pyfix_nested.py")
# name -> the interpreter (None: not installed here)
INTERPRETERS: dict[str, Path | None] = {
    **{v: pyenv_python(v) for v in PYENV_VERSIONS},
    "debian-3.11": DEBIAN_PYTHON if DEBIAN_PYTHON.exists() else None,
}
MARK = 7_000_000
BENCH_ARG = MARK + 999
FORK_EVENT = 0xFFFF  # py_status of the pseudo stack_event carrying a fork (stack_ref = child pid)
MAX_PY_FRAMES = 64

pytestmark = pytest.mark.bpf

# pyframes.h is pasted into the text, not #included: bcc rewrites map methods (pycfg.lookup) only in the main
# text (tracer/recorder/program.py inlines it the same way).
BPF_PROGRAM = r"""
#include "common.h"
PYFRAMES_H

/* Stack events and fork notices, in one ring so a child's fork notice precedes its stacks. 1 MiB. */
BPF_RINGBUF_OUTPUT(events, 256);
/* key: 0; value: the stack_event being built (1 KiB, too big for the BPF stack). */
BPF_PERCPU_ARRAY(scratch, struct stack_event, 1);
/* key: 0; value: frames walked over all benchmark hits (not sent), to check the depth the timing is for. */
BPF_ARRAY(bench_frames, u64, 1);

int on_labs(struct pt_regs *ctx)
{
    long arg = PT_REGS_PARM1(ctx);
    if (arg < MARK || arg >= MARK + 1000000)
        return 0;
    u32 zero = 0;
    struct stack_event *se = scratch.lookup(&zero);
    if (!se)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!pycfg.lookup(&tgid))
        return 0;
    se->stack_ref = arg;
    se->pid = tgid;
    se->tid = (u32)id;
    se->native_id = -1;
    u64 h = 0;
    int n = walk_python(se, tgid, &h);
    if (arg != MARK + 999) {
        events.ringbuf_output(se, sizeof(*se), 0);
    } else {
        u64 *acc = bench_frames.lookup(&zero);
        if (acc)
            __sync_fetch_and_add(acc, n);
    }
    return 0;
}

TRACEPOINT_PROBE(task, task_newtask)
{
    if (args->clone_flags & 0x00010000) /* CLONE_THREAD */
        return 0;
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!pycfg.lookup(&parent))
        return 0;
    u32 child = args->pid;
    pycfg_on_fork(parent, child);
    u32 zero = 0;
    struct stack_event *se = scratch.lookup(&zero);
    if (!se)
        return 0;
    se->stack_ref = child;
    se->pid = parent;
    se->n_py = 0;
    se->py_status = 0xffff;
    events.ringbuf_output(se, sizeof(*se), 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    if ((u32)id == id >> 32)
        pycfg_on_exit(id >> 32);
    return 0;
}
"""


class PyFrame(ct.Structure):
    _fields_ = [("code", ct.c_uint64), ("lasti", ct.c_uint32), ("_pad", ct.c_uint32)]


class StackEvent(ct.Structure):
    _fields_ = [
        ("stack_ref", ct.c_uint64),
        ("pid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("native_id", ct.c_int32),
        ("n_py", ct.c_uint16),
        ("py_status", ct.c_uint16),
        ("frames", PyFrame * MAX_PY_FRAMES),
    ]


@dataclass
class Got:
    arg: int
    pid: int
    tid: int
    status: int
    raw: list[tuple[int, int]]
    frames: list[pyruntime.PyFrameInfo]


def fixture_lines() -> dict[str, int]:
    out = {}
    for i, line in enumerate(FIXTURE.read_text().splitlines(), 1):
        m = re.search(r"# L:(\w+)$", line)
        if m:
            out[m.group(1)] = i
    return out


def load_bpf():
    from bcc import BPF

    text = BPF_PROGRAM.replace("PYFRAMES_H", (ROOT / "probes" / "pyframes.h").read_text())
    b = BPF(text=text.encode(), cflags=[f"-I{ROOT / 'probes'}", f"-DMARK={MARK}", *pycfg.cflags()])
    b.attach_uprobe(name="c", sym="labs", fn_name="on_labs")
    # A ring buffer can be opened once per BPF object: route its records to the session that is running.
    b.cht_session = None
    b["events"].open_ring_buffer(lambda ctx, data, size: b.cht_session._on_event(ctx, data, size))
    return b


class Session:
    """One fixture run under the BPF program: events are resolved as soon as they are polled."""

    def __init__(self, b, interp: Path, modes: list[str]) -> None:
        self.b = b
        self.mgr = pyruntime.PyRuntimeManager(b)
        self.got: list[Got] = []
        self.forks: list[tuple[int, int]] = []
        b.cht_session = self
        self.proc = subprocess.Popen(
            [str(interp), str(FIXTURE), *modes], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "ready", line
        self.pid = int(line[1])
        t0 = time.perf_counter()
        self.target = self.mgr.configure(self.pid)
        self.configure_s = time.perf_counter() - t0
        assert self.target is not None, f"{interp}: configure() found no CPython"

    def _on_event(self, _ctx, data, size) -> None:
        assert size == ct.sizeof(StackEvent)
        ev = ct.cast(data, ct.POINTER(StackEvent)).contents
        if ev.py_status == FORK_EVENT:
            self.mgr.note_fork(ev.pid, ev.stack_ref)
            self.forks.append((ev.pid, ev.stack_ref))
            return
        raw = [(ev.frames[i].code, ev.frames[i].lasti) for i in range(min(ev.n_py, MAX_PY_FRAMES))]
        frames = self.mgr.resolve(ev.pid, raw)
        self.got.append(Got(ev.stack_ref, ev.pid, ev.tid, ev.py_status, raw, frames))

    def run(self, timeout: float = 60) -> None:
        """Runs the modes and polls until the fixture says done; the fixture then waits in finish()."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.b.ring_buffer_poll(20)
            if select.select([self.proc.stdout], [], [], 0)[0]:
                assert self.proc.stdout.readline().strip() == "done"
                break
        else:
            raise AssertionError("fixture did not finish")
        self.b.ring_buffer_poll(20)

    def finish(self) -> None:
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=10)
        assert self.proc.returncode == 0


def expected(version: tuple[int, int], mode: str) -> list[tuple[str, str, int]]:
    """(file basename, qualname, line) innermost first, for the fixture part of the stack."""
    ln = fixture_lines()
    fwd = "forward" if version <= (3, 10) else "Model.forward"
    f = FIXTURE.name
    inner = [(f, "c", ln["c"]), (f, fwd, ln["forward"]), (f, "b", ln["b"]), (f, "a", ln["a"])]
    if mode == "main":
        return inner + [(f, "main", ln["main"]), (f, "<module>", ln["module"])]
    if mode == "fork":
        return inner + [
            (f, "run_fork", ln["fork_child"]),
            (f, "main", ln["main_fork"]),
            (f, "<module>", ln["module"]),
        ]
    run = "run" if version <= (3, 10) else "Thread.run"
    boot = "_bootstrap_inner" if version <= (3, 10) else "Thread._bootstrap_inner"
    boot2 = "_bootstrap" if version <= (3, 10) else "Thread._bootstrap"
    return inner + [("threading.py", run, -1), ("threading.py", boot, -1), ("threading.py", boot2, -1)]


def _simplify(frames: list[pyruntime.PyFrameInfo]) -> list[tuple[str, str, int]]:
    return [(os.path.basename(fr.filename), fr.qualname, fr.line) for fr in frames]


@pytest.fixture(scope="module")
def bpf():
    need_root("eBPF")
    b = load_bpf()
    yield b
    b.cleanup()


@pytest.mark.parametrize("name", list(INTERPRETERS))
def test_exact_frames(bpf, name: str) -> None:
    interp = INTERPRETERS[name]
    need(interp is not None, f"CPython {name} is not installed (pyenv install {name})")
    assert interp is not None
    s = Session(bpf, interp, ["main", "thread", "fork"])
    try:
        s.run()
        _check(s, name)
    finally:
        s.finish()


def test_truncated(bpf) -> None:
    """A stack deeper than MAX_PY_FRAMES: PYS_TRUNCATED, the innermost MAX_PY_FRAMES frames kept."""
    interp = next((p for p in INTERPRETERS.values() if p is not None), None)
    need(interp is not None, f"no CPython {'/'.join(INTERPRETERS)} is installed")
    assert interp is not None
    s = Session(bpf, interp, [f"deep:{MAX_PY_FRAMES + 10}"])
    try:
        s.run()
    finally:
        s.finish()
    (g,) = s.got
    assert g.status == 3  # PYS_TRUNCATED
    assert len(g.raw) == MAX_PY_FRAMES
    ln = fixture_lines()
    got = _simplify(g.frames)
    assert got[:4] == expected(s.target.version, "main")[:4]
    assert got[-1] == (FIXTURE.name, "deep_a", ln["deep_a"])


def test_cfg_layout_matches_c(bpf) -> None:
    """The ctypes PyCfg that pyruntime writes is the struct py_cfg bcc compiled."""
    assert ct.sizeof(bpf["pycfg"].Leaf) == ct.sizeof(pycfg.PyCfg) == 56
    assert ct.sizeof(StackEvent) == ct.sizeof(bpf["scratch"].sLeaf)


def _check(s: Session, name: str) -> None:
    version = s.target.version
    by_arg = {g.arg - MARK: g for g in s.got}
    assert sorted(by_arg) == [1, 2, 3], [(g.arg, g.pid, g.status) for g in s.got]
    for n, mode in ((1, "main"), (2, "thread"), (3, "fork")):
        g = by_arg[n]
        assert g.status == 0, (mode, g.status)
        got = _simplify(g.frames)
        want = expected(version, mode)
        assert all(fr.resolved for fr in g.frames), (mode, got)
        if mode == "thread":
            got = [(f, q, line if f != "threading.py" else -1) for f, q, line in got]
            assert g.tid != s.pid
        assert got == want, f"{name} {mode}:\n got  {got}\n want {want}"
    fork_child = by_arg[3].pid
    assert fork_child != s.pid and (s.pid, fork_child) in s.forks
    # The child has exited: a fresh manager still resolves its stack from the parent's memory (note_fork).
    assert not os.path.exists(f"/proc/{fork_child}")
    fresh = pyruntime.PyRuntimeManager(None)
    assert fresh.configure(s.pid) is not None
    fresh.note_fork(s.pid, fork_child)
    assert _simplify(fresh.resolve(fork_child, by_arg[3].raw)) == expected(version, "fork")


# ------------------------------------------------------------------------------------------------------------
# Timings (run this file as a script)


def _prog_stats(b, fn: str) -> tuple[int, int]:
    fd = b.funcs[fn.encode()].fd
    stats = {}
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            k, _, v = line.partition(":")
            stats[k.strip()] = v.strip()
    return int(stats.get("run_time_ns", 0)), int(stats.get("run_cnt", 0))


def bench(calls: int = 20000) -> None:
    from bcc import BPF

    with open("/proc/sys/kernel/bpf_stats_enabled") as f:
        old = f.read().strip()
    with open("/proc/sys/kernel/bpf_stats_enabled", "w") as f:
        f.write("1")
    try:
        for name, interp in INTERPRETERS.items():
            if interp is None:
                continue
            row = []
            for depth in (3, 28):
                b = load_bpf()
                s = Session(b, interp, [f"bench:{depth}:{calls}"])
                t0, c0 = _prog_stats(b, "on_labs")
                s.run()
                s.finish()
                t1, c1 = _prog_stats(b, "on_labs")
                frames = b["bench_frames"][ct.c_int(0)].value / max(c1 - c0, 1)
                # frames on the stack: `depth` deep() frames + main + <module>
                row.append(f"{frames:4.1f} frames: {(t1 - t0) / max(c1 - c0, 1):6.0f} ns/hit ({c1 - c0} hits)")
                b.cleanup()
            print(f"{name:12s} " + "  ".join(row) + f"  configure {s.configure_s * 1000:.1f} ms")
        empty = BPF(text="int f(struct pt_regs *ctx) { return 0; }")
        empty.attach_uprobe(name="c", sym="labs", fn_name="f")
        p = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import ctypes; l=ctypes.CDLL(None)\nfor _ in range({calls}): l.labs({BENCH_ARG})",
            ],
            check=True,
        )
        t, c = _prog_stats(empty, "f")
        print(f"empty uprobe program: {t / max(c, 1):.0f} ns/hit ({c} hits, rc {p.returncode})")
    finally:
        with open("/proc/sys/kernel/bpf_stats_enabled", "w") as f:
            f.write(old)


if __name__ == "__main__":
    bench()
