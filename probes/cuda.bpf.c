/* CUDA API calls: entry + return uprobes on libcudart / libcuda.
 *
 * Entry stores the call's start time and arguments keyed by thread; return computes the latency, counts it in the
 * exact per-(pid, op) histogram (every call), and sends a call_event for a sample of calls (every call whose
 * latency reaches the op's slow threshold, plus 1 in N of the rest), with a stack for a sample of those.
 * Nested calls (the runtime calling a probed driver function on the same thread) are one event: the outer call
 * counts them in `nested` and the inner call is not counted on its own.
 *
 * The per-op probe functions (entry_<op> / return_<op>) are generated from probes/catalog.py, with every argument
 * index a compile-time constant, so each compiles to a few loads.
 */
#include "common.h"
#include "maps.h"
#include "native_stack.h"
#ifdef WITH_PYFRAMES
#include "pyframes.h"
#endif

#ifndef CALLS_RB_PAGES
#define CALLS_RB_PAGES 1024 /* 4 MiB = ~47k call_events: 0.5 s of a 100k calls/s burst at a 100 ms poll */
#endif
#ifndef STACKS_RB_PAGES
#define STACKS_RB_PAGES 1024 /* 4 MiB = ~4k full stacks; stacks are sampled */
#endif
#ifndef NATIVE_STACKS
#define NATIVE_STACKS 16384 /* distinct native stacks; a training job has hundreds */
#endif

#ifndef USTACK_RB_PAGES
#define USTACK_RB_PAGES 1024 /* 4 MiB = ~250 user-stack copies of 16 KiB; they are a sample of the stacks */
#endif

BPF_RINGBUF_OUTPUT(calls, CALLS_RB_PAGES);
BPF_RINGBUF_OUTPUT(stacks_rb, STACKS_RB_PAGES);
/* Copies of the user stack for .eh_frame unwinding in user space (native_stack.h), where frame pointers stop
 * (libpython, libffi, libtorch are built without them). Taken for stacks with new Python code and 1 in
 * cfg_ustack_every[0] of the other captured stacks. */
BPF_RINGBUF_OUTPUT(ustack_rb, USTACK_RB_PAGES);
BPF_ARRAY(cfg_ustack_every, u32, 1);
BPF_PERCPU_ARRAY(ustack_cnt, u32, 1);

/* key: struct hist_key (pid, op, slot); value: calls in that latency bucket. 65536 = ~90 (pid, op) pairs with
 * ~700 slots each worst case; in practice a pair fills a few dozen slots. */
BPF_HASH(op_hist, struct hist_key, u64, 65536);
/* key: (pid, op); value: exact totals. 16384 (pid, op) pairs. */
BPF_HASH(op_totals, struct op_key, struct op_total, 16384);

/* Per-op settings written by user space (index: op id). sample_every: store 1 call in N (0 or 1: all);
 * slow_ns: calls at least this long are always stored, with a stack; stack_every: stack for 1 stored call in N
 * (0: only slow calls). */
BPF_ARRAY(cfg_sample_every, u32, OP_COUNT);
BPF_ARRAY(cfg_slow_ns, u64, OP_COUNT);
BPF_ARRAY(cfg_stack_every, u32, OP_COUNT);
/* index: op id; value: per-CPU call counter used for 1-in-N sampling without atomics. */
BPF_PERCPU_ARRAY(sample_cnt, u32, OP_COUNT);
BPF_PERCPU_ARRAY(stack_cnt, u32, OP_COUNT);
/* one slot per CPU: stack_event is ~1 KiB, too big for the 512-byte BPF stack. */
BPF_PERCPU_ARRAY(stack_scratch, struct stack_event, 1);
/* per-CPU sequence for stack_ref: (cpu << 48) | seq, never 0. */
BPF_PERCPU_ARRAY(stack_seq, u64, 1);
BPF_STACK_TRACE(native_stacks, NATIVE_STACKS);
/* index: probe op id; value: per-CPU entry-probe hits by target threads (nested ones too). User space turns
 * hits/s into the overhead estimate that drives duty-cycling. */
BPF_PERCPU_ARRAY(op_hits, u64, OP_COUNT);
/* The span the duty-cycled (hot) probes were live in the current on-window: 0 first hit ns, 1 last hit ns,
 * 2 hits; 3 the first hot hit of the whole session. User space reads and resets 0-2 after each detach; sum of
 * spans / (end - first hot hit) = sampled fraction. Measured from hits, not from attach/detach calls, because a
 * detach takes ~0.1 s to take effect, and from the first hit, because a job launches nothing while it starts. */
BPF_ARRAY(duty_span, u64, 4);

/* An empty probe: user space times it on a libc function in its own process to learn this machine's trap cost. */
int calib_probe(struct pt_regs *ctx)
{
    return 0;
}

