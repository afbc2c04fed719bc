"""Open a trace DB for reading, tell the user plainly when the file is not one we can read, and say how the
recording in it ended.

Every reader (CLI views, MCP tools, ``run_sql``'s query workers) goes through :func:`open_trace`. The connection
is read-only and hardened once for the whole DuckDB instance (no file or network access from SQL, no extension
install or load, no replacement scans of Python variables, configuration locked), because ``run_sql`` runs
untrusted SQL on it and the tracer may run as root. DuckDB refuses to reopen one file with a different
configuration in one process, so every read connection of a process uses the same configuration:
:data:`READ_CONFIG`, plus the query limits in a query worker (its own process).

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

import glob
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import duckdb
from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.job import GLOB_CHARS, JOB_SESSION, define_views, is_job
from tracer.analysis.sqltext import ident, literal, union_view
from tracer.errors import StoreError
from tracer.procfs import boot_id, process_start_ticks
from tracer.schema import APP_ID, SCHEMA_VERSION, TABLE_BY_NAME

READ_CONFIG: dict[str, str | bool | int] = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "python_enable_replacements": False,
    "lock_configuration": True,
}

# the one-row view that combines a job's session rows (tracer.analysis.job): what session_row reads on a job
LIVE_HINT = "Stop the recorder (Ctrl-C), or query it live through `tracer record --mcp-http`."
_RECORD_HINT = "Pass a trace DB written by `tracer record`."
_DAMAGED_HINT = (
    "The file is damaged or truncated (a copy cut short, a full disk, or a file changed while it was read). "
    "Use an intact copy, or record again: sudo tracer record -- python train.py"
)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_file(path: str | Path) -> Path:
    """Return ``path`` if it names a regular file (after symlinks); raise :class:`StoreError` otherwise.

    Checked before DuckDB opens anything: opening a FIFO blocks until a writer appears, a device can be endless.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise StoreError(
            f"no trace DB at {p}",
            "Record one first: sudo tracer record -- python train.py (or pass --db PATH).",
        ) from None
    except OSError as e:
        raise StoreError(f"cannot open {p}: {e.strerror}", "Check the path and its permissions.") from None
    if not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode) and dataset_files(p):
            raise StoreError(
                f"{p} is a Parquet dataset, and this reads a .duckdb file (tracer sql and run_sql do)",
                "Pass the .duckdb recording, or query the dataset with DuckDB's read_parquet (DIR/schema.json).",
            )
        what = _kind(st.st_mode)
        hint = (
            "Pass the .duckdb file with --db PATH, or a dataset directory written by `tracer export --format parquet`."
            if what == "a directory"
            else _RECORD_HINT
        )
        raise StoreError(f"{p} is {what}, not a trace DB file", hint)
    return p


def is_damaged(e: duckdb.Error) -> bool:
    """True when DuckDB's error means the file's bytes are wrong (truncated, corrupt, changed while read)."""
    msg = str(e).lower()
    return isinstance(e, duckdb.IOException) or any(
        s in msg for s in ("corrupt database", "could not read enough bytes", "checksum", "failed to deserialize")
    )


