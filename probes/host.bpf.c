/* What the host did while the target's CUDA calls ran.
 *
 * sched:sched_switch / sched_wakeup(_new): every off-CPU interval of every thread of a target process (filtered
 *   on the tgid), why it left the CPU (preempted while runnable, sleep, uninterruptible io), how long it waited
 *   runnable for a CPU, and who had the CPU. While a CUDA call is in flight on the thread, the interval is added
 *   to that call (maps.h `inflight`), so each call carries its own off_cpu_ns / runq_ns.
 * task:task_newtask / sched_process_exec / sched_process_exit / task:task_rename / oom:mark_victim: lifecycle of
 *   the traced tree on a ring buffer of its own (never sampled); forked children join `targets` in kernel.
 * kmem:mm_page_alloc, exceptions:page_fault_user: memory pressure counters.
 */
#include "common.h"
#include "maps.h"

#ifndef SCHED_RB_PAGES
#define SCHED_RB_PAGES 512 /* 2 MiB = ~29k sched_events; kept intervals are a few thousand a second */
#endif
#ifndef PROC_RB_PAGES
#define PROC_RB_PAGES 64 /* 256 KiB = ~2.3k lifecycle events between two polls */
#endif
#ifndef EXIT_CODE_OFF
#define EXIT_CODE_OFF -1 /* task_struct.exit_code from kernel BTF; -1: unknown */
#endif
#define CLONE_THREAD_FLAG 0x00010000
#ifndef PAGE_BYTES
#define PAGE_BYTES 4096
#endif

BPF_RINGBUF_OUTPUT(sched_rb, SCHED_RB_PAGES);
BPF_RINGBUF_OUTPUT(proc_rb, PROC_RB_PAGES);

/* A target thread off CPU since ts_out. ts_runnable: when it became runnable again (the switch-out itself for a
 * preemption, the wakeup for a sleep; 0 while still blocked). */
struct offcpu {
    u64 ts_out;
    u64 ts_runnable;
    u32 tgid;
    u8 reason;
    u8 _pad[3];
};
/* key: tid; value: the thread's current off-CPU interval. MAX_THREADS: one per target thread. */
BPF_HASH(offcpu, u32, struct offcpu, MAX_THREADS);

struct sched_key {
    u32 tid;
    u32 sec;
};
struct sched_agg {
    u64 switches;
    u64 preemptions;
    u64 off_cpu_ns;
    u64 runq_ns;
    u64 max_off_ns;
    u32 pid;
    u32 _pad;
};
/* key: (tid, second); value: exact totals. User space drains finished seconds every second, so 65536 covers
 * thousands of target threads. */
BPF_HASH(sched_aggs, struct sched_key, struct sched_agg, 65536);

struct preempt_key {
    u32 pid;
    u32 sec;
    char comm[16];
};
struct preempt_val {
    u64 preemptions;
    u64 runq_ns;
    u64 is_target;
};
/* key: (task that held the CPU while a target thread waited for it, second); value: waits it caused. 16384:
 * drained every second. */
BPF_HASH(preempt_aggs, struct preempt_key, struct preempt_val, 16384);

/* index: HC_*; per-CPU host counters read (and summed) by user space about once a second. */
#define HC_PAGE_ALLOC 0
#define HC_TARGET_PAGE_ALLOC 1
#define HC_TARGET_FAULTS 2
#define HC_SWITCHES 3
BPF_PERCPU_ARRAY(host_counters, u64, 4);

/* index: 0 session start (ktime ns), 1 keep every interval at least this long (ns), 2 store 1 in N of the other
 * intervals that overlap no call (0/1: all). */
BPF_ARRAY(cfg_sched, u64, 3);
BPF_PERCPU_ARRAY(sched_sample_cnt, u32, 1);

static __always_inline void host_count(int idx, u64 v)
{
    u64 *c = host_counters.lookup(&idx);
    if (c)
        *c += v;
}

static __always_inline u64 cfg_get(int idx)
{
    u64 *v = cfg_sched.lookup(&idx);
    return v ? *v : 0;
}

static __always_inline u32 session_sec(u64 now)
{
    u64 start = cfg_get(0);
    return now > start ? (u32)((now - start) / 1000000000ULL) : 0;
}

