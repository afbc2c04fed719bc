/* Every struct that crosses a ring buffer or is read from a map by user space, and the constants both sides need.
 *
 * Naming: as in the kernel, "pid" in BPF helpers is the thread id and "tgid" the process id. In these structs
 * `pid` is the process (tgid) and `tid` the thread, as user space and the DB name them.
 *
 * tracer/recorder/events.py mirrors these layouts as numpy dtypes (and ctypes for map values); tests/test_events.py checks
 * them against the layout bcc derives from this file, so change both together. Only uapi headers are included:
 * the installed kernel headers are not the running kernel's (setup.sh), so kernel struct members are reached
 * through offsets read from BTF (tracer/recorder/btf.py, passed as -D flags), never through the headers' definitions.
 */
#ifndef CHT_COMMON_H
#define CHT_COMMON_H

#include <uapi/linux/ptrace.h>

/* User-memory reads go through these pointers rather than bpf_probe_read_user(_str): bcc 0.26 rewrites each call
 * site of those after probing the kernel's symbol table for the helper, which cost ~0.11 s of compile per site
 * (23 sites: 2.5 s of the start-up; bench/startup.py). Every kernel we run on (6.6+) has both helpers, so there
 * is nothing to probe for. */
static long (*read_user)(void *dst, u32 size, const void *src) = (void *)BPF_FUNC_probe_read_user;
static long (*read_user_str)(void *dst, u32 size, const void *src) = (void *)BPF_FUNC_probe_read_user_str;

#define COMM_LEN 16 /* TASK_COMM_LEN */
#ifndef OP_COUNT
#define OP_COUNT 64 /* >= len(probes.catalog.CATALOG); the recorder passes -DOP_COUNT=OP_COUNT_MAX */
#endif
#ifndef MAX_PY_FRAMES
#define MAX_PY_FRAMES 64
#endif
#define HIST_SUB_BITS 4 /* 16 linear sub-buckets per power of two: <= 3.1% error at the midpoint */
#define HIST_SLOTS 704  /* 44 powers of two (up to ~4.8 hours in ns) x 16 */

/* Index of the `cfg` array (maps.h), written by user space. */
#define CFG_START_NS 0      /* session start, bpf_ktime_get_ns(): per-second aggregates count seconds from here */
#define CFG_SCHED_KEEP_NS 1 /* off-CPU intervals at least this long are always sent */
#define CFG_SCHED_EVERY 2   /* send 1 in N of the other intervals that overlap no call (0/1: all) */
#define CFG_LIBGATE 3       /* 1: stop a target that opens a CUDA library the tracer has not attached to */
#define CFG_OFFCPU_STACKS 4 /* 1: capture the stack of a target thread that blocks (offcpu.bpf.c) */
#define CFG_ALL_CUDA 5      /* 1: node agent (no --pid, no command): any process that opens a CUDA library joins */
#define CFG_COUNT 8

/* Index of the `lost` array: ring-buffer drops, counted in kernel (bcc has no lost callback for ring buffers). */
#define LOST_CALLS 0
#define LOST_STACKS 1
#define LOST_SCHED 2
#define LOST_PROC 3
#define LOST_CODES 4
#define LOST_MAPS 5
#define LOST_AGGS 6 /* a per-second aggregate map was full: an interval was not counted */
#define LOST_GC 7   /* a gc_event: the gc_rb ring was full */
#define LOST_COUNT 8

/* Index of the `host_counters` array (sched.bpf.c), summed over CPUs by user space about once a second. */
#define HC_PAGE_ALLOC 0        /* bytes of pages allocated host-wide */
#define HC_TARGET_PAGE_ALLOC 1 /* of those, by target threads */
#define HC_TARGET_FAULTS 2     /* user page faults of target threads */
#define HC_SWITCHES 3          /* context switches host-wide */
#define HC_COUNT 4

