"""Analyses over a trace DB: pure functions that take a read-only DuckDB connection and return typed records.

Every record is a frozen pydantic model with units in its field names (``p99_us``, ``off_cpu_s``) and a
description on each field, so the CLI renders it (``tracer.render``), ``--json`` dumps it, and the MCP tools
return
it with an output schema: the views cannot disagree. Modules: ``stats`` (trace overview), ``chains`` (causal
chain detectors), ``stacks`` (call stacks per op), ``timeline`` (time buckets, events around an instant),
``sql``
(guarded read-only SQL).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """Base of every analysis result: immutable, JSON-serialisable."""

    model_config = ConfigDict(frozen=True)
