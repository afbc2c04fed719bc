/* Maps shared by every concern: the traced and the tracer's own process sets, holds, calls in flight, settings.
 * Sizes are -D overridable.
 */
#ifndef CHT_MAPS_H
#define CHT_MAPS_H

#include "common.h"

#ifndef MAX_TARGETS
#define MAX_TARGETS 16384 /* processes in the traced tree at once; DataLoader trees are tens */
#endif
#ifndef MAX_THREADS
#define MAX_THREADS 65536 /* target threads alive at once; one entry each in the per-thread maps */
#endif

/* key: tgid of a traced process; value: 1. Fed by user space at attach and by task_newtask for children. */
BPF_HASH(targets, u32, u8, MAX_TARGETS);
/* key: tgid of the tracer's own processes (recorder, guardian, their children); value: 1. A CPU they hold is
 * charged to the tracer, never to the job or another tenant. 256: the recorder starts a handful. */
BPF_HASH(tracer_pids, u32, u8, 256);
/* key: tgid of a target this program stopped (SIGSTOP); value: ktime of the stop. User space (or, if the
 * recorder dies, the guardian) sends SIGCONT and deletes the entry. 4096: one per process at most. */
BPF_HASH(held, u32, u64, 4096);

/* Settings written by user space, index CFG_* (common.h). */
BPF_ARRAY(cfg, u64, CFG_COUNT);

/* A CUDA call in flight on a thread, from entry to return. sched.bpf.c adds the thread's off-CPU time to it. */
struct inflight {
    u64 ts_ns;
    u64 sp;       /* stack pointer at entry: a return with sp <= this is a nested call's; an entry with sp >=
                   * this finds a stale entry (its return was missed while a probe was being detached) */
    u64 bytes;
    u64 stream;
    u64 func;
    u64 off_cpu_ns;
    u64 runq_ns;
    u32 nested;
    u16 op;       /* the op recorded (a driver launch called from the runtime records the runtime op) */
    u8 kind;
    u8 _pad;
};

/* key: tid; value: the outermost probed call in flight. MAX_THREADS: one call in flight per thread. */
BPF_HASH(inflight, u32, struct inflight, MAX_THREADS);

/* Executable span of the libcudart mapped in a process. A driver launch whose return address lies inside it was
 * made by the runtime, so it is recorded as the runtime op without a probe on the runtime (one trap per launch).
 * key: tgid; value: [lo, hi). Set by user space at attach and by libload.bpf.c when ld.so maps a runtime whose
 * inode is in rt_inodes; copied to forked children. */
struct lib_range {
    u64 lo;
    u64 hi;
};
BPF_HASH(rt_ranges, u32, struct lib_range, MAX_TARGETS);

BPF_ARRAY(lost, u64, LOST_COUNT);

static __always_inline void count_lost(int idx)
{
    u64 *v = lost.lookup(&idx);
    if (v)
        __sync_fetch_and_add(v, 1);
}

/* The wakeup flag for a ring record that adds `add` to *n, the ring's count of what was sent since user space last
 * drained it (user space writes 0 after each drain): BPF_RB_FORCE_WAKEUP for the record that takes the count across
 * `at`, else BPF_RB_NO_WAKEUP. A ring drained on the recorder's timer is so woken once by a burst that has filled
 * part of it, before it overflows (cuda.bpf.c calls_wakeup, pycode.h codes_wakeup). */
static __always_inline u64 wakeup_past(u64 *n, u64 add, u64 at)
{
    if (!n)
        return BPF_RB_NO_WAKEUP;
    u64 before = __sync_fetch_and_add(n, add);
    return before < at && before + add >= at ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

static __always_inline int is_target(u32 tgid)
{
    return targets.lookup(&tgid) != 0;
}

static __always_inline int is_tracer(u32 tgid)
{
    return tracer_pids.lookup(&tgid) != 0;
}

static __always_inline u64 cfg_get(int idx)
{
    u64 *v = cfg.lookup(&idx);
    return v ? *v : 0;
}

/* Second of the session a timestamp falls in (timestamps before the start count in second 0). */
static __always_inline u32 session_sec(u64 ts)
{
    u64 start = cfg_get(CFG_START_NS);
    return ts > start ? (u32)((ts - start) / 1000000000ULL) : 0;
}

/* Stop the current process until user space has done what it must (attach to a library it opened), and
 * remember it, so that nothing can leave it stopped: the guardian continues every entry if the recorder dies. */
static __always_inline void hold_current(u32 tgid)
{
    u64 now = bpf_ktime_get_ns();
    held.update(&tgid, &now);
    bpf_send_signal(19 /* SIGSTOP */);
}

#endif /* CHT_MAPS_H */
