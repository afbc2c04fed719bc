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

/* The first allocation that scheduled a collection since the process's last one started (3.12+: the collection
 * runs later, at an eval-breaker check, maybe on another thread: 3.12's flag is the interpreter's). */
struct gc_trigger {
    u64 stack_ref;
    u32 runner_tid; /* the thread that entered _Py_RunGC for it (GC_PT_RUN); 0 while none has */
    u32 _pad;
};
/* key: tgid. Written by a schedule when empty or when a run already began for it (the flag is cleared before
 * _Py_RunGC: a schedule after that is a new one), taken by the collection its runner starts; a gc.collect() in
 * between, which no run precedes, keeps its own stack and drops the entry (it resets the counts: the run then
 * collects nothing). MAX_TARGETS: one per process. */
BPF_HASH(gc_trigger, u32, struct gc_trigger, MAX_TARGETS);

#endif /* CHT_GC_H */