/* call_event.flags */
#define CALL_F_NESTED 1 /* the call made nested calls into a probed lower layer (driver inside runtime) */
#define CALL_F_SLOW 2   /* kept because it was slow, not by sampling */

/* One CUDA API call, sent at return. 88 bytes. */
struct call_event {
    u64 ts_ns;      /* entry, bpf_ktime_get_ns() (CLOCK_MONOTONIC) */
    u64 dur_ns;
    u64 bytes;
    u64 stream;
    u64 func;       /* launch function pointer / CUfunction */
    u64 off_cpu_ns; /* calling thread off CPU inside the call */
    u64 runq_ns;    /* of that, runnable but waiting */
    u64 stack_ref;  /* 0 = no stack; else the stack's hash, as in the stack_event that first carried it */
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

/* stack_event.py_status */
#define PYS_OK 0
#define PYS_NO_CONFIG 1 /* the process has no pycfg entry: not Python, or user space has not configured it yet */
#define PYS_NO_TSTATE 2 /* no PyThreadState for this thread: a C/C++ thread that never ran Python */
#define PYS_TRUNCATED 3 /* more than MAX_PY_FRAMES frames; the outermost ones are missing */
#define PYS_READ_FAIL 4 /* a user-memory read failed mid-walk; frames [0, n_py) are still valid */

/* gc_event cookie (probes/gc.bpf.c): what a probe point of CPython's cyclic collector is and where its argument
 * lies, packed by tracer/recorder/cpython/gcprobe.py. bits 0-7: GC_PT_*; 8-15: pt_regs slot of the register (the
 * value itself, or the base of a memory operand), GC_ARG_NONE when unknown; bit 16: a memory operand; bits 17-20:
 * its size in bytes; bit 21: signed; bits 32-63: the memory operand's displacement (s32). */
#define GC_PT_START 1 /* the collection starts: the USDT python:gc__start, or gc_collect_main's entry (arg: generation) */
#define GC_PT_DONE 2  /* it ends: python:gc__done, or gc_collect_main's return (arg: objects collected) */
#define GC_PT_SCHEDULE 3 /* 3.12+: the allocation that schedules the collection (the store of the "scheduled" flag
                          * inlined from _Py_ScheduleGC into _PyObject_GC_Link, reached only when not yet scheduled) */
#define GC_PT_RUN 4      /* 3.12+: _Py_RunGC's entry, the eval-breaker check running the scheduled collection */
#define GC_ARG_NONE 255
#define GC_ARG_REGS 21 /* slots in x86-64 struct pt_regs */

/* One collection of CPython's cyclic garbage collector in a target thread, sent when it ends. 64 bytes. */
struct gc_event {
    u64 ts_ns;      /* start, bpf_ktime_get_ns() */
    u64 dur_ns;
    u64 off_cpu_ns; /* the thread off CPU inside it */
    u64 runq_ns;    /* of that, runnable but waiting for a CPU */
    u64 stack_ref;  /* the allocation that triggered it: on 3.12+ the stack that scheduled it (GC_PT_SCHEDULE), else
                     * the thread's stack at the start (3.10/3.11 collect inside that allocation); 0 = none */
    s64 collected;  /* objects collected (gc__done's argument / the collector's return value); -1 unknown */
    u32 pid;
    u32 tid;
    s32 generation; /* 0, 1, 2; -1 unknown */
    u32 _pad;
};

/* A distinct call stack, sent the first time its hash is seen (per process); calls then carry only the hash. The
 * ring buffer record is truncated after n_py frames by user space decoding. */
struct stack_event {
    u64 stack_ref;  /* the stack's hash: (tgid, native stack, Python frames with their lines) */
    u32 pid;
    u32 tid;
    s32 native_id;  /* id in the `native_stacks` BPF_STACK_TRACE map, < 0 if not captured */
    u16 n_py;
    u16 py_status;  /* PYS_* */
    struct py_frame frames[MAX_PY_FRAMES];
};