def read_error(name: str | Path, e: duckdb.Error) -> StoreError:
    """Return the :class:`StoreError` to raise when reading trace DB ``name`` failed inside DuckDB."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    first = first.replace(f'file "{name}"', "the file").replace(f'"{name}"', "the file")
    first = first.removeprefix("IO Error: ")[:200]
    if is_damaged(e):
        return StoreError(f"{name} cannot be read: {first}", _DAMAGED_HINT)
    return StoreError(
        f"reading {name} failed: {first}",
        "The DB may come from another tracer version; run_sql can still query its tables (tracer sql).",
    )


def connect_read_only(
    path: str | Path, config: Mapping[str, str | bool | int] | None = None
) -> duckdb.DuckDBPyConnection:
    """Return a hardened read-only connection to ``path`` without checking what the file holds.

    Args:
        config: settings added to :data:`READ_CONFIG` (a query worker's memory_limit, threads, temp directory).
    """
    p = check_file(path)
    try:
        return duckdb.connect(str(p), read_only=True, config={**READ_CONFIG, **(config or {})})
    except duckdb.Error as e:
        msg = str(e)
        low = msg.lower()
        if "could not set lock" in low or "conflicting lock" in low:
            raise StoreError(f"{p} is being written by another process (it holds the file lock)", LIVE_HINT) from None
        if "not a valid duckdb database" in low or "magic" in low:
            raise StoreError(f"{p} is not a DuckDB file", _RECORD_HINT) from None
        if is_damaged(e):
            raise read_error(p, e) from None
        raise StoreError(f"cannot open {p}: {(msg.splitlines() or [''])[0][:300]}", _RECORD_HINT) from None


class RecordingState(Record):
    """How the recording in a trace DB ended, or that its recorder is still writing it."""

    status: Annotated[
        str,
        Field(description="session.status: complete | interrupted | target_exited | failed | disk_full | recording"),
    ]
    live: Annotated[bool, Field(description="a recorder is writing this DB now (its pid lives, same boot)")]
    finished: Annotated[
        bool, Field(description="the recorder's final flush ran (exact aggregates, processes, chains written)")
    ]
    ended: Annotated[str, Field(description="how the recording ended, in one sentence")]
    recorder_pid: Annotated[int | None, Field(description="pid of the recorder, when recorded")] = None
    flushed_ns: Annotated[int | None, Field(description="ts_ns up to which rows were written (session.flushed_ns)")] = (
        None
    )


_ENDED = {
    "complete": "the recording finished (--duration reached)",
    "interrupted": "the recording was stopped with Ctrl-C",
    "target_exited": "the recording ended when the traced program exited",
    "failed": "the recorder stopped on an error; the data written before it is here",
    "disk_full": "the recording ended when the disk filled up; the data committed before that is here",
    "snapshot": "a snapshot of a recording in progress (tracer record --mcp-http): it covers up to session.flushed_ns",
}


def recorder_alive(pid: int | None, start_ticks: int | None, boot: str | None) -> bool:
    """True when the recorder identified by (pid, start ticks, boot id) is running now."""
    if pid is None or start_ticks is None:
        return False
    if boot is not None and boot != boot_id():
        return False
    return process_start_ticks(pid) == start_ticks


def session_row(
    conn: duckdb.DuckDBPyConnection, columns: Sequence[str], expressions: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """Return the recording's session row (the last one) as {name: value} for ``columns`` then ``expressions``,
    in that order; None when the table has no row. On a job of several recordings, its one combined row
    (``job_session``: the rules per column are :data:`tracer.analysis.job.SESSION_RULES`).

    A column the file's schema lacks (written by an older recorder: a v1 file has no recorder identity) reads
    None, as a NULL would, so callers need not check the schema version.

    Args:
        columns: session column names.
        expressions: name -> SQL expression over the session's columns, computed by DuckDB in the same query
            (``epoch_ns(started_at)``: its timestamp arithmetic, not Python's; a TIMESTAMPTZ itself would need
            pytz to reach Python).
    """
    if not all(c.isidentifier() for c in columns):  # names from our code, spliced into the query's regex
        raise ValueError(f"not session column names: {list(columns)}")
    extra = "".join(f", {sql} AS {name}" for name, sql in (expressions or {}).items())
    table = JOB_SESSION if is_job(conn) else "session"
    # COLUMNS(regex) selects those of the names this file's schema has, in one query; session_id is in every
    # schema, so the match is never empty (DuckDB refuses an empty one)
    cur = conn.execute(
        f"SELECT COLUMNS('^({'|'.join(('session_id', *columns))})$'){extra} FROM {table} "
        "ORDER BY session_id DESC LIMIT 1"
    )
    row = cur.fetchone()
    if row is None:
        return None
    have = dict(zip((d[0] for d in cur.description or []), row, strict=True))
    return {name: have.get(name) for name in (*columns, *(expressions or {}))}


_STATE_COLUMNS = ("status", "recorder_pid", "recorder_start_ticks", "boot_id", "flushed_ns")


def thinned_note(conn: duckdb.DuckDBPyConnection) -> str | None:
    """One line saying which detail rows ``tracer record --max-db-size`` thinned (table dropped_rows), or None when
    none were (or the recording predates the table). On a job: each recording's rows, the latest cut."""
    try:
        rows = conn.execute(
            "SELECT table_name, sum(rows), max(to_ns) FROM dropped_rows GROUP BY table_name HAVING sum(rows) > 0 "
            "ORDER BY table_name"
        ).fetchall()
    except duckdb.CatalogException:  # an older recording: nothing was ever thinned
        return None
    if not rows:
        return None
    cut = max(r[2] for r in rows)
    dropped = ", ".join(f"{t} {int(n):,}" for t, n, _ in rows)
    return (
        f"detail rows before {cut / 1e9:.1f} s were thinned to keep the file under --max-db-size ({dropped} rows "
        "dropped; table dropped_rows): per-call, off-CPU interval and stack rows cover only the time after it; "
        "op_stats, thread_breakdown and the per-second tables are exact over the whole recording"
    )


def recording_state(conn: duckdb.DuckDBPyConnection) -> RecordingState:
    """Return how the recording in the open trace DB ended (or that it is live), from its last session row.

    Raises:
        StoreError: no session row (the recording never started or was cut off before its first write).
    """
    s = session_row(conn, _STATE_COLUMNS)
    if s is None:
        raise StoreError(
            "the DB has no session row: the recording never started or was cut off early",
            "Record again: sudo tracer record -- python train.py",
        )
    status = str(s.get("status") or "")
    pid, flushed = s.get("recorder_pid"), s.get("flushed_ns")
    if status != "recording":
        ended = _ENDED.get(status, f"the recording ended with status {status!r}")
        return RecordingState(
            status=status,
            live=False,
            finished=status not in ("failed", "disk_full", "snapshot"),
            ended=ended,
            recorder_pid=pid,
            flushed_ns=flushed,
        )
    if recorder_alive(pid, s.get("recorder_start_ticks"), s.get("boot_id")):
        return RecordingState(
            status=status, live=True, finished=False, ended=f"still being recorded by pid {pid}", recorder_pid=pid
        )
    who = f"the recorder (pid {pid})" if pid is not None else "the recorder"
    upto = (
        f"the data up to its last flush (session.flushed_ns = {flushed:,} ns, {flushed / 1e9:.1f} s) is here"
        if flushed is not None
        else "the data it had written is here"
    )
    return RecordingState(
        status=status,
        live=False,
        finished=False,
        ended=f"{who} is gone: killed or crashed; {upto}",
        recorder_pid=pid,
        flushed_ns=flushed,
    )


def validate(conn: duckdb.DuckDBPyConnection, name: str = "the DB") -> RecordingState:
    """Return the recording state if ``conn`` holds a trace DB of a schema we can read, not being recorded now.

    Raises:
        StoreError: not ours, newer or unknown schema, damaged, no session row, or a live recording.
    """
    try:
        rows = conn.execute("SELECT key, value FROM meta WHERE key IN ('app', 'schema_version')").fetchall()
    except duckdb.CatalogException:
        raise StoreError(f"{name} is not a cuda-host-tracer trace DB (no meta table)", _RECORD_HINT) from None
    except duckdb.Error as e:
        raise read_error(name, e) from None
    meta = dict(rows)
    if meta.get("app") != APP_ID:
        raise StoreError(f"{name} is not a cuda-host-tracer trace DB (meta app = {meta.get('app')!r})", _RECORD_HINT)
    try:
        version = int(meta.get("schema_version", "0"))
    except ValueError:
        version = 0
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{name} has schema version {version}; this tracer reads up to {SCHEMA_VERSION}",
            "Upgrade cuda-host-tracer (pip install -U cuda-host-tracer).",
        )
    if version < 1:
        raise StoreError(f"{name} has an unknown schema version {meta.get('schema_version')!r}", _RECORD_HINT)
    try:
        state = recording_state(conn)
    except StoreError as e:
        raise StoreError(f"{name}: {e.message}", e.hint) from None
    except duckdb.Error as e:
        raise read_error(name, e) from None
    if state.live:
        raise StoreError(f"{name} is still being recorded ({state.ended})", LIVE_HINT)
    return state


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


