"""Several recordings analysed as one job (:mod:`tracer.analysis.job` defines its views, pids and clocks): which
recordings a ``--db`` names (:func:`recordings`), and opening them together (:func:`open_job`)."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import duckdb

from tracer.analysis.db.files import READ_CONFIG, check_file, connect_read_only, dataset_files, read_error
from tracer.analysis.db.state import validate
from tracer.analysis.job import GLOB_CHARS, define_views
from tracer.errors import StoreError
from tracer.sqltext import literal


def recordings(spec: str | Path | Sequence[str | Path]) -> list[Path]:
    """Return the recordings ``spec`` names, in order, each once: for each item, a file as given; a directory that
    is a Parquet dataset as given (it opens as one recording's dataset); another directory, the ``*.duckdb`` files
    directly in it (by name; none: the directory, which opening refuses); a path that does not exist but has glob
    characters, the paths matching it (by name).

    Raises:
        StoreError: a glob that matches nothing.
    """
    items = [spec] if isinstance(spec, str | Path) else list(spec)
    if not items:
        raise StoreError("no recording given", "Pass a trace DB with --db PATH (repeat --db for a job's recordings).")
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir() and not dataset_files(p):
            found = sorted(f for f in p.glob("*.duckdb") if f.is_file())
            out += found or [p]
        elif not p.exists() and any(c in str(p) for c in GLOB_CHARS):
            found = [Path(f) for f in sorted(glob.glob(str(p)))]
            if not found:
                raise StoreError(f"no recording matches {p}", "Check the pattern, e.g. --db 'runs/*.duckdb'.")
            out += found
        else:
            out.append(p)
    seen: set[Path] = set()
    unique = []
    for p in out:  # a file named twice (a glob and a path) is one recording
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def open_job(
    paths: Sequence[str | Path], *, config: Mapping[str, str | bool | int] | None = None
) -> duckdb.DuckDBPyConnection:
    """Return a validated connection to the job made of the recordings at ``paths`` (.duckdb files; see the
    module docstring for its views).

    Each file is checked as :func:`tracer.analysis.db.open_trace` checks one (ours, readable, not live), then
    attached READ_ONLY to an in-memory DuckDB hardened as a trace DB's connection is: no file access but to those
    files (DuckDB's ``allowed_paths``), no extensions, configuration locked.

    Args:
        config: settings added to :data:`tracer.analysis.db.READ_CONFIG` (memory_limit, threads).
    Raises:
        StoreError: a path that is no trace DB file (a Parquet dataset among them), or one that cannot be read.
    """
    files = []
    for p in paths:
        if Path(p).is_dir() and dataset_files(p):
            raise StoreError(
                f"{p} is a Parquet dataset: it cannot be analysed together with other recordings",
                "Pass the .duckdb recordings of the job (--db a.duckdb --db b.duckdb), or the dataset alone.",
            )
        files.append(check_file(p).resolve())
    for f in files:  # each one as open_trace checks it, with its own error
        c = connect_read_only(f, config)
        try:
            validate(c, str(f))
        finally:
            c.close()
    settings = {**READ_CONFIG, **(config or {})}
    lock = settings.pop("lock_configuration", True)
    external = settings.pop("enable_external_access", False)
    conn = duckdb.connect(":memory:", config=settings)
    try:
        # the recordings (and a write-ahead log a cut-off recording may have left) are the only files it reads
        conn.execute("SET allowed_paths = ?", [[str(f) for f in files] + [f"{f}.wal" for f in files]])
        conn.execute(f"SET enable_external_access = {bool(external)}")
        for i, f in enumerate(files):
            try:
                conn.execute(f"ATTACH {literal(str(f))} AS rec{i} (READ_ONLY)")
            except duckdb.Error as e:
                raise read_error(f, e) from None
        define_views(conn, files)
        if lock:
            conn.execute("SET lock_configuration = true")
    except duckdb.Error as e:
        conn.close()
        raise read_error(", ".join(os.path.basename(f) for f in files), e) from None
    except BaseException:
        conn.close()
        raise
    return conn
