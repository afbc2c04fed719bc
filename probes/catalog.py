"""The one table of every probed CUDA function.

Each :class:`ProbeSpec` names a library, the symbol (and the versioned variants a real library exports), the op
name stored in the DB, the API layer, and which argument carries bytes, memcpy kind, stream, or the launch function
pointer. The libraries: the CUDA runtime (``cudart``), the driver (``cuda``) and NCCL (``nccl``, ``libnccl.so.2``:
the collectives a data-parallel job's ranks wait on each other in).

``op_id`` is the position in :data:`CATALOG`; it is what crosses the ring buffer (``OP_COUNT`` in
``common.h`` must be at least ``len(CATALOG)``).

Argument indices follow the C signature as the ABI passes it: on x86-64 a ``dim3`` (12 bytes) takes two integer
registers, so ``cudaLaunchKernel``'s ``stream`` is the 8th machine argument (index 7) and lives on the stack.
``probes/common.h`` reads arguments past the 6th from the stack, behind ``PT_REGS`` macros, so arm64 (8 register
arguments) is a build away.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum


class Layer(IntEnum):
    RUNTIME = 0
    DRIVER = 1


class OpClass(IntEnum):
    """What an op does; drives sampling (launches are hot, the rest are rare and diagnostic), the analyses and the
    parts of a thread's time breakdown. This is the only op taxonomy: analyses ask the catalog, never the name."""

    LAUNCH = 0
    SYNC = 1
    ALLOC = 2
    FREE = 3
    COPY = 4
    OTHER = 5
    # An NCCL collective or point-to-point call (ncclAllReduce, ncclSend, the group calls): it enqueues the
    # collective's kernel on a stream and returns; the wait for the other ranks happens on the GPU and shows in
    # the host's next synchronize. Appended: the values above are stored (thread_breakdown's call parts) and
    # cross the ring buffer. Not a breakdown part of its own: its time goes to LAUNCH (ProbeSpec.part).
    COLLECTIVE = 6


class MemcpyKind(IntEnum):
    """cudaMemcpyKind values, also used for the driver's fixed-direction copies."""

    HOST_TO_HOST = 0
    HOST_TO_DEVICE = 1
    DEVICE_TO_HOST = 2
    DEVICE_TO_DEVICE = 3
    DEFAULT = 4


MEMCPY_KIND_NAMES = {0: "HtoH", 1: "HtoD", 2: "DtoH", 3: "DtoD", 4: "default"}

NO_ARG = -1


# ncclDataType_t (nccl.h) -> bytes per element. The BPF side (probes/cuda.bpf.c nccl_type_size) holds the same
# table and multiplies the count argument by it, so a collective's ``bytes`` is already count x size in the ring
# buffer and in op_stats; tests/test_collectives.py checks the two tables agree. 0: a type this table does not know
# (a newer NCCL), whose calls then record 0 bytes.
NCCL_TYPE_SIZES: dict[int, int] = {
    0: 1,  # ncclInt8 / ncclChar
    1: 1,  # ncclUint8
    2: 4,  # ncclInt32 / ncclInt
    3: 4,  # ncclUint32
    4: 8,  # ncclInt64
    5: 8,  # ncclUint64
    6: 2,  # ncclFloat16 / ncclHalf
    7: 4,  # ncclFloat32 / ncclFloat
    8: 8,  # ncclFloat64 / ncclDouble
    9: 2,  # ncclBfloat16 (2.10+)
    10: 1,  # ncclFloat8e4m3 (2.24+)
    11: 1,  # ncclFloat8e5m2 (2.24+)
}


