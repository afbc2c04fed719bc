"""Causal chains that appeared, went away or changed. Recomputed on both sides by the chains package (as
``tracer chains`` does; a stored ``causal_chains`` row may come from an older tracer), then paired by (category,
culprit kind, relation, name): pids and Python lines change between two runs and between two versions of the
code."""

from __future__ import annotations

from collections import defaultdict

from tracer.analysis.chains import CausalChain
from tracer.analysis.chains.model import SEVERITIES
from tracer.analysis.compare.load import Side
from tracer.analysis.compare.model import ChainChange
from tracer.analysis.compare.statistics import MIN_SHARE_DELTA

ChainKey = tuple[str, str, str, str]


def chain_key(c: CausalChain) -> ChainKey:
    u = c.culprit
    return (c.category, u.kind if u else "", u.relation if u else "", u.comm if u else "")


def culprit_text(c: CausalChain) -> str:
    """Return who or what the chain blames, in words: comm, [relation], at code site."""
    u = c.culprit
    if u is None:
        return ""
    return " ".join(x for x in (u.comm, f"[{u.relation}]", f"at {u.code_site}" if u.code_site else "") if x)


def compare_chains(before: Side, after: Side) -> list[ChainChange]:
    """Pair the two sides' chains by :func:`chain_key` (within a key, by share) and say what changed."""
    groups: dict[ChainKey, tuple[list[CausalChain], list[CausalChain]]] = defaultdict(lambda: ([], []))
    for i, side in enumerate((before, after)):
        for c in side.chains:
            groups[chain_key(c)][i].append(c)
    out = []
    for chains_before, chains_after in groups.values():
        chains_before.sort(key=lambda c: -c.share)
        chains_after.sort(key=lambda c: -c.share)
        for i in range(max(len(chains_before), len(chains_after))):
            x = chains_before[i] if i < len(chains_before) else None
            y = chains_after[i] if i < len(chains_after) else None
            ref = y or x
            assert ref is not None
            note = ""
            if x and y:
                rank = SEVERITIES.index(y.severity) - SEVERITIES.index(x.severity)
                status = "better" if rank > 0 else "worse" if rank < 0 else "unchanged"
                if rank and abs(y.share - x.share) < MIN_SHARE_DELTA:
                    note = "a threshold crossing: its share moved less than one point"
            else:
                status = "appeared" if y else "gone"
            if ref.culprit is not None and ref.culprit.relation == "other_process":
                note = (note + "; " if note else "") + "caused by another process on the host, not by the job"
            out.append(
                ChainChange(
                    category=ref.category,
                    status=status,
                    severity_before=x.severity if x else None,
                    severity_after=y.severity if y else None,
                    share_before=x.share if x else None,
                    share_after=y.share if y else None,
                    culprit=culprit_text(ref),
                    op=ref.op,
                    summary=ref.summary,
                    note=note,
                )
            )
    order = {"appeared": 0, "worse": 1, "gone": 2, "better": 3, "unchanged": 4}

    def worst(c: ChainChange) -> int:
        return min(SEVERITIES.index(s) for s in (c.severity_before, c.severity_after) if s)

    out.sort(key=lambda c: (order[c.status], worst(c), -(c.share_before or 0) - (c.share_after or 0), c.category))
    return out
