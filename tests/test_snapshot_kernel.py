"""tracer.snapshot.kernel: how long a thread has been off CPU, read from /proc of a real blocked process on either
CPU of this machine, against the wall clock and the CPU's stolen time (/proc/stat)."""

from __future__ import annotations

import os
import time

import pytest

from tracer.snapshot import kernel

TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")  # /proc/stat's unit


def _steal_ns(cpu: int) -> int:
    """Time the hypervisor stole from ``cpu`` since boot (/proc/stat's 8th value), ns."""
    for line in open("/proc/stat"):
        if line.startswith(f"cpu{cpu} "):
            return int(line.split()[8]) * TICK_NS
    raise AssertionError(f"cpu{cpu} not in /proc/stat")


def _blocked_child(cpu: int) -> tuple[int, int, int]:
    """Fork a child that runs on ``cpu`` only, says so, then blocks in read(); return its pid, the monotonic ns
    at which it had said so (it has not run since, to within the pipe's wake-up) and the pipe end that holds it."""
    r, w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {cpu})
        os.write(w, b"x")
        os.read(hold_r, 1)  # blocked until killed
        os._exit(0)
    os.read(r, 1)
    ready = time.monotonic_ns()
    for fd in (r, w, hold_r):
        os.close(fd)
    return pid, ready, hold_w


@pytest.mark.parametrize("child_cpu", [0, 1])
def test_idle_is_read_on_the_blocked_threads_own_cpu(child_cpu: int) -> None:
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1: the two clocks compared are two CPUs'")
    # GIVEN a thread blocked on one CPU while the reader runs on the other (a VM's CPUs' clocks differ by their
    # stolen time: the reader's own clock read 6.9 s for a 2 s wait here)
    home = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {1 - child_cpu})
    pid, ready, hold = _blocked_child(child_cpu)
    try:
        steal0 = _steal_ns(child_cpu)
        time.sleep(1.5)
        # WHEN its kernel state is read
        with kernel.SchedClock() as clock:
            k = kernel.read_thread(pid, pid, clock)
            steal1 = _steal_ns(child_cpu)
            waited = time.monotonic_ns() - ready
        # THEN the reader is back on its own CPU
        assert os.sched_getaffinity(0) == {1 - child_cpu}
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(hold)
        os.sched_setaffinity(0, home)
    assert k is not None and k.state == "sleeping" and k.syscall == "read"
    # AND its time off CPU is the wall time since it blocked, less what was stolen from its CPU meanwhile (its clock
    # does not count stolen time), to within /proc/stat's ticks and the scheduler's accounting (one tick each side)
    assert k.idle_ns is not None
    lower = waited - (steal1 - steal0) - 2 * TICK_NS - 10_000_000
    assert lower <= k.idle_ns <= waited + 10_000_000, (k.idle_ns, waited, steal1 - steal0)


def test_an_unknown_cpu_reads_the_readers_own_clock() -> None:
    # GIVEN a CPU number no thread can run on  WHEN now is read on it  THEN it is this CPU's clock, and the reader
    # may still run where it could. The reader stays on one CPU for the test: two CPUs' clocks differ by their
    # stolen time, so a reader moved between the two reads compared two clocks (2.98 s apart under two loads)
    outer = os.sched_getaffinity(0)
    home = {min(outer)}
    os.sched_setaffinity(0, home)
    try:
        with kernel.SchedClock() as clock:
            far = clock.now(100_000)
            assert far is not None and abs(far - kernel.now_exec_ns()) < 1_000_000_000
            assert os.sched_getaffinity(0) == home
        assert os.sched_getaffinity(0) == home
    finally:
        os.sched_setaffinity(0, outer)
