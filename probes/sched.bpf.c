/* What the target threads did between and during their CUDA calls: off-CPU intervals, who kept them waiting for
 * a CPU, who woke them.
 *
 * sched:sched_switch: a target thread leaving the CPU closes its on-CPU segment (accounting.h) and starts an
 *   off-CPU one; a target thread getting the CPU back closes it: blocked until its wakeup, then waiting in the run
 *   queue, charged to the task that held the CPU until now, classed as its own process, the traced tree (its
 *   workers), the tracer, or another process. Inside a call the interval goes to the call (maps.h `inflight`), so
 *   each call carries its own off_cpu_ns / runq_ns.
 * sched:sched_waking: runs in the waker's context, so it names who woke a blocked target thread (the GIL holder,
 *   the worker that delivered a batch). A wakeup from an interrupt handler (a timer expiring: a sleep, a timeout,
 *   the GIL's 5 ms wait; a softirq; a device) runs on whatever task the interrupt found, which woke no one: it is
 *   credited to pid 0, named for the kind of handler: "[timer]", "[net]", "[block]", "[softirq]", "[irq]".
 * A target thread that blocks has its stack captured (offcpu.bpf.c, a tail call at the end of sched_switch) and
 * its blocked time counted per stack when it runs again (offcpu_count).
 * Intervals go out as sched_events within a budget (every one >= CFG_SCHED_KEEP_NS or inside a call, 1 in
 * CFG_SCHED_EVERY of the rest); the per-second totals (tbreak, wake_aggs, preempt_aggs) are exact.
 */
#include "common.h"
#include "maps.h"
#include "accounting.h"
#include "gc.h"

#ifndef SCHED_RB_PAGES
#define SCHED_RB_PAGES 512 /* 2 MiB = ~21k sched_events; kept intervals are a few thousand a second */
#endif

BPF_RINGBUF_OUTPUT(sched_rb, SCHED_RB_PAGES);
/* key: (blocked thread, second, waker thread, in call); value: wakeups and the blocked time they ended. 16384:
 * drained every second. */
BPF_HASH(wake_aggs, struct wake_key, struct wake_val, 16384);
/* key: (task that held the CPU, target thread that waited, second, its comm); value: waits it caused. 16384:
 * drained every second. */
BPF_HASH(preempt_aggs, struct preempt_key, struct preempt_val, 16384);
BPF_PERCPU_ARRAY(sched_sample_cnt, u32, 1);

/* Interrupt handlers running on this CPU, innermost last: a depth, not a flag, as a hard interrupt can nest in a
 * softirq. Entries and exits are tracepoints, so neither is missed once both are attached (a handler that
 * interrupts a BPF program runs with tracepoint programs off for its entry and its exit alike). The exits are
 * defined, so attached, before the entries: a handler under way at attach time shows an exit first, which leaves
 * the depth at 0, never an entry without its exit. And every context switch resets it: no task switches inside
 * an interrupt handler, so a depth left over can never outlive the next switch on its CPU. */
#define IRQ_TIMER 1 /* an hrtimer, or the timer / hrtimer softirq: a sleep or timeout expired */
#define IRQ_SOFT 2  /* another softirq (RCU, tasklets, scheduler) */
#define IRQ_HARD 3  /* a device interrupt */
#define IRQ_NET 4   /* the network softirqs: a packet arrived or was sent */
#define IRQ_BLOCK 5 /* the block softirq: a disk I/O completed */
#define IRQ_NEST 4
struct irq_ctx {
    u32 depth;
    u8 kind[IRQ_NEST];
};
BPF_PERCPU_ARRAY(irq_ctx, struct irq_ctx, 1);

static __always_inline int irq_enter(u8 kind)
{
    u32 zero = 0;
    struct irq_ctx *c = irq_ctx.lookup(&zero);
    if (c) {
        if (c->depth < IRQ_NEST)
            c->kind[c->depth] = kind;
        c->depth++;
    }
    return 0;
}

static __always_inline int irq_exit(void)
{
    u32 zero = 0;
    struct irq_ctx *c = irq_ctx.lookup(&zero);
    if (c && c->depth)
        c->depth--;
    return 0;
}

TRACEPOINT_PROBE(timer, hrtimer_expire_exit) { return irq_exit(); }
TRACEPOINT_PROBE(irq, softirq_exit) { return irq_exit(); }
TRACEPOINT_PROBE(irq, irq_handler_exit) { return irq_exit(); }
TRACEPOINT_PROBE(timer, hrtimer_expire_entry) { return irq_enter(IRQ_TIMER); }
/* vec: TIMER_SOFTIRQ 1, NET_TX 2, NET_RX 3, BLOCK 4, HRTIMER_SOFTIRQ 8 (include/linux/interrupt.h) */
TRACEPOINT_PROBE(irq, softirq_entry)
{
    u32 v = args->vec;
    return irq_enter(v == 1 || v == 8 ? IRQ_TIMER : v == 2 || v == 3 ? IRQ_NET : v == 4 ? IRQ_BLOCK : IRQ_SOFT);
}
TRACEPOINT_PROBE(irq, irq_handler_entry) { return irq_enter(IRQ_HARD); }

