/* Files the traced tree maps and the CUDA libraries it opens, for symbolisation and for attaching in time.
 *
 * syscalls:sys_enter_mmap / sys_exit_mmap: every executable file mapping of a target (ld.so mapping a library's
 *   text) goes to user space as a map_event with the file's (dev, ino) and dentry names, so addresses resolve to
 *   (file, offset) from the event alone, after the process is gone. A mapping of a CUDA runtime the tracer knows
 *   (attached_files value FILE_RUNTIME) becomes the process's rt_ranges entry here, in kernel.
 * emit_exe_map() (called at exec by lifecycle.bpf.c): the same for the executable, whose text the kernel maps.
 * A CPython interpreter (an executable or a libpython) gets its frame walker configured right there, in kernel,
 *   from the layout user space registered for that file (pyframes.h py_binaries): a short script's first CUDA
 *   call, tens of ms after exec, already has its Python stack. An interpreter not registered yet holds the
 *   process once, while user space analyses it (MAPF_HELD_PYTHON).
 * syscalls:sys_exit_openat: a target that opens a file named libcud* or libnccl.* the tracer has not attached to
 *   (not in attached_files) is stopped (SIGSTOP, maps.h hold_current) before it returns to user space, and the
 *   file goes to user space, which attaches and continues it: no call is missed between the load and the attach.
 *   Files attached in advance (the recorder attaches every candidate it finds at start) never stop anyone.
 *   Node agent (CFG_ALL_CUDA, `tracer record` with no target): a process not traced yet that opens one joins
 *   `targets` there and is held once, attached file or not, so user space registers it before it runs on.
 */
#include "common.h"
#include "maps.h"
#include "files.h"

/* The text offset of a registered libpython (0 if the file is not one), for python_mapped's bias. */
static __always_inline u64 py_text_offset(struct file_key *k)
{
#ifdef WITH_PYFRAMES
    struct py_bin *b = py_binaries.lookup(k);
    return b ? b->text_offset : 0;
#else
    return 0;
#endif
}

#ifndef MAPS_RB_PAGES
/* 2 MiB = ~3,200 map_events between two drains: a process maps tens of executable files, torch ~200; a job that
 * starts 1,000 short commands a second maps ~3,000 (ld.so, libc, the program): 512 KiB lost a third of them. */
#define MAPS_RB_PAGES 512
#endif
#define PROT_EXEC_FLAG 4
#define MAP_ANON_FLAG 0x20

BPF_RINGBUF_OUTPUT(maps_rb, MAPS_RB_PAGES);

/* key: (ino, dev) of a CUDA library file the probes are attached to; value: FILE_ATTACHED, or FILE_RUNTIME for a
 * libcudart (its text span locates runtime launches). 1024 files. Written by user space. */
BPF_HASH(attached_files, struct file_key, u8, 1024);

struct mmap_args {
    u64 len;
    u64 pgoff;
    s64 fd;
};
/* key: tid; value: an executable file mmap in progress, between sys_enter and sys_exit. 4096 threads at once. */
BPF_HASH(mmap_pending, u32, struct mmap_args, 4096);

static __always_inline void emit_file_map(u64 file, u32 tgid, u16 kind, u64 start, u64 len, u64 pgoff, u32 mflags,
                                          u64 flags)
{
    struct map_event *e = maps_rb.ringbuf_reserve(sizeof(struct map_event));
    if (!e) {
        count_lost(LOST_MAPS);
        return;
    }
    e->start = start;
    e->len = len;
    e->pgoff = pgoff;
    e->pid = tgid;
    e->kind = kind;
    e->flags = mflags;
    e->ino = 0;
    e->dev = 0;
    file_id(file, &e->dev, &e->ino);
    file_names(file, e);
    maps_rb.ringbuf_submit(e, flags);
}

/* 1 if the file's own name starts with the prefix (at most 9 bytes, e.g. "libpython"). */
static __always_inline int name_starts(u64 file, const char *prefix, int n)
{
    u64 dentry = kread_ptr(file + OFF_FILE_PATH + OFF_PATH_DENTRY);
    u64 name = kread_ptr(dentry + OFF_DENTRY_NAME + OFF_QSTR_NAME);
    char head[16] = {};
    bpf_probe_read_kernel(head, sizeof(head), (void *)name);
    for (int i = 0; i < 9; i++)
        if (i < n && head[i] != prefix[i])
            return 0;
    return 1;
}

/* A CPython binary mapped by a target: configure its frame walker from the binary's layout (pyframes.h
 * py_binaries) at the address it is loaded at; an interpreter never analysed holds the process until user space
 * has (MAPF_HELD_PYTHON). Returns the map_event flags. */
