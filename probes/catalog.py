"""The one table of every probed CUDA function.

Each :class:`ProbeSpec` names a library, the symbol (and the versioned variants a real library exports), the op
name stored in the DB, the API layer, and which argument carries bytes, memcpy kind, stream, or the launch function
pointer. ``op_id`` is the position in :data:`CATALOG`; it is what crosses the ring buffer (``OP_COUNT`` in
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


class MemcpyKind(IntEnum):
    """cudaMemcpyKind values, also used for the driver's fixed-direction copies."""

    HOST_TO_HOST = 0
    HOST_TO_DEVICE = 1
    DEVICE_TO_HOST = 2
    DEVICE_TO_DEVICE = 3
    DEFAULT = 4


MEMCPY_KIND_NAMES = {0: "HtoH", 1: "HtoD", 2: "DtoH", 3: "DtoD", 4: "default"}

NO_ARG = -1


@dataclass(frozen=True)
class ProbeSpec:
    op: str
    library: str  # "cudart" | "cuda"
    layer: Layer
    op_class: OpClass
    symbols: tuple[str, ...]  # every exported name that implements this op (versioned variants)
    bytes_arg: int = NO_ARG
    kind_arg: int = NO_ARG  # argument holding a cudaMemcpyKind
    fixed_kind: int = NO_ARG  # copy direction implied by the function (cuMemcpyHtoD)
    stream_arg: int = NO_ARG
    stream_deref: int = NO_ARG  # stream read from *(arg + stream_deref) (cuLaunchKernelEx's config)
    func_arg: int = NO_ARG  # launch function pointer / CUfunction
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
        is time spent waiting for the GPU (SYNC)."""
        return OpClass.SYNC if self.sync_copy else self.op_class


R, D = Layer.RUNTIME, Layer.DRIVER
C = OpClass

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
}
# A stack for 1 stored call in N (the first N of an op on each CPU, then 1 in N): launches are the hot path (a
# Python walk costs ~0.5-1.5 us), the rest are rare and diagnostic. Stacks are deduplicated in kernel, so this
# bounds the walk cost, not the data.
STACK_EVERY: dict[OpClass, int] = {OpClass.LAUNCH: 64}

# Library file names as found in real installs (peers.md table 3): plain, versioned, auditwheel-mangled
# (libcudart-9335f6a2.so.12) and CUDA 13 (.so.13).
LIBRARY_PATTERNS: dict[str, str] = {
    "cudart": r"libcudart(-[0-9a-f]{8})?\.so(\.\d+)*$",
    "cuda": r"libcuda\.so(\.\d+)*$",
}


# Runtime ops whose calls the driver probes see and relabel; probed themselves only with --launch-probes both.
DRIVER_COVERED: frozenset[str] = frozenset(s.runtime_twin for s in CATALOG if s.runtime_twin)


def specs_for(library: str) -> list[tuple[int, ProbeSpec]]:
    """Return (op_id, spec) for every catalog entry probed in ``library`` ("cudart" or "cuda")."""
    return [(i, s) for i, s in enumerate(CATALOG) if s.library == library]


# OP_COUNT in common.h: the size of the per-op BPF arrays. Room to grow without touching the C.
OP_COUNT_MAX = 32
assert len(CATALOG) <= OP_COUNT_MAX
