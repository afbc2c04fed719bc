"""What the tracer itself cost on the host: its CPU, the CPU waits it caused traced threads, the holds. Never
a culprit: reported on its own line."""

from __future__ import annotations

from typing import Annotated

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.breakdown.thread_time import MS, ThreadTimes
from tracer.analysis.db import session_row
from tracer.analysis.recording import RecordingInfo


class TracerCost(Record):
    """What the tracer itself cost on this host; never a culprit, reported on its own line."""

    cpu_ms: Annotated[
        float | None, Field(description="CPU the recorder and its helpers used (session.recorder_cpu_s), ms")
    ]
    sampled_cpu_ms: Annotated[float | None, Field(description="sum of host_samples.tracer_cpu_ms, ms")]
    share_of_host_cpu: Annotated[float | None, Field(description="cpu_ms / (duration x CPUs)")]
    runq_caused_ms: Annotated[float, Field(description="time traced threads waited for a CPU the tracer held, ms")]
    holds: Annotated[int | None, Field(description="times a target was stopped to attach to a library it opened")]
    held_ms: Annotated[float | None, Field(description="total time targets spent stopped by the tracer, ms")]
    peak_rss_bytes: int | None
    summary: Annotated[str, Field(description="one line: the tracer used N ms of CPU on this host")]


def tracer_cost(conn: duckdb.DuckDBPyConnection, info: RecordingInfo, times: ThreadTimes) -> TracerCost:
    """Return the tracer's own cost on this host: its CPU, the CPU waits it caused, the holds."""
    s = session_row(conn, ("recorder_cpu_s", "holds", "held_ms", "recorder_peak_rss_bytes")) or {}
    recorder_cpu_s, holds, held_ms = s.get("recorder_cpu_s"), s.get("holds"), s.get("held_ms")
    sampled = None
    if info.has("host_samples", "tracer_cpu_ms"):
        sampled = conn.execute("SELECT sum(tracer_cpu_ms) FROM host_samples").fetchone()[0]
    cpu_ms = recorder_cpu_s * 1000 if recorder_cpu_s is not None else sampled
    cap = info.duration_ns / MS * info.cpu_cores if info.duration_ns and info.cpu_cores else 0
    runq = times.total_ns("runq_tracer")
    share = cpu_ms / cap if cpu_ms is not None and cap else None
    if cpu_ms is None:
        summary = "the tracer's own CPU use was not recorded in this recording"
    else:
        summary = f"the tracer used {cpu_ms:,.0f} ms of CPU on this host" + (
            f" ({share:.1%} of its {info.cpu_cores} CPUs over the recording)" if share is not None else ""
        )
    if runq:
        summary += f"; traced threads waited {runq / MS:,.1f} ms for a CPU it held"
    if held_ms:
        summary += f"; targets were held (stopped) {holds or 0} times, {held_ms:,.1f} ms in all"
    return TracerCost(
        cpu_ms=None if cpu_ms is None else round(cpu_ms, 1),
        sampled_cpu_ms=None if sampled is None else round(sampled, 1),
        share_of_host_cpu=None if share is None else round(share, 4),
        runq_caused_ms=round(runq / MS, 3),
        holds=holds,
        held_ms=held_ms,
        peak_rss_bytes=s.get("recorder_peak_rss_bytes"),
        summary=summary,
    )