@dataclass(frozen=True)
class ProbeSpec:
    op: str
    library: str  # "cudart" | "cuda" | "nccl"
    layer: Layer
    op_class: OpClass
    symbols: tuple[str, ...]  # every exported name that implements this op (versioned variants)
    bytes_arg: int = NO_ARG
    kind_arg: int = NO_ARG  # argument holding a cudaMemcpyKind
    fixed_kind: int = NO_ARG  # copy direction implied by the function (cuMemcpyHtoD)
    stream_arg: int = NO_ARG
    stream_deref: int = NO_ARG  # stream read from *(arg + stream_deref) (cuLaunchKernelEx's config)
    func_arg: int = NO_ARG  # launch function pointer / CUfunction
    # An NCCL count's ncclDataType_t: bytes = argument bytes_arg (the element count) x NCCL_TYPE_SIZES[this one],
    # multiplied in BPF at entry (a switch over 12 values), so bytes mean bytes in every table (cuda_calls,
    # op_stats) and no decoder has to know. A register argument (index < 6).
    dtype_arg: int = NO_ARG
    # ncclCommInitRank's rank and communicator size. No column of cuda_calls fits them (bytes and stream mean
    # bytes and streams): probes/nccl_comm.bpf.c reads them from these registers (PARM2, PARM3) with the unique
    # id's hash into nccl_comms, where a process without a rank in its environment (RANK / WORLD_SIZE,
    # tracer/recorder/rankenv.py) gets its rank (tracer.analysis.recording).
    rank_arg: int = NO_ARG
    nranks_arg: int = NO_ARG
    # An NCCL collective's ncclComm_t: every call is counted per (pid, op, communicator) in kernel (cuda.bpf.c
    # coll_counts -> the nccl_progress table), so ranks of one communicator (nccl_comms.id_hash) can be compared
    # call for call: a rank one collective behind the others is the one they wait for.
    comm_arg: int = NO_ARG
    # A driver launch called from inside libcudart is recorded as this runtime op (see maps.h rt_ranges), so the
    # runtime's own launch functions need no probe of their own: one trap per launch.
    runtime_twin: str | None = None
    # A copy that returns only once the device is done with it (cudaMemcpy, cuMemcpyDtoH_v2): the host waits for
    # the GPU, as in an explicit synchronize. The `loss.item()` trap is one of these.
    sync_copy: bool = False

    @property
    def layer_name(self) -> str:
        return "runtime" if self.layer == Layer.RUNTIME else "driver"

    @property
    def duty_cycled(self) -> bool:
        """True for the hot path: kernel launches (10-50 K/s in real training), which the overhead budget may probe
        only part of the time and count by scaling (tracer/recorder/budget.py). Graph launches come once a step, like
        syncs, and are always exact."""
        return self.op_class == OpClass.LAUNCH and self.func_arg != NO_ARG

    @property
    def waits_for_gpu(self) -> bool:
        """True when the calling thread waits for the device: an explicit synchronize or a synchronous copy."""
        return self.op_class == OpClass.SYNC or self.sync_copy

    @property
    def part(self) -> OpClass:
        """The part of a thread's time breakdown this op's time goes to: its class, except that a synchronous copy
        is time spent waiting for the GPU (SYNC), and a collective is LAUNCH.

        A collective call enqueues work on a stream and returns, as a kernel launch does (real NCCL's host side
        is mostly that launch: libnccl launches its kernel through libcuda from inside the call, and the probes
        fold that nested driver launch into the collective's call). The wait for the other ranks is device time,
        and a host that waits for it does so in its next synchronize (SYNC). So the launch part holds it, and
        CALL_PARTS, thread_breakdown's columns and the BPF accounting (TB_CALL + part) keep their six parts."""
        if self.sync_copy:
            return OpClass.SYNC
        if self.op_class == OpClass.COLLECTIVE:
            return OpClass.LAUNCH
        return self.op_class


R, D = Layer.RUNTIME, Layer.DRIVER
C = OpClass


def _nccl(
    op: str, count: int = NO_ARG, dtype: int = NO_ARG, stream: int = NO_ARG, comm: int = NO_ARG, **kw: int
) -> ProbeSpec:
    """An NCCL op: layer RUNTIME (an API the framework calls, above the driver; its nested driver calls fold into
    it as the runtime's do), class COLLECTIVE unless ``op_class`` says otherwise; ``count`` x ``dtype`` bytes;
    ``comm``: the argument holding its communicator (counted per communicator, ProbeSpec.comm_arg).

    RUNTIME, not a layer of its own: the analyses count, per part, the runtime layer and drop the driver's where the
    runtime has calls (a runtime call holds its driver call). NCCL's calls hold no recorded call and sit in no
    runtime call, so they add to the runtime's; a third layer would be dropped next to the runtime's launches the
    way the driver's are. ``library`` ("nccl") tells them from libcudart's.

    Symbols: the real libnccl.so.2 defines every API function as ``pncclX`` (the profiling interface's name, as
    MPI's PMPI_) and exports ``ncclX`` as a weak alias at the same address; neither is versioned. Both are listed,
    so a build that exports only one is still probed; at one offset they are probed once."""
    cls = OpClass(kw.pop("op_class", OpClass.COLLECTIVE))
    syms = (op, "p" + op)
    return ProbeSpec(
        op, "nccl", Layer.RUNTIME, cls, syms, bytes_arg=count, dtype_arg=dtype, stream_arg=stream, comm_arg=comm, **kw
    )


