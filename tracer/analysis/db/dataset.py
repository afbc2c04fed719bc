"""A directory written by ``tracer export --format parquet`` (a hive-partitioned Parquet dataset, layout in
:mod:`tracer.views.export.parquet`), opened as a recording (:func:`open_dataset`): an in-memory DuckDB with one view
per table over its files, so every analysis runs on it unchanged."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import duckdb

from tracer.analysis.db.files import PARTITION_TYPES, READ_CONFIG, RECORD_HINT, dataset_files, read_error
from tracer.analysis.db.state import validate
from tracer.analysis.job import GLOB_CHARS, define_views
from tracer.errors import StoreError
from tracer.schema import APP_ID, SCHEMA_VERSION, TABLE_BY_NAME
from tracer.sqltext import ident, literal, union_view


def _dataset_view(conn: duckdb.DuckDBPyConnection, root: Path, table: str, files: list[Path]) -> str:
    """Return the SELECT behind ``table``'s view: its files read with their hive partitions, the table's own
    columns in the schema's order (a partition key the table does not declare, such as rank on cuda_calls or
    host on every table but session, dropped)."""
    declared = TABLE_BY_NAME[table].column_names
    groups: dict[tuple[str, ...], list[Path]] = {}  # files by their partition directories (one layout per export)
    for f in files:
        groups.setdefault(tuple(d.split("=", 1)[0] for d in f.parent.relative_to(root).parts), []).append(f)
    parts: list[tuple[str, list[str]]] = []
    for rel, group in groups.items():
        keys = {d.split("=", 1)[0] for d in group[0].parent.parts if "=" in d}  # DuckDB reads all of the path's
        types = ", ".join(f"{k!r}: {PARTITION_TYPES[k]}" for k in sorted(keys) if k in PARTITION_TYPES)
        pattern = str(root.joinpath(*(f"{k}=*" for k in rel), f"{table}_[0-9]*.parquet"))
        # a root whose name has glob characters is read by its file list
        source = (
            literal(pattern)
            if not any(c in str(root) for c in GLOB_CHARS)
            else f"[{', '.join(literal(str(f)) for f in group)}]"
        )
        rel_sql = (
            f"read_parquet({source}, hive_partitioning = true, union_by_name = true"
            + (f", hive_types = {{{types}}}" if types else "")
            + ")"
        )
        have = [r[0] for r in conn.execute(f"DESCRIBE SELECT * FROM {rel_sql}").fetchall()]
        cols = [c for c in have if c not in keys or c in declared]
        parts.append((f"SELECT {', '.join(ident(c) for c in cols)} FROM {rel_sql}", cols))
    return union_view(table, parts)


def dataset_hosts(root: Path) -> list[Path]:
    """Return the host=<h> partitions of the dataset at ``root`` that hold a recording, by name; [] when ``root``
    is itself one host's partition."""
    if root.name.startswith("host="):
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and d.name.startswith("host=") and "meta" in dataset_files(d))


def _dataset_job(conn: duckdb.DuckDBPyConnection, hosts: list[Path]) -> None:
    """Define the views of a dataset that several hosts exported into as the job their recordings make
    (tracer.analysis.job): each host's partition is recording i, in an in-memory database rec<i> of views over its
    files, so its pids are keyed by host and its clock lined up with the others', as for their .duckdb files."""
    for i, h in enumerate(hosts):
        conn.execute(f"ATTACH ':memory:' AS rec{i}")
        for table, fs in dataset_files(h).items():
            conn.execute(f"CREATE VIEW rec{i}.main.{table} AS {_dataset_view(conn, h, table, fs)}")
    conn.execute("DROP VIEW meta")  # the job's meta replaces the one read to check the dataset
    define_views(conn, hosts)


def open_dataset(
    path: str | Path, *, config: Mapping[str, str | bool | int] | None = None
) -> duckdb.DuckDBPyConnection:
    """Return a validated connection to the Parquet dataset at ``path`` (its top, or one host=<h> partition):
    an in-memory DuckDB with one view per table over ``read_parquet('<path>/**/<table>_[0-9]*.parquet',
    hive_partitioning = true, union_by_name = true)``, so the analyses run on it as on a trace DB.

    A dataset several hosts exported into opens as the job their recordings make (:func:`_dataset_job`: pids
    keyed by host, clocks lined up); pass one host=<h> directory to read one recording alone. Hardened as a trace
    DB's connection is, except that it can read the files under ``path`` (DuckDB's ``allowed_directories``); it is
    meant for the analyses, not for untrusted SQL (``tracer sql`` and ``run_sql`` take a .duckdb file).

    Args:
        config: settings added to :data:`READ_CONFIG` (memory_limit, threads).
    Raises:
        StoreError: no dataset there, files DuckDB cannot read, not ours, a newer schema, or a live recording.
    """
    root = Path(path).resolve()
    files = dataset_files(root)
    if "meta" not in files:
        raise StoreError(
            f"{path} is not a trace dataset (no meta_*.parquet under host=<h>/)",
            "Pass a directory written by `tracer export --format parquet`, or a .duckdb file.",
        )
    settings = {**READ_CONFIG, **(config or {})}
    lock = settings.pop("lock_configuration", True)
    external = settings.pop("enable_external_access", False)
    conn = duckdb.connect(":memory:", config=settings)
    try:
        conn.execute("SET allowed_directories = ?", [[str(root) + os.sep]])
        conn.execute(f"SET enable_external_access = {bool(external)}")
        conn.execute(f"CREATE VIEW meta AS {_dataset_view(conn, root, 'meta', files['meta'])}")
        versions = conn.execute(
            "SELECT list(DISTINCT value) FILTER (key = 'app'), max(TRY_CAST(value AS INTEGER)) "
            "FILTER (key = 'schema_version') FROM meta"
        ).fetchone()
        apps, version = versions or (None, None)
        if apps != [APP_ID]:
            raise StoreError(f"{path} is not a cuda-host-tracer dataset (meta app = {apps!r})", RECORD_HINT)
        if version is not None and version > SCHEMA_VERSION:
            raise StoreError(
                f"{path} holds a recording of schema version {version}; this tracer reads up to {SCHEMA_VERSION}",
                "Upgrade cuda-host-tracer (pip install -U cuda-host-tracer).",
            )
        hosts = dataset_hosts(root)
        if len(hosts) > 1:
            _dataset_job(conn, hosts)
        else:
            for table, fs in files.items():
                if table != "meta":
                    conn.execute(f"CREATE VIEW {table} AS {_dataset_view(conn, root, table, fs)}")
        if lock:
            conn.execute("SET lock_configuration = true")
        validate(conn, str(path))
    except duckdb.Error as e:
        conn.close()
        raise read_error(path, e) from None
    except BaseException:
        conn.close()
        raise
    return conn