#define CODE_NAME_MAX 128
#define CODE_FILE_MAX 256
#define CODE_LT_MAX 4096 /* bytes of co_linetable sent; a 300-line function's table is ~3 KB on 3.11+ */
/* code_event.flags */
#define CODE_F_NAME_UNREAD 1 /* qualname not compact ASCII (or unreadable): user space reads it, if it still can */
#define CODE_F_FILE_UNREAD 2 /* same for the file name */
#define CODE_F_LT_UNREAD 4   /* the line table could not be read */

/* A Python code object read in BPF the first time a process shows it in a stack: what names a frame and maps
 * its instruction offset to the executing line, read while the object surely exists (no stop needed). At most
 * 4.5 KiB; sent as CODE_EVENT_HEAD bytes plus the lt_len bytes of the line table that were read. */
struct code_event {
    u64 code;        /* code object address */
    u32 pid;
    s32 firstlineno;
    u32 lt_len;      /* bytes in linetable[] */
    u32 lt_full;     /* the table's full length; > lt_len: truncated, lines past the end are approximate */
    u32 flags;       /* CODE_F_* */
    u32 _pad;
    char qualname[CODE_NAME_MAX];
    char filename[CODE_FILE_MAX];
    u8 linetable[CODE_LT_MAX];
};
#define CODE_EVENT_HEAD (sizeof(struct code_event) - CODE_LT_MAX)

/* sched_event.reason */
#define SCHED_PREEMPTED 0
#define SCHED_SLEEP 1
#define SCHED_IO 2

/* One off-CPU interval of a target thread, sent when it runs again. 96 bytes. */
struct sched_event {
    u64 ts_ns;      /* switched out */
    u64 dur_ns;     /* off CPU until switched in */
    u64 runq_ns;    /* of that, runnable but waiting */
    u32 pid;
    u32 tid;
    u32 by_pid;     /* the task that held the CPU until the thread got it back (tgid); 0: no wait */
    u32 waker_pid;  /* blocked intervals: the process of the task that woke the thread (sched_waking) */
    u32 waker_tid;
    u16 cpu;
    u8 reason;
    u8 in_call;     /* 1 if a CUDA call was in flight on the thread */
    char comm[COMM_LEN];
    char by_comm[COMM_LEN];
    char waker_comm[COMM_LEN];
};

/* How capture_stack (cuda.bpf.c) identifies a stack, i.e. what its hash covers. */
#define STACK_AT_CALL 0 /* a CUDA call: its Python frames, else its frame-pointer walk */
#define STACK_OFF_CPU 1 /* a blocked thread: also the user ip and sp it blocked at, which tell a GIL take, a lock
                         * wait and a write() on one Python line apart (each is a different native path) */
#define STACK_SAMPLE 2  /* an on-CPU sample: the Python frames alone (the native part changes every sample and is
                         * not captured), else the frame-pointer walk */
/* The per-CPU scratch of a stack capture (stack_scratch, code_pending, code_scratch) has one slot per kind of
 * program that captures, indexed by its STACK_* mode: a uprobe's (STACK_AT_CALL: a call's, a collection's), a
 * sched_switch's (STACK_OFF_CPU) and a cpu-clock sample's (STACK_SAMPLE). A uprobe's program runs preemptible
 * with interrupts on, and the kernel does not keep a perf_event program out of it: a sample of the same thread,
 * taken mid-capture, rewrote the capture's queue of new code objects with its own (empty: the capture had marked
 * them), and a frame of a process gone before the next drain stayed <unresolved> (CI, test_record's nested.py).
 * A sample's and a sched_switch's programs run with interrupts or preemption off and do not nest. */
#define SCRATCH_SLOTS 3