CATALOG: tuple[ProbeSpec, ...] = (
    # --- runtime (libcudart.so.12) ---
    ProbeSpec("cudaMalloc", "cudart", R, C.ALLOC, ("cudaMalloc",), bytes_arg=1),
    ProbeSpec("cudaFree", "cudart", R, C.FREE, ("cudaFree",)),
    ProbeSpec("cudaMallocManaged", "cudart", R, C.ALLOC, ("cudaMallocManaged",), bytes_arg=1),
    ProbeSpec(
        "cudaMallocAsync",
        "cudart",
        R,
        C.ALLOC,
        ("cudaMallocAsync", "cudaMallocAsync_ptsz"),
        bytes_arg=1,
        stream_arg=2,
    ),
    ProbeSpec("cudaFreeAsync", "cudart", R, C.FREE, ("cudaFreeAsync", "cudaFreeAsync_ptsz"), stream_arg=1),
    ProbeSpec("cudaHostAlloc", "cudart", R, C.ALLOC, ("cudaHostAlloc",), bytes_arg=1),
    ProbeSpec(
        "cudaLaunchKernel",
        "cudart",
        R,
        C.LAUNCH,
        ("cudaLaunchKernel", "cudaLaunchKernel_ptsz"),
        func_arg=0,
        stream_arg=7,
    ),
    ProbeSpec(
        "cudaMemcpy", "cudart", R, C.COPY, ("cudaMemcpy", "cudaMemcpy_ptds"), bytes_arg=2, kind_arg=3, sync_copy=True
    ),
    ProbeSpec(
        "cudaMemcpyAsync",
        "cudart",
        R,
        C.COPY,
        ("cudaMemcpyAsync", "cudaMemcpyAsync_ptsz"),
        bytes_arg=2,
        kind_arg=3,
        stream_arg=4,
    ),
    ProbeSpec("cudaMemset", "cudart", R, C.OTHER, ("cudaMemset", "cudaMemset_ptds"), bytes_arg=2),
    ProbeSpec(
        "cudaStreamSynchronize",
        "cudart",
        R,
        C.SYNC,
        ("cudaStreamSynchronize", "cudaStreamSynchronize_ptsz"),
        stream_arg=0,
    ),
    ProbeSpec("cudaDeviceSynchronize", "cudart", R, C.SYNC, ("cudaDeviceSynchronize",)),
    ProbeSpec("cudaEventSynchronize", "cudart", R, C.SYNC, ("cudaEventSynchronize",)),
    # enqueues a device-side wait; the host thread does not block, so it is not a sync
    ProbeSpec(
        "cudaStreamWaitEvent",
        "cudart",
        R,
        C.OTHER,
        ("cudaStreamWaitEvent", "cudaStreamWaitEvent_ptsz"),
        stream_arg=0,
    ),
    ProbeSpec("cudaGraphLaunch", "cudart", R, C.LAUNCH, ("cudaGraphLaunch", "cudaGraphLaunch_ptsz"), stream_arg=1),
    # --- driver (libcuda.so.1) ---
    ProbeSpec("cuMemAlloc", "cuda", D, C.ALLOC, ("cuMemAlloc_v2", "cuMemAlloc"), bytes_arg=1),
    ProbeSpec("cuMemFree", "cuda", D, C.FREE, ("cuMemFree_v2", "cuMemFree")),
    ProbeSpec(
        "cuLaunchKernel",
        "cuda",
        D,
        C.LAUNCH,
        ("cuLaunchKernel", "cuLaunchKernel_ptsz"),
        func_arg=0,
        stream_arg=8,
        runtime_twin="cudaLaunchKernel",
    ),
    ProbeSpec(
        "cuLaunchKernelEx",
        "cuda",
        D,
        C.LAUNCH,
        ("cuLaunchKernelEx", "cuLaunchKernelEx_ptsz"),
        func_arg=1,
        stream_arg=0,
        stream_deref=32,
        runtime_twin="cudaLaunchKernel",
    ),
    ProbeSpec(
        "cuMemcpyHtoD",
        "cuda",
        D,
        C.COPY,
        ("cuMemcpyHtoD_v2", "cuMemcpyHtoD"),
        bytes_arg=2,
        fixed_kind=MemcpyKind.HOST_TO_DEVICE,
        sync_copy=True,
    ),
    ProbeSpec(
        "cuMemcpyDtoH",
        "cuda",
        D,
        C.COPY,
        ("cuMemcpyDtoH_v2", "cuMemcpyDtoH"),
        bytes_arg=2,
        fixed_kind=MemcpyKind.DEVICE_TO_HOST,
        sync_copy=True,
    ),
    ProbeSpec(
        "cuMemcpyAsync",
        "cuda",
        D,
        C.COPY,
        ("cuMemcpyAsync", "cuMemcpyAsync_ptsz"),
        bytes_arg=2,
        stream_arg=3,
        fixed_kind=MemcpyKind.DEFAULT,
    ),
    ProbeSpec(
        "cuMemcpyHtoDAsync",
        "cuda",
        D,
        C.COPY,
        ("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz"),
        bytes_arg=2,
        stream_arg=3,
        fixed_kind=MemcpyKind.HOST_TO_DEVICE,
    ),
    ProbeSpec(
        "cuStreamSynchronize",
        "cuda",
        D,
        C.SYNC,
        ("cuStreamSynchronize", "cuStreamSynchronize_ptsz"),
        stream_arg=0,
    ),
    ProbeSpec("cuCtxSynchronize", "cuda", D, C.SYNC, ("cuCtxSynchronize",)),
    ProbeSpec("cuEventSynchronize", "cuda", D, C.SYNC, ("cuEventSynchronize",)),
    ProbeSpec(
        "cuGraphLaunch",
        "cuda",
        D,
        C.LAUNCH,
        ("cuGraphLaunch", "cuGraphLaunch_ptsz"),
        stream_arg=1,
        runtime_twin="cudaGraphLaunch",
    ),
    # --- NCCL (libnccl.so.2) ---
    # Argument indices as nccl.h declares them (2.x, unchanged since 2.0 for these); the 7th and 8th arguments
    # (ncclAllReduce's and ncclReduce's stream) are on the stack. bytes: count x datatype size, computed in BPF
    # (dtype_arg). ncclAllGather's count is what each rank sends (it receives nranks x that); ncclReduceScatter's
    # is what each rank receives (it sends nranks x that).
    # ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)
    _nccl("ncclAllReduce", count=2, dtype=3, stream=6, comm=5),
    # ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)
    _nccl("ncclAllGather", count=2, dtype=3, stream=5, comm=4),
    # ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
    _nccl("ncclReduceScatter", count=2, dtype=3, stream=6, comm=5),
    # ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)
    _nccl("ncclBroadcast", count=2, dtype=3, stream=6, comm=5),
    # ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream)
    _nccl("ncclReduce", count=2, dtype=3, stream=7, comm=6),
    # ncclSend(sendbuff, count, datatype, peer, comm, stream) / ncclRecv(recvbuff, count, datatype, peer, comm, stream)
    _nccl("ncclSend", count=1, dtype=2, stream=5, comm=4),
    _nccl("ncclRecv", count=1, dtype=2, stream=5, comm=4),
    # ncclGroupStart(void) / ncclGroupEnd(void): inside a group the collectives only queue; ncclGroupEnd launches
    # them all, so it is a collective's launch too
    _nccl("ncclGroupStart"),
    _nccl("ncclGroupEnd"),
    # ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank): the 128-byte ncclUniqueId is
    # passed by value in memory (the stack), so it takes no register: rank is the third integer argument (index
    # 2) on x86-64 (arm64 passes a struct over 16 bytes by reference, in a register: index 3 there). A set-up
    # call that blocks until every rank has joined (seconds on a real cluster), not a launch: OTHER.
    _nccl("ncclCommInitRank", op_class=OpClass.OTHER, nranks_arg=1, rank_arg=2),
)

