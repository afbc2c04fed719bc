/* CUDA API calls: one entry and one return program for every probed function of libcudart / libcuda / libnccl.
 *
 * User space attaches both with uprobe_multi links (tracer/recorder/links.py): one link per library and direction, with
 * each function's op id as the link cookie, so there is one program to verify and one link to detach per
 * library, and the duty-cycled launch functions have links of their own that can be closed and reopened in
 * milliseconds. Per-op settings (which argument carries bytes, kind, stream, the function; sampling; the slow
 * threshold) come from the op_cfg map, written from probes/catalog.py.
 *
 * Entry stores the call's start time and arguments keyed by thread; return computes the latency, counts it in
 * the exact per-(pid, op) histogram (every call), adds its time to the thread's breakdown (accounting.h), and
 * sends a call_event for a sample of calls (every call whose latency reaches the op's slow threshold, plus 1 in
 * N of the rest), with a stack for a sample of those. Stacks are deduplicated in kernel: a stack is hashed and
 * sent (with a copy of the user stack for unwinding) only the first time its process shows it; calls carry the
 * hash. Nested calls (the runtime calling a probed driver function on the same thread) are one event: the outer
 * call counts them in `nested`.
 */
#include "common.h"
#include "maps.h"
#include "accounting.h"
#include "native_stack.h"
/* The return probe's later stages, as tail calls, so the verifier sees each from a clean state (the Python walk
 * behind the return probe's sampling branches exceeds its complexity limit). Filled by tracer/recorder/program.py. */
#define STAGE_STACK 0 /* call_with_stack */
#define STAGE_CODES 1 /* py_read_codes (pycode.h) */
BPF_PROG_ARRAY(stage_prog, 2);

#ifdef WITH_PYFRAMES
#include "pyframes.h"
#include "pycode.h"
#endif

#ifndef CALLS_RB_PAGES
#define CALLS_RB_PAGES 1024 /* 4 MiB = ~47k call_events: 2 s of the stored-row budget (20k/s) at a 200 ms drain */
#endif
#ifndef STACKS_RB_PAGES
#define STACKS_RB_PAGES 256 /* 1 MiB = ~1000 full stack_events; only distinct stacks are sent */
#endif
#ifndef USTACK_RB_PAGES
#define USTACK_RB_PAGES 1024 /* 4 MiB = ~250 user-stack copies of 16 KiB, one per distinct stack */
#endif
#ifndef NATIVE_STACKS
#define NATIVE_STACKS 16384 /* distinct native stacks; a training job has hundreds */
#endif

static __u64 (*cht_attach_cookie)(void *ctx) = (void *)174; /* BPF_FUNC_get_attach_cookie (5.15+) */

BPF_RINGBUF_OUTPUT(calls, CALLS_RB_PAGES);
BPF_RINGBUF_OUTPUT(stacks_rb, STACKS_RB_PAGES);
BPF_RINGBUF_OUTPUT(ustack_rb, USTACK_RB_PAGES);

/* index: op id; value: its settings (common.h struct op_cfg), written by user space. */
BPF_ARRAY(op_cfg, struct op_cfg, OP_COUNT);

/* index: op id; value: when that op's links (entry and return) last finished closing, bpf_ktime_get_ns(), written
 * by user space (duty cycling closes the launch probes, and `auto` drops the runtime's). */
BPF_ARRAY(links_closed, u64, OP_COUNT);

/* A call whose return probe was closed before it returned: it entered before its op's links_closed, and never will
 * return through a probe. The thread's own next probe clears it (call_entry, sched_switch's switch_out, the
 * thread's exit). User space must not: writing the thread's tstate back from user space raced the thread itself,
 * and an in_call cleared just after the thread had entered its next call lost that call's off-CPU time. */
static __always_inline int missed_return(const struct inflight *f)
{
    u32 op = f->op;
    u64 *closed = links_closed.lookup(&op);
    return closed && f->ts_ns < *closed;
}

