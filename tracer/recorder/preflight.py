"""What a machine needs before it can record, checked in one place: ``tracer record`` stops at the first thing
missing (:func:`check_environment`), ``tracer doctor`` lists them all (:func:`checks`)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

UPROBE_MULTI_KERNEL = (6, 6)  # BPF_TRACE_UPROBE_MULTI links (links.py)


@dataclass(frozen=True)
class Check:
    """One requirement: its name, whether this machine meets it, and what to do when it does not."""

    name: str
    ok: bool
    problem: str  # what is wrong, as the error says it
    fix: str
    required: bool = True  # False: recording works without it, with less (doctor warns)


def kernel_version() -> tuple[int, int]:
    """(major, minor) of the running kernel."""
    parts = os.uname().release.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def _bcc_importable() -> bool:
    try:
        import bcc  # noqa: F401
    except ImportError:
        return False
    return True


def checks() -> list[Check]:
    """Every requirement, in the order a user should fix them."""
    rel = os.uname().release
    need = ".".join(map(str, UPROBE_MULTI_KERNEL))
    return [
        Check(
            "running as root",
            os.geteuid() == 0,
            "recording needs root (BPF and uprobes)",
            "run it with sudo: sudo tracer record ...",
        ),
        Check(
            "bcc importable",
            _bcc_importable(),
            "bcc (python3-bpfcc) is not importable",
            "run ./setup.sh, which installs it and the kernel headers",
        ),
        Check(
            f"uprobe_multi links (Linux {need}+)",
            kernel_version() >= UPROBE_MULTI_KERNEL,
            f"Linux {rel} has no uprobe_multi links; recording needs {need} or newer",
            "use a newer kernel (Ubuntu 24.04 ships 6.8; Ubuntu 22.04's HWE kernel is too old)",
        ),
        Check(
            f"kernel headers for {rel}",
            os.path.exists(f"/lib/modules/{rel}/build"),
            f"no kernel headers for {rel} (bcc compiles against them)",
            "run ./setup.sh: it installs them, or the newest Debian headers where none match",
        ),
        Check(
            "kernel BTF (/sys/kernel/btf/vmlinux)",
            os.path.exists("/sys/kernel/btf/vmlinux"),
            "no kernel BTF",
            "needed for Python frames and exit codes; use a kernel built with CONFIG_DEBUG_INFO_BTF",
            required=False,
        ),
    ]


def check_environment() -> None:
    """Raise EnvironmentProblem at the first unmet requirement; mount tracefs/debugfs if needed."""
    from tracer.errors import EnvironmentProblem

    for c in checks():
        if c.required and not c.ok:
            raise EnvironmentProblem(c.problem, c.fix)
    for fs, where in (("tracefs", "/sys/kernel/tracing"), ("debugfs", "/sys/kernel/debug")):
        if not os.path.ismount(where):
            # bcc reads tracepoint formats and removes uprobe events here; a fresh VM may not mount them at boot
            subprocess.run(["mount", "-t", fs, fs, where], capture_output=True)


def verify_program() -> str | None:
    """Compile, load and verify the full BPF program (Python frames included); return None, or what failed."""
    from tracer.recorder.program import ProgramOptions, compile_program, load_programs

    try:
        b = compile_program(ProgramOptions(with_pyframes=True))
        load_programs(b, True)
    except Exception as e:
        return str(e)
    return None


def cuda_libraries() -> list[str]:
    """The CUDA libraries found in the usual places (the ld.so cache, toolkit dirs, LD_LIBRARY_PATH, ...)."""
    from tracer.recorder import targets

    return [x.path for x in targets.resolve_libraries(targets.usual_library_paths())]
