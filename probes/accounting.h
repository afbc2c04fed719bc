/* Where each target thread's time goes, exactly, per second: the thread_breakdown table.
 *
 * Every target thread is in one state at a time, and each state change closes the segment [mark, now] into the
 * part it belongs to, so the parts add up to the thread's accounted span [first, end]:
 *   on CPU, no call in flight        -> TB_CPU              (closed at a call's entry, a switch-out, the exit)
 *   inside a CUDA call               -> TB_CALL + part      (closed at the call's return, entry to return)
 *   off CPU outside a call, blocked  -> TB_BLOCKED (+TB_IO) (closed when it runs again; blocked until its wakeup)
 *   off CPU outside a call, runnable -> TB_RUNQ_<holder>    (from the wakeup or preemption until it runs)
 * Off-CPU time inside a call stays in the call's part and is also noted in TB_CALL_OFF / TB_CALL_RUNQ.
 * A segment that spans second boundaries is split between the seconds (up to SPLIT_MAX pieces; the rest goes to
 * the last one), so per-second rows are exact too. User space drains finished seconds and, at the end, closes the
 * segments still open (tracer/recorder/columns.py), reading tstate and inflight.
 *
 * Include after maps.h.
 */
#ifndef CHT_ACCOUNTING_H
#define CHT_ACCOUNTING_H

#include "maps.h"

#ifndef TB_ENTRIES
#define TB_ENTRIES 16384 /* (thread, second) rows not yet drained: user space drains every second, so this covers
                          * ~8000 live target threads */
#endif
#define SPLIT_MAX 4

/* A target thread's current state. */
struct tstate {
    u64 first;       /* start of its accounted span: attach or its first event */
    u64 mark;        /* start of the segment not yet accounted */
    u64 ts_runnable; /* off CPU: when it became runnable (a preemption: the switch-out); 0 while blocked */
    u64 reclaim_ts;  /* in direct reclaim since, 0 otherwise */
    u64 off_stack;   /* blocked: the stack it blocked in (offcpu.bpf.c), 0 if not captured */
    u32 tgid;
    u32 waker_tid;   /* who woke it (sched_waking), while off CPU */
    u32 waker_tgid;
    u8 off_cpu;
    u8 reason;       /* SCHED_*, while off CPU */
    u8 in_call;      /* a probed CUDA call is in flight: its time goes to the call's part */
    u8 waker_irq;    /* woken by an interrupt handler of this kind (IRQ_*, sched.bpf.c), 0 otherwise */
    u8 in_gc;        /* inside a garbage collection (gc.bpf.c): its off-CPU time goes to gc_inflight too */
    char waker_comm[COMM_LEN];
};

/* key: tid; value: its state. MAX_THREADS: one per live target thread; deleted at the thread's exit. */
BPF_HASH(tstate, u32, struct tstate, MAX_THREADS);
/* key: (tid, second); value: the per-second sums, TB_* (common.h). */
BPF_HASH(tbreak, struct tb_key, struct tb_val, TB_ENTRIES);

static __always_inline struct tb_val *tb_row(u32 tid, u32 tgid, u32 sec)
{
    struct tb_key k = {.tid = tid, .sec = sec};
    struct tb_val *a = tbreak.lookup(&k);
    if (a)
        return a;
    struct tb_val init = {.pid = tgid};
    if (tbreak.insert(&k, &init) && !tbreak.lookup(&k)) {
        count_lost(LOST_AGGS);
        return 0;
    }
    return tbreak.lookup(&k);
}

/* Add v to field `field` of the thread's row for the second holding ts. */
static __always_inline void tb_add(u32 tid, u32 tgid, u64 ts, u32 field, u64 v)
{
    struct tb_val *a = tb_row(tid, tgid, session_sec(ts));
    if (a)
        __sync_fetch_and_add(&a->v[field & (TB_NFIELDS - 1)], v);
}

static __always_inline void tb_max(u32 tid, u32 tgid, u64 ts, u32 field, u64 v)
{
    struct tb_val *a = tb_row(tid, tgid, session_sec(ts));
    if (a && a->v[field & (TB_NFIELDS - 1)] < v)
        a->v[field & (TB_NFIELDS - 1)] = v; /* a racing max between CPUs only loses a concurrent extreme */
}

/* Add the span [start, end) to `field`, split at second boundaries. */
static __always_inline void tb_span(u32 tid, u32 tgid, u32 field, u64 start, u64 end)
{
    u64 t0 = cfg_get(CFG_START_NS);
    if (start < t0)
        start = t0; /* a segment that began before the session counts from its start */
    if (end <= start)
        return;
#pragma unroll
    for (int i = 0; i < SPLIT_MAX; i++) {
        u64 boundary = t0 + ((start - t0) / 1000000000ULL + 1) * 1000000000ULL;
        u64 piece_end = (end <= boundary || i == SPLIT_MAX - 1) ? end : boundary;
        tb_add(tid, tgid, start, field, piece_end - start);
        if (piece_end >= end)
            break;
        start = piece_end;
    }
}

/* The thread's state, created at its first event (its span starts there). */
static __always_inline struct tstate *tstate_of(u32 tid, u32 tgid, u64 now)
{
    struct tstate *st = tstate.lookup(&tid);
    if (st)
        return st;
    struct tstate init = {.first = now, .mark = now, .tgid = tgid};
    tstate.insert(&tid, &init);
    return tstate.lookup(&tid);
}

/* The outermost CUDA call starts on a running thread: close its on-CPU segment. A call already marked in flight
 * is one whose return was missed (its probe was detached meanwhile): its time since then counts as CPU. */
static __always_inline void acct_call_entry(u32 tid, u32 tgid, u64 now)
{
    struct tstate *st = tstate_of(tid, tgid, now);
    if (!st)
        return;
    tb_span(tid, tgid, TB_CPU, st->mark, now);
    st->in_call = 1;
    st->mark = now;
}

/* The outermost call returned: its whole duration goes to its part. */
static __always_inline void acct_call_return(u32 tid, u32 tgid, u32 part, u64 entry_ts, u64 now)
{
    struct tstate *st = tstate_of(tid, tgid, now);
    if (!st)
        return;
    tb_span(tid, tgid, TB_CALL + part, entry_ts > st->first ? entry_ts : st->first, now);
    tb_add(tid, tgid, now, TB_CALLS, 1);
    st->in_call = 0;
    st->mark = now;
}

#endif /* CHT_ACCOUNTING_H */
