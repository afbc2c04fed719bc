/* Python code objects read in BPF, the first time a process shows each in a captured stack.
 *
 * What naming a frame needs: qualified name, file name, first line, and the line table (up to CODE_LT_MAX bytes),
 * sent as a code_event. So a frame resolves even after its code object, or its whole process, is gone (a script's
 * <module> code is freed the moment its body returns; a DataLoader worker exits at the end of its epoch), and no
 * process is ever stopped to read it. User space decodes the executing line from the table and the instruction
 * index the walk recorded (tracer/recorder/pyruntime.py).
 *
 * Include after pyframes.h and maps.h. queue_new_codes() runs in the stack capture; py_read_codes is a separate
 * program, tail-called after it (cuda.bpf.c STAGE_CODES), so the capture's verifier work stays small.
 */
#ifndef CHT_PYCODE_H
#define CHT_PYCODE_H

#include "common.h"
#include "maps.h"
#include "pyframes.h"

#ifndef CODES_RB_PAGES
#define CODES_RB_PAGES 256 /* 1 MiB = ~230 code_events: a process shows tens of new code objects at a time */
#endif
#define CODE_PENDING_MAX MAX_PY_FRAMES /* code objects queued per captured stack: all of its frames */
#define CODE_READS_PER_CALL 8            /* read per py_read_codes run, which tail-calls itself for the rest */

BPF_RINGBUF_OUTPUT(codes_rb, CODES_RB_PAGES);
/* index 0: bytes of code events sent since user space last drained (it writes 0 after each drain, with
 * calls_pending). The ring is drained on the recorder's timer; a burst of new code objects (a job forking workers
 * that each show their stacks' code objects, fresh code compiled in a loop) that fills a third of it forces one
 * wakeup, so the recorder drains before the ring overflows: a code object lost there is read again only at a new
 * stack that shows it, and a process that exits first keeps its frames <unresolved>. */
BPF_ARRAY(codes_pending, u64, 1);
#define CODES_WAKE_AT (CODES_RB_PAGES * 4096 / 3)

static __always_inline u64 codes_wakeup(u32 size)
{
    u32 zero = 0;
    return wakeup_past(codes_pending.lookup(&zero), size, CODES_WAKE_AT);
}

struct code_key {
    u32 pid;
    u32 gen; /* the process's exec_gen (pyframes.h): its image */
    u64 code;
};
/* key: (tgid, its image, code object address) sent for that process; value: the object's fingerprint when read
 * (code_fingerprint). Marked once the event is in the ring, not when queued: a queue a preempting capture
 * overwrote (see SCRATCH_SLOTS) leaves its code objects unmarked, so the next stack showing them reads them.
 * LRU: 65536 code objects is far more than a training job runs; an evicted one is read again. */
BPF_TABLE("lru_hash", struct code_key, u64, seen_code, 65536);

/* New code objects of the stack just captured, read by py_read_codes (tail call) on the same CPU; one per
 * SCRATCH_SLOTS slot (common.h), the capture's context. */
struct code_pending {
    u32 pid;
    u32 tid;  /* whose queue: a uprobe's chain that was preempted finds another thread's there, and leaves it */
    u32 n;    /* queued */
    u32 done; /* read so far */
    u64 codes[CODE_PENDING_MAX];
};
BPF_PERCPU_ARRAY(code_pending, struct code_pending, SCRATCH_SLOTS);

/* What tells two code objects at one address apart: its file name object and first line. A code object dies and
 * its address is reused (the "<string>" code site.py execs for a .pth line, then the main script's functions):
 * with stacks captured from the first instruction on (off CPU, samples), a frame would otherwise keep the name
 * of the dead object read at that address. Never 0. fingerprint_of: from the two as read_code read them. */
static __always_inline u64 fingerprint_of(u64 filename, s32 first)
{
    return (filename ^ ((u64)(u32)first << 48)) | 1;
}

static __always_inline u64 code_fingerprint(struct py_cfg *cfg, u64 code)
{
    u64 fn = 0;
    s32 first = 0;
    read_user(&fn, sizeof(fn), (void *)(code + cfg->co_filename));
    read_user(&first, sizeof(first), (void *)(code + cfg->co_firstlineno));
    return fingerprint_of(fn, first);
}

/* Queue the stack's code objects this process has not sent before (up to CODE_PENDING_MAX; a recursion's frames
 * once); return how many. The count lives in the map value, not in a register: a register count makes the
 * verifier track every (frame, count) pair and exceed its complexity limit. */
static __always_inline u32 queue_new_codes(struct stack_event *se, u32 tgid, u32 tid, u32 slot)
{
    struct code_pending *p = code_pending.lookup(&slot);
    if (!p)
        return 0;
    p->pid = tgid;
    p->tid = tid;
    p->n = 0;
    p->done = 0;
    struct py_cfg *cfg = pycfg.lookup(&tgid);
    if (!cfg)
        return 0;
    u32 *g = exec_gen.lookup(&tgid);
    u32 gen = g ? *g : 0;
    u64 last = 0;
    for (int i = 0; i < MAX_PY_FRAMES; i++) {
        if (i >= se->n_py)
            break;
        struct code_key k = {.pid = tgid, .gen = gen, .code = se->frames[i].code};
        if (!k.code || k.code == last)
            continue;
        u64 fp = code_fingerprint(cfg, k.code);
        u64 *seen = seen_code.lookup(&k);
        if (seen && *seen == fp)
            continue;
        u32 n = p->n;
        if (n >= CODE_PENDING_MAX)
            break;
        p->codes[n & (CODE_PENDING_MAX - 1)] = k.code;
        p->n = n + 1;
        last = k.code;
    }
    return se->tid == tid ? p->n : 0; /* else preempted by another thread's capture: its frames, not ours */
}

