"""Python frames of every thread of a CPython process, read from its memory through /proc/PID/mem (pread: the
process is never stopped): _PyRuntime -> interpreters -> thread states -> frames, with the frame and code layouts
the BPF walker uses (tracer.recorder.cpython.layouts) and these thread-list offsets.

A read races the running threads: a frame may change under us. Each thread's walk stops at the first bad read and
keeps what it had (a torn stack is marked ``partial``), as py-spy --nonblocking does."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from tracer.recorder.cpython.layouts import V310, PyTarget
from tracer.recorder.cpython.memory import ProcessMemory
from tracer.recorder.pyruntime import PyFrameInfo, PyRuntimeManager

# Offsets of the thread list, x86_64 default builds, measured with ctypes in each interpreter
# (PyInterpreterState_Head/ThreadHead, PyThreadState_Next, threading.get_native_id) on pyenv 3.10-3.13 and
# Debian's 3.11; 3.13's agree with its _Py_DebugOffsets. native: None on 3.10, which has no native_thread_id:
# the tid is then read from glibc's struct pthread (thread_id is a pthread_t) at PTHREAD_TID.
# fmt: off
THREAD_LIST: dict[tuple[int, int], dict[str, int | None]] = {
    (3, 10): dict(interp_head=32, threads_head=8, interp_next=0, ts_next=8, thread_id=176, native=None),
    (3, 11): dict(interp_head=40, threads_head=16, interp_next=0, ts_next=8, thread_id=152, native=160),
    (3, 12): dict(interp_head=40, threads_head=72, interp_next=0, ts_next=8, thread_id=136, native=144),
    (3, 13): dict(interp_head=632, threads_head=7344, interp_next=0, ts_next=8, thread_id=152, native=160),
}
# fmt: on
PTHREAD_TID = 0x2D0  # glibc x86_64: offsetof(struct pthread, tid)
MAX_THREADS = 4096
MAX_FRAMES = 256


@dataclass
class PyThread:
    """One thread state: its OS thread id and frames, innermost first."""

    tid: int
    frames: list[PyFrameInfo] = field(default_factory=list)
    partial: bool = False


def _q(mem: ProcessMemory, addr: int) -> int:
    return struct.unpack("<Q", mem.read(addr, 8))[0]


def _frames(mem: ProcessMemory, t: PyTarget, tstate: int) -> tuple[list[tuple[int, int]], bool]:
    """(code, lasti) pairs innermost first, as probes/pyframes.h walk_python computes them."""
    o = t.binary.offsets
    frame = _q(mem, tstate + o["ts_frame"])
    if o.get("cframe_current") is not None and frame:
        frame = _q(mem, frame + o["cframe_current"])
    out: list[tuple[int, int]] = []
    owner = o.get("f_owner")
    tagged = t.version >= (3, 14)
    try:
        while frame and len(out) < MAX_FRAMES:
            buf = mem.read(frame, 128)
            code = struct.unpack_from("<Q", buf, o["f_code"])[0] & (~3 if tagged else ~0)
            if t.version <= V310:
                lasti = struct.unpack_from("<i", buf, o["f_instr"])[0]
            else:
                ip = struct.unpack_from("<Q", buf, o["f_instr"])[0]
                lasti = ((ip - code - (o.get("co_adaptive") or 0)) >> 1) & 0xFFFFFFFF
            if owner is not None and buf[owner] >= 3:
                code = 0  # a C-stack shim frame (3.12+)
            out.append((code, lasti))
            frame = struct.unpack_from("<Q", buf, o["f_previous"])[0]
    except OSError:
        return out, True
    return out, False


def read_threads(pid: int, runtime: PyRuntimeManager) -> list[PyThread] | None:
    """Every Python thread state of ``pid`` with its frames; None when ``pid`` is not a CPython this knows."""
    # The recorder's own runtime (its bpf set) configures a process itself, when its lifecycle says so: a snapshot
    # that configured one first (a forked child, before its fork was handled) left the child's code objects
    # unresolved once the GC probes were attached at that registration (test_record's debian-fork stack).
    t = runtime.targets.get(pid) or (runtime.configure(pid) if runtime.bpf is None else None)
    if t is None or t.version not in THREAD_LIST:
        return None
    lay = THREAD_LIST[t.version]
    try:
        mem = ProcessMemory(pid)
    except OSError:
        return None
    out: list[PyThread] = []
    try:
        interp = _q(mem, t.runtime_addr + lay["interp_head"])
        seen: set[int] = set()
        while interp and interp not in seen:
            seen.add(interp)
            ts = _q(mem, interp + lay["threads_head"])
            while ts and ts not in seen and len(seen) < MAX_THREADS:
                seen.add(ts)
                head = mem.read(ts, 192)
                native = lay["native"]
                if native is not None:
                    tid = struct.unpack_from("<Q", head, native)[0] & 0xFFFFFFFF
                else:
                    pthread = struct.unpack_from("<Q", head, lay["thread_id"])[0]
                    tid = struct.unpack("<i", mem.read(pthread + PTHREAD_TID, 4))[0] if pthread else 0
                try:
                    raw, partial = _frames(mem, t, ts)
                except OSError:
                    raw, partial = [], True
                frames = [f for f in runtime.resolve(pid, raw)]
                out.append(PyThread(tid, frames, partial))
                ts = struct.unpack_from("<Q", head, lay["ts_next"])[0]
            break  # sub-interpreters: the main one only (interp->next's offset differs per version)
    except OSError:
        pass
    finally:
        mem.close()
    return out
