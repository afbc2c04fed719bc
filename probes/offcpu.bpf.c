/* Where target threads block: the stack of every blocking switch-out, and the blocked time per stack.
 *
 * sched:sched_switch (sched.bpf.c) runs in the context of the task leaving the CPU. When a target thread leaves it
 * sleeping (S) or uninterruptible (D), sched.bpf.c tail-calls offcpu_stack, which captures the thread's stack as
 * it is now (its Python frames, walked by pyframes.h, and its native code from the user registers it entered the
 * kernel with), deduplicated in kernel like a call's stack (cuda.bpf.c capture_stack, STACK_OFF_CPU), and notes
 * it in the thread's state. When the thread is woken and runs again, sched.bpf.c calls offcpu_count, which adds
 * the blocked time (switch-out to wakeup) to offcpu_aggs by (thread, second, stack, state, waker). So the sum over
 * a thread's rows outside calls is its thread_breakdown.blocked_ns, exactly; only the stack is missing (0) where
 * the capture failed.
 *
 * The capture is a tail call, so sched_switch's own verification stays small, and it costs a Python walk per
 * blocking switch (~1 us; bench/probe_cost.py). CFG_OFFCPU_STACKS = 0 turns it off (--no-offcpu-stacks).
 */
#include "common.h"
#include "maps.h"
#include "accounting.h"

#ifndef OFFCPU_ENTRIES
#define OFFCPU_ENTRIES 16384 /* (thread, second, stack, waker) rows not yet drained: drained every second, and a
                              * thread blocks in tens of distinct places a second at most */
#endif
#define OFFCPU_STAGE_CAPTURE 0 /* offcpu_stack */
#define OFFCPU_STAGE_CODES 1   /* py_read_codes_tp */

/* The tracepoint stages, by slot (a tail call reaches only programs of the caller's type); filled by
 * tracer/recorder/program.py. */
BPF_PROG_ARRAY(offcpu_stage, 2);
/* key: (stack, thread, second, waker, state, in call); value: blocked intervals and time. */
BPF_HASH(offcpu_aggs, struct offcpu_key, struct offcpu_val, OFFCPU_ENTRIES);

/* Stage OFFCPU_STAGE_CAPTURE, tail-called from sched_switch for a target thread leaving the CPU blocked (it is
 * still current): capture its stack and note it in its state. */
int offcpu_stack(void *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    struct tstate *st = tstate.lookup(&tid);
    if (!st)
        return 0;
    struct user_regs ur;
    user_regs_of_task(&ur);
    u32 new_codes = 0;
    u64 ref = capture_stack(ctx, &ur, STACK_OFF_CPU, &new_codes);
    st = tstate.lookup(&tid); /* re-read: the verifier forgets map values across the capture's helper calls */
    if (st)
        st->off_stack = ref;
#ifdef WITH_PYFRAMES
    if (new_codes)
        offcpu_stage.call(ctx, OFFCPU_STAGE_CODES);
#endif
    return 0;
}

#ifdef WITH_PYFRAMES
/* Stage OFFCPU_STAGE_CODES: pycode.h's py_read_codes for tracepoint programs. */
int py_read_codes_tp(void *ctx)
{
    if (read_queued_codes(STACK_OFF_CPU))
        offcpu_stage.call(ctx, OFFCPU_STAGE_CODES);
    return 0;
}
#endif

/* A blocked target thread runs again (sched_switch, switch-in side): add its blocked time to its stack's row. */
static __always_inline void offcpu_count(struct tstate *o, u32 tid, u32 sec, u8 in_call, u64 blocked_ns)
{
    if (!cfg_get(CFG_OFFCPU_STACKS))
        return;
    struct offcpu_key k = {
        .stack_ref = o->off_stack,
        .tid = tid,
        .sec = sec,
        .waker_pid = o->waker_tgid,
        .state = o->reason,
        .in_call = in_call,
        .waker_irq = o->waker_irq,
    };
    struct offcpu_val *v = offcpu_aggs.lookup(&k);
    if (!v) {
        struct offcpu_val init = {.pid = o->tgid};
        __builtin_memcpy(init.waker_comm, o->waker_comm, COMM_LEN);
        offcpu_aggs.insert(&k, &init);
        v = offcpu_aggs.lookup(&k);
    }
    if (!v) {
        count_lost(LOST_AGGS);
        return;
    }
    v->waker_tid = o->waker_tid;
    __sync_fetch_and_add(&v->count, 1);
    __sync_fetch_and_add(&v->blocked_ns, blocked_ns);
}