/* Blocked time per (thread, second, stack, sleep state, waker): the offcpu_stacks table (offcpu.bpf.c). 24 bytes. */
struct offcpu_key {
    u64 stack_ref;  /* the stack it blocked in (stack_event hash); 0: not captured */
    u32 tid;
    u32 sec;        /* second of the wakeup */
    u32 waker_pid;  /* tgid of the waking task; 0: an interrupt handler (waker_irq) or no wakeup seen */
    u8 state;       /* SCHED_SLEEP (S) | SCHED_IO (D, uninterruptible) */
    u8 in_call;     /* 1: blocked inside a CUDA call */
    u8 waker_irq;   /* IRQ_* of sched.bpf.c when an interrupt handler woke it */
    u8 _pad;
};
struct offcpu_val {
    u32 pid;
    u32 waker_tid;  /* the last waking thread seen for this key */
    u64 count;      /* blocked intervals */
    u64 blocked_ns; /* switch-out to wakeup (the run-queue wait after it is the holders', thread_breakdown) */
    char waker_comm[COMM_LEN];
};

/* On-CPU samples per (thread, second, stack): the cpu_samples table (profile.bpf.c). 24 bytes. */
struct sample_key {
    u64 stack_ref;  /* STACK_SAMPLE hash; 0: not captured */
    u32 tid;
    u32 sec;
    u8 in_call;     /* 1: inside a CUDA call */
    u8 kernel;      /* 1: the sample interrupted kernel code (a syscall, a page fault) */
    u16 _pad;
    u32 _pad2;
};
struct sample_val {
    u32 pid;
    u32 _pad;
    u64 count;
};

/* proc_event.kind */
#define PROC_FORK 0
#define PROC_EXEC 1
#define PROC_EXIT 2
#define PROC_RENAME 3
#define PROC_OOM 4
#define PROC_THREAD_END 5 /* a target thread exited: its accounted span is [aux, ts_ns] */

/* Lifecycle of the traced tree; its own ring buffer, never sampled. 120 bytes. */
struct proc_event {
    u64 ts_ns;
    u64 aux;        /* PROC_THREAD_END: first_ns of the thread's accounted span */
    u32 kind;
    u32 pid;
    u32 ppid;
    u32 child;
    s32 exit_code;
    u32 tid;        /* PROC_THREAD_END: the thread */
    char comm[COMM_LEN];
    char filename[64];
};

/* map_event.kind */
#define MAP_MMAP 0     /* an executable file mapping made with mmap(2) (ld.so mapping a library's text) */
#define MAP_EXE 1      /* the executable's text at exec: start = mm->start_code, len = end_code - start_code */
#define MAP_LIB_OPEN 2 /* a CUDA library file opened and not attached: the process is held until user space attaches */

/* map_event.flags */
#define MAPF_HELD_PYTHON 1 /* an interpreter the tracer has no layout for: the process is held until user space
                            * has analysed it and configured the walker (once per interpreter binary) */
#define MAPF_NEW_TARGET 2  /* MAP_LIB_OPEN of a process that was not traced (CFG_ALL_CUDA): it joined `targets` in
                            * kernel at this open, and is held until user space has registered it */

/* A file, by identity: the key of the per-file maps (attached_files, py_binaries). */
struct file_key {
    u64 ino;
    u32 dev; /* kernel dev_t */
    u32 _pad;
};

/* attached_files values (libload.bpf.c): what the probes know about a file. */
#define FILE_ATTACHED 1 /* a CUDA library the probes are attached to: opening it needs no hold */
#define FILE_RUNTIME 2  /* the same, and a libcudart: its text span locates runtime launches (rt_ranges) */

#define PATH_DEPTH 12 /* dentry names sent per file: enough for /usr/local/lib/python3.x/site-packages/... */
#define PATH_NAME 48

/* A file mapped executable in a target: enough to symbolise its addresses after the process is gone. The path
 * is the dentry chain, file first, up to the root of its filesystem; user space joins it with the mount point
 * of `dev` and checks (dev, ino) with stat. 632 bytes. */
