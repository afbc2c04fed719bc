"""The user's own line in a stack, the one rule every tool names a line by (issue 31): the chains' culprit sites,
the step series' wait site, the thread stacks, the export and the names of threads all call :func:`user_frame`.

The innermost Python frame outside libraries (site-packages, the stdlib). When the stack enters CUDA and that
frame is the innermost Python frame of all, it is the binding that made the call (a ctypes wrapper such as
FakeCuda.call): if a caller in another file exists, that caller is the code site, not the wrapper. A stack that
does not enter CUDA (where a thread blocked, or ran when sampled) is named by its innermost user frame as is: the
line that waits or runs.
"""

from __future__ import annotations

import duckdb

# kind, module, function, file, line: one frame, outermost first
Frame = tuple[str, str | None, str | None, str | None, int | None]

LIBRARY_PARTS = ("site-packages", "dist-packages", "<frozen", "/lib/python3")


def is_library(path: str | None) -> bool:
    return not path or any(p in path for p in LIBRARY_PARTS)


def user_frame(frames: list[Frame]) -> Frame | None:
    """The stack's user frame (see the module docstring), else its innermost Python frame; None without one."""
    py = [f for f in reversed(frames) if f[0] == "python"]
    user = [f for f in py if not is_library(f[3])] or py
    if user and user[0][3] == py[0][3] and any(f[0] == "cuda" for f in frames):
        user = [f for f in user if f[3] != user[0][3]] or user
    return user[0] if user else None


def site_of(frames: list[Frame]) -> str | None:
    """'file:line function' of the stack's user frame, or None without Python frames."""
    f = user_frame(frames)
    return f"{f[3]}:{f[4]} {f[2]}" if f else None


def short_site(frames: list[Frame]) -> str | None:
    """'function (file.py:line)' of the stack's user frame, the way a thread is named."""
    f = user_frame(frames)
    return f"{f[2]} ({(f[3] or '?').rsplit('/', 1)[-1]}:{f[4]})" if f else None


def code_site(conn: duckdb.DuckDBPyConnection, stack_id: int) -> str | None:
    """Return 'file:line function' of stored stack ``stack_id``'s user frame, None without a Python frame."""
    frames = conn.execute(
        "SELECT kind, module, function, file, line FROM stacks WHERE stack_id = ? ORDER BY depth", [stack_id]
    ).fetchall()
    return site_of(frames)
