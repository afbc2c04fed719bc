/* Every struct that crosses a ring buffer, and the constants both sides need.
 *
 * Naming: as in the kernel, "pid" in BPF helpers is the thread id and "tgid" the process id. In these structs
 * `pid` is the process (tgid) and `tid` the thread, as user space and the DB name them.
 *
 * tracer/events.py mirrors these layouts as numpy dtypes; tests/test_events.py checks them against the layout
 * bcc derives from this file, so change both together.
 */
#ifndef CHT_COMMON_H
#define CHT_COMMON_H

#include <uapi/linux/ptrace.h>
#include <linux/sched.h>

#ifndef OP_COUNT
#define OP_COUNT 32 /* >= len(probes.catalog.CATALOG) */
#endif
#ifndef MAX_PY_FRAMES
#define MAX_PY_FRAMES 64
#endif
#define HIST_SUB_BITS 4 /* 16 linear sub-buckets per power of two: <= 3.1% error at the midpoint */
#define HIST_SLOTS 704  /* 44 powers of two (up to ~4.8 hours in ns) x 16 */

/* cuda_call.flags */
#define CALL_F_NESTED 1    /* the call made nested calls into a probed lower layer (driver inside runtime) */
#define CALL_F_SLOW 2      /* kept because it was slow, not by sampling */

/* One CUDA API call, sent at return. 88 bytes. */
struct call_event {
    u64 ts_ns;      /* entry, bpf_ktime_get_ns() (CLOCK_MONOTONIC) */
    u64 dur_ns;
    u64 bytes;
    u64 stream;
    u64 func;       /* launch function pointer / CUfunction */
    u64 off_cpu_ns; /* calling thread off CPU inside the call (host.bpf.c adds to the in-flight entry) */
    u64 runq_ns;    /* of that, runnable but waiting */
    u64 stack_ref;  /* 0 = no stack; else matches stack_event.stack_ref */
    u32 pid;
    u32 tid;
    s32 ret;
    u16 op;
    u8 kind;        /* cudaMemcpyKind, 255 = not a copy */
    u8 flags;
    u32 nested;     /* probed lower-layer calls made inside this one */
    u32 _pad;
};

/* One Python frame as walked in BPF: the code object and the instruction offset (code units). */
struct py_frame {
    u64 code;
    u32 lasti;
    u32 _pad;
};

/* stack_event.py_status bit: the process was stopped (SIGSTOP) because the stack holds code objects never seen
 * before; user space reads them from the live process, then sends SIGCONT. */
#define PYS_STOPPED 0x8000

/* A call stack captured at a call's entry. Sent before the call_event that refers to it. The ring buffer
 * record is truncated after n_py frames. */
struct stack_event {
    u64 stack_ref;
    u32 pid;
    u32 tid;
    s32 native_id;  /* id in the `native_stacks` BPF_STACK_TRACE map, < 0 if not captured */
    u16 n_py;
    u16 py_status;  /* 0 ok, else PYS_* in pyframes.h */
    struct py_frame frames[MAX_PY_FRAMES];
};

/* sched_event.reason */
#define SCHED_PREEMPTED 0
#define SCHED_SLEEP 1
#define SCHED_IO 2

/* One off-CPU interval of a target thread, sent when it runs again. 72 bytes. */
struct sched_event {
    u64 ts_ns;      /* switched out */
    u64 dur_ns;     /* off CPU until switched in */
    u64 runq_ns;    /* of that, runnable but waiting */
    u32 pid;
    u32 tid;
    u32 by_pid;     /* preemptor (tgid), or the task that held the CPU when the thread became runnable */
    u16 cpu;
    u8 reason;
    u8 in_call;     /* 1 if a CUDA call was in flight on the thread */
    char comm[16];
    char by_comm[16];
};

/* proc_event.kind */
#define PROC_FORK 0
#define PROC_EXEC 1
#define PROC_EXIT 2
#define PROC_RENAME 3
#define PROC_OOM 4

/* Lifecycle of the traced tree; its own ring buffer, never sampled. 112 bytes. */
struct proc_event {
    u64 ts_ns;
    u32 kind;
    u32 pid;
    u32 ppid;
    u32 child;
    s32 exit_code;
    u32 _pad;
    char comm[16];
    char filename[64];
};

/* Key of the exact latency histogram: one slot per (pid, op, bucket). */
struct hist_key {
    u32 pid;
    u16 op;
    u16 slot;
};

/* Exact per-(pid, op) totals next to the histogram. */
struct op_total {
    u64 calls;
    u64 total_ns;
    u64 min_ns;
    u64 max_ns;
    u64 bytes;
};

struct op_key {
    u32 pid;
    u32 op;
};

#endif /* CHT_COMMON_H */