struct map_event {
    u64 start;
    u64 len;
    u64 pgoff;      /* file offset of start, bytes */
    u64 ino;
    u32 dev;        /* kernel dev_t: major << 20 | minor */
    u32 pid;
    u16 kind;       /* MAP_* */
    u16 depth;      /* entries of names[] used */
    u32 flags;      /* MAPF_* */
    char names[PATH_DEPTH * PATH_NAME]; /* PATH_DEPTH names of PATH_NAME bytes (flat: bcc's table types have no
                                          * 2-D arrays) */
};

#define KNAME_MAX 192

/* kname probe cookies (kernel_names.bpf.c): how the probed function names the handle it returns. */
#define KNAME_BY_NAME 0 /* cuModuleGetFunction / cuLibraryGetKernel (CUfunction *out, module, const char *name) */
#define KNAME_BY_STUB 1 /* __cudaGetKernel / cudaGetKernel (cudaKernel_t *out, const void *host_stub) */

/* A launch handle named by its kernel's name or by its host stub. 216 bytes. */
struct kname_event {
    u64 handle;
    u64 stub;       /* KNAME_BY_STUB: the host stub's address; 0 otherwise */
    u32 pid;
    u32 _pad;
    char name[KNAME_MAX];
};

#define NCCL_UNIQUE_ID_BYTES 128 /* sizeof(ncclUniqueId) (nccl.h NCCL_UNIQUE_ID_BYTES) */

/* An NCCL communicator joined (ncclCommInitRank / ncclCommInitRankConfig, nccl_comm.bpf.c): who this rank is in it.
 * Every rank of one communicator passes the same ncclUniqueId, so id_hash (FNV-1a of its 128 bytes) groups the ranks
 * of a communicator across processes and hosts; comm is the handle the rank's collectives then pass. 48 bytes. */
struct comm_event {
    u64 ts_ns;      /* the call's entry */
    u64 dur_ns;     /* until it returned: the set-up waits for every rank to join */
    u64 comm;       /* *comm after the call: the ncclComm_t handle (0 if it failed before writing it) */
    u64 id_hash;
    u32 pid;
    u32 tid;
    s32 nranks;
    s32 rank;
    s32 ret;        /* ncclResult_t: 0 is ncclSuccess */
    u32 _pad;
};

/* An NCCL collective's progress per communicator (cuda.bpf.c coll_counts): the calls one process made of one op on one
 * ncclComm_t, counted at entry, so a rank blocked inside its next collective has already counted it. Compared
 * across the ranks of a communicator (nccl_comms.id_hash), the rank whose count is lower is the one the others wait
 * for: "one collective behind". */
struct coll_key {
    u32 pid;
    u32 op;
    u64 comm;   /* the ncclComm_t handle the call passed */
};

struct coll_count {
    u64 calls;
    u64 first_ns;  /* bpf_ktime_get_ns() of the first and the last entry */
    u64 last_ns;
};

#ifndef USTACK_MAX
#define USTACK_MAX 16384 /* bytes copied from %rsp at most: enough for ~20-40 C/C++ frames */
#endif

/* One copied user stack, for .eh_frame unwinding in user space (native_stack.h). 48 + USTACK_MAX bytes. */
struct ustack_event {
    u64 stack_ref;  /* the stack_event this belongs to */
    u64 ip;         /* user registers at the probe */
    u64 sp;
    u64 bp;
    u32 pid;
    u32 tid;
    u32 len;        /* valid bytes in data[], copied from sp upwards; 0 if nothing could be read */
    s32 native_id;
    u8 data[USTACK_MAX];
};

/* Key of the exact latency histogram: one slot per (pid, op, bucket). */
struct hist_key {
    u32 pid;
    u16 op;
    u16 slot;
};

/* Exact per-(pid, op) totals next to the histogram. first/last: the span of calls, which bounds the process's
 * active time when launch probes are duty-cycled (tracer/recorder/budget.py). */
struct op_total {
    u64 calls;
    u64 total_ns;
    u64 min_ns;
    u64 max_ns;
    u64 bytes;
    u64 first_ns;
    u64 last_ns;
};

