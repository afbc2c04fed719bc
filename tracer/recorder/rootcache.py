"""The rule for a cache the recorder (root) loads from: bytecode (bpfcache.py) and parsed libraries (elfcache.py).

Whatever is in such a directory ends up in the kernel or steers what the recorder reads, so it is trusted only when
root alone could have written it: the directory and its parent root's and writable by no one else, no symlink,
and each entry root's too (checked by the caches, with :func:`safe_owner`).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)


def safe_owner(st: os.stat_result) -> bool:
    """Whether a file or directory with this stat is root's (and we are root), writable by no group or other."""
    return st.st_uid == os.geteuid() == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def dir_ok(d: Path) -> bool:
    """Whether ``d`` is a directory we may load from: root's, no symlink, writable by root alone, in a parent of
    the same kind (else another user could put a directory of their making in its place)."""
    try:
        st, parent = os.lstat(d), os.stat(d.absolute().parent)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and safe_owner(st) and safe_owner(parent)


def ensure_dir(d: Path, what: str) -> bool:
    """Create ``d`` (mode 0700) if missing; return whether it may be used (:func:`dir_ok`). ``what`` names the
    cache in the warning about an unsafe directory."""
    if not d.exists():
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
        except OSError as e:
            log.debug("%s: cannot create %s: %s", what, d, e)
            return False
    ok = dir_ok(d)
    if not ok:
        log.warning("%s: %s is not a root-owned directory writable by root alone: not used", what, d)
    return ok


def read_entry(path: Path, what: str) -> bytes | None:
    """The bytes of the cache entry at ``path``, or None: absent, a link, or not a regular file root alone could
    have written (warned, naming the cache ``what``). The caller then checks its content."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or not safe_owner(st):
            log.warning("%s: %s is not a root-owned file writable by root alone: ignored", what, path)
            return None
        try:
            return f.read()
        except OSError:
            return None