OP_NAMES: tuple[str, ...] = tuple(s.op for s in CATALOG)
OP_IDS: dict[str, int] = {s.op: i for i, s in enumerate(CATALOG)}
SPEC_BY_OP: dict[str, ProbeSpec] = {s.op: s for s in CATALOG}


def spec_of(op: str) -> ProbeSpec | None:
    """Return the catalog entry of an op name as stored in the DB (``cuda_calls.op``), or None if unknown."""
    return SPEC_BY_OP.get(op)


def ops_where(pred: Callable[[ProbeSpec], bool]) -> tuple[str, ...]:
    """Return the op names whose catalog entry satisfies ``pred``, e.g. ``ops_where(lambda s: s.waits_for_gpu)``:
    the list analyses bind into SQL (``op IN (...)``) instead of matching names."""
    return tuple(s.op for s in CATALOG if pred(s))


# The parts of a thread's time inside CUDA calls, in the column order of thread_breakdown (``<name>_ns``).
CALL_PARTS: tuple[OpClass, ...] = (
    OpClass.LAUNCH,
    OpClass.SYNC,
    OpClass.ALLOC,
    OpClass.FREE,
    OpClass.COPY,
    OpClass.OTHER,
)


# Default slow thresholds (ns) per op class: calls this slow are always stored, with a stack. A launch that takes
# 200 us is already 20-50x its normal cost; a sync, copy or allocation past 1 ms is a visible stall. Here, not in
# the recorder, because the analyses say from them why a stored call has no stack (tracer.analysis.stacks).
SLOW_NS: dict[OpClass, int] = {
    OpClass.LAUNCH: 200_000,
    OpClass.SYNC: 1_000_000,
    OpClass.ALLOC: 1_000_000,
    OpClass.FREE: 1_000_000,
    OpClass.COPY: 1_000_000,
    OpClass.OTHER: 1_000_000,
    OpClass.COLLECTIVE: 1_000_000,  # its host side is a launch or two; 1 ms is a group of them or a blocked queue
}
# A stack for 1 stored call in N (the first N of an op on each CPU, then 1 in N): launches are the hot path (a
# Python walk costs ~0.5-1.5 us), the rest are rare and diagnostic. Stacks are deduplicated in kernel, so this
# bounds the walk cost, not the data. 8, not 64 (issue 23: 98% of launches had no stack): on bench/overhead (train.py,
# ~14 K launches/s, quiet VM) traced/untraced 1.022 against 1.034 at 64 (spread 2-4%), the recorder 3.0% of a core
# against 2.0%; 12.6% of stored launches then carry a stack, so every hot launch site has one within a second.
STACK_EVERY: dict[OpClass, int] = {OpClass.LAUNCH: 8}

