/* Maps shared by cuda.bpf.c and host.bpf.c: the traced process set and the calls in flight.
 * Sizes are -D overridable; record.py passes MAX_TARGETS from the process count it expects.
 */
#ifndef CHT_MAPS_H
#define CHT_MAPS_H

#include "common.h"

#ifndef MAX_TARGETS
#define MAX_TARGETS 16384 /* processes in the traced tree at once; DataLoader trees are tens */
#endif
#ifndef MAX_THREADS
#define MAX_THREADS 65536 /* threads with a call in flight or off CPU at once; one entry per thread */
#endif

/* key: tgid of a traced process; value: 1. Fed by user space at attach and by task_newtask for children. */
BPF_HASH(targets, u32, u8, MAX_TARGETS);

/* A CUDA call in flight on a thread, from entry to return. host.bpf.c adds the thread's off-CPU time to it. */
struct inflight {
    u64 ts_ns;
    u64 bytes;
    u64 stream;
    u64 func;
    u64 off_cpu_ns;
    u64 runq_ns;
    u32 nested;
    u16 op;       /* the op recorded (a driver launch called from the runtime records the runtime op) */
    u16 probe_op; /* the op whose probe made this entry: its return probe closes it */
    u8 kind;
    u8 _pad[7];
};

/* key: tid; value: the outermost probed call in flight. MAX_THREADS: one call in flight per thread. */
BPF_HASH(inflight, u32, struct inflight, MAX_THREADS);

/* Address span of the libcudart mapped in a process. A driver launch whose return address lies inside it was
 * made by the runtime, so it is recorded as the runtime op without a second uprobe on the runtime (one trap per
 * launch). key: tgid; value: [lo, hi). Set from /proc/PID/maps at attach and by libload.bpf.c at mmap time;
 * copied to forked children. */
struct lib_range {
    u64 lo;
    u64 hi;
};
BPF_HASH(rt_ranges, u32, struct lib_range, MAX_TARGETS);

/* Ring-buffer drops, counted in kernel because bcc's ring buffer has no lost callback (bcc#3476).
 * index: LOST_CALLS, LOST_STACKS, LOST_SCHED, LOST_PROC. */
#define LOST_CALLS 0
#define LOST_STACKS 1
#define LOST_SCHED 2
#define LOST_PROC 3
BPF_ARRAY(lost, u64, 4);

static __always_inline void count_lost(int idx)
{
    u64 *v = lost.lookup(&idx);
    if (v)
        __sync_fetch_and_add(v, 1);
}

static __always_inline int is_target(u32 tgid)
{
    return targets.lookup(&tgid) != 0;
}

#endif /* CHT_MAPS_H */
