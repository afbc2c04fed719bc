"""hang: the job stopped making progress, and where each of its threads is stuck.

A job is hung when it made no step for longer than its own steps allow: the time since its training thread's
last step (tracer.analysis.steps.step_markers, the one step definition) is at least STEPS_FOR_HANG of its median
steps, and at least FLOOR_NS. A job that made no step in the whole recording (attached after it hung, or a CPU job
with no wait for the GPU) is hung when its threads sit blocked in their snapshots (thread_snapshots) for at least
FLOOR_NS and half the recording, and either one waits in a collective (it waits for a peer) or the process is
idle (its threads' CPU below IDLE_CPU_SHARE of the recording): a process whose main thread joins workers that
compute is working, not hung.

A thread blocked since before the recording never switches out during it, so it has no off-CPU stack: its
stack, kernel state and since-when come from its latest snapshot. Each process's thread that trains (its rank's
thread, its driver thread, else its main thread) is judged, and listed with the threads of the process that run
Python code. A thread whose stack is inside a collective (torch.distributed's all_reduce, barrier...; NCCL's
entry points in its native frame) waits for its peers; a rank whose thread is not inside one while others are is
the one they wait for. With NCCL, the ranks' collective counts per communicator (collective_progress) name it
too, when no stack shows a collective (the NCCL call returned; its peers wait in a synchronize): the rank that
entered fewer collectives than the others is "one collective behind", the others entered the one it has not. The
culprit is named with its line, its system call and what that call waits on (the file
its fd names, the path it opens). Severity HIGH: a hung job loses all of its time.
"""

from __future__ import annotations

import signal
import statistics

import numpy as np

from tracer.analysis.chains.context import ChainContext
from tracer.analysis.chains.model import CausalChain, Culprit, HangEvidence, Hop, HungThread, Root
from tracer.analysis.code_site import is_library, site_of
from tracer.analysis.collective_progress import behind_summary, comm_progress
from tracer.analysis.thread_dump import DumpThread, thread_dump

CATEGORY = "hang"
S = 1_000_000_000
MS = 1_000_000
# no step for this long is never called a hang, however short the steps: a checkpoint save, an evaluation pass
# or a slow first batch takes seconds
FLOOR_NS = 2 * S
# a job is hung after this many of its median steps without one (a slow step is a few times the median)
STEPS_FOR_HANG = 20
# a process whose threads ran on CPU for less than this share of the recording is idle
IDLE_CPU_SHARE = 0.10
MAX_STACK = 6  # frames of each thread's stack in the evidence
MAX_THREADS = 8  # threads listed per process
# torch.distributed's collectives, as their Python function names (distributed_c10d.py)
COLLECTIVES = frozenset(
    {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
     "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
     "send", "recv", "isend", "irecv", "all_to_all", "all_to_all_single", "gather", "scatter", "batch_isend_irecv",
     "_all_gather_base", "_reduce_scatter_base"}
)  # fmt: skip
C10D_FILES = ("torch/distributed/distributed_c10d.py", "torch/distributed/c10d_logger.py")
NCCL_ENTRY = ("ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclReduce", "ncclSend",
              "ncclRecv", "ncclGroupEnd", "ncclCommInitRank")  # fmt: skip
# the innermost frames of a thread that waits for a thread of its own (join) or for a condition
THREAD_WAITS = frozenset({"_wait_for_tstate_lock", "join", "wait"})
SYNC_NAMES = ("synchronize", "Synchronize")


def collective_of(t: DumpThread) -> str | None:
    """Return the collective thread ``t`` is inside (its stack's torch.distributed function or NCCL entry
    point), or None."""
    for f in t.frames:
        if f.function in COLLECTIVES and any(f.file.endswith(c) for c in C10D_FILES):
            return f.function
    return next((n for n in NCCL_ENTRY if n in t.native), None)


def _site(t: DumpThread) -> str | None:
    # code_site's rule: frames outermost first, as ("python", module, function, file, line); a thread waiting in
    # a CUDA call enters CUDA, so its binding (a ctypes wrapper) is not its line but the wrapper's caller
    frames = [("python", None, f.function, f.file, f.line) for f in reversed(t.frames)]
    return site_of(frames + ([("cuda", None, None, None, None)] if _in_cuda_wait(t) else []))


def _in_cuda_wait(t: DumpThread) -> bool:
    return any(n in t.native for n in SYNC_NAMES) or any(n in f.function for f in t.frames for n in SYNC_NAMES)


def _stack(t: DumpThread) -> list[str]:
    return [f"{f.file}:{f.line} {f.function}" for f in t.frames[:MAX_STACK]]