# Library file names as found in real installs (peers.md table 3): plain, versioned, auditwheel-mangled
# (libcudart-9335f6a2.so.12) and CUDA 13 (.so.13). NCCL: the nvidia-nccl-cu12/cu13 wheels' libnccl.so.2, a
# toolkit's libnccl.so.2.x.y. (A torch built with NCCL linked in statically has no libnccl to probe.)
LIBRARY_PATTERNS: dict[str, str] = {
    "cudart": r"libcudart(-[0-9a-f]{8})?\.so(\.\d+)*$",
    "cuda": r"libcuda\.so(\.\d+)*$",
    "nccl": r"libnccl(-[0-9a-f]{8})?\.so(\.\d+)*$",
}
# A file given with --lib under another name is told by what it exports.
LIBRARY_MARKERS: dict[str, str] = {"cuda": "cuLaunchKernel", "cudart": "cudaLaunchKernel", "nccl": "ncclAllReduce"}


# Runtime ops whose calls the driver probes see and relabel; probed themselves only with --launch-probes both.
DRIVER_COVERED: frozenset[str] = frozenset(s.runtime_twin for s in CATALOG if s.runtime_twin)


def specs_for(library: str) -> list[tuple[int, ProbeSpec]]:
    """Return (op_id, spec) for every catalog entry probed in ``library`` ("cudart", "cuda" or "nccl")."""
    return [(i, s) for i, s in enumerate(CATALOG) if s.library == library]


# OP_COUNT in common.h: the size of the per-op BPF arrays. Room to grow without touching the C.
OP_COUNT_MAX = 64
assert len(CATALOG) <= OP_COUNT_MAX
# thread_breakdown's call parts are TB_CALL + part (common.h): every op's part must be one of the six
assert all(s.part in CALL_PARTS for s in CATALOG)
# cuda.bpf.c reads a datatype from the registers only (reg_arg_copy): one of the first six arguments
assert all(s.dtype_arg < 6 for s in CATALOG)
