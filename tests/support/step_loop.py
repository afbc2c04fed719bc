"""fixtures/workloads/step_loop.py as a hand-built recording, with run-to-run noise, for the comparison tests."""

from __future__ import annotations

import random

from tests.support.builder import MAIN_PID, MS, US, TraceBuilder
from tests.support.scenarios import ITEM_STACK, LAUNCH_STACK, TRAIN_STACK

STEP_LOOP_SYNC_OPS = {"memcpy": "cudaMemcpy", "stream": "cudaStreamSynchronize", "none": None}


def step_loop(
    b: TraceBuilder,
    seed: int,
    *,
    host_ms: float = 5.0,
    host_where: str = "before",
    kernel_ms: float = 5.0,
    launches: int = 10,
    sync: str = "memcpy",
    sync_every: int = 1,
    jitter: float = 0.1,
) -> None:
    """fixtures/workloads/step_loop.py as a scenario, with run-to-run noise: per step ``host_ms`` of Python work
    before or after ``launches`` launches that queue ``kernel_ms`` of GPU work, then every ``sync_every`` steps a
    call that waits for the GPU (``memcpy``: ``loss.item()``'s 4-byte DtoH cudaMemcpy with the driver copy inside;
    ``stream``: cudaStreamSynchronize; ``none``). Host and GPU times vary per step by +-``jitter`` (uniform, from
    ``seed``), so two seeds are two runs of one workload. The simulated GPU runs the queued work in order; keep the
    GPU work per step at or below the host's when nothing syncs (the queue has no bound)."""
    rng = random.Random(seed)
    op = STEP_LOOP_SYNC_OPS[sync]
    cmd = (
        f"python step_loop.py --host-ms {host_ms:g} --host-where {host_where} --launches {launches} "
        f"--kernel-us {kernel_ms * 1000:g} --sync {sync} --sync-every {sync_every}"
    )
    b.target = cmd
    b.process(MAIN_PID, "python3", ppid=1, cmdline=cmd)
    launch = b.stack(LAUNCH_STACK)
    wait_stack = b.stack(ITEM_STACK if sync == "memcpy" else TRAIN_STACK)
    end = b.end_ns - 50 * MS
    t, gpu_free, i = 200 * MS, 0, 0
    while t < end:
        host = int(host_ms * MS * rng.uniform(1 - jitter, 1 + jitter))
        if host_where == "before":
            t += host
        for k in range(launches):
            d = rng.randint(6 * US, 12 * US)
            b.call(t, d, "cudaLaunchKernel", stack_id=launch, stream=7, kernel=f"step_kernel_{k % 3}")
            gpu_free = max(gpu_free, t + d) + int(kernel_ms * MS / launches * rng.uniform(1 - jitter, 1 + jitter))
            t += d + 20 * US
        if host_where == "after":
            t += host
        i += 1
        if op is not None and i % sync_every == 0:
            wait = max(gpu_free - t, 0) + 30 * US
            b.call(
                t,
                wait,
                op,
                bytes=4 if sync == "memcpy" else None,
                kind="DtoH" if sync == "memcpy" else None,
                stream=None if sync == "memcpy" else 7,
                stack_id=wait_stack,
                off_cpu_ns=wait - 25 * US if wait > 100 * US else 0,
            )
            if sync == "memcpy":
                b.call(t + 2 * US, wait - 4 * US, "cuMemcpyDtoH", bytes=4, kind="DtoH")
            if wait > 100 * US:  # the thread sleeps inside the copy until the GPU is done
                b.off_cpu(t + 20 * US, wait - 25 * US, reason="sleep")
            t += wait
        t += 10 * US
    for sec in range(int(b.duration_s)):
        b.host(sec)
