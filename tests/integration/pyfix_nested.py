"""Fixture for tests/integration/test_pyframes_bpf.py: a known Python stack around a cheap C call.

a -> b -> Model.forward -> c -> libc labs(MARK + n) through ctypes (CDLL releases the GIL, as torch does). The
tracer uprobes labs and keeps only arguments in [MARK, MARK + 1_000_000). Lines tagged ``# L:<name>`` are the
ones the test expects; it reads them from this file, so the file can be edited freely.

Usage: python pyfix_nested.py [main] [thread] [fork] [deep:DEPTH] [bench:DEPTH:CALLS]... Prints ``ready PID``
and waits for one line on stdin before running the modes in order, then prints ``done`` and waits for one more
line before exiting (so the test can read this process's memory after its children exit). Works on Python 3.6+
(no newer syntax)."""

import ctypes
import os
import sys
import threading

MARK = 7000000
libc = ctypes.CDLL(None)
libc.labs.argtypes = [ctypes.c_long]
libc.labs.restype = ctypes.c_long


def c(n):
    return libc.labs(MARK + n)  # L:c


class Model:
    def forward(self, n):
        return c(n)  # L:forward


def b(n):
    return Model().forward(n)  # L:b


def a(n):
    return b(n)  # L:a


def run_thread(n):
    t = threading.Thread(target=a, args=(n,))
    t.start()
    t.join()


def run_fork(n):
    pid = os.fork()
    if pid == 0:
        a(n)  # L:fork_child
        os._exit(0)
    os.waitpid(pid, 0)


def deep(depth, calls):
    if depth > 1:
        return deep(depth - 1, calls)  # L:deep
    for _ in range(calls):
        libc.labs(MARK + 999)  # L:bench


def deep_a(depth, n):
    if depth > 1:
        return deep_a(depth - 1, n)  # L:deep_a
    return a(n)


def main():
    print("ready", os.getpid(), flush=True)
    sys.stdin.readline()
    for mode in sys.argv[1:]:
        if mode == "main":
            a(1)  # L:main
        elif mode == "thread":
            run_thread(2)
        elif mode == "fork":
            run_fork(3)  # L:main_fork
        elif mode.startswith("bench:"):
            _, depth, calls = mode.split(":")
            deep(int(depth), int(calls))
        elif mode.startswith("deep:"):
            deep_a(int(mode.split(":")[1]), 4)
        elif mode == "none":
            for _ in range(int(1e5)):
                pass
    print("done", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()  # L:module
