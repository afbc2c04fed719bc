"""analysis/stack_time.py: where a blocked stack waits (the GIL, a lock, the disk, a sleep) from its native frames,
as recorded on Debian's stripped CPython 3.11 (static take_gil shows as '?') and on a build with its symbols."""

from __future__ import annotations

from tracer.analysis.code_site import short_site, site_of
from tracer.analysis.stack_time import StackTime, blocked_kind, syscall_of, thread_name

PY = ("python", "/w/train.py", "main", "/w/train.py", 40)
CALL = ("python", "/w/fakecuda.py", "FakeCuda.call", "/w/fakecuda.py", 299)


def native(module: str, function: str) -> tuple:
    return ("native", module, function, None, None)


# the training thread re-taking the GIL after a ctypes call, as recorded (tests/integration/test_stack_chains_real)
GIL_AFTER_CALL = [
    native("python3.11", "_start"),
    PY,
    CALL,
    native("python3.11", "PyObject_Call"),
    native("_ctypes.cpython-311-x86_64-linux-gnu.so", "?"),
    native("python3.11", "PyEval_RestoreThread"),
    native("python3.11", "?"),
    native("libc.so.6", "pthread_cond_timedwait"),
    native("libc.so.6", "?"),
]
# a thread running Python asked to drop the GIL by the eval breaker, then waiting to take it back
GIL_IN_EVAL = [PY, native("python3.11", "?"), native("libc.so.6", "pthread_cond_timedwait"), native("libc.so.6", "?")]
GIL_NAMED = [PY, native("libpython3.12.so.1.0", "take_gil"), native("libc.so.6", "pthread_cond_timedwait")]
LOCK = [
    PY,
    native("python3.11", "?"),
    native("python3.11", "PyThread_acquire_lock_timed"),
    native("libc.so.6", "sem_clockwait"),
]
# a condition variable waited on by a C extension is not the GIL
EXT_COND = [PY, native("libtorch_cpu.so", "c10::ThreadPool::run"), native("libc.so.6", "pthread_cond_wait")]
FSYNC = [PY, native("python3.11", "?"), native("libc.so.6", "fsync")]
SLEEP = [PY, native("python3.11", "?"), native("libc.so.6", "clock_nanosleep")]


def test_gil_waits_are_told_from_lock_waits():
    assert blocked_kind(GIL_AFTER_CALL, "S", False) == "gil"
    assert blocked_kind(GIL_IN_EVAL, "S", False) == "gil"
    assert blocked_kind(GIL_NAMED, "S", False) == "gil"
    assert blocked_kind(LOCK, "S", False) == "lock"
    assert blocked_kind(EXT_COND, "S", False) == "other"


def test_io_sleep_and_calls():
    assert blocked_kind(FSYNC, "S", False) == "io"
    assert blocked_kind([PY, native("libc.so.6", "open")], "D", False) == "io"
    assert blocked_kind(SLEEP, "S", False) == "sleep"
    # inside a CUDA call the wait is the call's, whatever it waits in
    assert blocked_kind(GIL_AFTER_CALL, "S", True) == "cuda"
    assert syscall_of(FSYNC) == "fsync" and syscall_of(GIL_AFTER_CALL) == "pthread_cond_timedwait"


def test_sites_skip_library_frames():
    stdlib = ("python", "/usr/lib/python3.11/threading.py", "Thread.run", "/usr/lib/python3.11/threading.py", 975)
    frames = [stdlib, PY, stdlib]
    assert site_of(frames) == "/w/train.py:40 main"
    assert short_site(frames) == "main (train.py:40)"
    assert site_of([native("libc.so.6", "read")]) is None


def test_threads_are_named_by_os_name_else_hottest_function():
    hot = [StackTime(1, frames=[PY])]
    assert thread_name("metrics", "python3", 12858, hot) == "metrics (12858)"
    assert thread_name("python3", "python3", 12858, hot) == "thread 12858 (main, train.py:40)"
    assert thread_name("python3", "python3", 12858, []) == "thread 12858"
