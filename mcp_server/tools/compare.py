"""compare_traces: did a change work? The served recording against another of the same workload, named by file
in the served recording's directory (:mod:`tracer.analysis.db.siblings` finds and checks it), compared by
:func:`tracer.analysis.compare.compare_traces`. Cancellable, and under the call's time budget on both files."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Annotated

import duckdb
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from mcp_server.budget import budget, cancellable, over_budget
from mcp_server.state import state
from tracer.analysis import compare
from tracer.analysis.compare import Comparison
from tracer.analysis.db import open_trace, read_error
from tracer.analysis.db.siblings import listing, sibling
from tracer.errors import TracerError


@cancellable
def compare_traces(
    before: Annotated[
        str | None,
        Field(
            description="File name of the recording before the change, e.g. baseline.duckdb: a .duckdb file in "
            "the served recording's directory. Omit for the served recording."
        ),
    ] = None,
    after: Annotated[
        str | None,
        Field(description="File name of the recording after the change, likewise. Omit for the served recording."),
    ] = None,
    *,
    ctx: Context,
) -> Comparison:
    """Did a change work? Compare two recordings of the same workload, before and after it. Name the other
    recording by file name (a .duckdb next to the served one; a wrong name lists them); the served recording
    is the side you omit.

    Returns a headline of the differences beyond noise; steps/s and how a step was detected (the training
    thread's waits for the GPU, or launches per step when one side waits less often); the training thread's
    parts (cpu, launch, sync, ..., runq_*, blocked) as ms, shares and ms per step before and after; per op
    calls/s, ms per second, p50/p99 µs (exact histograms); chains that appeared, went away or changed
    severity; and warnings (different programs, workloads, machines, options, too short). Each difference
    has a verdict (beyond_noise | within_noise | too_short | not_tested) and an interval from the
    recordings' own second-to-second variance; noise_test names the tests. Next: get_causal_chains and
    get_stacks(op) on the served recording for a chain that remains or appeared.
    """
    st = state(ctx)
    if before is None and after is None:
        raise ToolError(
            "name the other recording: before='baseline.duckdb' compares it with the served recording as "
            f"after (or pass after=...); recordings here: {listing(st.siblings)}"
        )
    failed: TracerError | None = None
    try:
        named = {k: sibling(st.siblings, v) for k, v in (("before", before), ("after", after)) if v is not None}
    except TracerError as e:
        failed = e
    if failed is not None:
        raise st.error(failed)
    with ExitStack() as stack:
        conns: dict[str, duckdb.DuckDBPyConnection] = {}
        for k, p in named.items():
            try:
                conns[k] = stack.enter_context(open_trace(p))
            except TracerError as e:
                raise st.error(e) from None
        if len(conns) < 2:  # the side left out is the served recording (live: its latest snapshot)
            served = stack.enter_context(st.connection())
            conns.setdefault("before", served)
            conns.setdefault("after", served)
        names = {k: named[k].name if k in named else st.served_name for k in ("before", "after")}
        served_file = None if st.live or st.job else st.paths[0].resolve()
        where = {k: named[k].resolve() if k in named else served_file for k in names}
        try:
            # the served side's connection has its own budget
            with budget(*(conns[k] for k in named), seconds=st.limits.tool_budget_s):
                return compare.compare_traces(
                    conns["before"],
                    conns["after"],
                    before_name=names["before"],
                    after_name=names["after"],
                    same_file=where["before"] is not None and where["before"] == where["after"],
                )
        except duckdb.InterruptException:
            failed = over_budget(st.limits.tool_budget_s)
        except duckdb.Error as e:  # a file damaged or changed while read: one clear answer, no traceback
            failed = read_error(" or ".join(dict.fromkeys(names.values())), e)
    assert failed is not None
    raise st.error(failed)
