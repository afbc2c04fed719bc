/* A garbage collection in progress on a target thread (gc.bpf.c), shared with sched.bpf.c, which adds the thread's
 * off-CPU time inside it (the collection's on-CPU time is its duration less that). */
#ifndef CHT_GC_H
#define CHT_GC_H

#include "common.h"
#include "maps.h"

struct gc_inflight {
    u64 ts_ns;
    u64 stack_ref;
    u64 off_cpu_ns; /* off CPU inside the collection (preempted, or blocked: a finalizer taking a lock) */
    u64 runq_ns;    /* of that, runnable but waiting for a CPU */
    s32 generation;
    u32 _pad;
};
/* key: tid; value: its collection in progress (one at a time: the collector does not nest). MAX_THREADS: one per
 * target thread. */
BPF_HASH(gc_inflight, u32, struct gc_inflight, MAX_THREADS);

/* key: tgid; value: the stack_ref of the first allocation that scheduled a collection since the process's last one
 * started (3.12+: the collection runs later, at an eval-breaker check, maybe on another thread: 3.12's flag is the
 * interpreter's). Written only when empty, taken by the next collection's start. MAX_TARGETS: one per process. */
BPF_HASH(gc_trigger, u32, u64, MAX_TARGETS);

#endif /* CHT_GC_H */