def doing(t: DumpThread, coll: str | None) -> str:
    """What thread ``t`` is stuck in, in a few words."""
    if coll:
        return f"waits in {coll}"
    if t.state == "running" or t.blocked_ms == 0:
        return "running on CPU"
    if _in_cuda_wait(t):
        return "waits for the GPU (a synchronize that does not return)"
    on = f" on {t.waits_on}" if t.waits_on else ""
    if t.syscall == "futex" and t.frames:
        inner = t.frames[0]
        # the function's own name: Python 3.11+ frames carry qualified names (Condition.wait, Thread.join)
        if is_library(inner.file) and inner.function.rsplit(".", 1)[-1] in THREAD_WAITS:
            return "waits for another thread (join / condition)"
        if "queues.py" in inner.file or "dataloader.py" in inner.file or "connection.py" in inner.file:
            return "waits for a batch from its data workers"
        return "waits for a lock"
    if t.syscall in ("read", "readv", "pread64", "recvfrom", "recvmsg", "poll", "ppoll", "select", "epoll_wait"):
        if "dataloader.py" in " ".join(f.file for f in t.frames) or "queues.py" in " ".join(f.file for f in t.frames):
            return f"waits for a batch from its data workers ({t.syscall}{on})"
        return f"blocked in {t.syscall}{on}"
    if t.syscall:
        return f"blocked in {t.syscall}{on}"
    return f"{t.state}" + (f" in {t.wchan}" if t.wchan else "")


def blocked_ns(ctx: ChainContext, t: DumpThread, until: int) -> float:
    """How long thread ``t`` has been off CPU at ``until``. From its off-CPU intervals (sched: every one of 1 ms or
    more) where it has any: it last ran when the last one ended (an interval still open at the end, closed there,
    began when it stopped); else, blocked since before the recording, from its snapshot. The snapshot's since-when
    alone compares two CPUs' scheduler clocks, which drift apart by seconds on a loaded VM (steal time)."""
    snap_ns = (t.blocked_ms or 0) * MS
    if not ctx.info.has("sched"):
        return snap_ns
    row = ctx.conn.execute(
        "SELECT max(CASE WHEN ts_ns + dur_ns >= $end THEN ts_ns ELSE ts_ns + dur_ns END) FROM sched WHERE tid = $tid",
        {"tid": t.tid, "end": until - 10 * MS},
    ).fetchone()
    if row is None or row[0] is None:
        return max(snap_ns, float(until))  # no switch in the recording: blocked since before it began
    return max(until - int(row[0]), 0)


def detect(ctx: ChainContext) -> list[CausalChain]:
    """Return one hang chain for the job when it stopped making progress (see the module docstring); asked about
    one pid (``ctx.pid``), only a hang of a job that pid belongs to (the job is judged whole: its other ranks)."""
    chains = _detect(ctx)
    return [c for c in chains if ctx.pid is None or ctx.pid in c.pids]


