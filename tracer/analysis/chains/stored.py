"""The chains' whole answer, kept in the recording: ``tracer record`` computes it once at the recording's end
(:func:`tracer.analysis.chains.store_chains`), and the tools that ask of the whole recording serve it instead of
running every detector again on each call. On a 1-hour recording with 200 K processes the detectors take 1.5 s,
and get_causal_chains, get_trace_stats and compare_traces each ran them (issue 28: at most 2 s a tool).

A stored answer is served only where it is still the answer:
- by the analysis code that wrote it (``analysis``: a hash of the tracer package's source), so a recording read by
  another version of the tracer, or by an edited checkout, is computed afresh;
- on the rows it was computed from (``row_counts``: every table's count), so rows added or removed after the end
  recompute it (the tracer writes nothing else into a finished recording: store_chains is its only writer);
- from a recording's own table: a job of several recordings, or a Parquet dataset, sees ``chains_result`` as a
  view (or not at all) and computes its own answer.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import duckdb

import tracer
from tracer.analysis.chains.model import ChainsResult
from tracer.schema import CHAINS_RESULT as TABLE
from tracer.sqltext import ident, literal

# written after the answer, or the answer itself: not part of the rows it was computed from
NOT_INPUTS = frozenset({TABLE, "causal_chains"})
PACKAGE = Path(__file__).resolve().parents[2]  # the tracer package


@functools.cache
def analysis_version() -> str:
    """Return a hash of the tracer package's Python source, and its version (an install without sources still
    changes it): the code that computes an answer."""
    h = hashlib.sha256(tracer.__version__.encode())
    for f in sorted(PACKAGE.rglob("*.py")):
        h.update(str(f.relative_to(PACKAGE)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def row_counts(conn: duckdb.DuckDBPyConnection) -> str | None:
    """Return every base table's row count in ``conn``'s database as ``table:count,...``; None when
    ``chains_result`` is not one of them (a job's or a dataset's views, an older recording)."""
    tables = [
        t
        for (t,) in conn.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
            "AND schema_name = 'main' ORDER BY table_name"
        ).fetchall()
    ]
    if TABLE not in tables:
        return None
    counted = [t for t in tables if t not in NOT_INPUTS]
    if not counted:
        return ""
    # exact counts, in one query: a table's estimated_size counts rows deleted since its last checkpoint. A UNION
    # ALL's rows come in no set order, so they are put in the tables' order here.
    union = " UNION ALL ".join(f"SELECT {literal(t)}, count(*) FROM main.{ident(t)}" for t in counted)
    n_of = dict(conn.execute(union).fetchall())
    return ",".join(f"{t}:{n_of[t]}" for t in counted)


def load(conn: duckdb.DuckDBPyConnection) -> ChainsResult | None:
    """Return the answer stored in the recording behind ``conn``, or None where there is none this code may
    serve (see the module docstring)."""
    counts = row_counts(conn)
    if counts is None:
        return None
    row = conn.execute(
        f"SELECT result FROM {TABLE} WHERE analysis = ? AND row_counts = ? ORDER BY computed_at DESC LIMIT 1",
        [analysis_version(), counts],
    ).fetchone()
    return ChainsResult.model_validate_json(row[0]) if row else None


def save(rw_conn: duckdb.DuckDBPyConnection, result: ChainsResult) -> None:
    """Store ``result``, computed on ``rw_conn``'s rows as they are, for this code to serve; an older answer is
    replaced. Does nothing on a recording whose schema lacks the table (one written before it existed)."""
    counts = row_counts(rw_conn)
    if counts is None:
        return
    rw_conn.execute(f"DELETE FROM {TABLE}")
    rw_conn.execute(
        f"INSERT INTO {TABLE} (analysis, row_counts, computed_at, result) VALUES (?, ?, now(), ?)",
        [analysis_version(), counts, result.model_dump_json()],
    )