static __always_inline struct sched_agg *agg_for(u32 tid, u32 tgid, u32 sec)
{
    struct sched_key k = {.tid = tid, .sec = sec};
    struct sched_agg *a = sched_aggs.lookup(&k);
    if (a)
        return a;
    struct sched_agg init = {.pid = tgid};
    sched_aggs.insert(&k, &init);
    return sched_aggs.lookup(&k);
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    host_count(HC_SWITCHES, 1);
    u64 id = bpf_get_current_pid_tgid();
    u32 prev_tgid = id >> 32;
    u32 prev_tid = args->prev_pid;

    /* the target thread leaving the CPU */
    if (prev_tid && is_target(prev_tgid)) {
        struct offcpu o = {};
        o.ts_out = now;
        o.tgid = prev_tgid;
        long st = args->prev_state;
        if ((st & 0xff) == 0) { /* TASK_RUNNING (or TASK_REPORT_MAX for a preemption): still runnable */
            o.reason = SCHED_PREEMPTED;
            o.ts_runnable = now;
        } else {
            o.reason = (st & 2) ? SCHED_IO : SCHED_SLEEP; /* TASK_UNINTERRUPTIBLE = 2 */
        }
        offcpu.update(&prev_tid, &o);
        struct sched_agg *a = agg_for(prev_tid, prev_tgid, session_sec(now));
        if (a) {
            __sync_fetch_and_add(&a->switches, 1);
            if (o.reason == SCHED_PREEMPTED)
                __sync_fetch_and_add(&a->preemptions, 1);
        }
    }

    /* a target thread getting the CPU back */
    u32 next_tid = args->next_pid;
    struct offcpu *o = offcpu.lookup(&next_tid);
    if (!o)
        return 0;
    u64 dur = now - o->ts_out;
    u64 runq = o->ts_runnable ? now - o->ts_runnable : 0;
    struct inflight *f = inflight.lookup(&next_tid);
    if (f) {
        __sync_fetch_and_add(&f->off_cpu_ns, dur);
        __sync_fetch_and_add(&f->runq_ns, runq);
    }
    struct sched_agg *a = agg_for(next_tid, o->tgid, session_sec(o->ts_out));
    if (a) {
        __sync_fetch_and_add(&a->off_cpu_ns, dur);
        __sync_fetch_and_add(&a->runq_ns, runq);
        if (dur > a->max_off_ns)
            a->max_off_ns = dur;
    }
    if (runq) {
        /* charge the wait to the task that had this CPU until now */
        struct preempt_key pk = {.pid = prev_tgid, .sec = session_sec(now)};
        bpf_probe_read_kernel(pk.comm, sizeof(pk.comm), args->prev_comm);
        struct preempt_val *pv = preempt_aggs.lookup(&pk);
        if (!pv) {
            struct preempt_val init = {.is_target = is_target(prev_tgid)};
            preempt_aggs.insert(&pk, &init);
            pv = preempt_aggs.lookup(&pk);
        }
        if (pv) {
            __sync_fetch_and_add(&pv->runq_ns, runq);
            if (o->reason == SCHED_PREEMPTED)
                __sync_fetch_and_add(&pv->preemptions, 1);
        }
    }

    int keep = f != 0 || dur >= cfg_get(1);
    if (!keep) {
        u64 every = cfg_get(2);
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
        e.ts_ns = o->ts_out;
        e.dur_ns = dur;
        e.runq_ns = runq;
        e.pid = o->tgid;
        e.tid = next_tid;
        e.cpu = bpf_get_smp_processor_id();
        e.reason = o->reason;
        e.in_call = f != 0;
        bpf_probe_read_kernel(e.comm, sizeof(e.comm), args->next_comm);
        /* Who kept the thread waiting: the task that had this CPU until the thread got it back, as a process id
         * (tgid), the same task the preemptors table charges. (The task that took the CPU at the preemption is
         * known only by its thread id and is often a short kernel thread before the real competitor.) */
        if (runq) {
            e.by_pid = prev_tgid;
            bpf_probe_read_kernel(e.by_comm, sizeof(e.by_comm), args->prev_comm);
        }
        if (sched_rb.ringbuf_output(&e, sizeof(e), 0))
            count_lost(LOST_SCHED);
    }
    offcpu.delete(&next_tid);
    return 0;
}

