"""The answer of one ``run_sql`` query, on its own so that the query-worker pool can read it without the query
code (:mod:`tracer.analysis.sql` starts the pool; the pool must not import it back)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from tracer.analysis import Record


class SqlResult(Record):
    """Rows of a read-only query."""

    columns: list[str]
    column_types: Annotated[list[str], Field(description="DuckDB type of each column")]
    rows: Annotated[
        list[list[Any]],
        Field(
            description="JSON-safe values, exact or as DuckDB's text: timestamps ISO, blobs hex, NaN/inf as "
            "'nan'/'inf'/'-inf'; infinity or BC dates, TIME/TIMETZ/TIME_NS/BIT/INTERVAL/GEOMETRY and decimals a "
            "double cannot hold as DuckDB's text"
        ),
    ]
    row_count: Annotated[int, Field(description="rows returned (<= limit)")]
    truncated: Annotated[
        bool, Field(description="true when the query had more rows than the limit or than fit in the reply")
    ]
    elapsed_ms: float
    note: Annotated[
        str | None,
        Field(description="why rows are missing or values were shortened (reply-size cap); null when neither"),
    ] = None
