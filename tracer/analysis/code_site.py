"""The user's own line behind a call: a stack's innermost Python frame outside libraries and bindings. The chains
name their culprit's code site with it, the step series its wait's site."""

from __future__ import annotations

import duckdb

LIBRARY_PARTS = ("site-packages", "dist-packages", "<frozen", "/lib/python3")


def is_library(path: str | None) -> bool:
    return not path or any(p in path for p in LIBRARY_PARTS)


def code_site(conn: duckdb.DuckDBPyConnection, stack_id: int) -> str | None:
    """Return 'file:line function' of the stack's innermost Python frame in the user's own code, None without one.

    Library frames (site-packages, the stdlib) are skipped. When no library frame sits above the C call, the
    innermost file is the binding that made it (a ctypes wrapper such as FakeCuda.call): if a caller in another
    file exists, that caller is the code site, not the wrapper."""
    frames = conn.execute(
        "SELECT file, line, function FROM stacks WHERE stack_id = ? AND kind = 'python' ORDER BY depth DESC",
        [stack_id],
    ).fetchall()
    user = [f for f in frames if not is_library(f[0])] or frames
    if user and frames and user[0][0] == frames[0][0]:
        callers = [f for f in user if f[0] != user[0][0]]
        user = callers or user
    f = user[0] if user else None
    return f"{f[0]}:{f[1]} {f[2]}" if f else None
