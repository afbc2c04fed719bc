"""One ranking rule between chains (issue 28): a chain whose wait path ends at a root that another chain of the
same thread is about yields to that chain (``explained_by``).

A category names a symptom (the training thread waits in a sync, on a lock, for the GIL) or a root (CPU capacity:
``cpu_contention``; the job's placement: ``cpu_placement``; CPython's collector: ``gc_pause``). When a symptom's
path ends at a root that a chain of the same thread names, the fix is that chain's: a sync spent waiting for a
CPU is not fixed by overlapping it with the GPU's work, but by freeing the CPU. The rule does not weigh shares
(a HIGH stall yields to a MEDIUM placement whose waits it is): a diagnosis that flips on which side of a cut-off
a share falls is not one a user can act on. It follows ``explained_by`` to its end: a stall whose root is CPU
capacity yields to the placement that the contention chain yields to.

Only the symptoms yield (:data:`SYMPTOMS`): a dataloader_starvation or process_churn chain rooted at CPU capacity
carries its own advice for that root (workers CPU-bound on full cores), and a root chain never yields by this
rule (placement over contention is :func:`cpu_placement.explains`' rule, with its own measure).
"""

from __future__ import annotations

from tracer.analysis.chains.model import CausalChain

# root kind -> the category that names it as its cause
OWNERS: dict[str, str] = {
    "cpu_capacity": "cpu_contention",
    "placement": "cpu_placement",
    "interpreter": "gc_pause",
}
# categories about where the thread waited, not why: they yield to the chain of their root
SYMPTOMS = frozenset(
    {"sync_stall", "gpu_bound", "launch_bound", "lock_contention", "gil_contention", "blocking_io", "memory_pressure"}
)


def yield_to_roots(chains: list[CausalChain]) -> list[CausalChain]:
    """Return ``chains`` with each symptom chain (SYMPTOMS) whose path's root is a kind another chain of its thread
    names (OWNERS) marked as explained by that chain, or by the chain that one is explained by."""
    by_id = {c.id: c for c in chains}
    owners: dict[tuple[int | None, str], CausalChain] = {}
    for c in sorted(chains, key=lambda c: -c.impact_ms):  # the heaviest of a thread's chains of one category
        owners.setdefault((c.tid, c.category), c)
    out = []
    for c in chains:
        owner_cat = OWNERS.get(c.root.kind) if c.root is not None else None
        o = owners.get((c.tid, owner_cat)) if owner_cat else None
        if c.tid is not None and o is not None and c.category in SYMPTOMS and c.explained_by is None:
            seen = {c.id}
            while o.explained_by in by_id and o.explained_by not in seen:
                seen.add(o.id)
                o = by_id[o.explained_by]
            if o.id not in seen:
                c = c.explained(o, f"Its waits end at {c.root.kind.replace('_', ' ')}: chain {o.id} comes first.")
        out.append(c)
    return out
