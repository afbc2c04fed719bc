/* On-CPU samples of the target threads: where their CPU time goes, outside CUDA calls and inside them.
 *
 * A perf_event software cpu-clock event per CPU (tracer/recorder/sampler.py, --sample-hz; no hardware PMU needed)
 * runs cpu_sample in the interrupt of each tick. Whatever is not a target thread returns at once; a target thread
 * has its stack captured (cuda.bpf.c capture_stack, STACK_SAMPLE: its Python frames alone, else its native walk),
 * deduplicated in kernel, and the sample counted in sample_aggs by (thread, second, stack). Each sample stands for
 * one period of CPU time (1 / sample_hz s). Every thread of the job is covered, CUDA-calling or not.
 */
#include "common.h"
#include "maps.h"
#include "accounting.h"
#ifdef __x86_64__
/* uapi/linux/bpf_perf_event.h's context, declared here: compiling that header (and what it includes) cost 0.8 s of
 * the recorder's start-up. On x86-64 its bpf_user_pt_regs_t is struct pt_regs, and the sample reads regs.cs. */
struct bpf_perf_event_data {
    struct pt_regs regs;
    __u64 sample_period;
    __u64 addr;
};
#else
#include <uapi/linux/bpf_perf_event.h>
#endif

#ifndef SAMPLE_ENTRIES
#define SAMPLE_ENTRIES 16384 /* (thread, second, stack) rows not yet drained: drained every second; at 99 Hz a
                              * thread adds at most 99 a second */
#endif
#define SAMPLE_STAGE_CODES 0 /* py_read_codes_pe */

/* The perf_event stage (a tail call reaches only programs of the caller's type); filled by program.py. */
BPF_PROG_ARRAY(sample_stage, 1);
/* key: (stack, thread, second, in call, kernel); value: samples. */
BPF_HASH(sample_aggs, struct sample_key, struct sample_val, SAMPLE_ENTRIES);

int cpu_sample(struct bpf_perf_event_data *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!tid || !is_target(tgid))
        return 0;
    struct tstate *st = tstate.lookup(&tid);
    u8 in_call = st ? st->in_call : 0;
    struct user_regs ur;
    user_regs_of_task(&ur);
    u32 new_codes = 0;
    struct sample_key k = {};
    k.stack_ref = capture_stack(ctx, &ur, STACK_SAMPLE, &new_codes);
    k.tid = tid;
    k.sec = session_sec(bpf_ktime_get_ns());
    k.in_call = in_call;
    k.kernel = (ctx->regs.cs & 3) == 0; /* CPL 0: the tick interrupted kernel code */
    struct sample_val *v = sample_aggs.lookup(&k);
    if (!v) {
        struct sample_val init = {.pid = tgid};
        sample_aggs.insert(&k, &init);
        v = sample_aggs.lookup(&k);
    }
    if (v)
        __sync_fetch_and_add(&v->count, 1);
    else
        count_lost(LOST_AGGS);
#ifdef WITH_PYFRAMES
    if (new_codes)
        sample_stage.call(ctx, SAMPLE_STAGE_CODES);
#endif
    return 0;
}

#ifdef WITH_PYFRAMES
/* Stage SAMPLE_STAGE_CODES: pycode.h's py_read_codes for perf_event programs. */
int py_read_codes_pe(struct bpf_perf_event_data *ctx)
{
    if (read_queued_codes(STACK_SAMPLE))
        sample_stage.call(ctx, SAMPLE_STAGE_CODES);
    return 0;
}
#endif
