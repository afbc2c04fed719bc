/* Bounded copy of the user stack, for unwinding with .eh_frame in user space (tracer/recorder/unwind.py).
 *
 * Why: the BPF_STACK_TRACE frame-pointer walk stops at the first library built without frame pointers
 * (libpython, libffi, most -O2 C++), typically after 3 frames. Copying the raw stack from %rsp and unwinding it
 * with each module's .eh_frame CFI recovers the whole chain (21 frames vs 3 in the prototype).
 *
 * Cost: ~300 ns for 4 KB, ~1.6 us for 16 KB per copy, and the event is 16 KB on the ring buffer: it is sent once
 * per distinct stack (cuda.bpf.c dedups stacks in kernel), never for every call.
 *
 * Usage (the struct is too big for the 512-byte BPF stack; reserve it in a ring buffer):
 *
 *     struct ustack_event *e = ustacks.ringbuf_reserve(sizeof(*e));
 *     if (!e) return 0;
 *     struct user_regs ur;
 *     user_regs_of_ctx(ctx, &ur);   (or user_regs_of_task(&ur) outside a uprobe)
 *     copy_user_stack(&ur, e);
 *     e->stack_ref = ...; e->pid = ...; e->tid = ...; e->native_id = ...;
 *     ustacks.ringbuf_submit(e, 0);
 *
 * struct ustack_event is in common.h; tracer/recorder/events.py mirrors it.
 */
#ifndef CHT_NATIVE_STACK_H
#define CHT_NATIVE_STACK_H

#include "common.h"

/* User registers where a stack is captured: at a uprobe, the probe's own; in a tracepoint or a perf_event
 * sample, those the task saved entering the kernel (user_regs_of_task). */
struct user_regs {
    u64 ip;
    u64 sp;
    u64 bp;
};

static __always_inline void user_regs_of_ctx(struct pt_regs *ctx, struct user_regs *ur)
{
    ur->ip = ctx->ip;
    ur->sp = ctx->sp;
    ur->bp = ctx->bp;
}

/* The current task's user registers, as saved at the top of its kernel stack when it entered the kernel (a
 * syscall, a fault, the timer interrupt of a sample): valid in any context where current is a user task. */
static __always_inline void user_regs_of_task(struct user_regs *ur)
{
    struct pt_regs *r = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
    ur->ip = ur->sp = ur->bp = 0;
    bpf_probe_read_kernel(&ur->ip, sizeof(u64), &r->ip);
    bpf_probe_read_kernel(&ur->sp, sizeof(u64), &r->sp);
    bpf_probe_read_kernel(&ur->bp, sizeof(u64), &r->bp);
}

/* Save ip/sp/bp and copy the user stack from sp into e->data. Returns the bytes copied (also in e->len).
 *
 * bpf_probe_read_user fails as a whole if any page of the range is unmapped, which happens near the top of the
 * main thread's stack (environment and auxv sit just above). So try 16 KB, then 8 KB, then 4 KB, then up to
 * the end of sp's own page, which is always mapped. */
static __always_inline int copy_user_stack(struct user_regs *ur, struct ustack_event *e)
{
    u64 sp = ur->sp;
    e->ip = ur->ip;
    e->sp = sp;
    e->bp = ur->bp;
    e->len = 0;
    if (read_user(e->data, USTACK_MAX, (void *)sp) == 0) {
        e->len = USTACK_MAX;
    } else if (USTACK_MAX >= 8192 && read_user(e->data, 8192, (void *)sp) == 0) {
        e->len = 8192;
    } else if (read_user(e->data, 4096, (void *)sp) == 0) {
        e->len = 4096;
    } else {
        u32 n = 4096 - (u32)(sp & 4095); /* 1..4096 */
        if (n > 0 && n <= 4096 && read_user(e->data, n, (void *)sp) == 0)
            e->len = n;
    }
    return e->len;
}

#endif /* CHT_NATIVE_STACK_H */
