"""Analyses over a trace DB: pure functions that take a read-only DuckDB connection and return typed records.

Every record is a frozen pydantic model with units in its field names (``p99_us``, ``off_cpu_s``) and a
description on each field, so the CLI renders it (``tracer.views.render``), ``--json`` dumps it, and the MCP tools
return it with an output schema: the views cannot disagree. Modules: ``recording`` (what a DB holds: roles, the
tracer's pids, which v2 tables exist), ``taxonomy`` (op parts from the probe catalog), ``breakdown`` (where each
thread's time went), ``chains`` (causal chains ranked by the time they cost, one detector module each),
``stats`` (trace overview), ``stacks`` (call stacks per op), ``timeline`` (time buckets, events around an
instant), ``arguments`` (argument checks shared by the CLI and MCP), ``sql`` (guarded read-only SQL).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """Base of every analysis result: immutable, JSON-serialisable."""

    model_config = ConfigDict(frozen=True)
