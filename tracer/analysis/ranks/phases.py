"""A rank's time in *phases*: its thread's exact breakdown, with the blocked part split by who ended each wait.

The breakdown's parts add up to the thread's wall time; blocked time (off CPU, not runnable, outside CUDA calls)
is split here by its wakers (``thread_wakers``): a collective's wait ends when the communication library's
thread (gloo's ``pt_gloo_runloop``: torch runs a gloo collective there while the caller waits on the result) or
another rank wakes the caller; a ``time.sleep`` or a timed wait ends with a timer interrupt; a disk read with a
block-device interrupt; a batch with a DataLoader worker's wakeup. The split keeps the blocked total exact and
shares it out in the wakers' proportions (a wakeup's row is counted in the second it happened, the blocked time
in the seconds it spanned). Blocked time inside a CUDA call (a sync that sleeps) is in the call's part, so the
wakers of in-call waits are left out.

A wait for a GPU-side collective (NCCL) is a host sync: the collective call enqueues and returns, and the host
waits for the other ranks in its next synchronize. With the NCCL probes (``OpClass.COLLECTIVE``) such a sync,
the first after a collective call on the thread, is moved from ``sync`` to the collective phase
(``gpu_collective``: its ns per second). It also holds the rank's own kernels queued before the collective; the
ranks are compared with each other, and a rank's own GPU work is the same on every rank of a data-parallel job.
Without the probes (an older recording, a torch with NCCL linked in statically) it stays ``sync``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tracer.analysis.breakdown.thread_time import ThreadTime
from tracer.analysis.recording import RecordingInfo
from tracer.analysis.taxonomy import CALL_PART_NAMES, RUNQ_PART_NAMES
from tracer.vocabulary import BLOCK_WAKER, DATALOADER_ROLE, NET_WAKER, TIMER_WAKER

# Thread names of communication libraries' own threads (prefixes). torch names gloo's worker threads
# pt_gloo_runloop and gloo its TCP loop gloo_tcp_loop; NCCL's proxy and torch's NCCL watchdog threads start
# with these too.
COMM_THREAD_PREFIXES: tuple[str, ...] = ("pt_gloo", "gloo", "pt_nccl", "nccl", "pt_mpi")

COLLECTIVE = "collective"
BLOCKED_PHASES: tuple[str, ...] = (
    COLLECTIVE,
    "asleep",
    "disk_io",
    "network",
    "data_workers",
    "own_threads",
    "other_blocked",
)
# every phase, in the order tables show them; they add up to the thread's wall time
PHASES: tuple[str, ...] = ("cpu", *CALL_PART_NAMES, "runq", *BLOCKED_PHASES)
LABELS: dict[str, str] = {
    "cpu": "on CPU (Python and host work)",
    "launch": "launching kernels",
    "sync": "waiting for the GPU",
    "alloc": "in CUDA allocations",
    "free": "in CUDA frees",
    "copy": "in async copies",
    "other": "in other CUDA calls",
    "runq": "waiting for a CPU",
    COLLECTIVE: "waiting in collectives (gloo's, or an NCCL one's next sync)",
    "asleep": "asleep (woken by a timer: time.sleep, a timed wait)",
    "disk_io": "blocked on disk I/O",
    "network": "blocked on the network",
    "data_workers": "waiting for DataLoader workers",
    "own_threads": "blocked on its own threads (GIL, locks, queues)",
    "other_blocked": "blocked (other wakers)",
}
_INTERRUPTS = {TIMER_WAKER: "asleep", BLOCK_WAKER: "disk_io", NET_WAKER: "network"}


def is_comm_thread(comm: str | None) -> bool:
    """Return True for a thread name of a communication library (:data:`COMM_THREAD_PREFIXES`)."""
    return bool(comm) and comm.startswith(COMM_THREAD_PREFIXES)


def blocked_phase(info: RecordingInfo, pid: int, waker_pid: int | None, waker_comm: str | None) -> str:
    """Return the blocked phase of a wait of a thread of ``pid`` that ``waker_pid``/``waker_comm`` ended."""
    if not waker_pid:
        return _INTERRUPTS.get(waker_comm or "", "other_blocked")
    if info.is_tracer(waker_pid, waker_comm, False):
        return "other_blocked"
    if is_comm_thread(waker_comm):
        return COLLECTIVE
    if waker_pid != pid and waker_pid in info.rank_pids:
        return COLLECTIVE  # a peer rank woke it itself (a shared-memory transport)
    if info.process_role(waker_pid) == DATALOADER_ROLE:
        return "data_workers"
    return "own_threads" if waker_pid == pid else "other_blocked"


WakerRow = tuple[int, int, str | None, int]  # sec, waker pid, waker comm, blocked ns (outside calls)


def phases_by_second(
    info: RecordingInfo,
    t: ThreadTime,
    wakers: Iterable[WakerRow],
    weights: Mapping[int, float],
    gpu_collective: Mapping[int, float] | None = None,
) -> dict[int, dict[str, float]]:
    """Return {sec: {phase: ns}} of thread ``t`` in the seconds of ``weights``, each second weighted by its share.

    Blocked time is split by the wakers of its second; a second whose blocked time no waker row explains lends the
    thread's wakers over the whole window their shares (a wait that ended in the next second)."""
    by_sec: dict[int, dict[str, float]] = {}
    overall: dict[str, float] = {}
    for sec, wp, comm, ns in wakers:
        if sec not in weights or ns <= 0:
            continue
        ph = blocked_phase(info, t.pid, wp, comm)
        d = by_sec.setdefault(sec, {})
        d[ph] = d.get(ph, 0.0) + ns
        overall[ph] = overall.get(ph, 0.0) + ns
    out: dict[int, dict[str, float]] = {}
    for sec, k in weights.items():
        row = t.by_sec[sec]
        ph = {"cpu": row.get("cpu", 0) * k, "runq": sum(row.get(p, 0) for p in RUNQ_PART_NAMES) * k}
        for p in CALL_PART_NAMES:
            ph[p] = row.get(p, 0) * k
        blocked = row.get("blocked", 0) * k
        split = by_sec.get(sec) or overall or {"other_blocked": 1.0}
        total = sum(split.values())
        for p in BLOCKED_PHASES:
            ph[p] = blocked * split.get(p, 0.0) / total if total > 0 else 0.0
        if gpu_collective:
            moved = min(ph["sync"], gpu_collective.get(sec, 0.0) * k)
            ph["sync"] -= moved
            ph[COLLECTIVE] += moved
        out[sec] = ph
    return out