def _detect(ctx: ChainContext) -> list[CausalChain]:
    if not ctx.info.has("thread_snapshots"):
        return []
    end_ns = ctx.info.duration_ns
    if end_ns <= 0:
        return []
    snaps = [t for t in thread_dump(ctx.conn).threads if not ctx.info.is_tracer(t.pid)]
    if not snaps:
        return []
    by_pid: dict[int, dict[int, DumpThread]] = {}
    for t in snaps:
        by_pid.setdefault(t.pid, {})[t.tid] = t
    ranks = ctx.info.rank_pids
    rank_of = {p: r for p, r in ranks.items()}
    for t in snaps:
        if t.rank is not None:
            rank_of.setdefault(t.pid, t.rank)
    # the processes that train: the ranks; else those with a driver thread; else the traced tree's main process
    pids = sorted(p for p in rank_of if p in by_pid)
    if not pids:
        pids = sorted({d.pid for d in ctx.times.drivers} & set(by_pid))
    if not pids:
        main = ctx.info.main_pid if ctx.info.main_pid in by_pid else min(by_pid)
        pids = [main]
    judged: list[tuple[int, DumpThread, bool, float, float | None, float | None]] = []
    # (pid, its thread, stalled, no step for this long (ns), median step (ns), threshold (ns))
    stepped_any = False
    until_of: dict[int, int] = {}
    for pid in pids:
        p = ctx.info.procs.get(pid)
        if p is not None and p.exit_ns is not None and p.exit_code == 0:
            continue  # it finished: not hung
        # a process killed (by the recorder at --duration, a watchdog, a signal) was alive until then
        until = min(p.exit_ns, end_ns) if p is not None and p.exit_ns is not None else end_ns
        until_of[pid] = until
        t = ctx.times.rank_thread(pid) if pid in rank_of else next((d for d in ctx.times.drivers if d.pid == pid), None)
        tid = t.tid if t is not None and t.tid in by_pid[pid] else pid if pid in by_pid[pid] else None
        if tid is None:
            continue
        snap = by_pid[pid][tid]
        ends = ctx.step_ends(tid)
        if len(ends):
            stepped_any = True
            step = float(np.median(np.diff(ends))) if len(ends) > 1 else None
            threshold = max(FLOOR_NS, STEPS_FOR_HANG * step) if step else FLOOR_NS
            gap = until - int(ends[-1])
            judged.append((pid, snap, gap >= threshold, gap, step, threshold))
            continue
        blocked = blocked_ns(ctx, snap, until)
        # half of the thread's own time in the recording (a launched command starts seconds after it began)
        tt = ctx.times.by_tid(tid)
        life = until - max(tt.first_ns if tt is not None else 0, 0)
        threshold = max(FLOOR_NS, life / 2)
        cpu = sum(x.total.get("cpu", 0) for x in ctx.threads_of(pid))
        idle = cpu < IDLE_CPU_SHARE * end_ns
        coll = collective_of(snap)
        stalled = snap.state != "running" and blocked >= threshold and (idle or coll is not None)
        judged.append((pid, snap, stalled, blocked, None, threshold))
    if not judged or not any(j[2] for j in judged):
        return []
    if stepped_any and any(not j[2] and j[4] is not None for j in judged):
        return []  # a process still steps: the job progresses

    waiting: list[HungThread] = []
    stuck: list[HungThread] = []
    for pid, snap, _, _, _, _ in judged:
        rows = [snap] + [t for t in by_pid[pid].values() if t.tid != snap.tid and t.frames]
        for t in rows[:MAX_THREADS]:
            coll = collective_of(t)
            h = HungThread(
                rank=rank_of.get(pid),
                pid=pid,
                tid=t.tid,
                comm=t.name,
                in_collective=coll is not None,
                collective=coll,
                doing=doing(t, coll),
                state=t.state,
                syscall=t.syscall,
                wchan=t.wchan,
                waits_on=t.waits_on,
                blocked_ms=round(blocked_ns(ctx, t, until_of[pid]) / MS, 1) if t.state != "running" else 0.0,
                site=_site(t),
                stack=_stack(t),
            )
            (waiting if coll else stuck).append(h)
    main_tids = {snap.tid for _, snap, _, _, _, _ in judged}
    behind = _nccl_behind(ctx, {j[0] for j in judged}, main_tids, waiting, stuck)
    # the ranks not inside a collective while another rank is: the ones the others wait for
    in_coll_pids = {h.pid for h in waiting}
    culprits = [h for h in stuck if h.tid in main_tids and h.pid not in in_coll_pids]
    if behind:  # NCCL's counts name them even when no rank's stack is inside a collective
        culprits = sorted((h for h in culprits if h.pid in behind), key=lambda h: h.rank or 0) or culprits
    if not culprits:  # a single process: its stuck threads, its training thread first
        culprits = sorted(stuck, key=lambda h: (h.tid not in main_tids, h.tid))
    if not culprits:  # every rank inside a collective: they disagree on which (or NCCL's own hang)
        culprits = waiting[:1]
    top = culprits[0]
    ranks_stuck = sorted(
        {h.rank for h in culprits if h.rank is not None and in_coll_pids and h.pid not in in_coll_pids}
    )
    stalled_ns = max(j[3] for j in judged if j[2])
    steps = [j[4] for j in judged if j[4]]
    step_ns = statistics.median(steps) if steps else None
    threshold_ns = min(j[5] for j in judged if j[2])
    trigger = "steps_stopped" if stepped_any else "no_step"
    locks = [h for h in stuck if h.doing == "waits for a lock" and h.pid == top.pid]
    gone = _exited_children(ctx, top.pid)
    note = "; ".join(behind[r] for r in sorted(behind) if any(h.pid == r for h in culprits))
    summary = _summary(top, culprits, waiting, ranks_stuck, locks, stalled_ns, trigger, note)
    if gone:
        summary = summary[:-1] + f"; {gone}, and nothing replaced it."
    affected = waiting[0] if waiting and ranks_stuck else top
    path = [
        Hop(tid=affected.tid, pid=affected.pid, comm=affected.comm, role="rank" if affected.rank is not None else
            "training", edge="start", state="blocked", share=1.0, ms=round(stalled_ns / MS, 1), site=affected.site)
    ]  # fmt: skip
    if affected is not top:
        path.append(Hop(tid=top.tid, pid=top.pid, comm=top.comm, role="rank", edge="collective",
                        state="on_cpu" if top.state == "running" else "blocked", share=1.0,
                        ms=round(stalled_ns / MS, 1), site=top.site))  # fmt: skip
    root = Root(kind="hung", detail=f"{_who(top)} {top.doing}" + _since(top), site=top.site, stack=top.stack)
    who = f"rank {top.rank}" if top.rank is not None else top.comm
    return [
        CausalChain(
            id=f"{CATEGORY}-{top.pid}-{top.tid}",
            severity="HIGH",
            category=CATEGORY,
            start_ns=max(int(end_ns - stalled_ns), 0),
            end_ns=int(end_ns),
            pids=sorted({j[0] for j in judged}),
            tid=affected.tid,
            thread_comm=affected.comm,
            share=round(min(stalled_ns / end_ns, 1.0), 4),
            impact_ms=round(min(stalled_ns, end_ns) / MS, 1),  # the recording's part; stalled_ms: all of it
            basis=ctx.times.basis,
            culprit=Culprit(
                kind="rank" if ranks_stuck else "thread",
                pid=top.pid,
                tid=top.tid,
                comm=who,
                relation="peer_rank" if ranks_stuck else "own_process",
                code_site=top.site,
            ),
            op="",
            op_p50_us=0.0,
            op_p99_us=0.0,
            summary=summary,
            evidence=HangEvidence(
                trigger=trigger,
                stalled_ms=round(stalled_ns / MS, 1),
                threshold_ms=round(threshold_ns / MS, 1),
                step_ms=round(step_ns / MS, 2) if step_ns else None,
                waiting=waiting,
                stuck=stuck,
                ranks_stuck=ranks_stuck,
                behind=[behind[p] for p in sorted(behind)],
            ),
            recommendations=_advice(top, locks, ranks_stuck, gone),
            path=path,
            root=root,
        )
    ]


