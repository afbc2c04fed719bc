/* CPython's cyclic garbage collector in target threads: each collection's start, duration, generation and the
 * stack it started from (issue 28: the interpreter's own time is a root of the wait graph).
 *
 * One program for every probe point; the point's kind and where its argument lies come in the link's cookie
 * (common.h GC_PT_*, packed by tracer/recorder/cpython/gcprobe.py), so interpreters of any version attach without
 * a recompile. Where the interpreter has USDT probes (Debian's and Ubuntu's system Pythons) the points are
 * python:gc__start / gc__done, whose semaphores the uprobe_multi link's ref_ctr_offsets raise in every process
 * mapping the file; elsewhere (pyenv builds) gc_collect_main's entry and return (3.10-3.13: generation in its
 * second argument, the objects collected in its return value).
 *
 * The start captures the thread's stack (cuda.bpf.c capture_stack: on 3.10/3.11 its Python frames are the line whose
 * allocation crossed the threshold), about a Python walk per collection. On 3.12+ that allocation only schedules the
 * collection, which runs at the next eval-breaker check (another line, even another thread); there a third point
 * (GC_PT_SCHEDULE), passed only by the allocation that sets the "scheduled" flag, captures the allocating stack
 * into gc_trigger; a fourth, _Py_RunGC's entry (GC_PT_RUN), marks the thread that runs it, and the collection that
 * thread starts takes that stack instead of walking its own: still one walk per collection.
 */
#include "common.h"
#include "maps.h"
#include "accounting.h"
#include "gc.h"

#ifndef GC_RB_PAGES
#define GC_RB_PAGES 128 /* 512 KiB = ~11000 gc_events: building a large heap runs thousands of young collections a
                         * second, and the recorder may not drain for a second or two while it starts up */
#endif

BPF_RINGBUF_OUTPUT(gc_rb, GC_RB_PAGES);

static __u64 (*gc_cookie)(void *ctx) = (void *)174; /* BPF_FUNC_get_attach_cookie */

/* The probe point's argument as its cookie locates it; -1 when it cannot be read. */
static __always_inline s64 gc_arg(struct pt_regs *ctx, u64 cookie)
{
    u32 reg = (cookie >> 8) & 0xff;
    if (reg >= GC_ARG_REGS)
        return -1;
    u64 v = 0;
    if (bpf_probe_read_kernel(&v, sizeof(v), (u64 *)ctx + reg))
        return -1;
    u32 size = (cookie >> 17) & 0xf;
    if (cookie & (1 << 16)) {
        u64 addr = v + (s64)(s32)(cookie >> 32);
        v = 0;
        if (read_user(&v, size > 8 ? 8 : size & 0xf, (void *)addr))
            return -1;
    }
    if (size == 1)
        return (cookie & (1 << 21)) ? (s64)(s8)v : (s64)(u8)v;
    if (size == 2)
        return (cookie & (1 << 21)) ? (s64)(s16)v : (s64)(u16)v;
    if (size == 4)
        return (cookie & (1 << 21)) ? (s64)(s32)v : (s64)(u32)v;
    return (s64)v;
}

int gc_probe(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_target(tgid))
        return 0;
    u64 cookie = gc_cookie(ctx);
    u32 kind = cookie & 0xff;
    if (kind == GC_PT_SCHEDULE) {
        struct gc_trigger *t = gc_trigger.lookup(&tgid);
        if (t && !t->runner_tid)
            return 0; /* an earlier allocation scheduled it (3.13's flag is per thread: another thread's may be set) */
        u32 new_codes = 0;
        struct user_regs ur;
        user_regs_of_ctx(ctx, &ur);
        struct gc_trigger nt = {.stack_ref = capture_stack(ctx, &ur, STACK_AT_CALL, &new_codes)};
        gc_trigger.update(&tgid, &nt);
#ifdef WITH_PYFRAMES
        if (new_codes)
            stage_prog.call(ctx, STAGE_CODES);
#endif
        return 0;
    }
    if (kind == GC_PT_RUN) {
        struct gc_trigger *t = gc_trigger.lookup(&tgid);
        if (t)
            t->runner_tid = tid;
        return 0;
    }
    if (kind == GC_PT_START) {
        u64 now = bpf_ktime_get_ns();
        struct gc_inflight g = {.ts_ns = now, .generation = (s32)gc_arg(ctx, cookie)};
        u32 new_codes = 0;
        struct gc_trigger *t = gc_trigger.lookup(&tgid);
        if (t && t->runner_tid == tid) {
            g.stack_ref = t->stack_ref;
            gc_trigger.delete(&tgid);
        } else {
            /* not the scheduled run: a gc.collect() (or a 3.10/3.11 collection). One while a collection is
             * scheduled resets the counts that run would have collected for: it will find none (gc_race.py) */
            if (t)
                gc_trigger.delete(&tgid);
            struct user_regs ur;
            user_regs_of_ctx(ctx, &ur);
            g.stack_ref = capture_stack(ctx, &ur, STACK_AT_CALL, &new_codes);
        }
        gc_inflight.update(&tid, &g);
        struct tstate *st = tstate_of(tid, tgid, now);
        if (st)
            st->in_gc = 1; /* sched.bpf.c adds its off-CPU time to the collection */
#ifdef WITH_PYFRAMES
        if (new_codes)
            stage_prog.call(ctx, STAGE_CODES); /* py_read_codes reads them */
#endif
        return 0;
    }
    if (kind != GC_PT_DONE)
        return 0;
    struct tstate *st = tstate.lookup(&tid);
    if (st)
        st->in_gc = 0;
    struct gc_inflight *g = gc_inflight.lookup(&tid);
    if (!g)
        return 0;
    struct gc_event ev = {
        .ts_ns = g->ts_ns,
        .dur_ns = bpf_ktime_get_ns() - g->ts_ns,
        .stack_ref = g->stack_ref,
        .off_cpu_ns = g->off_cpu_ns,
        .runq_ns = g->runq_ns,
        .collected = gc_arg(ctx, cookie),
        .pid = tgid,
        .tid = tid,
        .generation = g->generation,
    };
    gc_inflight.delete(&tid);
    if (gc_rb.ringbuf_output(&ev, sizeof(ev), 0))
        count_lost(LOST_GC);
    return 0;
}
