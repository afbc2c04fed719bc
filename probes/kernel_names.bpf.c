/* Kernel names for driver launch handles.
 *
 * cuLaunchKernel receives an opaque CUfunction (or, since CUDA 12, a CUkernel). The runtime and JITs get those
 * handles from cuModuleGetFunction(CUfunction *out, CUmodule, const char *name) and
 * cuLibraryGetKernel(CUkernel *out, CUlibrary, const char *name): entry keeps (out, name) per thread, return reads
 * the handle and sends (pid, handle, mangled name) to user space, which demangles it. These calls are rare (once
 * per kernel per process), so every one is sent.
 *
 * The runtime does the same for `kernel<<<...>>>` launches: the stub nvcc emits calls __cudaGetKernel(cudaKernel_t
 * *out, const void *stub) once per kernel and launches with the handle it got, which with a driver is opaque.
 * Those probes (cookie KNAME_BY_STUB) send (pid, handle, stub address); user space names the stub's symbol.
 * Attached with uprobe_multi links like the call probes; struct kname_event is in common.h.
 */
#include "common.h"
#include "maps.h"

struct kname_args {
    u64 out;
    u64 arg;  /* the name (KNAME_BY_NAME) or the host stub (KNAME_BY_STUB) */
    u64 kind;
};

static __u64 (*kname_cookie)(void *ctx) = (void *)174; /* BPF_FUNC_get_attach_cookie */

BPF_RINGBUF_OUTPUT(knames_rb, 16); /* 64 KiB = ~300 names between two polls */
/* key: tid; value: the (out, name) arguments of a handle lookup in flight. */
BPF_HASH(kname_inflight, u32, struct kname_args, 4096);
BPF_PERCPU_ARRAY(kname_scratch, struct kname_event, 1);

int kname_entry(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_target(tgid))
        return 0;
    u64 kind = kname_cookie(ctx);
    /* both registers loaded for sure (the barrier keeps clang from turning the choice into a conditional offset
     * into ctx, which the verifier refuses as a "modified ctx pointer") */
    u64 p2 = PT_REGS_PARM2(ctx), p3 = PT_REGS_PARM3(ctx);
    asm volatile("" : "+r"(p2), "+r"(p3));
    struct kname_args a = {.out = PT_REGS_PARM1(ctx), .arg = kind == KNAME_BY_STUB ? p2 : p3, .kind = kind};
    kname_inflight.update(&tid, &a);
    return 0;
}

int kname_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    struct kname_args *a = kname_inflight.lookup(&tid);
    if (!a)
        return 0;
    int zero = 0;
    struct kname_event *e = kname_scratch.lookup(&zero);
    if (e && PT_REGS_RC(ctx) == 0) {
        e->pid = tgid;
        e->handle = 0;
        e->stub = 0;
        e->name[0] = 0;
        read_user(&e->handle, sizeof(e->handle), (void *)a->out);
        if (a->kind == KNAME_BY_STUB)
            e->stub = a->arg;
        else
            read_user_str(e->name, sizeof(e->name), (void *)a->arg);
        knames_rb.ringbuf_output(e, sizeof(*e), BPF_RB_NO_WAKEUP);
    }
    kname_inflight.delete(&tid);
    return 0;
}