static __always_inline u32 python_mapped(u64 file, u32 tgid, struct file_key *k, u64 vaddr_base_bias, int is_lib)
{
#ifdef WITH_PYFRAMES
    struct py_bin *b = py_binaries.lookup(k);
    if (b) {
        if (b->is_lib == is_lib)
            pycfg_from_binary(tgid, b, vaddr_base_bias - b->text_vaddr);
        return 0;
    }
    if (cfg_get(CFG_LIBGATE) && (is_lib ? name_starts(file, "libpython", 9) : name_starts(file, "python", 6))) {
        hold_current(tgid);
        return MAPF_HELD_PYTHON;
    }
#endif
    return 0;
}

/* The executable's text, at exec (the kernel mapped it; there is no mmap to see). */
static __always_inline void emit_exe_map(u32 tgid)
{
    u64 task = bpf_get_current_task();
    u64 mm = kread_ptr(task + OFF_TASK_MM);
    u64 exe = kread_ptr(mm + OFF_MM_EXE_FILE);
    u64 start = kread_ptr(mm + OFF_MM_START_CODE), end = kread_ptr(mm + OFF_MM_END_CODE);
    if (!exe || end <= start)
        return;
    struct file_key k = {};
    u32 mflags = 0;
    if (!file_id(exe, &k.dev, &k.ino))
        mflags = python_mapped(exe, tgid, &k, start, 0); /* start_code = bias + the text segment's vaddr */
    emit_file_map(exe, tgid, MAP_EXE, start, end - start, 0, mflags,
                  mflags ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!(args->prot & PROT_EXEC_FLAG) || (args->flags & MAP_ANON_FLAG) || (s64)args->fd < 0 || !is_target(tgid))
        return 0;
    struct mmap_args a = {.len = args->len, .pgoff = args->off, .fd = (s64)args->fd};
    mmap_pending.update(&tid, &a);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_mmap)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    struct mmap_args *a = mmap_pending.lookup(&tid);
    if (!a)
        return 0;
    u64 ret = (u64)args->ret;
    if ((s64)ret > 0 && (ret & 0xfff) == 0) {
        u64 file = fd_file((int)a->fd);
        if (file) {
            struct file_key k = {};
            u32 mflags = 0;
            if (!file_id(file, &k.dev, &k.ino)) {
                u8 *known = attached_files.lookup(&k);
                if (known && *known == FILE_RUNTIME) {
                    struct lib_range r = {.lo = ret, .hi = ret + a->len};
                    rt_ranges.update(&tgid, &r);
                }
                /* the text mapped at `ret` holds file offset pgoff: that is vaddr (text_vaddr - text_offset +
                 * pgoff) at link time, so the bias is ret minus that; python_mapped wants bias + text_vaddr */
                mflags = python_mapped(file, tgid, &k, ret - a->pgoff + py_text_offset(&k), 1);
            }
            emit_file_map(file, tgid, MAP_MMAP, ret, a->len, a->pgoff, mflags,
                          mflags ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
        }
    }
    mmap_pending.delete(&tid);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    long fd = args->ret;
    if (fd < 0)
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!cfg_get(CFG_LIBGATE))
        return 0;
    /* node agent: a process outside the traced set that opens a CUDA library joins it here (MAPF_NEW_TARGET) */
    int joins = !is_target(tgid);
    if (joins && (!cfg_get(CFG_ALL_CUDA) || is_tracer(tgid)))
        return 0;
    u64 file = fd_file((int)fd);
    if (!file)
        return 0;
    /* the opened file's own name (a symlink resolved): "libcud" starts libcudart* and libcuda*; "libnccl."
     * libnccl.so* (NCCL, whose collectives are probed too), and not NCCL's plugins (libnccl-net.so, ...) */
    u64 dentry = kread_ptr(file + OFF_FILE_PATH + OFF_PATH_DENTRY);
    u64 name = kread_ptr(dentry + OFF_DENTRY_NAME + OFF_QSTR_NAME);
    char head[8] = {};
    bpf_probe_read_kernel(head, 8, (void *)name);
    if (head[0] != 'l' || head[1] != 'i' || head[2] != 'b')
        return 0;
    int cud = head[3] == 'c' && head[4] == 'u' && head[5] == 'd';
    int nccl = head[3] == 'n' && head[4] == 'c' && head[5] == 'c' && head[6] == 'l' && head[7] == '.';
    if (!cud && !nccl)
        return 0;
    struct file_key k = {};
    if (file_id(file, &k.dev, &k.ino) || (!joins && attached_files.lookup(&k)))
        return 0;
    if (joins) {
        /* traced from this open on (its children too: task_newtask); held until user space has its maps, Python
         * layout and placement, which a process that was not a target at exec never sent */
        u8 one = 1;
        targets.update(&tgid, &one);
    }
    hold_current(tgid);
    emit_file_map(file, tgid, MAP_LIB_OPEN, 0, 0, 0, joins ? MAPF_NEW_TARGET : 0, BPF_RB_FORCE_WAKEUP);
    return 0;
}