/* Clear the thread's missed call (above): its time since the call's entry then counts as CPU, the best we know. */
static __always_inline void clear_missed_call(u32 tid, struct tstate *st)
{
    if (!st->in_call)
        return;
    struct inflight *f = inflight.lookup(&tid);
    if (f && missed_return(f)) {
        inflight.delete(&tid);
        st->in_call = 0;
    }
}

/* key: (pid, op, slot); value: calls in that latency bucket. 65536 = ~90 (pid, op) pairs with ~700 slots each
 * worst case; in practice a pair fills a few dozen slots. */
BPF_HASH(op_hist, struct hist_key, u64, 65536);
/* key: (pid, op); value: exact totals. 16384 (pid, op) pairs. */
BPF_HASH(op_totals, struct op_key, struct op_total, 16384);
/* key: (pid, op, ncclComm_t); value: the collectives entered (common.h struct coll_count), every call, never
 * sampled. 4096: a job's process has a few communicators (world, data/tensor/pipeline groups) x 7 collective ops. */
BPF_HASH(coll_counts, struct coll_key, struct coll_count, 4096);
/* index: op id; value: per-CPU call counters for 1-in-N sampling of rows and of stacks, without atomics. */
BPF_PERCPU_ARRAY(sample_cnt, u32, OP_COUNT);
BPF_PERCPU_ARRAY(stack_cnt, u32, OP_COUNT);
/* index: probe op id; value: per-CPU entry-probe hits by target threads (nested ones too): hits/s x the trap
 * cost is the overhead estimate that drives duty-cycling (tracer/recorder/budget.py). */
BPF_PERCPU_ARRAY(op_hits, u64, OP_COUNT);
/* per CPU, one slot per capturing context (SCRATCH_SLOTS, common.h): stack_event is ~1 KiB, too big for the
 * 512-byte BPF stack. */
BPF_PERCPU_ARRAY(stack_scratch, struct stack_event, SCRATCH_SLOTS);
BPF_STACK_TRACE(native_stacks, NATIVE_STACKS);
/* index 0: call events sent since user space last drained (it writes 0 after each drain). The calls ring is
 * drained on a timer without a wakeup per event; when a burst has filled a third of it, one forced wakeup makes
 * the recorder drain at once, before the ring overflows. */
BPF_ARRAY(calls_pending, u64, 1);
#define CALLS_WAKE_AFTER (CALLS_RB_PAGES * 4096 / 88 / 3)

static __always_inline u64 calls_wakeup(void)
{
    u32 zero = 0;
    return wakeup_past(calls_pending.lookup(&zero), 1, CALLS_WAKE_AFTER + 1); /* the call after CALLS_WAKE_AFTER */
}

/* key: stack hash already sent; value: 1. LRU: an evicted stack is sent again, which user space dedups. */
BPF_TABLE("lru_hash", u64, u8, seen_stacks, 65536);

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
        if (n > 15)
            return 0;
        read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n - 5)));
        return v;
    }
}

/* Register argument n (0-5) read through a helper. A second inlined call_arg in one program lets the compiler
 * merge its cases into one load from ctx + a variable offset, which the verifier rejects ("dereference of
 * modified ctx ptr"); a helper may be handed any pointer. */
static __always_inline u64 reg_arg_copy(struct pt_regs *ctx, int n)
{
    void *p;
    switch (n) {
    case 0: p = &PT_REGS_PARM1(ctx); break;
    case 1: p = &PT_REGS_PARM2(ctx); break;
    case 2: p = &PT_REGS_PARM3(ctx); break;
    case 3: p = &PT_REGS_PARM4(ctx); break;
    case 4: p = &PT_REGS_PARM5(ctx); break;
    case 5: p = &PT_REGS_PARM6(ctx); break;
    default: return 0;
    }
    u64 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), p);
    return v;
}

/* Bytes per element of an NCCL ncclDataType_t (nccl.h); the same table as probes/catalog.py NCCL_TYPE_SIZES.
 * 0: a type this table does not know. */
static __always_inline u64 nccl_type_size(u64 t)
{
    switch (t) {
    case 0: case 1: case 10: case 11: return 1; /* int8, uint8, float8e4m3, float8e5m2 */
    case 6: case 9: return 2;                   /* float16, bfloat16 */
    case 2: case 3: case 7: return 4;           /* int32, uint32, float32 */
    case 4: case 5: case 8: return 8;           /* int64, uint64, float64 */
    default: return 0;
    }
}