/* Argument n of a function at its entry. x86-64 passes 6 in registers; the rest sit above the return address. */
static __always_inline u64 call_arg(struct pt_regs *ctx, int n)
{
    u64 v = 0;
    switch (n) {
    case 0: return PT_REGS_PARM1(ctx);
    case 1: return PT_REGS_PARM2(ctx);
    case 2: return PT_REGS_PARM3(ctx);
    case 3: return PT_REGS_PARM4(ctx);
    case 4: return PT_REGS_PARM5(ctx);
    case 5: return PT_REGS_PARM6(ctx);
    default:
        bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n - 5)));
        return v;
    }
}

static __always_inline int on_entry(struct pt_regs *ctx, u16 op, int bytes_arg, int kind_arg, int fixed_kind,
                                    int stream_arg, int stream_deref, int func_arg, int rt_twin, int hot)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_target(tgid))
        return 0;
    u32 opi = op;
    u64 *hits = op_hits.lookup(&opi);
    if (hits)
        *hits += 1;
    if (hot) {
        int i0 = 0, i1 = 1, i2 = 2, i3 = 3;
        u64 now = bpf_ktime_get_ns();
        u64 *first = duty_span.lookup(&i0), *last = duty_span.lookup(&i1), *n = duty_span.lookup(&i2);
        u64 *start = duty_span.lookup(&i3);
        if (start && *start == 0)
            *start = now;
        if (first && last && n) {
            if (*first == 0)
                *first = now;
            *last = now;
            __sync_fetch_and_add(n, 1);
        }
    }
    struct inflight *outer = inflight.lookup(&tid);
    if (outer)
        return 0; /* nested inside a probed call: the return probe counts it */

    struct inflight f = {};
    f.op = op;
    f.probe_op = op;
    f.kind = 255;
    if (rt_twin >= 0) {
        /* at function entry the return address is at [sp]: called from inside libcudart = a runtime launch */
        struct lib_range *r = rt_ranges.lookup(&tgid);
        u64 ra = 0;
        if (r) {
            bpf_probe_read_user(&ra, sizeof(ra), (void *)PT_REGS_SP(ctx));
            if (ra >= r->lo && ra < r->hi)
                f.op = rt_twin;
        }
    }
    if (bytes_arg >= 0)
        f.bytes = call_arg(ctx, bytes_arg);
    if (kind_arg >= 0)
        f.kind = (u8)call_arg(ctx, kind_arg);
    else if (fixed_kind >= 0)
        f.kind = (u8)fixed_kind;
    if (stream_arg >= 0) {
        f.stream = call_arg(ctx, stream_arg);
        if (stream_deref >= 0) {
            u64 s = 0;
            bpf_probe_read_user(&s, sizeof(s), (void *)(f.stream + stream_deref));
            f.stream = s;
        }
    }
    if (func_arg >= 0)
        f.func = call_arg(ctx, func_arg);
    f.ts_ns = bpf_ktime_get_ns();
    inflight.update(&tid, &f);
    return 0;
}

static __always_inline u16 hist_slot(u64 v)
{
    if (v < 16)
        return v;
    u32 msb = bpf_log2l(v) - 1; /* bcc's bpf_log2l is floor(log2(v)) + 1 */
    u32 slot = (msb - 3) * 16 + ((v >> (msb - 4)) & 15);
    if (slot >= HIST_SLOTS)
        slot = HIST_SLOTS - 1;
    return slot;
}

static __always_inline void count_call(u32 tgid, u16 op, u64 dur, u64 bytes)
{
    struct hist_key hk = {.pid = tgid, .op = op, .slot = hist_slot(dur)};
    op_hist.atomic_increment(hk);

    struct op_key ok = {.pid = tgid, .op = op};
    struct op_total *t = op_totals.lookup(&ok);
    if (!t) {
        struct op_total init = {.min_ns = ~0ULL};
        op_totals.insert(&ok, &init);
        t = op_totals.lookup(&ok);
        if (!t)
            return;
    }
    __sync_fetch_and_add(&t->calls, 1);
    __sync_fetch_and_add(&t->total_ns, dur);
    __sync_fetch_and_add(&t->bytes, bytes);
    /* min/max races between CPUs only lose a concurrent extreme, never a count */
    if (dur < t->min_ns)
        t->min_ns = dur;
    if (dur > t->max_ns)
        t->max_ns = dur;
}

#ifdef WITH_PYFRAMES
struct code_key {
    u32 pid;
    u32 _pad;
    u64 code;
};
/* key: (tgid, code object address) seen in a captured stack; value: 1. LRU: 65536 code objects is far more than
 * a training job runs; an evicted one only costs one more stop. */
BPF_TABLE("lru_hash", struct code_key, u8, seen_code, 65536);
/* index 0: 1 to hold processes on first sight of new code (the recorder, which continues them); 0 (the
 * default, for other users of this program such as bench/probe_cost) never stops anything. */
BPF_ARRAY(cfg_hold, u32, 1);