# --- Parquet datasets (tracer export --format parquet) -------------------------------------------------------------

# the hive partition keys a dataset's paths carry, with their types (a host named "123" stays a name)
PARTITION_TYPES: dict[str, str] = {"host": "VARCHAR", "rank": "INTEGER"}
# a table's files are <table>_<i>.parquet (DuckDB's FILENAME_PATTERN '<table>_{i}'); the digit keeps sched_0 apart
# from sched_stats_0
DATASET_FILE = re.compile(r"^([a-z][a-z0-9_]*?)_([0-9]+)\.parquet$")


def dataset_files(root: str | Path) -> dict[str, list[Path]]:
    """Return {table: its Parquet files} of the dataset under ``root`` (its top or one host=<h> partition), for
    the tables of the schema; {} when ``root`` holds none. Hidden directories (an export in progress) are skipped."""
    root = Path(root)
    found: dict[str, list[Path]] = {}
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if "=" in d and not d.startswith("."))  # host=<h>, rank=<r> only
        if len(Path(top).relative_to(root).parts) > 2:
            dirs[:] = []
            continue
        for f in files:
            m = DATASET_FILE.match(f)
            if m and m.group(1) in TABLE_BY_NAME:
                found.setdefault(m.group(1), []).append(Path(top, f))
    return found


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
            raise StoreError(f"{path} is not a cuda-host-tracer dataset (meta app = {apps!r})", _RECORD_HINT)
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


# --- several recordings as one job (tracer.analysis.job: the views, pids and clocks) ----------------------------------


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