/* Count an NCCL collective's entry on its communicator (argument n; ncclReduce's is the 7th, on the stack). */
static __always_inline void count_collective(struct pt_regs *ctx, u32 tgid, u32 op, int n, u64 now)
{
    struct coll_key k = {.pid = tgid, .op = op};
    if (n < 6)
        k.comm = reg_arg_copy(ctx, n);
    else if (n <= 15)
        read_user(&k.comm, sizeof(k.comm), (void *)(PT_REGS_SP(ctx) + 8 * (n - 5)));
    struct coll_count *v = coll_counts.lookup(&k);
    if (!v) {
        struct coll_count init = {.first_ns = now};
        coll_counts.insert(&k, &init);
        v = coll_counts.lookup(&k);
        if (!v)
            return;
    }
    __sync_fetch_and_add(&v->calls, 1);
    v->last_ns = now;
}

int cuda_entry(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_target(tgid))
        return 0;
    u32 op = (u32)cht_attach_cookie(ctx);
    struct op_cfg *c = op_cfg.lookup(&op);
    if (!c)
        return 0;
    u64 *hits = op_hits.lookup(&op);
    if (hits)
        *hits += 1;
    u64 sp = PT_REGS_SP(ctx);
    struct inflight *outer = inflight.lookup(&tid);
    if (outer && sp <= outer->sp && !missed_return(outer))
        return 0; /* nested inside a probed call: deeper in the stack, or at the same depth when the outer one
                   * tail-calls it (cudaFree: jmp cuMemFree_v2). A missed return's entry is replaced. */

    u64 now = bpf_ktime_get_ns();
    struct inflight f = {};
    f.op = op;
    f.kind = 255;
    f.sp = sp;
    if (c->rt_twin >= 0) {
        /* at function entry the return address is at [sp]: called from inside libcudart = a runtime launch */
        struct lib_range *r = rt_ranges.lookup(&tgid);
        u64 ra = 0;
        if (r) {
            read_user(&ra, sizeof(ra), (void *)sp);
            if (ra >= r->lo && ra < r->hi)
                f.op = c->rt_twin;
        }
    }
    if (c->bytes_arg >= 0) {
        f.bytes = call_arg(ctx, c->bytes_arg);
        if (c->dtype_arg >= 0) /* an NCCL count of elements of this ncclDataType_t */
            f.bytes *= nccl_type_size((u32)reg_arg_copy(ctx, c->dtype_arg));
    }
    if (c->kind_arg >= 0)
        f.kind = (u8)call_arg(ctx, c->kind_arg);
    else if (c->fixed_kind >= 0)
        f.kind = (u8)c->fixed_kind;
    if (c->stream_arg >= 0) {
        f.stream = call_arg(ctx, c->stream_arg);
        if (c->stream_deref >= 0) {
            u64 s = 0;
            read_user(&s, sizeof(s), (void *)(f.stream + c->stream_deref));
            f.stream = s;
        }
    }
    if (c->func_arg >= 0)
        f.func = call_arg(ctx, c->func_arg);
    if (c->comm_arg >= 0)
        count_collective(ctx, tgid, op, c->comm_arg, now);
    f.ts_ns = now;
    inflight.update(&tid, &f);
    acct_call_entry(tid, tgid, now);
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

static __always_inline void count_call(u32 tgid, u16 op, u64 dur, u64 bytes, u64 now)
{
    struct hist_key hk = {.pid = tgid, .op = op, .slot = hist_slot(dur)};
    op_hist.atomic_increment(hk);

    struct op_key ok = {.pid = tgid, .op = op};
    struct op_total *t = op_totals.lookup(&ok);
    if (!t) {
        struct op_total init = {.min_ns = ~0ULL, .first_ns = now - dur};
        op_totals.insert(&ok, &init);
        t = op_totals.lookup(&ok);
        if (!t)
            return;
    }
    __sync_fetch_and_add(&t->calls, 1);
    __sync_fetch_and_add(&t->total_ns, dur);
    __sync_fetch_and_add(&t->bytes, bytes);
    /* min/max/last race between CPUs only lose a concurrent extreme, never a count */
    if (dur < t->min_ns)
        t->min_ns = dur;
    if (dur > t->max_ns)
        t->max_ns = dur;
    t->last_ns = now;
}

