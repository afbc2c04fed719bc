"""Open a trace DB for reading, tell the user plainly when the file is not one we can read, and say how the
recording in it ended.

Every reader (CLI views, MCP tools, ``run_sql``'s query workers) goes through :func:`open_trace`. Its parts, one
module each: the file and its hardened read-only connection (:mod:`.files`), the recording in it and how it
ended (:mod:`.state`), a Parquet dataset (:mod:`.dataset`), several recordings as one job (:mod:`.jobs`),
another recording named by file beside the served one (:mod:`.siblings`, for ``compare_traces``).

A directory written by ``tracer export --format parquet`` (a hive-partitioned Parquet dataset, layout in
:mod:`tracer.views.export.parquet`) opens too (:func:`open_dataset`): an in-memory DuckDB with one view per table
over its files, so every analysis runs on it unchanged.

Refusals raise :class:`tracer.errors.StoreError` (exit code 5): missing file, not a regular file (a FIFO would
block the open forever; a directory that is no dataset), not a DuckDB file, damaged or truncated, a DuckDB file
that is not a trace DB (no ``meta`` app row), a newer schema, or a recording still being written by a live
recorder. A recording whose recorder is gone (killed, crashed, or stopped by a full disk) opens with what it
holds; :func:`recording_state` says how it ended.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import duckdb

from tracer.analysis.db.dataset import dataset_hosts, open_dataset
from tracer.analysis.db.files import (
    LIVE_HINT,
    PARTITION_TYPES,
    READ_CONFIG,
    check_file,
    connect_read_only,
    dataset_files,
    is_damaged,
    read_error,
)
from tracer.analysis.db.jobs import open_job, recordings
from tracer.analysis.db.state import (
    RecordingState,
    recorder_alive,
    recording_state,
    session_row,
    thinned_note,
    validate,
)

__all__ = [
    "LIVE_HINT",
    "PARTITION_TYPES",
    "READ_CONFIG",
    "RecordingState",
    "check_file",
    "connect_read_only",
    "dataset_files",
    "dataset_hosts",
    "is_damaged",
    "open_dataset",
    "open_job",
    "open_trace",
    "read_error",
    "recorder_alive",
    "recording_state",
    "recordings",
    "session_row",
    "thinned_note",
    "validate",
]


def open_trace(
    path: str | Path | Sequence[str | Path], *, config: Mapping[str, str | bool | int] | None = None
) -> duckdb.DuckDBPyConnection:
    """Return a validated, hardened read-only connection to the trace DB at ``path``.

    Args:
        config: settings added to :data:`READ_CONFIG` (see :func:`connect_read_only`).
    ``path`` may also be a Parquet dataset directory (:func:`open_dataset`), or name several recordings analysed
    as one job (:func:`tracer.analysis.job.open_job`): a list of paths, a directory of ``*.duckdb`` files, or a
    glob (:func:`tracer.analysis.job.recordings`).

    Raises:
        StoreError: missing, not a regular file, not a DuckDB file, damaged, not ours, newer schema, or still
            being written.
    """
    paths = recordings(path)
    if len(paths) > 1:
        return open_job(paths, config=config)
    path = paths[0] if paths else Path(str(path))
    if Path(path).is_dir() and dataset_files(path):
        return open_dataset(path, config=config)
    conn = connect_read_only(path, config)
    try:
        validate(conn, str(path))
    except BaseException:
        conn.close()
        raise
    return conn