static __always_inline void mark_runnable(u32 tid)
{
    struct offcpu *o = offcpu.lookup(&tid);
    if (o && !o->ts_runnable)
        o->ts_runnable = bpf_ktime_get_ns();
}

TRACEPOINT_PROBE(sched, sched_wakeup)
{
    mark_runnable(args->pid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup_new)
{
    mark_runnable(args->pid);
    return 0;
}

static __always_inline void emit_proc(struct proc_event *e)
{
    if (proc_rb.ringbuf_output(e, sizeof(*e), 0))
        count_lost(LOST_PROC);
}

/* current = the parent. A new thread needs nothing (targets are keyed by tgid); a new process joins the tree. */
TRACEPOINT_PROBE(task, task_newtask)
{
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!is_target(parent) || (args->clone_flags & CLONE_THREAD_FLAG))
        return 0;
    u32 child = args->pid;
    u8 one = 1;
    targets.update(&child, &one);
    struct lib_range *r = rt_ranges.lookup(&parent);
    if (r) {
        struct lib_range copy = *r;
        rt_ranges.update(&child, &copy);
    }
#ifdef WITH_PYFRAMES
    pycfg_on_fork(parent, child);
#endif
    struct proc_event e = {};
    e.ts_ns = bpf_ktime_get_ns();
    e.kind = PROC_FORK;
    e.pid = child;
    e.ppid = parent;
    e.child = child;
    bpf_probe_read_kernel(e.comm, sizeof(e.comm), args->comm);
    emit_proc(&e);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!is_target(tgid))
        return 0;
#ifdef WITH_PYFRAMES
    pycfg_on_exec(tgid);
#endif
    struct proc_event e = {};
    e.ts_ns = bpf_ktime_get_ns();
    e.kind = PROC_EXEC;
    e.pid = tgid;
    bpf_get_current_comm(e.comm, sizeof(e.comm));
    u16 off = args->data_loc_filename & 0xffff;
    bpf_probe_read_kernel_str(e.filename, sizeof(e.filename), (void *)args + off);
    emit_proc(&e);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    inflight.delete(&tid);
    offcpu.delete(&tid);
    if (tid != tgid || !is_target(tgid))
        return 0;
    struct proc_event e = {};
    e.ts_ns = bpf_ktime_get_ns();
    e.kind = PROC_EXIT;
    e.pid = tgid;
    e.exit_code = -1;
    if (EXIT_CODE_OFF >= 0) {
        struct task_struct *t = (struct task_struct *)bpf_get_current_task();
        bpf_probe_read_kernel(&e.exit_code, sizeof(e.exit_code), (void *)t + EXIT_CODE_OFF);
    }
    bpf_get_current_comm(e.comm, sizeof(e.comm));
    emit_proc(&e);
    targets.delete(&tgid);
    rt_ranges.delete(&tgid);
#ifdef WITH_PYFRAMES
    pycfg_on_exit(tgid);
#endif
    return 0;
}

/* prctl(PR_SET_NAME): DataLoader workers become pt_data_worker right after fork. */
TRACEPOINT_PROBE(task, task_rename)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if ((u32)id != tgid || !is_target(tgid))
        return 0;
    struct proc_event e = {};
    e.ts_ns = bpf_ktime_get_ns();
    e.kind = PROC_RENAME;
    e.pid = tgid;
    bpf_probe_read_kernel(e.comm, sizeof(e.comm), args->newcomm);
    emit_proc(&e);
    return 0;
}

TRACEPOINT_PROBE(oom, mark_victim)
{
    struct proc_event e = {};
    e.ts_ns = bpf_ktime_get_ns();
    e.kind = PROC_OOM;
    e.pid = args->pid;
    emit_proc(&e);
    return 0;
}

TRACEPOINT_PROBE(kmem, mm_page_alloc)
{
    u64 bytes = (u64)PAGE_BYTES << args->order;
    host_count(HC_PAGE_ALLOC, bytes);
    if (is_target(bpf_get_current_pid_tgid() >> 32))
        host_count(HC_TARGET_PAGE_ALLOC, bytes);
    return 0;
}

TRACEPOINT_PROBE(exceptions, page_fault_user)
{
    if (is_target(bpf_get_current_pid_tgid() >> 32))
        host_count(HC_TARGET_FAULTS, 1);
    return 0;
}
