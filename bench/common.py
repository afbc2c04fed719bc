"""Shared by the benchmarks: result JSON (machine info + timestamp), summary statistics, small helpers.

Every benchmark prints its figures and writes ``bench/results/<name>.json``; none asserts a threshold. Uprobe
costs in a VM are ~10x bare metal, so overhead figures are ratios against a baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
FIXTURES = REPO / "fixtures"
WORKLOADS = FIXTURES / "workloads"
FIXTURE_LIBS = FIXTURES / "build"
TRACER = REPO / ".venv" / "bin" / "tracer"


def machine_info() -> dict[str, Any]:
    """Return what a reader needs to compare two result files: host, kernel, CPU, cores, memory, Python."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = None
    virt = None
    try:
        virt = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu_model": cpu,
        "cpu_cores": os.cpu_count(),
        "mem_bytes": mem,
        "virtualization": virt or None,
        "python": sys.version.split()[0],
    }


def write_result(name: str, figures: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``{"bench", "timestamp", "machine", **figures}`` to ``<out_dir>/<name>.json``; return the path."""
    d = Path(out_dir) if out_dir else RESULTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    doc = {
        "bench": name,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        **figures,
    }
    path = d / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    return path


def median(xs: Sequence[float]) -> float | None:
    """Median of ``xs``; None when empty."""
    return float(statistics.median(xs)) if xs else None


def spread(xs: Sequence[float]) -> dict[str, float | None]:
    """Return min, max and the relative spread ((max - min) / median) of ``xs``; Nones when empty."""
    if not xs:
        return {"min": None, "max": None, "rel": None}
    m = statistics.median(xs)
    return {"min": float(min(xs)), "max": float(max(xs)), "rel": (max(xs) - min(xs)) / m if m else None}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def base_parser(description: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes: --quick and --out."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes / fewer repetitions (a smoke run)")
    p.add_argument("--out", type=Path, default=None, help=f"directory for the JSON result (default {RESULTS_DIR})")
    return p


def build_fixtures() -> None:
    """Build the stand-in CUDA libraries (make -C fixtures); quiet unless it fails."""
    subprocess.run(["make", "-s", "--no-print-directory", "-C", str(FIXTURES)], check=True)


def need_root(what: str) -> None:
    """Exit with a message unless running as root (BPF needs it)."""
    if os.geteuid() != 0:
        sys.exit(f"{what} needs root (BPF and uprobes): run it with sudo")


def print_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    """Print a plain aligned table on stdout."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for c, w in zip(r, widths, strict=True)))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)