/* 1 if any frame of the stack is a code object this process has not shown before (and remember them all). */
static __always_inline int first_sight(struct stack_event *se, u32 tgid)
{
    int fresh = 0, zero = 0;
    u32 *hold = cfg_hold.lookup(&zero);
    if (!hold || !*hold)
        return 0;
    u8 one = 1;
    for (int i = 0; i < MAX_PY_FRAMES; i++) {
        if (i >= se->n_py)
            break;
        struct code_key k = {.pid = tgid, .code = se->frames[i].code};
        if (!k.code)
            continue;
        if (!seen_code.lookup(&k)) {
            seen_code.update(&k, &one);
            fresh = 1;
        }
    }
    return fresh;
}
#endif

static __always_inline u64 capture_stack(struct pt_regs *ctx, u32 tgid, u32 tid)
{
    u32 zero = 0;
    struct stack_event *se = stack_scratch.lookup(&zero);
    u64 *seq = stack_seq.lookup(&zero);
    if (!se || !seq)
        return 0;
    *seq += 1;
    u64 ref = ((u64)bpf_get_smp_processor_id() << 48) | (*seq & 0xffffffffffffULL);
    se->stack_ref = ref;
    se->pid = tgid;
    se->tid = tid;
    se->native_id = native_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    se->n_py = 0;
    se->py_status = 1;
    int stop = 0;
#ifdef WITH_PYFRAMES
    walk_python(se, tgid);
    stop = first_sight(se, tgid);
#endif
    /* reserve first: a process is stopped only once its record is sure to reach user space, which continues it */
    struct stack_event *r = stacks_rb.ringbuf_reserve(sizeof(struct stack_event));
    if (!r) {
        count_lost(LOST_STACKS);
        return 0;
    }
    bpf_probe_read_kernel(r, sizeof(*r), se);
    if (stop) {
        /* hold the process until user space has read the new code objects: a short-lived worker, or a script
         * whose <module> code is freed as soon as its body returns, would be gone before the next poll */
        r->py_status |= PYS_STOPPED;
        bpf_send_signal(19 /* SIGSTOP */);
    }
    stacks_rb.ringbuf_submit(r, 0);

    int want_copy = stop;
    u32 *every = cfg_ustack_every.lookup(&zero), *cnt = ustack_cnt.lookup(&zero);
    if (!want_copy && every && *every && cnt) {
        *cnt += 1;
        want_copy = (*cnt % *every) == 0;
    }
    if (want_copy) {
        struct ustack_event *u = ustack_rb.ringbuf_reserve(sizeof(struct ustack_event));
        if (u) {
            copy_user_stack(ctx, u);
            u->stack_ref = ref;
            u->pid = tgid;
            u->tid = tid;
            u->native_id = se->native_id;
            ustack_rb.ringbuf_submit(u, 0);
        }
    }
    return ref;
}

static __always_inline int on_return(struct pt_regs *ctx, u16 op)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    struct inflight *f = inflight.lookup(&tid);
    if (!f)
        return 0;
    if (f->probe_op != op) {
        /* a probed call nested inside the outer one on this thread */
        f->nested += 1;
        return 0;
    }
    u64 now = bpf_ktime_get_ns();
    u64 dur = now - f->ts_ns;
    op = f->op;
    count_call(tgid, op, dur, f->bytes);

    u32 opi = op;
    u64 *slow = cfg_slow_ns.lookup(&opi);
    int is_slow = slow && *slow && dur >= *slow;
    int keep = is_slow;
    if (!keep) {
        u32 *every = cfg_sample_every.lookup(&opi);
        u32 *cnt = sample_cnt.lookup(&opi);
        u32 n = every ? *every : 1;
        if (n <= 1) {
            keep = 1;
        } else if (cnt) {
            *cnt += 1;
            keep = (*cnt % n) == 0;
        }
    }
    if (!keep) {
        inflight.delete(&tid);
        return 0;
    }

    u64 stack_ref = 0;
    int want_stack = is_slow;
    if (!want_stack) {
        u32 *every = cfg_stack_every.lookup(&opi);
        u32 *cnt = stack_cnt.lookup(&opi);
        if (every && *every && cnt) {
            *cnt += 1;
            want_stack = (*cnt % *every) == 0;
        }
    }
    if (want_stack)
        stack_ref = capture_stack(ctx, tgid, tid);

    struct call_event ev = {};
    ev.ts_ns = f->ts_ns;
    ev.dur_ns = dur;
    ev.bytes = f->bytes;
    ev.stream = f->stream;
    ev.func = f->func;
    ev.off_cpu_ns = f->off_cpu_ns;
    ev.runq_ns = f->runq_ns;
    ev.stack_ref = stack_ref;
    ev.pid = tgid;
    ev.tid = tid;
    ev.ret = (s32)PT_REGS_RC(ctx);
    ev.op = op;
    ev.kind = f->kind;
    ev.flags = (f->nested ? CALL_F_NESTED : 0) | (is_slow ? CALL_F_SLOW : 0);
    ev.nested = f->nested;
    inflight.delete(&tid);
    if (calls.ringbuf_output(&ev, sizeof(ev), 0))
        count_lost(LOST_CALLS);
    return 0;
}
