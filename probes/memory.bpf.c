/* Memory pressure, host-wide and per target thread.
 *
 * kmem:mm_page_alloc: pages allocated (host-wide counter, and per target thread in its breakdown row).
 * filemap:mm_filemap_add_to_page_cache: of those, the page cache a target thread filled (writes, reads).
 * exceptions:page_fault_user: user page faults of target threads. The kernel has no fault-exit tracepoint, so
 *   faults are counted, not timed; their CPU time is inside the thread's on-CPU parts.
 * vmscan:mm_vmscan_direct_reclaim_begin/end: time a target thread spent reclaiming memory itself (TB_RECLAIM).
 */
#include "common.h"
#include "maps.h"
#include "accounting.h"

#ifndef PAGE_BYTES
#define PAGE_BYTES 4096
#endif

TRACEPOINT_PROBE(kmem, mm_page_alloc)
{
    u64 bytes = (u64)PAGE_BYTES << args->order;
    host_count(HC_PAGE_ALLOC, bytes);
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_target(tgid))
        return 0;
    host_count(HC_TARGET_PAGE_ALLOC, bytes);
    tb_add((u32)id, tgid, bpf_ktime_get_ns(), TB_PAGE_ALLOC, bytes);
    return 0;
}

/* A page (folio) added to the page cache in the thread's context: a write() into a file, or a read's readahead.
 * Those allocations are the file's, not fresh memory of the job: memory_pressure leaves them out of a fault
 * storm (a checkpoint's write is blocking I/O, not a fault storm). */
TRACEPOINT_PROBE(filemap, mm_filemap_add_to_page_cache)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_target(tgid))
        return 0;
    tb_add((u32)id, tgid, bpf_ktime_get_ns(), TB_PAGE_CACHE, (u64)PAGE_BYTES << args->order);
    return 0;
}

TRACEPOINT_PROBE(exceptions, page_fault_user)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_target(tgid))
        return 0;
    host_count(HC_TARGET_FAULTS, 1);
    tb_add((u32)id, tgid, bpf_ktime_get_ns(), TB_FAULTS, 1);
    return 0;
}

TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_begin)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_target(tgid))
        return 0;
    u64 now = bpf_ktime_get_ns();
    struct tstate *st = tstate_of(tid, tgid, now);
    if (st)
        st->reclaim_ts = now;
    return 0;
}

TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_end)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct tstate *st = tstate.lookup(&tid);
    if (!st || !st->reclaim_ts)
        return 0;
    tb_span(tid, st->tgid, TB_RECLAIM, st->reclaim_ts, bpf_ktime_get_ns());
    st->reclaim_ts = 0;
    return 0;
}
