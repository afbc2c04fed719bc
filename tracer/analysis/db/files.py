"""The trace DB's file: what is on disk (a regular file, a Parquet dataset's files), opening it read-only and
hardened, and the errors a user sees when it is not a file we can read.

The connection is read-only and hardened once for the whole DuckDB instance (no file or network access from SQL,
no extension install or load, no replacement scans of Python variables, configuration locked), because
``run_sql`` runs untrusted SQL on it and the tracer may run as root. DuckDB refuses to reopen one file with a
different configuration in one process, so every read connection of a process uses the same configuration:
:data:`READ_CONFIG`, plus the query limits in a query worker (its own process).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

import duckdb

from tracer.errors import StoreError
from tracer.schema import TABLE_BY_NAME

READ_CONFIG: dict[str, str | bool | int] = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "python_enable_replacements": False,
    "lock_configuration": True,
}

# what to do about a recording still being written
LIVE_HINT = "Stop the recorder (Ctrl-C), or query it live through `tracer record --mcp-http`."
# the hint of a file that is not a recording (the dataset and job openers say it too)
RECORD_HINT = "Pass a trace DB written by `tracer record`."
_DAMAGED_HINT = (
    "The file is damaged or truncated (a copy cut short, a full disk, or a file changed while it was read). "
    "Use an intact copy, or record again: sudo tracer record -- python train.py"
)

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
            else RECORD_HINT
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
            raise StoreError(f"{p} is not a DuckDB file", RECORD_HINT) from None
        if is_damaged(e):
            raise read_error(p, e) from None
        raise StoreError(f"cannot open {p}: {(msg.splitlines() or [''])[0][:300]}", RECORD_HINT) from None
