"""The CPython builds the frame-walker tests run, found where pyenv keeps them rather than at fixed paths.

The pyenv builds carry DWARF, so the tests compare the built-in offset table with the offsets the debug info
gives; Debian's own interpreter has none and exercises the table alone.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

# the versions whose layouts the recorder's built-in table verifies against DWARF (3.14 is not installed here)
PYENV_VERSIONS = ("3.10", "3.11", "3.12", "3.13")
DEBIAN_PYTHON = Path("/usr/bin/python3.11")  # Debian 12's interpreter, stripped of DWARF
_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)")  # a plain release: not 3.13.0t (free-threaded) nor 3.13.0rc1


@functools.cache  # `pyenv root` is a shell script that forks dozens of helpers
def pyenv_roots() -> tuple[Path, ...]:
    """Where pyenv may keep its builds: $PYENV_ROOT, what ``pyenv root`` says, ~/.pyenv (those that exist)."""
    found = [os.environ.get("PYENV_ROOT", "")]
    exe = shutil.which("pyenv")
    if exe:
        try:
            found.append(subprocess.run([exe, "root"], capture_output=True, text=True, timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    found.append(str(Path.home() / ".pyenv"))
    return tuple(dict.fromkeys(Path(p) for p in found if p and Path(p, "versions").is_dir()))


def pyenv_home(version: str) -> Path | None:
    """The newest pyenv build of CPython ``version`` ("3.12"), or None when there is none."""
    best: tuple[int, Path] | None = None
    for root in pyenv_roots():
        for d in (root / "versions").glob(f"{version}.*"):
            m = _RELEASE.fullmatch(d.name)
            if m and f"{m[1]}.{m[2]}" == version and (d / "bin" / "python").exists():
                if best is None or int(m[3]) > best[0]:
                    best = (int(m[3]), d)
    return best[1] if best else None


def pyenv_python(version: str) -> Path | None:
    home = pyenv_home(version)
    return home / "bin" / "python" if home else None


def pyenv_libpython(version: str) -> Path | None:
    """The shared libpython of the pyenv build (pyenv builds with --enable-shared here), or None."""
    home = pyenv_home(version)
    lib = home / "lib" / f"libpython{version}.so.1.0" if home else None
    return lib if lib is not None and lib.exists() else None
