"""A recording from before schema v2, made from a hand-built one: what v2 added is dropped, so the analyses'
fallbacks for old recordings (an estimated breakdown, no roles, no wakers) can be tested on known rows."""

from __future__ import annotations

from pathlib import Path

import duckdb

# The tables and columns schema v2 added: a recording made before it has none of them.
V2_TABLES = ("threads", "thread_breakdown", "thread_wakers")
V2_COLUMNS = (
    ("processes", "role"),
    ("sched", "waker_pid"),
    ("sched", "waker_tid"),
    ("sched", "waker_comm"),
    ("sched", "in_call"),
    ("preemptors", "tid"),
    ("preemptors", "is_tracer"),
    ("cuda_calls", "kernel_note"),
    ("op_stats", "error_pct"),
    ("stacks", "line_approx"),
    ("host_samples", "tracer_cpu_ms"),
    *(
        ("session", c)
        for c in (
            "recorder_pid",
            "recorder_start_ticks",
            "boot_id",
            "recorder_cpu_s",
            "recorder_peak_rss_bytes",
            "startup_s",
            "compile_s",
            "attach_s",
            "first_event_s",
            "flush_s",
            "holds",
            "held_ms",
            "command_fate",
            "flushed_ns",
        )
    ),
)


def downgrade_to_v1(path: str | Path) -> Path:
    """Drop what schema v2 added from the DB at ``path``: it then reads like a recording from before v2."""
    con = duckdb.connect(str(path))
    try:
        for t in V2_TABLES:
            con.execute(f"DROP TABLE IF EXISTS {t}")
        for t, c in V2_COLUMNS:
            con.execute(f"ALTER TABLE {t} DROP COLUMN {c}")
        con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    finally:
        con.close()
    return Path(path)
