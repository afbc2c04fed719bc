"""A short-step training loop that checkpoints every N steps, hand-built: the step series' and the waits' ground
truth (issue 23's "every 40th step took 57 ms instead of 3.2 ms").

Per step (STEP_NS = 3.2 ms, each step 0-40 µs longer by a seeded jitter): 4 launches, then Python work, then
a 4-byte DtoH cudaMemcpy (``loss.item()``, checkpoint.py:31) that waits for the GPU, blocked inside it and woken
by the GPU's interrupt (``[irq]``): 421 waits. After every EVERY-th wait (waits 40, 80, ... 400), the thread
writes a checkpoint: CKPT_CPU_NS on CPU serialising, then CKPT_IO_NS blocked in fsync until the disk's completion
interrupt (``[block]``) wakes it. Step k is numbered by the wait that ends it, so steps 41, 81, ... 401 are the
slow ones: every 40th, 10 of them, each CKPT_CPU_NS + CKPT_IO_NS = 54 ms longer than its neighbours. Between
checkpoints it also sleeps 1 ms in every 10th step (``time.sleep``, woken by ``[timer]``). With ``odd_wakers``,
two of those sleeps (waits 15 and 25) end as older or racing recordings show them: pid 0 with no name (no wakeup
seen) and ``swapper/1`` (the idle task, before interrupt kinds were told apart).
"""

from __future__ import annotations

import random

from tests.support.builder import MAIN_PID, MS, US, S, TraceBuilder

STEPS = 421  # waits: 420 steps between them
EVERY = 40
STEP_NS = 3200 * US
JITTER_NS = 40 * US
CKPT_CPU_NS = 4 * MS
CKPT_IO_NS = 50 * MS
SLEEP_EVERY = 10
SLEEP_NS = 1 * MS
START_NS = 1 * S
SYNC_STACK = [
    ("python", "checkpoint.py", "<module>", "checkpoint.py", 60),
    ("python", "checkpoint.py", "train_step", "checkpoint.py", 31),
    ("cuda", "libcudart.so.12", "cudaMemcpy", None, None),
]


ODD_WAKERS = {15: "", 25: "swapper/1"}


def checkpoint_loop(b: TraceBuilder, odd_wakers: bool = False, pid: int = MAIN_PID, every: int = EVERY) -> list[int]:
    """Build the loop (module docstring) into ``b`` as process ``pid``, checkpointing every ``every`` steps (0:
    never); return the waits (1-based) a checkpoint follows."""
    rng = random.Random(40)
    b.duration_s = 4.0
    b.target = "python checkpoint.py"
    b.process(pid, "python3", ppid=1, cmdline="python checkpoint.py")
    sync = b.stack(SYNC_STACK)
    t = START_NS
    ckpts = []
    for i in range(STEPS):
        # step i is the interval that ends with wait i; the checkpoint after wait i-1 opens it
        if i and every and i % every == 0:
            ckpts.append(i)
            t += CKPT_CPU_NS
            b.off_cpu(t, CKPT_IO_NS, pid=pid, reason="io", waker_pid=0, waker_tid=0, waker_comm="[block]")
            t += CKPT_IO_NS
        a = t
        for _ in range(4):
            b.call(t, 8 * US, "cudaLaunchKernel", pid=pid, stream=7)
            t += 20 * US
        if i % SLEEP_EVERY == 5:
            comm = ODD_WAKERS.get(i, "[timer]") if odd_wakers else "[timer]"
            b.off_cpu(t + 100 * US, SLEEP_NS, pid=pid, reason="sleep", waker_pid=0, waker_tid=0, waker_comm=comm)
        wait = 1200 * US
        start = a + STEP_NS + rng.randrange(JITTER_NS) - wait
        b.call(start, wait, "cudaMemcpy", pid=pid, bytes=4, kind="DtoH", stack_id=sync, off_cpu_ns=wait - 100 * US)
        b.off_cpu(
            start + 50 * US, wait - 100 * US, pid=pid, reason="sleep", waker_pid=0, waker_tid=0, waker_comm="[irq]"
        )
        t = start + wait
    return ckpts