def _nccl_behind(
    ctx: ChainContext, pids: set[int], main_tids: set[int], waiting: list[HungThread], stuck: list[HungThread]
) -> dict[int, str]:
    """Return {pid: 'rank R is one collective behind ...'} for the judged ranks that entered fewer NCCL
    collectives on a communicator than its most advanced ranks (collective_progress); and move those advanced
    ranks' training threads from ``stuck`` to ``waiting``: they entered the collective the others have not, and
    wait for its end (on a GPU, in a synchronize or their next collective, not in the NCCL call, which returned)."""
    behind: dict[int, str] = {}
    ahead: dict[int, str] = {}
    for cp in comm_progress(ctx.conn, ctx.info):
        late = [r for r in cp.behind if r.pid in pids]
        if not late:
            continue
        for r in late:
            behind.setdefault(r.pid, behind_summary(cp, r))
        for r in cp.leaders:
            ahead.setdefault(r.pid, f"{r.last_op or 'a collective'} #{r.calls}")
    for h in [h for h in stuck if h.tid in main_tids and h.pid in ahead and h.pid not in behind]:
        stuck.remove(h)
        waiting.append(
            h.model_copy(update={"in_collective": True, "collective": ahead[h.pid], "doing": f"entered "
                                 f"{ahead[h.pid]} and {h.doing}"})
        )  # fmt: skip
    return behind


def _exited_children(ctx: ChainContext, pid: int) -> str:
    """Return 'its child pid N (comm) exited at T s (code C)' for the children of ``pid`` that exited during the
    recording (a data worker that died leaves its loop waiting for a batch), '' when none."""
    kids = [p for p in ctx.info.children_of(pid) if p.exit_ns is not None and not ctx.info.is_tracer(p.pid)]
    if not kids:
        return ""
    return "; ".join(
        f"its child pid {p.pid} ({p.comm}) exited at {p.exit_ns / S:.1f} s{_fate(p.exit_code)}" for p in kids[:3]
    )


def _fate(status: int | None) -> str:
    """' (killed by SIGKILL)' / ' (exit code 1)' from a wait(2) status (processes.exit_code), '' if unknown."""
    if status is None:
        return ""
    sig = status & 0x7F
    if sig:
        try:
            return f" (killed by {signal.Signals(sig).name})"
        except ValueError:
            return f" (killed by signal {sig})"
    return f" (exit code {status >> 8})"


def _who(h: HungThread) -> str:
    return (f"rank {h.rank} " if h.rank is not None else "") + f"thread {h.tid} ({h.comm}, pid {h.pid})"


