"""Another recording named by its bare file name in one directory: how ``compare_traces`` (MCP) finds the
recording to compare the served one with.

A model names the file, so nothing but a ``*.duckdb`` file directly in the directory may be reached: no path, no
hidden file, no link that leads out of the directory (issue 17: a link in it led to any file on the host). The
errors name the recordings that can be named, never the directory (the server's paths stay its own, issue 30).
"""

from __future__ import annotations

from pathlib import Path

from tracer.errors import UsageError, echo

RECORDING_SUFFIX = ".duckdb"  # only files so named are read
LIST_RECORDINGS = 20  # recordings named in the error for a name that is not one of them
NAME_MAX = 255  # a file name's longest (NAME_MAX on Linux)


def sibling(directory: Path, name: str) -> Path:
    """Return the recording ``name`` in ``directory``, every symlink resolved (the checked target, not the link: a
    link swapped after this check is not followed).

    Raises:
        UsageError: ``name`` is not a bare ``*.duckdb`` file name, names no file there, or is a link leading out
            of ``directory`` (or to a file not so named); the message lists the recordings that can be named.
    """
    bad = (
        not name
        or len(name) > NAME_MAX
        or any(ch in name for ch in ("/", "\\", "\0"))
        or name.startswith(".")
        or not name.endswith(RECORDING_SUFFIX)
    )
    if bad:
        raise UsageError(
            f"{echo(name)} is not a recording's file name: pass the bare name of a {RECORDING_SUFFIX} file in the "
            f"served recording's directory, without a path; recordings here: {listing(directory)}"
        )
    p = directory / name
    if not p.exists():
        raise UsageError(f"no recording {echo(name)} here; recordings here: {listing(directory)}")
    real = inside(directory, p)
    if real is None:
        raise UsageError(
            f"{echo(name)} is a link that leads out of the served recording's directory (or to a file not named "
            f"{RECORDING_SUFFIX}): nothing outside it is read; recordings here: {listing(directory)}"
        )
    return real


def listing(directory: Path) -> str:
    """The recordings :func:`sibling` accepts in ``directory``, by name, comma-separated (at most
    :data:`LIST_RECORDINGS`, then how many in all); ``(none)`` when there are none or it cannot be read."""
    try:
        names = sorted(
            p.name
            for p in directory.iterdir()
            if p.name.endswith(RECORDING_SUFFIX) and not p.name.startswith(".") and inside(directory, p) is not None
        )
    except OSError:
        names = []
    shown = ", ".join(names[:LIST_RECORDINGS])
    return (shown + (f" … ({len(names)} in all)" if len(names) > LIST_RECORDINGS else "")) or "(none)"


def inside(directory: Path, p: Path) -> Path | None:
    """Return ``p`` with every symlink resolved when that stays within ``directory`` and names a
    ``*.duckdb`` file, else None (a dangling link, a loop, a link out)."""
    try:
        real = p.resolve(strict=True)
        root = directory.resolve(strict=True)
    except (OSError, RuntimeError):  # a dangling link, a loop
        return None
    return real if real.is_relative_to(root) and real.name.endswith(RECORDING_SUFFIX) else None
