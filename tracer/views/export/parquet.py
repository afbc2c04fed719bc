"""Export a recording as a hive-partitioned Parquet dataset: many recordings (one per host of a job) in one
directory, read by DuckDB, Spark, Polars or pandas, and by every ``tracer`` analysis (``--db DIR``).

Layout of ``tracer export --db REC --format parquet -o DIR`` (written by DuckDB's own ``COPY … TO (FORMAT
parquet, PARTITION_BY (…), FILENAME_PATTERN '<table>_{i}')``, zstd-compressed)::

    DIR/schema.json                                   every table's columns, types and meanings (below)
    DIR/host=<host>/<table>_0.parquet                 tables of the whole host: meta, session, host_samples,
                                                      stacks, causal_chains
    DIR/host=<host>/rank=<rank>/<table>_0.parquet     tables with a pid: processes, threads, thread_breakdown,
                                                      thread_wakers, cuda_calls, op_stats, sched, sched_stats,
                                                      preemptors, process_events, offcpu_stacks, cpu_samples,
                                                      kernel_names

- ``host`` is the recording's host (``session.host`` of its last session), percent-encoded in the directory name
  as Hive does (``my host`` -> ``host=my%20host``); readers decode it.
- ``rank`` is ``processes.rank`` of the row's pid (a forked DataLoader worker has its rank's); for ``preemptors``,
  whose pid is the preempting task, the rank of the thread that waited (its tid). A process that is no rank (a
  launcher such as torchrun's agent, a single-process job, a pid not in ``processes``) lies under
  ``rank=__HIVE_DEFAULT_PARTITION__``: Hive's and Spark's name for NULL, which DuckDB writes and reads back as
  NULL. ``processes`` itself is partitioned by its own rank column. A recording without ``processes.rank``
  (schema < 3) has no rank partitions: every table lies under ``host=<host>/`` (read such a host's partition on
  its own with DuckDB, whose hive reader refuses files of one table at two depths; ``tracer`` reads both).
- Partition columns are in the paths, not in the files: ``session.host`` and ``processes.rank`` come back from
  their directories with ``hive_partitioning``; on every other table ``host`` and ``rank`` are extra columns a
  reader may filter on (``WHERE rank = 3`` reads rank 3's files alone).
- An empty table is one empty file (``rank=__HIVE_DEFAULT_PARTITION__`` for a table with a pid), so every table of
  the recording has files on every host and its columns are known. A table the recording lacks (an older
  schema) has no files.
- ``<table>_<i>``: DuckDB's FILENAME_PATTERN; glob ``<table>_[0-9]*.parquet`` (``sched_*`` would also match
  ``sched_stats_0``).

Several recordings share DIR, one ``host=`` partition each: an export writes its host's partition under a hidden
temporary directory in DIR and renames it into place at the end (a failed export leaves nothing), and refuses a
host that DIR already holds unless ``force`` (which replaces that host's partition alone).

The schema is documented in ``DIR/schema.json`` rather than in each file's Parquet key-value metadata: one file a
person or any tool reads without a Parquet reader (``jq``, a notebook), the layout and partition keys next to the
columns, written once rather than copied into hundreds of files; the files themselves carry the column types.
It is rewritten on each export (the same for one tracer version).

Reading it: :func:`tracer.analysis.db.open_dataset` (``tracer stats --db DIR``), or DuckDB directly::

    SELECT host, rank, op, count(*) FROM read_parquet('DIR/**/cuda_calls_[0-9]*.parquet',
        hive_partitioning = true, union_by_name = true) GROUP BY ALL

or any engine that reads hive-partitioned Parquet: :data:`STRAGGLER_SQL`, the cross-rank straggler table, runs
unchanged in DuckDB and in Spark SQL over a view ``cuda_calls`` of the dataset (tests/test_export_spark.py)::

    CREATE VIEW cuda_calls AS SELECT * FROM read_parquet('DIR/**/cuda_calls_[0-9]*.parquet',
        hive_partitioning = true, union_by_name = true)                                 -- DuckDB
    spark.read.option("basePath", DIR).parquet(DIR + "/host=*/rank=*/cuda_calls_[0-9]*.parquet")
        .createOrReplaceTempView("cuda_calls")                                          # Spark
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Annotated
from urllib.parse import unquote

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.db import PARTITION_TYPES, open_trace, read_error, session_row
from tracer.analysis.recording import table_columns
from tracer.errors import StoreError, UsageError
from tracer.schema import APP_ID, SCHEMA_VERSION, TABLES, Table
from tracer.sqltext import literal
from tracer.views.output import refuse_existing

NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"  # what DuckDB (as Hive and Spark) names a NULL partition value
SCHEMA_FILE = "schema.json"
# The cross-rank straggler table, in SQL that DuckDB and Spark SQL both run unchanged over a view (or table)
# ``cuda_calls`` of the dataset with its host and rank partition columns; the README shows it.
# - A step is the time between the ends of a process's consecutive cudaStreamSynchronize calls. It splits into work
#   (up to the latest end of the process's CUDA calls started before the step's sync, a nested driver call's outer
#   call included: the rank's own host-side time) and wait (from there to the sync's end: the GPU, and a
#   collective's wait for the other ranks).
# - Ranks in lockstep share one step time, so the straggler is the rank with the most work per step: first.
# - Only what both engines accept and compute alike: median (an even count's two middle values averaged, exact in
#   both) and percentile_disc (a step's own time). percentile_cont interpolates differently in the last bits of a
#   double (DuckDB 2.0 and Spark 4.3: 49 of 400 random groups differ, by ~1e-16 relative). Plain SQL otherwise
#   (explicit GROUP BY columns), for engines beyond these two.
STRAGGLER_SQL = """\
WITH calls AS (
  SELECT host, rank, pid, op, ts_ns + dur_ns AS end_ns,
         max(ts_ns + dur_ns) OVER (PARTITION BY host, pid ORDER BY ts_ns
                                   ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_end_ns
  FROM cuda_calls
  WHERE rank IS NOT NULL
), steps AS (
  SELECT host, rank, end_ns - prev_end_ns AS wait_ns,
         end_ns - lag(end_ns) OVER (PARTITION BY host, pid ORDER BY end_ns) AS step_ns
  FROM calls
  WHERE op = 'cudaStreamSynchronize'
)
SELECT host, rank, count(step_ns) AS steps,
       median(step_ns) / 1e6 AS step_ms,
       percentile_disc(0.99) WITHIN GROUP (ORDER BY step_ns) / 1e6 AS p99_ms,
       median(step_ns - wait_ns) / 1e6 AS work_ms,
       median(wait_ns) / 1e6 AS wait_ms
FROM steps
GROUP BY host, rank
ORDER BY work_ms DESC, host, rank   -- the straggler first
"""
# tables with a pid whose rank is not that pid's: preemptors.pid is the preempting task, tid the thread that waited
_RANK_BY_TID = frozenset({"preemptors"})
_WRITE_CONFIG: dict[str, str | bool | int] = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "python_enable_replacements": False,
}


class ParquetExport(Record):
    """What a Parquet export wrote."""

    format: Annotated[str, Field(description="parquet")]
    path: Annotated[str, Field(description="the dataset directory")]
    host: Annotated[str | None, Field(description="the recording's host: its partition's value")]
    partition: Annotated[str, Field(description="the directory written, DIR/host=<host>")]
    ranks: Annotated[list[int | None], Field(description="rank partitions written (None: processes of no rank)")]
    rows: Annotated[dict[str, int], Field(description="rows written, by table")]
    files: Annotated[int, Field(description="Parquet files written")]
    replaced: Annotated[bool, Field(description="an earlier export of this host was replaced (--force)")]
    notes: Annotated[list[str], Field(description="what the dataset does not hold, and why")] = []


def by_rank(table: Table) -> bool:
    """True when ``table`` is partitioned by rank as well as host (it has a pid column)."""
    return "pid" in table.column_names


def schema_document() -> dict:
    """Return the content of ``DIR/schema.json``: the layout, the partition keys and every table's columns."""
    return {
        "app": APP_ID,
        "schema_version": SCHEMA_VERSION,
        "layout": "host=<host>/<table>_<i>.parquet, or host=<host>/rank=<rank>/<table>_<i>.parquet for tables "
        "partitioned by rank",
        "partition_keys": {
            "host": {"type": PARTITION_TYPES["host"], "doc": "the recording's host (session.host), percent-encoded"},
            "rank": {
                "type": PARTITION_TYPES["rank"],
                "doc": f"processes.rank of the row's pid (preemptors: of the waiting thread's tid); {NULL_PARTITION}"
                " = NULL: a process that is no rank (a launcher, a single-process job)",
            },
        },
        "read_with": "read_parquet('DIR/**/<table>_[0-9]*.parquet', hive_partitioning = true, union_by_name = true)",
        "tables": {
            t.name: {
                "doc": t.doc,
                "partitioned_by": ["host", "rank"] if by_rank(t) else ["host"],
                "columns": [{"name": c.name, "type": c.type, "doc": c.doc} for c in t.columns],
            }
            for t in TABLES
        },
    }


def _text(s: str | None) -> str:
    return "NULL::VARCHAR" if s is None else literal(s)


def check_output(out: Path) -> None:
    """Refuse an ``-o`` that cannot hold a dataset (a file, under a missing directory), in one error; create it."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} is not a directory", "Pass a directory for the Parquet dataset, e.g. -o dataset/.")
    if not out.exists():
        if not out.parent.is_dir():
            raise UsageError(f"no directory {out.parent} to create {out.name} in", "Create it, or pick another -o.")
        try:
            out.mkdir()
        except OSError as e:
            raise StoreError(f"cannot create {out}: {e.strerror}", "Pick a directory you can write, -o DIR.") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise StoreError(f"cannot write into {out}: permission denied", "Pick a directory you can write, -o DIR.")


def export_parquet(db: Path, out: Path, *, force: bool = False) -> ParquetExport:
    """Write the recording at ``db`` (a .duckdb file) into the dataset ``out`` as its host's partition.

    Raises:
        UsageError: ``out`` is a file or under a missing directory, or it holds this host already (without
            ``force``).
        StoreError: ``db`` is not a finished trace DB, or ``out`` cannot be written.
    """
    if Path(db).is_dir():
        raise UsageError(f"{db} is a directory", "Export a .duckdb recording: --db trace.duckdb.")
    with open_trace(db) as conn:  # validated: ours, readable, not being recorded
        s = session_row(conn, ("host",))
        host = s["host"] if s else None
        present = table_columns(conn)
    check_output(out)
    out = out.resolve()
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".tracer-export-", dir=out))
    except OSError as e:
        raise StoreError(f"cannot write into {out}: {e.strerror}", "Pick a directory you can write, -o DIR.") from None
    try:
        return _export(Path(db).resolve(), out, tmp, host, present, force)
    except duckdb.Error as e:
        damaged = any(w in str(e).lower() for w in ("corrupt", "could not read", "checksum", "deserialize"))
        if isinstance(e, duckdb.IOException) and not damaged:  # the writes: a full disk, an I/O error
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise StoreError(f"writing {out} failed: {first}", "Check the disk and its permissions.") from None
        raise read_error(db, e) from None
    except OSError as e:
        raise StoreError(f"writing {out} failed: {e.strerror or e}", "Check the disk and its permissions.") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _export(
    db: Path, out: Path, tmp: Path, host: str | None, present: dict[str, frozenset[str]], force: bool
) -> ParquetExport:
    conn = duckdb.connect(":memory:", config=_WRITE_CONFIG)
    try:
        conn.execute(f"ATTACH {_text(str(db))} AS rec (READ_ONLY)")
        # from here on DuckDB reads the attached recording and writes under DIR alone
        conn.execute("SET allowed_directories = ?", [[str(out) + os.sep]])
        conn.execute("SET enable_external_access = false")
        conn.execute("SET lock_configuration = true")
        notes: list[str] = []
        has_rank = "rank" in present.get("processes", frozenset())
        if has_rank:
            conn.execute("CREATE TABLE pid_rank AS SELECT pid, max(rank) AS rank FROM rec.processes GROUP BY pid")
            threads = "SELECT DISTINCT pid, tid FROM rec.threads UNION " if "threads" in present else ""
            if "preemptors" in present:  # a main thread's tid is its pid
                conn.execute(
                    "CREATE TABLE tid_rank AS SELECT x.tid, max(r.rank) AS rank FROM ("
                    f"{threads}SELECT DISTINCT tid AS pid, tid FROM rec.preemptors) x "
                    "JOIN pid_rank r ON r.pid = x.pid GROUP BY x.tid"
                )
        else:
            notes.append(
                "the recording has no processes.rank (schema < 3): no rank partitions, every table under host="
            )
        rows: dict[str, int] = {}
        hostdir: str | None = None
        for t in TABLES:  # meta first: its partition names the host's directory
            if t.name not in present:
                continue
            rows[t.name] = n = conn.execute(f"SELECT count(*) FROM rec.{t.name}").fetchone()[0]
            keys = ["host", "rank"] if by_rank(t) and has_rank else ["host"]
            if n == 0:  # one empty file, so the table and its columns are there
                assert hostdir is not None  # meta always has rows (validated)
                d = tmp / hostdir / (f"rank={NULL_PARTITION}" if "rank" in keys else "")
                d.mkdir(parents=True, exist_ok=True)
                own = [k for k in keys if k in present[t.name]]
                cols = f"* EXCLUDE ({', '.join(own)})" if own else "*"
                conn.execute(
                    f"COPY (SELECT {cols} FROM rec.{t.name} LIMIT 0) TO {_text(str(d / f'{t.name}_0.parquet'))} "
                    "(FORMAT parquet, COMPRESSION zstd)"
                )
                continue
            conn.execute(
                f"COPY ({_select(t, present, host, has_rank)}) TO {_text(str(tmp))} (FORMAT parquet, "
                f"PARTITION_BY ({', '.join(keys)}), FILENAME_PATTERN '{t.name}_{{i}}', COMPRESSION zstd, "
                "OVERWRITE_OR_IGNORE)"
            )
            if hostdir is None:
                dirs = [d.name for d in tmp.iterdir() if d.is_dir()]
                assert len(dirs) == 1, dirs
                hostdir = dirs[0]
                _refuse_existing(out / hostdir, host, force)
        missing = [t.name for t in TABLES if t.name not in present]
        if missing:
            notes.append(f"not in the recording (an older schema): {', '.join(missing)}")
    finally:
        conn.close()
    assert hostdir is not None
    replaced = _move_into_place(tmp / hostdir, out / hostdir, host, force)
    _write_schema(out)
    part = out / hostdir
    ranks = sorted(
        {_rank_value(d.name) for d in part.iterdir() if d.is_dir() and d.name.startswith("rank=")},
        key=lambda r: (r is None, r or 0),
    )
    return ParquetExport(
        format="parquet",
        path=str(out),
        host=host,
        partition=str(part),
        ranks=ranks,
        rows=rows,
        files=sum(1 for _ in part.rglob("*.parquet")),
        replaced=replaced,
        notes=notes,
    )


def _select(t: Table, present: dict[str, frozenset[str]], host: str | None, has_rank: bool) -> str:
    """The SELECT that COPY partitions: the table's rows with their host and rank partition columns."""
    h = _text(host)
    if not (by_rank(t) and has_rank):
        if "host" in present[t.name]:  # session: every row under the recording's host
            return f"SELECT * REPLACE ({h} AS host) FROM rec.{t.name}"
        return f"SELECT *, {h} AS host FROM rec.{t.name}"
    if t.name == "processes":  # its own rank column
        return f"SELECT *, {h} AS host FROM rec.processes"
    if t.name in _RANK_BY_TID:
        return f"SELECT t.*, {h} AS host, r.rank FROM rec.{t.name} t LEFT JOIN tid_rank r ON r.tid = t.tid"
    return f"SELECT t.*, {h} AS host, r.rank FROM rec.{t.name} t LEFT JOIN pid_rank r ON r.pid = t.pid"


def _rank_value(dirname: str) -> int | None:
    v = unquote(dirname.split("=", 1)[1])
    return None if v == NULL_PARTITION else int(v)


def _refuse_existing(dst: Path, host: str | None, force: bool) -> None:
    refuse_existing(
        [dst],
        force,
        f"A recording of host {host!r} was exported there before: pass --force to replace that host's "
        "partition (the other hosts' stay), or pick another -o.",
    )


def _move_into_place(src: Path, dst: Path, host: str | None, force: bool) -> bool:
    """Rename the written partition to ``dst``; with ``force`` replace what is there. True when it replaced."""
    _refuse_existing(dst, host, force)  # again: another export may have written it meanwhile
    old = None
    if dst.exists():
        old = dst.with_name(f".tracer-old-{os.getpid()}-{dst.name}")
        os.rename(dst, old)
    try:
        os.rename(src, dst)
    except OSError:
        if old is not None:
            os.rename(old, dst)
        if dst.exists():
            _refuse_existing(dst, host, False)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return old is not None


def _write_schema(out: Path) -> None:
    tmp = out / f".{SCHEMA_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(schema_document(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, out / SCHEMA_FILE)
    finally:
        tmp.unlink(missing_ok=True)
