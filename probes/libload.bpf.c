/* CUDA libraries opened by a target after attach (PyTorch loads libcudart lazily, libcuda at CUDA init).
 *
 * syscalls:sys_enter_openat / sys_exit_openat: when a target thread successfully opens a file whose base name
 * starts with "libcud", the process is stopped with SIGSTOP before it returns to user space, and the path is
 * sent to user space, which attaches the uprobes and sends SIGCONT. So no call is missed between the load and the
 * attach; the stop lasts one attach (milliseconds), once per library file per process.
 */
#include "common.h"
#include "maps.h"

#define LIB_PATH_MAX 256
#define SIGSTOP_NR 19

struct lib_open_event {
    u32 pid;
    u32 tid;
    char path[LIB_PATH_MAX];
    u32 is_runtime; /* the name is libcudart*: its first mmap gives the process's rt_ranges entry */
    u32 _pad;
};

BPF_RINGBUF_OUTPUT(libload_rb, 16); /* 64 KiB: library opens are a handful per process */
/* key: tid; value: the path being opened, between sys_enter and sys_exit. 4096: concurrent opens of CUDA
 * libraries by target threads. */
BPF_HASH(lib_opening, u32, struct lib_open_event, 4096);
BPF_PERCPU_ARRAY(lib_scratch, struct lib_open_event, 1);
/* key: tgid; value: fd of a libcudart it just opened, until ld.so maps it. */
BPF_HASH(cudart_fd, u32, u32, 4096);
/* key: tid; value: length of an mmap of that fd in progress. */
BPF_HASH(mmap_pending, u32, u64, 4096);
/* index 0: 1 while the gate is on (user space turns it off with --no-lib-gate). */
BPF_ARRAY(cfg_libgate, u32, 1);

TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    int zero = 0;
    u32 *on = cfg_libgate.lookup(&zero);
    if (!on || !*on || !is_target(tgid))
        return 0;
    struct lib_open_event *e = lib_scratch.lookup(&zero);
    if (!e)
        return 0;
    int n = bpf_probe_read_user_str(e->path, sizeof(e->path), args->filename);
    if (n <= 0)
        return 0;
    /* "libcud" at the start or right after a '/': branch-free per position, so the verifier walks one path */
    u32 hit = 0, rt = 0;
    char *p = e->path;
    u32 x0 = (p[0] ^ 'l') | (p[1] ^ 'i') | (p[2] ^ 'b') | (p[3] ^ 'c') | (p[4] ^ 'u') | (p[5] ^ 'd');
    hit |= x0 == 0;
    rt |= (x0 | (p[6] ^ 'a') | (p[7] ^ 'r') | (p[8] ^ 't')) == 0;
    for (int i = 0; i < LIB_PATH_MAX - 11; i++) {
        u32 x = (p[i] ^ '/') | (p[i + 1] ^ 'l') | (p[i + 2] ^ 'i') | (p[i + 3] ^ 'b') | (p[i + 4] ^ 'c') |
                (p[i + 5] ^ 'u') | (p[i + 6] ^ 'd');
        hit |= x == 0;
        rt |= (x | (p[i + 7] ^ 'a') | (p[i + 8] ^ 'r') | (p[i + 9] ^ 't')) == 0;
    }
    if (!hit)
        return 0;
    e->is_runtime = rt;
    e->pid = tgid;
    e->tid = tid;
    lib_opening.update(&tid, e);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct lib_open_event *e = lib_opening.lookup(&tid);
    if (!e)
        return 0;
    if (args->ret >= 0) {
        if (e->is_runtime) {
            u32 fd = args->ret;
            cudart_fd.update(&e->pid, &fd);
        }
        libload_rb.ringbuf_output(e, sizeof(*e), 0);
        bpf_send_signal(SIGSTOP_NR);
    }
    lib_opening.delete(&tid);
    return 0;
}

/* ld.so's first mmap of a library reserves its whole span; that span becomes the process's rt_ranges entry. */
TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    u32 *fd = cudart_fd.lookup(&tgid);
    if (!fd || (u64)*fd != (u64)args->fd || args->off != 0)
        return 0;
    u64 len = args->len;
    mmap_pending.update(&tid, &len);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_mmap)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    u64 *len = mmap_pending.lookup(&tid);
    if (!len)
        return 0;
    if (args->ret > 0 && (args->ret & 0xfff) == 0) {
        struct lib_range r = {.lo = (u64)args->ret, .hi = (u64)args->ret + *len};
        rt_ranges.update(&tgid, &r);
        cudart_fd.delete(&tgid);
    }
    mmap_pending.delete(&tid);
    return 0;
}
