"""chains.yielding: a symptom chain whose wait path ends at a root that another chain of the same thread names
yields to that chain, whatever their severities, and through that chain's own explained_by; causes never yield by
this rule, nor chains of another thread."""

from __future__ import annotations

from tracer.analysis.chains.model import CausalChain, Root
from tracer.analysis.chains.yielding import yield_to_roots

TID = 100


def chain(cid: str, category: str, root: str | None, severity: str = "MEDIUM", impact_ms: float = 100.0,
          tid: int = TID, explained_by: str | None = None) -> CausalChain:  # fmt: skip
    return CausalChain.model_construct(
        id=cid,
        category=category,
        severity=severity,
        tid=tid,
        impact_ms=impact_ms,
        summary=f"{category}.",
        root=Root(kind=root, detail=root) if root else None,
        explained_by=explained_by,
    )


def by_id(chains: list[CausalChain]) -> dict[str, str | None]:
    return {c.id: c.explained_by for c in chains}


def test_a_high_stall_whose_syncs_waited_for_a_cpu_yields_to_the_placement_its_contention_yields_to():
    # GIVEN a HIGH sync_stall whose syncs were mostly runnable (root CPU capacity), a cpu_contention chain that
    # cpu_placement.explains already marked, and a MEDIUM placement chain
    chains = [
        chain("stall", "sync_stall", "cpu_capacity", "HIGH", 900),
        chain("cont", "cpu_contention", "cpu_capacity", "HIGH", 500, explained_by="place"),
        chain("place", "cpu_placement", "placement", "MEDIUM", 300),
    ]
    out = yield_to_roots(chains)
    # THEN the stall yields to the placement (the end of the explained_by chain), not to the contention
    assert by_id(out) == {"stall": "place", "cont": "place", "place": None}
    assert out[0].summary.endswith("chain place comes first.")


def test_each_root_to_its_chain():
    chains = [
        chain("gil", "gil_contention", "interpreter"),
        chain("gc", "gc_pause", "interpreter", "LOW", 10),
        chain("lock", "lock_contention", "placement"),
        chain("place", "cpu_placement", "placement"),
        chain("gpu", "gpu_bound", "cpu_capacity", "LOW"),
        chain("cont_small", "cpu_contention", "cpu_capacity", "LOW", 10),
        chain("cont", "cpu_contention", "cpu_capacity", "MEDIUM", 200),
    ]
    # a LOW gpu_bound ("the GPU is the limit") whose waits were for a CPU yields to the heaviest contention chain
    assert by_id(yield_to_roots(chains)) == {
        "gil": "gc",
        "gc": None,
        "lock": "place",
        "place": None,
        "gpu": "cont",
        "cont_small": None,
        "cont": None,
    }


def test_causes_other_threads_and_roots_without_a_chain_do_not_yield():
    chains = [
        # a starvation rooted at CPU capacity carries its own advice for it (workers CPU-bound on full cores)
        chain("starved", "dataloader_starvation", "cpu_capacity"),
        chain("cont", "cpu_contention", "cpu_capacity"),
        # another thread's contention is not this thread's root
        chain("stall", "sync_stall", "cpu_capacity", tid=TID + 1),
        # a root no chain names, and a stall rooted at the GPU
        chain("io", "blocking_io", "external_wait"),
        chain("gpu_stall", "sync_stall", "gpu"),
        chain("no_root", "lock_contention", None),
    ]
    assert set(by_id(yield_to_roots(chains)).values()) == {None}
