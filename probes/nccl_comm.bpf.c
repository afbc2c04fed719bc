/* NCCL communicators: which rank of which communicator each process is, from the call that makes it one.
 *
 * ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) and ncclCommInitRankConfig(...,
 * rank, config): entry keeps (comm, nranks, rank, the unique id's hash) per thread, return reads the handle the
 * call wrote to *comm and sends one comm_event (common.h). On x86-64 the 128-byte ncclUniqueId is passed by value
 * in memory: at the entry uprobe (the first instruction) it lies just above the return address, at sp + 8, and
 * takes no register, so rank is the third integer argument. The call is timed as an op too (the catalog's
 * ncclCommInitRank); these probes only name the communicator. Rare (once per communicator per rank): every call
 * is sent, failed ones too (ret), as a rank that could not join is worth seeing.
 */
#include "common.h"
#include "maps.h"

struct comm_args {
    u64 ts_ns;
    u64 out;
    u64 id_hash;
    s32 nranks;
    s32 rank;
};

BPF_RINGBUF_OUTPUT(comms_rb, 4); /* 16 KiB = ~340 events between two polls; a job makes a few per rank */
/* key: tid; value: the arguments of a communicator set-up in flight. 1024: threads inside one at once. */
BPF_HASH(comm_inflight, u32, struct comm_args, 1024);

/* FNV-1a, 64-bit, over the id's 128 bytes read as 16 little-endian words: a bounded loop the verifier unrolls. */
static __always_inline u64 unique_id_hash(const u64 *w)
{
    u64 h = 0xcbf29ce484222325ULL;
#pragma unroll
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES / 8; i++) {
        h ^= w[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

int comm_entry(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_target(tgid))
        return 0;
    u64 words[NCCL_UNIQUE_ID_BYTES / 8] = {};
    read_user(words, sizeof(words), (void *)(PT_REGS_SP(ctx) + 8));
    struct comm_args a = {
        .ts_ns = bpf_ktime_get_ns(),
        .out = PT_REGS_PARM1(ctx),
        .id_hash = unique_id_hash(words),
        .nranks = (s32)PT_REGS_PARM2(ctx),
        .rank = (s32)PT_REGS_PARM3(ctx),
    };
    comm_inflight.update(&tid, &a);
    return 0;
}

int comm_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    struct comm_args *a = comm_inflight.lookup(&tid);
    if (!a)
        return 0;
    struct comm_event e = {
        .ts_ns = a->ts_ns,
        .dur_ns = bpf_ktime_get_ns() - a->ts_ns,
        .id_hash = a->id_hash,
        .pid = tgid,
        .tid = tid,
        .nranks = a->nranks,
        .rank = a->rank,
        .ret = (s32)PT_REGS_RC(ctx),
    };
    read_user(&e.comm, sizeof(e.comm), (void *)a->out);
    comms_rb.ringbuf_output(&e, sizeof(e), 0);
    comm_inflight.delete(&tid);
    return 0;
}
