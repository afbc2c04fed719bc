"""Recordings that lack what a chain is about, for the test that no detector speaks of something absent (issue 23).

- :func:`startup_helpers`: a training loop without a DataLoader whose process runs ``bash`` helper commands at
  start-up (``subprocess.run``: three waves, each child exiting, the main thread waiting for each): the shape that
  drew a false ``process_churn`` with DataLoader advice in three of four recordings an assistant was given;
- :func:`without_dataloader`: any scenario of :mod:`tests.support.scenarios` with its DataLoader workers, their
  rows and the main thread's waits for their batches taken out.
"""

from __future__ import annotations

import random

from tests.support.builder import MAIN_PID, MS, S, TraceBuilder
from tests.support.scenarios import SCENARIOS, Step, _base

DATALOADER_COMM = "pt_data_worker"
HELPER_PID = MAIN_PID + 200
# (fork time, how long the command ran): the helpers a job's start-up runs (nvidia-smi, git rev-parse, ldconfig),
# each in a wave of its own (more than a second apart), the main thread blocked until each one exits
HELPERS: tuple[tuple[int, int], ...] = ((2 * S, 600 * MS), (3200 * MS, 600 * MS), (4400 * MS, 600 * MS))


def startup_helpers(b: TraceBuilder) -> None:
    """The shared loop with no DataLoader workers; at 2.0, 3.2 and 4.4 s pid 1000 forks a ``bash`` that runs 600 ms
    and blocks its main thread until the child exits (the child's exit wakes it): 1.8 s of the 60 s, 3 %."""

    def busy(st: Step) -> bool:
        return any(a <= st.t0 < a + d + 100 * MS for a, d in HELPERS)

    def shape(st: Step) -> None:
        st.skip = busy(st)

    _base(b, random.Random(23), workers=0, shape=shape)
    for i, (fork, dur) in enumerate(HELPERS):
        pid = HELPER_PID + i
        b.process(pid, "bash", ppid=MAIN_PID, first_ns=fork, exit_ns=fork + dur, exit_code=0)
        b.event(fork, "fork", MAIN_PID, "python3", ppid=1, child=pid)
        b.event(fork + 2 * MS, "exec", pid, "bash", filename="/usr/bin/bash")
        b.event(fork + dur, "exit", pid, "bash", exit_code=0)
        b.off_cpu(fork + 1 * MS, dur - 1 * MS, pid=pid, comm="bash", reason="sleep")
        # the parent waits in waitpid until the child exits: the exiting child wakes it
        b.off_cpu(fork + 2 * MS, dur - 2 * MS, reason="sleep", waker_pid=pid, waker_comm="bash")


def without_dataloader(name: str) -> TraceBuilder:
    """Return scenario ``name`` with no DataLoader workers: their processes, events and rows gone, and the main
    thread's waits for their batches and CPU waits behind them with them (that time is on CPU instead)."""
    b = TraceBuilder()
    SCENARIOS[name](b)
    workers = {p["pid"] for p in b.processes if p["comm"] == DATALOADER_COMM}
    b.processes = [p for p in b.processes if p["pid"] not in workers]
    b.process_events = [e for e in b.process_events if e["pid"] not in workers and e.get("child") not in workers]
    b.sched = [
        r
        for r in b.sched
        if r["pid"] not in workers and r.get("waker_pid") not in workers and r.get("preempted_by_pid") not in workers
    ]
    return b


def helpers_builder() -> TraceBuilder:
    b = TraceBuilder()
    startup_helpers(b)
    return b
