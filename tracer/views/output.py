"""Refusing to write over existing output files (`export`, `export --per-rank`, the Parquet host); a single new
file is checked by tracer/newfile.py."""

from __future__ import annotations

from pathlib import Path

from tracer.errors import UsageError


def refuse_existing(
    paths: list[Path], force: bool, hint: str = "Pass --force to overwrite, or pick another -o."
) -> None:
    """Refuse to write over ``paths`` that exist, unless ``force``."""
    taken = [str(p) for p in paths if p.exists()]
    if taken and not force:
        raise UsageError(f"{', '.join(taken)} exist{'s' if len(taken) == 1 else ''}", hint)