/* Copy a str object's characters into out (NUL-terminated); 0 on success. Only compact ASCII is read here;
 * other strings are left to user space (CODE_F_*_UNREAD). */
static __always_inline int read_pystr(char *out, u32 size, u64 str, struct py_cfg *cfg)
{
    u32 state = 0;
    if (!str || read_user(&state, sizeof(state), (void *)(str + 32)))
        return -1;
    if (!((state >> 5) & 1) || !((state >> 6) & 1)) /* compact, ascii */
        return -1;
    return read_user_str(out, size, (void *)(str + cfg->str_data)) > 0 ? 0 : -1;
}

/* The code event being read: one per CPU and SCRATCH_SLOTS slot, sent with only the bytes of its line table that
 * were read. */
BPF_PERCPU_ARRAY(code_scratch, struct code_event, SCRATCH_SLOTS);

static __always_inline void read_code(struct py_cfg *cfg, u32 tgid, u64 code, u32 slot)
{
    struct code_event *e = code_scratch.lookup(&slot);
    if (!e)
        return;
    e->code = code;
    e->pid = tgid;
    e->flags = 0;
    e->firstlineno = 0;
    e->lt_len = 0;
    e->lt_full = 0;
    e->qualname[0] = 0;
    e->filename[0] = 0;
    u64 fn = 0, qn = 0, lt = 0;
    read_user(&fn, sizeof(fn), (void *)(code + cfg->co_filename));
    read_user(&qn, sizeof(qn), (void *)(code + cfg->co_name));
    read_user(&lt, sizeof(lt), (void *)(code + cfg->co_linetable));
    read_user(&e->firstlineno, sizeof(e->firstlineno), (void *)(code + cfg->co_firstlineno));
    if (read_pystr(e->qualname, CODE_NAME_MAX, qn, cfg))
        e->flags |= CODE_F_NAME_UNREAD;
    if (read_pystr(e->filename, CODE_FILE_MAX, fn, cfg))
        e->flags |= CODE_F_FILE_UNREAD;
    s64 len = 0; /* PyBytesObject: ob_size at 16, ob_sval at 32, in every supported version */
    u32 n = 0;
    if (!lt || read_user(&len, sizeof(len), (void *)(lt + 16)) || len < 0) {
        e->flags |= CODE_F_LT_UNREAD;
    } else {
        n = len < CODE_LT_MAX ? (u32)len : CODE_LT_MAX - 1;
        n &= CODE_LT_MAX - 1;
        e->lt_full = (u32)len;
        if (n && read_user(e->linetable, n, (void *)(lt + 32))) {
            e->flags |= CODE_F_LT_UNREAD;
            n = 0;
        }
        e->lt_len = n;
    }
    /* Only the table's bytes are sent (a record of CODE_EVENT_HEAD + lt_len; user space pads it): a table is tens
     * to hundreds of bytes, so the ring holds ~5x the code objects it would at the full 4.5 KiB. A fork's child
     * shows its new code objects once, at its first stacks: one lost to a full ring is never read again there
     * (suite runs: a forked child's frames <unresolved> after two interpreters started in one drain). */
    if (e->code != code || e->pid != tgid)
        return; /* a preempting capture on this CPU read into this slot meanwhile: read at the next stack instead */
    u32 size = CODE_EVENT_HEAD + (n & (CODE_LT_MAX - 1));
    if (codes_rb.ringbuf_output(e, size, codes_wakeup(size))) {
        count_lost(LOST_CODES); /* unmarked: read at the next stack that shows it */
        return;
    }
    u32 *g = exec_gen.lookup(&tgid);
    struct code_key k = {.pid = tgid, .gen = g ? *g : 0, .code = code};
    u64 fp = fingerprint_of(fn, e->firstlineno);
    seen_code.update(&k, &fp);
}

/* Read CODE_READS_PER_CALL of the queued code objects of `slot` (the caller's context: SCRATCH_SLOTS); return 1
 * when more are left for another run. */
static __always_inline int read_queued_codes(u32 slot)
{
    struct code_pending *p = code_pending.lookup(&slot);
    if (!p)
        return 0;
    if (p->tid != (u32)bpf_get_current_pid_tgid())
        return 0; /* preempted since the capture, and another thread's capture queued here: its chain reads it */
    u32 tgid = p->pid;
    struct py_cfg *cfg = pycfg.lookup(&tgid);
    if (!cfg) {
        p->n = 0;
        return 0;
    }
    for (int i = 0; i < CODE_READS_PER_CALL; i++) {
        u32 k = p->done;
        if (k >= p->n)
            break;
        /* the mask is the verifier's bound: with a `k < CODE_PENDING_MAX` test instead, clang drops the mask and
         * indexes with a register the verifier does not know is bounded */
        read_code(cfg, tgid, p->codes[k & (CODE_PENDING_MAX - 1)], slot);
        p->done = k + 1;
    }
    if (p->done < p->n)
        return 1;
    p->n = 0;
    return 0;
}

/* Tail-called (stage STAGE_CODES of cuda.bpf.c) after a stack in which queue_new_codes found new code objects:
 * reads CODE_READS_PER_CALL of them, then tail-calls itself for the rest (a chain of at most 8 for a 64-frame
 * stack; the kernel allows 33), so the verifier sees a short loop. A tail call only reaches a program of its own
 * type: offcpu.bpf.c and profile.bpf.c have copies of this for tracepoints and perf events. */
int py_read_codes(struct pt_regs *ctx)
{
    if (read_queued_codes(STACK_AT_CALL))
        stage_prog.call(ctx, STAGE_CODES);
    return 0;
}

#endif /* CHT_PYCODE_H */