struct op_key {
    u32 pid;
    u32 op;
};

/* thread_breakdown fields (struct tb_val.v index). The parts TB_CPU .. TB_BLOCKED add up to the thread's
 * accounted time; the others annotate them. Call parts: TB_CALL + OpClass of the op's part (catalog CALL_PARTS). */
#define TB_CPU 0
#define TB_CALL 1 /* .. TB_CALL + 5: launch, sync, alloc, free, copy, other */
#define TB_RUNQ_SELF 7
#define TB_RUNQ_TREE 8
#define TB_RUNQ_OTHER 9
#define TB_RUNQ_TRACER 10
#define TB_BLOCKED 11
#define TB_IO 12
#define TB_CALL_OFF 13
#define TB_CALL_RUNQ 14
#define TB_FAULTS 15
#define TB_PAGE_ALLOC 16
#define TB_RECLAIM 17
#define TB_SWITCHES 18
#define TB_PREEMPTIONS 19
#define TB_MAX_OFF 20 /* longest off-CPU interval ending in this second (a max, not a sum) */
#define TB_CALLS 21   /* outermost CUDA calls that returned in this second */
#define TB_PAGE_CACHE 22 /* of TB_PAGE_ALLOC, bytes added to the page cache (a write()'s or a read's pages, not faults) */
#define TB_NFIELDS 32 /* a power of two: field indices are masked for the verifier */

struct tb_key {
    u32 tid;
    u32 sec;
};
struct tb_val {
    u32 pid;
    u32 _pad;
    u64 v[TB_NFIELDS];
};

/* Blocked time per (thread, second, waker). */
struct wake_key {
    u32 tid;
    u32 sec;
    u32 waker_tid; /* 0: an interrupt handler (waker_irq says which kind) */
    u8 in_call;
    u8 waker_irq; /* IRQ_* (sched.bpf.c): handlers of different kinds are different wakers */
    u16 _pad;
};
struct wake_val {
    u32 pid;
    u32 waker_pid;
    u64 wakeups;
    u64 blocked_ns;
    char waker_comm[COMM_LEN];
};

/* Run-queue waits per (task that held the CPU, waiting target thread, second). */
struct preempt_key {
    u32 pid;    /* holder's tgid */
    u32 tid;    /* the target thread that waited */
    u32 sec;
    u32 _pad;
    char comm[COMM_LEN];
};
struct preempt_val {
    u64 preemptions;
    u64 runq_ns;
    u32 is_target;
    u32 is_tracer;
};

/* Per-op probe settings (op_cfg map, index: op id), written by user space from probes/catalog.py. */
struct op_cfg {
    s16 bytes_arg;    /* argument index (0-based) or -1 (s16, not s8: bcc's table types have no signed char) */
    s16 kind_arg;
    s16 fixed_kind;
    s16 stream_arg;
    s16 stream_deref; /* stream read from *(arg + stream_deref) (cuLaunchKernelEx's config), or -1 */
    s16 func_arg;
    s16 rt_twin;      /* runtime op a call from inside libcudart is recorded as, or -1 */
    s16 dtype_arg;    /* NCCL: bytes = argument bytes_arg (an element count) x the size of the ncclDataType_t in
                       * this argument (cuda.bpf.c nccl_type_size), or -1 */
    u8 part;          /* thread_breakdown call part: OpClass of the catalog's ProbeSpec.part */
    u8 hot;           /* a launch op: duty-cycled */
    s16 comm_arg;     /* NCCL: the argument holding the ncclComm_t, counted per (pid, op, comm) in coll_counts, or -1 */
    u32 sample_every; /* store 1 call in N (0/1: all) */
    u32 stack_every;  /* stack for 1 stored call in N (0: only slow calls) */
    u32 _pad2;
    u64 slow_ns;      /* calls at least this long are always stored, with a stack */
};

#endif /* CHT_COMMON_H */
