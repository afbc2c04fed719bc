"""What every view formats the same way: latencies, byte counts, traced strings, severities."""

from __future__ import annotations

from rich.markup import escape

SEVERITY_STYLE = {"HIGH": "bold red", "MEDIUM": "yellow", "LOW": "cyan"}


def us(v: float | None) -> str:
    """Format a µs latency with a readable unit: 850µs, 1.2ms, 3.40s."""
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f}s"
    if v >= 1e3:
        return f"{v / 1e3:.1f}ms"
    return f"{v:.0f}µs" if v >= 10 else f"{v:.1f}µs"


def nbytes(v: float | None) -> str:
    """Format a byte count with a decimal unit: 406.0 GB, 512 B."""
    if v is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.1f} {unit}"
    return f"{v:.0f} B"


def escaped(text: object) -> str:
    """Return ``text`` with rich markup escaped: a traced string (comm, path, kernel name) is data, printed as is."""
    return escape(str(text))
