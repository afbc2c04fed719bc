/* Lifecycle of the traced tree, on a ring buffer of its own (never sampled), and the in-kernel upkeep of the
 * process sets.
 *
 * task:task_newtask: a new process of a target joins `targets` in kernel (so nothing it does is missed), with its
 *   parent's rt_ranges and Python layout; a new process of the tracer joins `tracer_pids`.
 * sched:sched_process_exec: the new image (its executable's text goes out as a map_event, libload.bpf.c).
 * sched:sched_process_exit: for every exiting target thread, its last on-CPU segment is closed (accounting.h)
 *   and its accounted span sent (PROC_THREAD_END); for a process, its exit code (task_struct.exit_code at a
 *   BTF offset).
 * task:task_rename: prctl(PR_SET_NAME): DataLoader workers become pt_data_worker right after fork.
 * oom:mark_victim: the OOM killer chose a process.
 */
#include "common.h"
#include "maps.h"
#include "accounting.h"

#ifndef PROC_RB_PAGES
/* 1 MiB = ~8.5k lifecycle events between two drains. A process makes about four (fork, exec, exit, its thread's
 * end): 256 KiB lost events above ~2,000 forks/s on a loaded 2-CPU VM, where a drain comes late (issue 21). */
#define PROC_RB_PAGES 256
#endif
#ifndef EXIT_CODE_OFF
#define EXIT_CODE_OFF -1 /* task_struct.exit_code from kernel BTF; -1: unknown */
#endif
#define CLONE_THREAD_FLAG 0x00010000

BPF_RINGBUF_OUTPUT(proc_rb, PROC_RB_PAGES);

static __always_inline void emit_proc(struct proc_event *e)
{
    if (proc_rb.ringbuf_output(e, sizeof(*e), BPF_RB_NO_WAKEUP))
        count_lost(LOST_PROC);
}

/* current = the parent. A new thread needs nothing here (targets are keyed by tgid); a new process joins. */
TRACEPOINT_PROBE(task, task_newtask)
{
    if (args->clone_flags & CLONE_THREAD_FLAG)
        return 0;
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    u32 child = args->pid;
    u8 one = 1;
    if (!is_target(parent)) {
        if (is_tracer(parent))
            tracer_pids.update(&child, &one);
        return 0;
    }
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
    rt_ranges.delete(&tgid);
    struct proc_event e = {};
    e.ts_ns = bpf_ktime_get_ns();
    e.kind = PROC_EXEC;
    e.pid = tgid;
    bpf_get_current_comm(e.comm, sizeof(e.comm));
    u16 off = args->data_loc_filename & 0xffff;
    bpf_probe_read_kernel_str(e.filename, sizeof(e.filename), (void *)args + off);
    emit_proc(&e);
    emit_exe_map(tgid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    u64 now = bpf_ktime_get_ns();
    struct tstate *st = tstate.lookup(&tid);
    if (st) {
        struct proc_event te = {};
        clear_missed_call(tid, st);
        if (!st->in_call)
            tb_span(tid, tgid, TB_CPU, st->mark, now);
        te.ts_ns = now;
        te.aux = st->first;
        te.kind = PROC_THREAD_END;
        te.pid = tgid;
        te.tid = tid;
        bpf_get_current_comm(te.comm, sizeof(te.comm));
        emit_proc(&te);
        tstate.delete(&tid);
    }
    inflight.delete(&tid);
    if (tid != tgid)
        return 0;
    if (is_tracer(tgid)) {
        tracer_pids.delete(&tgid);
        return 0;
    }
    if (!is_target(tgid))
        return 0;
    struct proc_event e = {};
    e.ts_ns = now;
    e.kind = PROC_EXIT;
    e.pid = tgid;
    e.exit_code = -1;
    if (EXIT_CODE_OFF >= 0) {
        u64 t = bpf_get_current_task();
        bpf_probe_read_kernel(&e.exit_code, sizeof(e.exit_code), (void *)(t + EXIT_CODE_OFF));
    }
    bpf_get_current_comm(e.comm, sizeof(e.comm));
    emit_proc(&e);
    targets.delete(&tgid);
    rt_ranges.delete(&tgid);
    held.delete(&tgid);
    gc_trigger.delete(&tgid); /* gc.h: a collection scheduled but never run */
#ifdef WITH_PYFRAMES
    pycfg_on_exit(tgid);
#endif
    return 0;
}

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
