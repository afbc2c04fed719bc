/* Bounded copy of the user stack, for unwinding with .eh_frame in user space (tracer/unwind.py).
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
 *     copy_user_stack(ctx, e);
 *     e->stack_ref = ...; e->pid = ...; e->tid = ...; e->native_id = ...;
 *     ustacks.ringbuf_submit(e, 0);
 *
 * struct ustack_event is in common.h; tracer/events.py mirrors it.
 */
#ifndef CHT_NATIVE_STACK_H
#define CHT_NATIVE_STACK_H

#include "common.h"

/* Save ip/sp/bp and copy the user stack from sp into e->data. Returns the bytes copied (also in e->len).
 *
 * bpf_probe_read_user fails as a whole if any page of the range is unmapped, which happens near the top of the
 * main thread's stack (environment and auxv sit just above). So try 16 KB, then 8 KB, then 4 KB, then up to
 * the end of sp's own page, which is always mapped. */
static __always_inline int copy_user_stack(struct pt_regs *ctx, struct ustack_event *e)
{
    u64 sp = ctx->sp;
    e->ip = ctx->ip;
    e->sp = sp;
    e->bp = ctx->bp;
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