def window_total(
    info: RecordingInfo,
    t: ThreadTime,
    wakers: Iterable[WakerRow],
    weights: Mapping[int, float],
    gpu_collective: Mapping[int, float] | None = None,
) -> dict[str, float]:
    """Return thread ``t``'s phases over the seconds of ``weights`` (each weighted by its share), its blocked time
    split by the wakers of the whole window: a wait that spans a second boundary is then misplaced only at the
    window's two ends, not at every second (per second, its wakeup row lies in one second, its time in two)."""
    by_sec = phases_by_second(info, t, (), weights)  # no wakers: every blocked ns in other_blocked
    out = dict.fromkeys(PHASES, 0.0)
    for row in by_sec.values():
        for p, v in row.items():
            out[p] += v
    blocked = sum(out[p] for p in BLOCKED_PHASES)
    split: dict[str, float] = {}
    for sec, wp, comm, ns in wakers:
        if sec in weights and ns > 0:
            ph = blocked_phase(info, t.pid, wp, comm)
            split[ph] = split.get(ph, 0.0) + ns * weights[sec]
    norm = sum(split.values())
    for p in BLOCKED_PHASES:
        out[p] = blocked * split.get(p, 0.0) / norm if norm > 0 else (blocked if p == "other_blocked" else 0.0)
    for sec, k in weights.items() if gpu_collective else ():
        moved = min(t.by_sec[sec].get("sync", 0) * k, gpu_collective.get(sec, 0.0) * k)  # type: ignore[union-attr]
        out["sync"] -= moved
        out[COLLECTIVE] += moved
    return out