def _since(h: HungThread) -> str:
    where = f" at {h.site}" if h.site else ""
    return where + (f", blocked {h.blocked_ms / 1e3:,.1f} s" if h.blocked_ms else "")


def _summary(
    top: HungThread,
    culprits: list[HungThread],
    waiting: list[HungThread],
    ranks_stuck: list[int],
    locks: list[HungThread],
    stalled_ns: float,
    trigger: str,
    behind: str = "",
) -> str:
    head = (
        f"The job made no step for {stalled_ns / S:,.1f} s"
        if trigger == "steps_stopped"
        else f"The job made no step in the recording ({stalled_ns / S:,.1f} s blocked)"
    )
    if ranks_stuck:
        others = sorted({h.rank for h in waiting if h.rank is not None})
        coll = waiting[0].collective
        wsite = f" at {waiting[0].site}" if waiting[0].site else ""
        many = len(others) > 1
        if behind:
            return (
                f"{head}: rank{'s' if many else ''} {', '.join(map(str, others))} entered {coll}{wsite} and "
                f"wait{'' if many else 's'} for rank {', '.join(map(str, ranks_stuck))}: {behind}. "
                f"{_who(top)} {top.doing}{_since(top)}."
            )
        return (
            f"{head}: rank{'s' if many else ''} {', '.join(map(str, others))} wait{'' if many else 's'}"
            f" in {coll}{wsite} for rank {', '.join(map(str, ranks_stuck))}, which is not inside a collective: "
            f"{_who(top)} {top.doing}{_since(top)}."
        )
    if len(locks) >= 2:
        names = "; ".join(f"thread {h.tid} ({h.comm}) at {h.site}" for h in locks)
        return f"{head}: {len(locks)} threads of pid {top.pid} each wait for a lock, a deadlock: {names}."
    return f"{head}: {_who(top)} {top.doing}{_since(top)}."


def _advice(top: HungThread, locks: list[HungThread], ranks_stuck: list[int], gone: str = "") -> list[str]:
    out = []
    where = f" ({top.site})" if top.site else ""
    if gone:
        out.append(
            f"A child process died while the loop waits ({gone}): a data worker killed (dmesg for the OOM killer) "
            "leaves its batch unfinished. torch's DataLoader checks its workers only between reads, so give it a "
            "timeout= (the loop then raises), and lower num_workers or the batch size if it ran out of memory."
        )
    if ranks_stuck:
        out.append(
            f"Fix rank {top.rank}'s wait{where} first: the other ranks wait in the collective for it and resume "
            "when it arrives."
        )
    if top.doing.startswith("waits for a batch") and not gone:
        out.append(
            "Its data workers stopped delivering: check whether one died (dmesg for an OOM kill) and give the "
            "DataLoader a timeout= so the loop raises instead of waiting forever."
        )
    elif top.waits_on.startswith("pipe:") or "pipe" in top.wchan or "fifo" in top.wchan:
        out.append(
            f"It reads a pipe or FIFO{f' ({top.waits_on})' if top.waits_on else ''} whose writer never writes: "
            "find the writer (lsof on it) and whether it died; read with a timeout."
        )
    elif top.waits_on.startswith("socket:"):
        out.append(f"It waits on a socket ({top.waits_on}): check the peer it talks to (ss -p); set a timeout.")
    elif top.waits_on.startswith("/"):
        out.append(
            f"It waits on {top.waits_on}: check the file system holding it (findmnt -T {top.waits_on}; a stalled "
            "NFS/FUSE/object-store mount blocks every read), and read with a timeout or from local storage."
        )
    if len(locks) >= 2:
        out.append(
            "Threads wait for each other's locks: take the locks in one global order everywhere, or use one lock "
            "for both; acquire(timeout=...) turns a deadlock into an error with a stack."
        )
    elif top.doing == "waits for a lock":
        out.append("Find the lock's holder (tracer dump --pid shows every thread's line) and what it waits for.")
    if top.doing.startswith("waits for the GPU"):
        out.append(
            "A kernel never finished: run with CUDA_LAUNCH_BLOCKING=1 to find it; check nvidia-smi for a GPU at "
            "100% or in error, and a collective kernel waiting for a peer."
        )
    out.append(
        "Set a timeout on the process group (init_process_group(timeout=...)) and TORCH_NCCL_ASYNC_ERROR_HANDLING "
        "so a hang ends in an error, and `tracer dump --pid` to see every thread now."
        if ranks_stuck or top.rank is not None
        else "`tracer dump --pid` shows every thread's line now, without stopping the process."
    )
    return out