/* Hash the current thread's stack; send it (with a copy of the user stack) the first time this process shows it,
 * and queue its new code objects (*new_codes: how many). Return the hash, or 0 when the stack could not be sent.
 * `mode` (STACK_*, common.h) says what identifies the stack; `ur` holds the user registers to unwind from.
 * The thread is the current one. Inlined into each of its three programs (a call's, a blocking switch's, a
 * sample's): bcc loads each program from its own section, so a BPF-to-BPF call to a shared function fails to
 * load ("jump out of range"). */
static __always_inline u64 capture_stack(void *ctx, struct user_regs *ur, u32 mode, u32 *new_codes)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    u32 slot = mode; /* SCRATCH_SLOTS */
    struct stack_event *se = stack_scratch.lookup(&slot);
    if (!se)
        return 0;
    se->pid = tgid;
    se->tid = tid;
    se->native_id = -1;
    se->n_py = 0;
    se->py_status = PYS_NO_CONFIG;
    u64 h = (0xcbf29ce484222325ULL ^ tgid) * 0x100000001b3ULL;
#ifdef WITH_PYFRAMES
    walk_python(se, tgid, &h);
#endif
    /* A sample's native part differs at every sample: a Python stack is its Python frames alone, unwalked */
    int native = mode != STACK_SAMPLE || !se->n_py;
    if (native)
        se->native_id = native_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    /* A Python stack is identified by its Python frames: the frame-pointer walk past an FP-less library (libffi,
     * libpython) ends in stack garbage that differs call to call. Without Python frames the native walk is it. */
    if (!se->n_py)
        h = (h ^ (u64)(s64)se->native_id) * 0x100000001b3ULL;
    if (mode == STACK_OFF_CPU) {
        h = (h ^ ur->ip) * 0x100000001b3ULL;
        h = (h ^ ur->sp) * 0x100000001b3ULL;
    }
    h = (h ^ mode) * 0x100000001b3ULL; /* a call's and a sample's stack on one line are different records */
    h |= 1; /* never 0, which means "no stack" */
    se->stack_ref = h;
    if (seen_stacks.lookup(&h))
        return h;
    struct stack_event *r = stacks_rb.ringbuf_reserve(sizeof(struct stack_event));
    if (!r) {
        count_lost(LOST_STACKS);
        return 0;
    }
    bpf_probe_read_kernel(r, sizeof(*r), se);
    if (r->tid != tid || r->stack_ref != h) {
        /* preempted, and another thread's capture on this CPU wrote the slot: no stack rather than its frames */
        stacks_rb.ringbuf_discard(r, BPF_RB_NO_WAKEUP);
        return 0;
    }
    stacks_rb.ringbuf_submit(r, BPF_RB_NO_WAKEUP);
    u8 one = 1;
    seen_stacks.update(&h, &one);
#ifdef WITH_PYFRAMES
    *new_codes = queue_new_codes(se, tgid, tid, slot);
#endif
    if (!native)
        return h;
    struct ustack_event *u = ustack_rb.ringbuf_reserve(sizeof(struct ustack_event));
    if (u) {
        copy_user_stack(ur, u);
        u->stack_ref = h;
        u->pid = tgid;
        u->tid = tid;
        u->native_id = se->native_id;
        ustack_rb.ringbuf_submit(u, BPF_RB_NO_WAKEUP);
    }
    return h;
}

/* The call being returned from, on its way to the ring buffer: one per CPU, so a tail call can finish it. */
BPF_PERCPU_ARRAY(call_scratch, struct call_event, 1);

