"""`tracer record`, `tracer doctor`, `tracer demo` (registered on the app by tracer.cli)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the recording commands to ``app``."""
