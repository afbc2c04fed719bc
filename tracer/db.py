"""Open a trace DB for reading, and tell the user plainly when the file is not one we can read.

Every reader (CLI views, MCP tools, ``run_sql``) goes through :func:`open_trace`. The connection is read-only
and
hardened once for the whole DuckDB instance (no file or network access from SQL, no extension install or load,
no replacement scans of Python variables, configuration locked), because ``run_sql`` runs untrusted SQL on it
and
the tracer may run as root. DuckDB refuses to reopen one file with a different configuration in one process,
so
every read connection uses the same :data:`READ_CONFIG`.

Refusals raise :class:`tracer.errors.StoreError` (exit code 5): missing file, not a DuckDB file, a DuckDB file
that is not a trace DB (no ``meta`` app row), a newer schema, or a DB still being recorded.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from tracer.errors import StoreError
from tracer.schema import APP_ID, SCHEMA_VERSION

READ_CONFIG: dict[str, str | bool] = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "python_enable_replacements": False,
    "lock_configuration": True,
}

_LIVE_HINT = (
    "Stop the recorder (Ctrl-C) and retry, or query the live trace through the MCP server the recorder serves "  # noqa: E501
    "(see tracer record --help)."
)


def connect_read_only(path: str | Path) -> duckdb.DuckDBPyConnection:
    """Return a hardened read-only connection to ``path`` without checking what the file holds."""
    p = Path(path)
    if not p.exists():
        raise StoreError(
            f"no trace DB at {p}",
            "Record one first: sudo tracer record -- python train.py (or pass --db PATH).",
        )
    if p.is_dir():
        raise StoreError(f"{p} is a directory, not a trace DB", "Pass the .duckdb file with --db PATH.")
    try:
        return duckdb.connect(str(p), read_only=True, config=dict(READ_CONFIG))
    except duckdb.IOException as e:
        msg = str(e)
        if "lock" in msg.lower():
            raise StoreError(f"{p} is being written by another process (it holds the file lock)", _LIVE_HINT) from None
        if "not a valid DuckDB database" in msg or "database file" in msg.lower() or "magic" in msg.lower():
            raise StoreError(f"{p} is not a DuckDB file", "Pass a trace DB written by `tracer record`.") from None
        raise StoreError(f"cannot open {p}: {msg.splitlines()[0]}", "Check the path and its permissions.") from None
    except duckdb.Error as e:
        raise StoreError(
            f"cannot open {p}: {str(e).splitlines()[0]}", "Pass a trace DB written by `tracer record`."
        ) from None


def validate(conn: duckdb.DuckDBPyConnection, name: str = "the DB", *, allow_recording: bool = False) -> None:
    """Raise :class:`StoreError` unless ``conn`` holds a complete trace DB of a schema we can read.

    Args:
        allow_recording: accept a session still marked ``recording`` (the recorder's own in-process server).
    """
    try:
        rows = conn.execute("SELECT key, value FROM meta WHERE key IN ('app', 'schema_version')").fetchall()
    except duckdb.Error:
        raise StoreError(
            f"{name} is not a cuda-host-tracer trace DB (no meta table)",
            "Pass a trace DB written by `tracer record`.",
        ) from None
    meta = dict(rows)
    if meta.get("app") != APP_ID:
        raise StoreError(
            f"{name} is not a cuda-host-tracer trace DB (meta app = {meta.get('app')!r})",
            "Pass a trace DB written by `tracer record`.",
        )
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
        raise StoreError(
            f"{name} has an unknown schema version {meta.get('schema_version')!r}",
            "Pass a trace DB written by `tracer record`.",
        )
    if not allow_recording:
        status = conn.execute("SELECT status FROM session ORDER BY session_id DESC LIMIT 1").fetchone()
        if status is None:
            raise StoreError(
                f"{name} has no session row: the recording never started or was cut off early",
                "Record again: sudo tracer record -- python train.py",
            )
        if status[0] == "recording":
            raise StoreError(f"{name} is still being recorded (session status 'recording')", _LIVE_HINT)


def open_trace(path: str | Path, *, allow_recording: bool = False) -> duckdb.DuckDBPyConnection:
    """Return a validated, hardened read-only connection to the trace DB at ``path``.

    Raises:
        StoreError: missing, not a DuckDB file, not ours, newer schema, or still being written.
    """
    conn = connect_read_only(path)
    try:
        validate(conn, str(path), allow_recording=allow_recording)
    except BaseException:
        conn.close()
        raise
    return conn
