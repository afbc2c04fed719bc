/* Python call stacks walked in BPF: the current thread's CPython frames as (code object, instruction index).
 *
 * Include after common.h. Needs -DFSBASE_OFF=<offsetof(task_struct, thread.fsbase)> from the running kernel's
 * BTF (tracer/recorder/pyruntime.py cflags(); the installed headers are not the running kernel's, so never use
 * task->thread.fsbase directly). User space (tracer/recorder/pyruntime.py PyRuntimeManager) writes one `pycfg` entry
 * per traced process; the host probe calls pycfg_on_fork/exit/exec to keep them in step with the process tree.
 *
 * The walk, per hit:
 *   1. cfg = pycfg[tgid]                        (PYS_NO_CONFIG if absent)
 *   2. tls = task->thread.fsbase                 (bpf_probe_read_kernel at FSBASE_OFF)
 *   3. key = *(int *)tss_key_addr                (PyGILState TSS key; valid while the GIL is released, unlike the
 *      tstate = pthread_getspecific(key)          "current thread state" globals, which torch/ctypes clear)
 *   4. frame = tstate->frame (3.10) | tstate->cframe->current_frame (3.11, 3.12) | tstate->current_frame (3.13+)
 *   5. up to MAX_PY_FRAMES frames, one bpf_probe_read_user each: slot i = {code, lasti}, code = 0 for C-stack shim
 *      frames (3.12+), which user space skips. Slot i is written unconditionally: a conditional index made the
 *      verifier's state count explode in the prototype.
 * Names, files and lines are decoded in user space from the code object, which pycode.h reads in BPF the first
 * time a process shows it.
 *
 * Paste this file into the program text (tracer/recorder/program.py inlines includes): bcc rewrites map methods such as
 * pycfg.lookup() only in the main text, and an #included copy fails to load with "unknown opcode 8d".
 */
#ifndef CHT_PYFRAMES_H
#define CHT_PYFRAMES_H

#ifndef FSBASE_OFF
#error "pyframes.h needs -DFSBASE_OFF (tracer.recorder.pyruntime.cflags())"
#endif
#if MAX_PY_FRAMES & (MAX_PY_FRAMES - 1)
#error "MAX_PY_FRAMES must be a power of two (slot index masking for the verifier)"
#endif
#ifndef PYCFG_MAX_PROCS
#define PYCFG_MAX_PROCS 4096
#endif

/* py_cfg.flags */
#define PYCFG_F_LASTI_INT 1  /* 3.10: frame->f_lasti is an int in code units, not an instruction pointer */
#define PYCFG_F_CFRAME 2     /* 3.11, 3.12: tstate->cframe->current_frame */
#define PYCFG_F_TAGGED 4     /* 3.14+: f_executable is a _PyStackRef, clear the low tag bits */

#define PY_FRAME_READ 128    /* bytes of frame struct fetched per frame; cfg->frame_read <= this */

/* Per-interpreter layout, written by tracer/recorder/pyruntime.py (ctypes mirror: PyCfg). 56 bytes. */
struct py_cfg {
    u64 tss_key_addr;    /* address of the Py_tss_t {int _is_initialized; int _key} holding the GILState key */
    u64 runtime_addr;    /* &_PyRuntime, for diagnostics and a future thread-list fallback */
    u16 version;         /* major << 8 | minor */
    u16 flags;           /* PYCFG_F_* */
    u16 ts_frame;        /* PyThreadState -> frame / cframe / current_frame */
    u16 cframe_current;  /* _PyCFrame.current_frame (PYCFG_F_CFRAME only) */
    u16 f_previous;      /* frame -> previous frame (f_back on 3.10) */
    u16 f_code;          /* frame -> code object (f_code / f_executable) */
    u16 f_instr;         /* frame -> prev_instr / instr_ptr (pointer), or f_lasti (int, PYCFG_F_LASTI_INT) */
    u16 f_owner;         /* frame -> owner byte; 0xffff if none (3.10, 3.11 have no shim frames) */
    u16 co_adaptive;     /* offsetof(PyCodeObject, co_code_adaptive): lasti = (ip - code - this) / 2 */
    u16 frame_read;      /* bytes to read per frame, <= PY_FRAME_READ, covers every offset above */
    u16 pthread_spec1;   /* offsetof(struct pthread, specific_1stblock) (glibc x86_64: 0x310) */
    u16 pthread_spec2;   /* offsetof(struct pthread, specific) (glibc x86_64: 0x510), keys >= 32 */
    u16 co_filename;     /* PyCodeObject -> co_filename (str) */
    u16 co_name;         /* -> co_qualname (3.11+) or co_name (3.10) */
    u16 co_firstlineno;  /* -> co_firstlineno (int) */
    u16 co_linetable;    /* -> co_linetable (bytes) */
    u16 str_data;        /* offset of a compact ASCII str's characters: sizeof(PyASCIIObject), 48 <= 3.11, 40 after */
    u8 owner_skip;       /* skip frames whose owner >= this (3 on 3.12-3.14: CSTACK/INTERPRETER shims); 255 none */
    u8 _pad[5];
};

