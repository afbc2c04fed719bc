"""The one check of a file a command is about to create: the recorder's ``--db`` and the views' ``-o``.

Each refusal names what is wrong and what to do, in the error its caller raises (a StoreError for the recording,
exit 5; a UsageError for an export's ``-o``, exit 2), with the option to change.
"""

from __future__ import annotations

import os
from pathlib import Path

from tracer.errors import TracerError, UsageError


def check_new_file(path: Path, force: bool, option: str = "-o", error: type[TracerError] = UsageError) -> None:
    """Raise ``error`` unless ``path`` can be written as a new file, or replaced under ``force``: a directory, a
    missing or unwritable parent and an existing file without ``force`` are refused; ``force`` replaces a file,
    never a directory."""
    parent = path.parent if str(path.parent) else Path(".")
    try:
        is_dir, parent_ok, exists = path.is_dir(), parent.is_dir(), path.exists()
        writable = parent_ok and os.access(parent, os.W_OK)
    except OSError as e:  # a parent we may not even look into
        raise error(f"cannot use {path}: {e.strerror}", f"Pick another {option}.") from None
    if is_dir:
        raise error(f"{path} is a directory", f"Pass a file name with {option}.")
    if not parent_ok:
        hint = f"Create it (mkdir -p {parent}), or pick another {option}."
        raise error(f"no directory {parent} to write {path.name} into", hint)
    if not writable:
        raise error(f"cannot write to directory {parent}", f"Pick another {option}.")
    if exists and not force:
        raise error(f"{path} already exists", f"Pass --force to overwrite it, or pick another {option}.")
