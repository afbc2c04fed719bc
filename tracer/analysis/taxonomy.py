"""The op taxonomy as the analyses use it, read from the probe catalog (``probes/catalog.py``) and nowhere else.

An op's *part* is where its time goes in a thread's breakdown: its ``OpClass``, except that a synchronous copy
(``cudaMemcpy``, ``cuMemcpyDtoH_v2``) waits for the GPU and counts as ``sync``, and an NCCL collective
(``OpClass.COLLECTIVE``: ``ncclAllReduce``, ...) enqueues its kernel and returns, as a launch does, and counts as
``launch``: the wait for the other ranks is on the GPU, and shows in the host's next synchronize (``ProbeSpec.part``
says why at length). A collective is therefore never a part of its own: the six call parts stay. Timeline
buckets, stats, chains and the breakdown all classify through :func:`part_name`, so they cannot disagree. An op
the catalog does not know (a DB from a newer tracer) is ``other``.

The breakdown's parts, in ``thread_breakdown`` column order: on CPU outside calls, the call parts
(``CALL_PARTS``), waiting for a CPU by holder, blocked.
"""

from __future__ import annotations

from probes.catalog import CALL_PARTS, OpClass, ProbeSpec, spec_of
from tracer.vocabulary import CALL_PART_NAMES, PART_NAMES, RUNQ_PART_NAMES

# every part of thread_breakdown, in column order; column = f"{name}_ns"; they sum to wall_ns (named in the one
# vocabulary, tracer/vocabulary.py, which the recorder writes them from too)
__all__ = [
    "CALL_PARTS",
    "CALL_PART_NAMES",
    "PART_NAMES",
    "RUNQ_PART_NAMES",
    "is_implicit_sync",
    "part_case_sql",
    "part_name",
    "part_of",
    "spec",
    "waits_for_gpu",
]


def spec(op: str) -> ProbeSpec | None:
    """Return the catalog entry of ``op`` (as stored in the DB), or None for an op the catalog does not know."""
    return spec_of(op)


def part_of(op: str) -> OpClass:
    """Return the breakdown part ``op``'s time goes to (``ProbeSpec.part``); OTHER for unknown ops."""
    s = spec_of(op)
    return s.part if s else OpClass.OTHER


def part_name(op: str) -> str:
    """Return the part name of ``op``: launch | sync | alloc | free | copy | other (a collective: launch)."""
    return part_of(op).name.lower()


def waits_for_gpu(op: str) -> bool:
    """Return True when a call of ``op`` blocks the host until the GPU is done (explicit or implicit sync)."""
    s = spec_of(op)
    return bool(s and s.waits_for_gpu)


def is_implicit_sync(op: str) -> bool:
    """Return True for a synchronous copy: a sync the code does not spell as one (``loss.item()``)."""
    s = spec_of(op)
    return bool(s and s.sync_copy)


def part_case_sql(column: str = "op") -> str:
    """Return a SQL CASE expression mapping ``column`` (an op name) to its part name, built from the catalog.

    The literals are the catalog's own op names (identifiers, never user input), so inlining them is safe.
    """
    from probes.catalog import CATALOG

    whens = []
    for part in CALL_PARTS:
        ops = [s.op for s in CATALOG if s.part == part]
        if ops and part != OpClass.OTHER:
            whens.append(f"WHEN {column} IN ({', '.join(repr(o) for o in ops)}) THEN '{part.name.lower()}'")
    return "CASE " + " ".join(whens) + " ELSE 'other' END"