/* key: tgid; value: that process's interpreter layout; PYCFG_MAX_PROCS: one per traced Python process (workers
 * included). Written by user space on attach/exec, copied by pycfg_on_fork, deleted on exit and exec. */
BPF_HASH(pycfg, u32, struct py_cfg, PYCFG_MAX_PROCS);
/* key: tgid; value: how many times it exec'd while traced. Part of the key of the code objects a process has
 * shown (pycode.h seen_code), so that an image's code objects are read again after an exec: the launched command
 * is a copy of the recorder until it execs, and its new image reuses the old one's addresses (a frame then read
 * as the recorder's "<string> <module>"). PYCFG_MAX_PROCS: one per traced Python process. */
BPF_HASH(exec_gen, u32, u32, PYCFG_MAX_PROCS);

/* The TSS lookup, glibc x86_64 (2.27-2.38): pthread_getspecific(key) reads
 * key < 32:  ((struct pthread *)fs)->specific_1stblock[key].data              = fs + spec1 + key*16 + 8
 * else:      ((struct pthread *)fs)->specific[key / 32][key % 32].data        = *(fs + spec2 + key/32*8) + ... */
static __always_inline u64 py_tstate(struct py_cfg *cfg)
{
    struct task_struct *task = (struct task_struct *)bpf_get_current_task();
    u64 fs = 0;
    if (bpf_probe_read_kernel(&fs, sizeof(fs), (void *)((char *)task + FSBASE_OFF)) || !fs)
        return 0;
    u32 tss[2] = {0, 0}; /* Py_tss_t: _is_initialized, _key */
    if (read_user(tss, sizeof(tss), (void *)cfg->tss_key_addr) || !tss[0])
        return 0;
    u32 key = tss[1];
    u64 slot;
    if (key < 32) {
        slot = fs + cfg->pthread_spec1 + (u64)key * 16 + 8;
    } else {
        if (key >= 1024) /* PTHREAD_KEYS_MAX */
            return 0;
        u64 block = 0;
        if (read_user(&block, sizeof(block), (void *)(fs + cfg->pthread_spec2 + (u64)(key / 32) * 8)) ||
            !block)
            return 0;
        slot = block + (u64)(key % 32) * 16 + 8;
    }
    u64 tstate = 0;
    if (read_user(&tstate, sizeof(tstate), (void *)slot))
        return 0;
    return tstate;
}

/* Fill se->frames[0..n) innermost first, set se->n_py and se->py_status; return the frames' hash, folded into
 * *hash (code objects and instruction indices: two stacks that differ in a line differ in hash). tgid = process
 * id. Slots whose code is 0 are shim frames: skip them when decoding. */