int cuda_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    struct inflight *f = inflight.lookup(&tid);
    if (!f)
        return 0;
    if (PT_REGS_SP(ctx) <= f->sp) {
        /* a probed call nested inside the outer one returned: the outer's return pops past its entry sp (a
         * tail-called inner one returns straight to the outer's caller, and so closes the outer call itself) */
        f->nested += 1;
        return 0;
    }
    u64 now = bpf_ktime_get_ns();
    u64 dur = now - f->ts_ns;
    u32 op = f->op;
    struct op_cfg *c = op_cfg.lookup(&op);
    if (!c) {
        inflight.delete(&tid);
        return 0;
    }
    count_call(tgid, op, dur, f->bytes, now);
    acct_call_return(tid, tgid, c->part, f->ts_ns, now);

    int is_slow = c->slow_ns && dur >= c->slow_ns;
    int keep = is_slow;
    if (!keep) {
        u32 *cnt = sample_cnt.lookup(&op);
        if (c->sample_every <= 1) {
            keep = 1;
        } else if (cnt) {
            *cnt += 1;
            keep = (*cnt % c->sample_every) == 0;
        }
    }
    if (!keep) {
        inflight.delete(&tid);
        return 0;
    }
    int want_stack = is_slow;
    if (!want_stack && c->stack_every) {
        u32 *cnt = stack_cnt.lookup(&op);
        if (cnt) {
            *cnt += 1;
            /* the first stack_every calls of an op on each CPU, then 1 in stack_every at random: a short run still
             * has the stacks of its launch sites, and stacks are deduplicated, so this costs walks, not data. At
             * random, not every Nth: a step's calls repeat with its period, and a counter whose period shares a
             * factor with it walks the same call of every step (2 launches a step and 1 in 8: always the first
             * or always the second, so the launch before the sync could go a whole run without a stack). */
            want_stack = *cnt <= c->stack_every || (bpf_get_prandom_u32() % c->stack_every) == 0;
        }
    }
    u32 zero = 0;
    struct call_event *ev = call_scratch.lookup(&zero);
    if (!ev) {
        inflight.delete(&tid);
        return 0;
    }
    ev->ts_ns = f->ts_ns;
    ev->dur_ns = dur;
    ev->bytes = f->bytes;
    ev->stream = f->stream;
    ev->func = f->func;
    ev->off_cpu_ns = f->off_cpu_ns;
    ev->runq_ns = f->runq_ns;
    ev->stack_ref = 0;
    ev->pid = tgid;
    ev->tid = tid;
    ev->ret = (s32)PT_REGS_RC(ctx);
    ev->op = op;
    ev->kind = f->kind;
    ev->flags = (f->nested ? CALL_F_NESTED : 0) | (is_slow ? CALL_F_SLOW : 0);
    ev->nested = f->nested;
    ev->_pad = 0;
    inflight.delete(&tid);
    if (want_stack)
        stage_prog.call(ctx, STAGE_STACK); /* call_with_stack: hashes the stack and sends the event; no return */
    /* no stack wanted, or the tail call failed: send the call alone */
    if (calls.ringbuf_output(ev, sizeof(*ev), calls_wakeup()))
        count_lost(LOST_CALLS);
    return 0;
}

/* Stage STAGE_STACK: the call in call_scratch with its stack's hash; then read its new code objects. */
int call_with_stack(struct pt_regs *ctx)
{
    u32 zero = 0;
    struct call_event *ev = call_scratch.lookup(&zero);
    if (!ev)
        return 0;
    if (ev->tid != (u32)bpf_get_current_pid_tgid()) {
        /* preempted since cuda_return, and another thread's return on this CPU wrote the scratch (and sends it) */
        count_lost(LOST_CALLS);
        return 0;
    }
    u32 new_codes = 0;
    struct user_regs ur;
    user_regs_of_ctx(ctx, &ur);
    ev->stack_ref = capture_stack(ctx, &ur, STACK_AT_CALL, &new_codes);
    if (calls.ringbuf_output(ev, sizeof(*ev), calls_wakeup()))
        count_lost(LOST_CALLS);
    if (new_codes)
        stage_prog.call(ctx, STAGE_CODES); /* py_read_codes reads them */
    return 0;
}
