"""The one check of an output file a command is about to write (`export`, `flame`, `export --per-rank`)."""

from __future__ import annotations

from pathlib import Path

from tracer.errors import UsageError


def check_output_file(path: Path, force: bool) -> None:
    """Refuse ``path`` unless it can be written as a new file, or replaced under ``force``: a directory, a missing
    parent directory and an existing file without ``force`` each get a UsageError that says what to do."""
    if path.is_dir():
        raise UsageError(f"{path} is a directory", "Pass a file name with -o.")
    if not path.parent.is_dir():
        raise UsageError(f"no directory {path.parent} to write {path.name} into", "Create it, or pick another -o.")
    refuse_existing([path], force)


def refuse_existing(
    paths: list[Path], force: bool, hint: str = "Pass --force to overwrite, or pick another -o."
) -> None:
    """Refuse to write over ``paths`` that exist, unless ``force``."""
    taken = [str(p) for p in paths if p.exists()]
    if taken and not force:
        raise UsageError(f"{', '.join(taken)} exist{'s' if len(taken) == 1 else ''}", hint)
