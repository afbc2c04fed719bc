"""The names a reader sees, spelled once: who woke a thread, whose a CPU holder was, what a process or thread is,
and the parts of a thread's time.

An assistant reading one recording through several tools (and SQL) must meet one name per thing: the timer
interrupt was ``comm "?"`` / ``interrupt`` in the breakdown and ``[timer]`` in ``thread_wakers`` (issue 23).
The recorder writes these names into the tables (the interrupt wakers, ``processes.role``, the
``thread_breakdown`` columns), the analyses return them and the views print them: all three import them from
here, and ``tests/test_vocabulary.py`` checks every tool's output and the tables' values against these sets.
"""

from __future__ import annotations

from probes.catalog import CALL_PARTS

# -- wakers -----------------------------------------------------------------------------------------------------
# A wakeup from an interrupt handler runs on whatever task the interrupt found, which woke no one: it is credited
# to pid 0 and named for the kind of handler (probes/sched.bpf.c, IRQ_*; the numbers are its codes).
TIMER_WAKER = "[timer]"  # an hrtimer or the timer softirq: a sleep, a timeout, the GIL's 5 ms timed wait expired
SOFTIRQ_WAKER = "[softirq]"  # another softirq (RCU, tasklets, the scheduler)
IRQ_WAKER = "[irq]"  # a device interrupt
NET_WAKER = "[net]"  # the network softirqs: a packet arrived or was sent
BLOCK_WAKER = "[block]"  # the block softirq: a disk I/O completed
WAKER_KINDS: dict[int, str] = {1: TIMER_WAKER, 2: SOFTIRQ_WAKER, 3: IRQ_WAKER, 4: NET_WAKER, 5: BLOCK_WAKER}
# pid 0 outside any handler the probes saw: the idle task (a recording made before handlers were told apart
# names it swapper/N, by CPU)
IDLE_WAKER = "[idle]"
# a blocked thread that became runnable with no wakeup the probes saw (a wakeup that raced its own switch-out):
# thread_wakers had pid 0 with an empty name ("?" in the breakdown), sched a NULL waker
UNSEEN_WAKER = "[unseen]"
INTERRUPT_WAKERS: frozenset[str] = frozenset({*WAKER_KINDS.values(), IDLE_WAKER, UNSEEN_WAKER})
# a task whose name the probes could not read (it exited as it woke the thread)
UNNAMED_TASK = "?"


def waker_name(pid: int | None, comm: str | None) -> str:
    """Return the one name of a waker: a task's comm; for pid 0 (or none) the interrupt's kind, the idle task,
    or :data:`UNSEEN_WAKER` when no waker was seen."""
    if pid:
        return comm or UNNAMED_TASK
    if comm in INTERRUPT_WAKERS:
        return comm
    return IDLE_WAKER if comm else UNSEEN_WAKER


# -- whose a task was, seen from the thread it kept waiting or woke ------------------------------------------------
SELF = "self"  # a thread of the waiting thread's own process
TREE = "tree"  # another process of the traced tree (its DataLoader workers, its ranks)
OTHER = "other"  # a process outside the traced tree (another tenant)
TRACER = "tracer"  # the recorder and its helpers: never a culprit
INTERRUPT = "interrupt"  # no task: an interrupt handler (wakers only; the name says which kind)
HOLDER_CLASSES: tuple[str, ...] = (SELF, TREE, OTHER, TRACER)
WAKER_CLASSES: tuple[str, ...] = (*HOLDER_CLASSES, INTERRUPT)

# -- what a process is --------------------------------------------------------------------------------------------
# processes.role as the recorder writes it
TARGET_ROLE = "target"
TRACER_ROLE = "tracer"
RECORDED_ROLES: tuple[str, ...] = (TARGET_ROLE, TRACER_ROLE)
# a process's role as every analysis reports it (tracer.analysis.recording.RecordingInfo.process_role)
MAIN_ROLE = "main"  # the traced command, or the --pid attached to
RANK_ROLE = "rank"  # a rank's own process in a distributed job: each one trains
LAUNCHER_ROLE = "launcher"  # the process that started the ranks (torchrun's agent, mpirun)
DATALOADER_ROLE = "dataloader_worker"
CHILD_ROLE = "child"  # any other process of the traced tree
PROCESS_ROLES: tuple[str, ...] = (MAIN_ROLE, RANK_ROLE, LAUNCHER_ROLE, DATALOADER_ROLE, CHILD_ROLE, TRACER_ROLE)
DATALOADER_COMM = "pt_data_worker"  # torch's DataLoader workers rename themselves so

# -- what a thread is (the breakdown's threads) -------------------------------------------------------------------
# the training thread (most launch + sync time), and under a launcher every rank's: its driver thread, else its main
# thread (a rank training on the CPU makes no CUDA call)
TRAINING_THREAD = "training"
DRIVER_THREAD = "driver"  # another process's main CUDA thread (most launch + sync time of its process)
CUDA_THREAD = "cuda"  # another thread that makes CUDA calls
PLAIN_THREAD = "thread"  # a thread with no CUDA call
THREAD_ROLES: tuple[str, ...] = (TRAINING_THREAD, DRIVER_THREAD, CUDA_THREAD, PLAIN_THREAD)
# -- what a hop of a chain's wait path is, seen from the affected thread (tracer.analysis.waitgraph; chains.model.Hop)
HOP_ROLES: tuple[str, ...] = (
    TRAINING_THREAD,
    "worker",  # a DataLoader worker process's thread
    "helper",  # another process of the job
    RANK_ROLE,
    "job_thread",  # another thread of the affected thread's process (or the affected thread, not training)
    "other_process",  # outside the traced job
    "kernel",  # an interrupt, no task
    "gpu",
)


# -- the parts of a thread's time ---------------------------------------------------------------------------------
# thread_breakdown's columns are f"{part}_ns" in this order, and they add up to wall_ns: on CPU outside calls,
# inside CUDA calls by the catalog's classes, waiting for a CPU by whose it was, blocked
CALL_PART_NAMES: tuple[str, ...] = tuple(p.name.lower() for p in CALL_PARTS)
RUNQ_PART_NAMES: tuple[str, ...] = tuple(f"runq_{c}" for c in HOLDER_CLASSES)
PART_NAMES: tuple[str, ...] = ("cpu", *CALL_PART_NAMES, *RUNQ_PART_NAMES, "blocked")