/* The kind of interrupt handler running on this CPU (IRQ_*), 0 in task context. */
static __always_inline u8 irq_kind(void)
{
    u32 zero = 0;
    struct irq_ctx *c = irq_ctx.lookup(&zero);
    if (!c || !c->depth)
        return 0;
    u32 i = c->depth > IRQ_NEST ? IRQ_NEST - 1 : c->depth - 1;
    return c->kind[i & (IRQ_NEST - 1)];
}

/* index: HC_* (common.h); per-CPU host counters read (and summed) by user space about once a second. */
BPF_PERCPU_ARRAY(host_counters, u64, HC_COUNT);

static __always_inline void host_count(int idx, u64 v)
{
    u64 *c = host_counters.lookup(&idx);
    if (c)
        *c += v;
}

/* Which part of the breakdown a run-queue wait of a thread of `tgid` goes to, by who held the CPU. */
static __always_inline u32 holder_part(u32 holder_tgid, u32 tgid)
{
    if (holder_tgid == tgid)
        return TB_RUNQ_SELF;
    if (is_tracer(holder_tgid))
        return TB_RUNQ_TRACER;
    if (is_target(holder_tgid))
        return TB_RUNQ_TREE;
    return TB_RUNQ_OTHER;
}

/* A target thread leaves the CPU; return 1 when it blocked (sleeping or uninterruptible), 0 when preempted. */
static __always_inline int switch_out(u32 tid, u32 tgid, long prev_state, u64 now)
{
    /* The exiting thread's last switch (prev_state reports its exit_state: EXIT_DEAD 0x10, EXIT_ZOMBIE 0x20):
     * sched_process_exit has closed its span and dropped its state, which must not be made anew here (it was:
     * a dead thread then counted as blocked until the end of the recording). */
    if (prev_state & 0x30)
        return 0;
    struct tstate *st = tstate_of(tid, tgid, now);
    if (!st)
        return 0;
    clear_missed_call(tid, st);
    if (!st->in_call)
        tb_span(tid, tgid, TB_CPU, st->mark, now);
    st->off_cpu = 1;
    st->mark = now;
    st->waker_tid = 0;
    st->waker_tgid = 0;
    st->waker_comm[0] = 0; /* no wakeup seen yet */
    st->waker_irq = 0;
    st->off_stack = 0; /* offcpu.bpf.c captures it after this, when wanted */
    if ((prev_state & 0xff) == 0) { /* TASK_RUNNING (or TASK_REPORT_MAX for a preemption): still runnable */
        st->reason = SCHED_PREEMPTED;
        st->ts_runnable = now;
    } else {
        st->reason = (prev_state & 2) ? SCHED_IO : SCHED_SLEEP; /* TASK_UNINTERRUPTIBLE = 2 */
        st->ts_runnable = 0;
    }
    tb_add(tid, tgid, now, TB_SWITCHES, 1);
    if (st->reason == SCHED_PREEMPTED)
        tb_add(tid, tgid, now, TB_PREEMPTIONS, 1);
    return st->reason != SCHED_PREEMPTED;
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    host_count(HC_SWITCHES, 1);
    u32 zero = 0;
    struct irq_ctx *ic = irq_ctx.lookup(&zero);
    if (ic)
        ic->depth = 0; /* task context: no interrupt handler is running on this CPU */
    u32 prev_tgid = bpf_get_current_pid_tgid() >> 32;
    u32 prev_tid = args->prev_pid;

    /* a target thread getting the CPU back (first: the thread leaving may end in a tail call, which never
     * returns) */
    u32 next_tid = args->next_pid;
    struct tstate *o = tstate.lookup(&next_tid);
    if (!o || !o->off_cpu)
        goto out_prev;
    u32 tgid = o->tgid;
    u64 out = o->mark;
    u64 dur = now - out;
    u64 runnable = o->ts_runnable ? o->ts_runnable : now;
    u64 runq = now - runnable;
    u32 in_call = o->in_call;
    if (in_call) {
        struct inflight *f = inflight.lookup(&next_tid);
        if (f) {
            __sync_fetch_and_add(&f->off_cpu_ns, dur);
            __sync_fetch_and_add(&f->runq_ns, runq);
        }
        tb_span(next_tid, tgid, TB_CALL_OFF, out, now);
        tb_span(next_tid, tgid, TB_CALL_RUNQ, runnable, now);
    } else {
        tb_span(next_tid, tgid, TB_BLOCKED, out, runnable);
        if (o->reason == SCHED_IO)
            tb_span(next_tid, tgid, TB_IO, out, runnable);
        tb_span(next_tid, tgid, holder_part(prev_tgid, tgid), runnable, now);
    }
    if (o->in_gc) {
        struct gc_inflight *g = gc_inflight.lookup(&next_tid);
        if (g) {
            __sync_fetch_and_add(&g->off_cpu_ns, dur);
            __sync_fetch_and_add(&g->runq_ns, runq);
        }
    }
    tb_max(next_tid, tgid, out, TB_MAX_OFF, dur);
    u32 sec = session_sec(now);
    if (o->reason != SCHED_PREEMPTED && runnable > out) {
        struct wake_key wk = {
            .tid = next_tid, .sec = sec, .waker_tid = o->waker_tid, .in_call = in_call, .waker_irq = o->waker_irq};
        struct wake_val *wv = wake_aggs.lookup(&wk);
        if (!wv) {
            struct wake_val init = {.pid = tgid, .waker_pid = o->waker_tgid};
            __builtin_memcpy(init.waker_comm, o->waker_comm, COMM_LEN);
            wake_aggs.insert(&wk, &init);
            wv = wake_aggs.lookup(&wk);
        }
        if (wv) {
            __sync_fetch_and_add(&wv->wakeups, 1);
            __sync_fetch_and_add(&wv->blocked_ns, runnable - out);
        } else {
            count_lost(LOST_AGGS);
        }
        offcpu_count(o, next_tid, sec, in_call, runnable - out);
    }
    if (runq) {
        /* charge the wait to the task that had this CPU until now */
        struct preempt_key pk = {.pid = prev_tgid, .tid = next_tid, .sec = sec};
        bpf_probe_read_kernel(pk.comm, sizeof(pk.comm), args->prev_comm);
        struct preempt_val *pv = preempt_aggs.lookup(&pk);
        if (!pv) {
            struct preempt_val init = {.is_target = is_target(prev_tgid), .is_tracer = is_tracer(prev_tgid)};
            preempt_aggs.insert(&pk, &init);
            pv = preempt_aggs.lookup(&pk);
        }
        if (pv) {
            __sync_fetch_and_add(&pv->runq_ns, runq);
            if (o->reason == SCHED_PREEMPTED)
                __sync_fetch_and_add(&pv->preemptions, 1);
        } else {
            count_lost(LOST_AGGS);
        }
    }

    int keep = in_call || dur >= cfg_get(CFG_SCHED_KEEP_NS);
    if (!keep) {
        u64 every = cfg_get(CFG_SCHED_EVERY);
        u32 zero = 0;
        u32 *cnt = sched_sample_cnt.lookup(&zero);
        if (every <= 1) {
            keep = 1;
        } else if (cnt) {
            *cnt += 1;
            keep = (*cnt % (u32)every) == 0;
        }
    }
    if (keep) {
        struct sched_event e = {};
        e.ts_ns = out;
        e.dur_ns = dur;
        e.runq_ns = runq;
        e.pid = tgid;
        e.tid = next_tid;
        e.cpu = bpf_get_smp_processor_id();
        e.reason = o->reason;
        e.in_call = in_call;
        bpf_probe_read_kernel(e.comm, sizeof(e.comm), args->next_comm);
        /* Who kept the thread waiting: the task that had this CPU until the thread got it back, as a process id
         * (tgid), the same task preempt_aggs charges. */
        if (runq) {
            e.by_pid = prev_tgid;
            bpf_probe_read_kernel(e.by_comm, sizeof(e.by_comm), args->prev_comm);
        }
        if (o->reason != SCHED_PREEMPTED && o->waker_comm[0]) {
            e.waker_pid = o->waker_tgid;
            e.waker_tid = o->waker_tid;
            __builtin_memcpy(e.waker_comm, o->waker_comm, COMM_LEN);
        }
        if (sched_rb.ringbuf_output(&e, sizeof(e), BPF_RB_NO_WAKEUP))
            count_lost(LOST_SCHED);
    }
    o->off_cpu = 0;
    o->mark = now;

out_prev:
    /* the target thread leaving the CPU: account it, and capture where it blocks (offcpu.bpf.c) */
    if (prev_tid && is_target(prev_tgid) && switch_out(prev_tid, prev_tgid, args->prev_state, now) &&
        cfg_get(CFG_OFFCPU_STACKS))
        offcpu_stage.call(args, OFFCPU_STAGE_CAPTURE); /* no return */
    return 0;
}

/* A blocked target thread is being woken, in the waker's context. */
TRACEPOINT_PROBE(sched, sched_waking)
{
    u32 tid = args->pid;
    struct tstate *o = tstate.lookup(&tid);
    if (!o || !o->off_cpu || o->ts_runnable)
        return 0;
    o->ts_runnable = bpf_ktime_get_ns();
    u8 irq = irq_kind();
    o->waker_irq = irq;
    if (irq) {
        o->waker_tid = 0;
        o->waker_tgid = 0;
        if (irq == IRQ_TIMER)
            __builtin_memcpy(o->waker_comm, "[timer]", 8);
        else if (irq == IRQ_NET)
            __builtin_memcpy(o->waker_comm, "[net]", 6);
        else if (irq == IRQ_BLOCK)
            __builtin_memcpy(o->waker_comm, "[block]", 8);
        else if (irq == IRQ_SOFT)
            __builtin_memcpy(o->waker_comm, "[softirq]", 10);
        else
            __builtin_memcpy(o->waker_comm, "[irq]", 6);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    o->waker_tid = (u32)id;
    o->waker_tgid = id >> 32;
    bpf_get_current_comm(o->waker_comm, sizeof(o->waker_comm));
    return 0;
}