static __always_inline int walk_python(struct stack_event *se, u32 tgid, u64 *hash)
{
    u64 h = *hash;
    se->n_py = 0;
    struct py_cfg *cfg = pycfg.lookup(&tgid);
    if (!cfg) {
        se->py_status = PYS_NO_CONFIG;
        return 0;
    }
    u64 tstate = py_tstate(cfg);
    if (!tstate) {
        se->py_status = PYS_NO_TSTATE;
        return 0;
    }
    u64 frame = 0;
    if (read_user(&frame, sizeof(frame), (void *)(tstate + cfg->ts_frame))) {
        se->py_status = PYS_READ_FAIL;
        return 0;
    }
    if ((cfg->flags & PYCFG_F_CFRAME) && frame) {
        u64 cframe = frame;
        frame = 0;
        if (read_user(&frame, sizeof(frame), (void *)(cframe + cfg->cframe_current))) {
            se->py_status = PYS_READ_FAIL;
            return 0;
        }
    }
    u32 o_prev = cfg->f_previous & 0x78, o_code = cfg->f_code & 0x78, o_instr = cfg->f_instr & 0x78;
    u32 o_owner = cfg->f_owner & 0x7f;
    u32 has_owner = cfg->f_owner != 0xffff;
    u32 is_int = cfg->flags & PYCFG_F_LASTI_INT;
    u64 code_mask = (cfg->flags & PYCFG_F_TAGGED) ? ~3ULL : ~0ULL;
    u64 cadapt = cfg->co_adaptive;
    u8 owner_skip = cfg->owner_skip;
    u32 rd = cfg->frame_read;
    if (rd > PY_FRAME_READ)
        rd = PY_FRAME_READ;
    u8 buf[PY_FRAME_READ];
    u16 status = PYS_OK;
    int i;
    for (i = 0; i < MAX_PY_FRAMES; i++) {
        if (!frame)
            break;
        if (read_user(buf, rd, (void *)frame)) {
            status = PYS_READ_FAIL;
            break;
        }
        u64 code = *(u64 *)(buf + o_code) & code_mask;
        u64 ip = *(u64 *)(buf + o_instr);
        u32 lasti;
        if (is_int)
            lasti = *(u32 *)(buf + (o_instr & 0x7c));
        else
            lasti = (u32)((ip - code - cadapt) >> 1);
        if (has_owner && buf[o_owner] >= owner_skip)
            code = 0;
        struct py_frame *pf = &se->frames[i & (MAX_PY_FRAMES - 1)];
        pf->code = code;
        pf->lasti = lasti;
        pf->_pad = 0;
        h = (h ^ code ^ ((u64)lasti << 40)) * 0x100000001b3ULL;
        frame = *(u64 *)(buf + o_prev);
    }
    if (status == PYS_OK && frame && i >= MAX_PY_FRAMES)
        status = PYS_TRUNCATED;
    se->n_py = i;
    se->py_status = status;
    *hash = h;
    return i;
}

/* A CPython binary's layout, registered by user space for its (dev, ino): its py_cfg with tss_key_addr and
 * runtime_addr at link-time addresses, and its text segment, so that the kernel can configure a process that
 * maps it at exec or mmap time, adding the load bias (libload.bpf.c python_mapped). */
struct py_bin {
    struct py_cfg cfg;
    u64 text_vaddr;  /* p_vaddr of the first executable PT_LOAD */
    u64 text_offset; /* its p_offset */
    u32 is_lib;      /* 1: a shared libpython (configured at the mmap of its text); 0: an executable (at exec);
                      * 2: named like an interpreter but without CPython in it (never held again) */
    u32 _pad;
};
/* key: the binary's file; value: its layout. 256: interpreters on one host. */
BPF_HASH(py_binaries, struct file_key, struct py_bin, 256);

static __always_inline void pycfg_from_binary(u32 tgid, struct py_bin *b, u64 bias)
{
    struct py_cfg c = b->cfg;
    c.tss_key_addr += bias;
    c.runtime_addr += bias;
    pycfg.update(&tgid, &c);
}

/* Fork: the child's address space is a copy, so the parent's layout and addresses hold. Called by the host
 * probe on task_newtask / sched_process_fork for a new process (not a new thread). */
static __always_inline void pycfg_on_fork(u32 parent_tgid, u32 child_tgid)
{
    struct py_cfg *cfg = pycfg.lookup(&parent_tgid);
    if (cfg) {
        struct py_cfg copy = *cfg;
        pycfg.update(&child_tgid, &copy);
    }
}

/* Exit: the pid may be reused by anything. */
static __always_inline void pycfg_on_exit(u32 tgid)
{
    pycfg.delete(&tgid);
    exec_gen.delete(&tgid);
}

/* Exec: new image, new layout (or no Python); user space recomputes it. */
static __always_inline void pycfg_on_exec(u32 tgid)
{
    pycfg.delete(&tgid);
    u32 *g = exec_gen.lookup(&tgid);
    u32 next = g ? *g + 1 : 1;
    exec_gen.update(&tgid, &next);
}

#endif /* CHT_PYFRAMES_H */
