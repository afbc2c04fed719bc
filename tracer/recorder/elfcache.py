"""What the symbolizer and the unwinder parsed from each ELF file, kept on disk between recordings (issue 33).

Parsing a library with pyelftools is the recorder's largest cost in a short recording: its symbols, its PT_LOADs,
its .eh_frame index and, where it has one, its .debug_line table took ~450 ms of the `tracer demo` recording's
~930 ms of CPU (2026-11-28), and ~260 ms of a 5,000-step train.py recording's ~800 ms, all in the first drains.
Those facts depend on the file alone, so each file's are written here once (at the end of the recording that
parsed them) and read back, as numpy arrays, by the next recording in about a millisecond.

An entry is keyed by the file's identity as stat(2) sees it: device, inode, size, mtime and ctime (ctime cannot be
set back by a user, so a rewritten file misses). It is an ``.npz`` read with ``allow_pickle=False`` (arrays only,
never code), from the same kind of directory as the BPF compile cache (tracer/recorder/bpfcache.py): root's, mode
0700, no symlink, writable by root alone; anything else, or an entry whose arrays do not have the expected shape, is
ignored and the file parsed again.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import overload

import numpy as np

from tracer.recorder.rootcache import dir_ok, ensure_dir, read_entry

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what an entry holds changes: old entries then miss
DEFAULT_DIR = Path("/var/cache/cuda-host-tracer/elf")
ENV_DIR = "TRACER_ELF_CACHE"  # another directory (tests, bench cold runs); "off": no cache
KEEP = 1024  # entries kept, newest first (a few KB to a few MB each: libtorch's symbols are the large ones)
# An entry past this is not written: writing it would lengthen the recording's finish by about as long as the
# parse it saves, and KEEP of them would fill a disk (libtorch_cuda's millions of symbol names alone are ~100 MB).
MAX_ENTRY_BYTES = 64 * 2**20

Arrays = dict[str, np.ndarray]


def cache_dir() -> Path | None:
    """The cache directory in use: $TRACER_ELF_CACHE, else :data:`DEFAULT_DIR`; None when the cache is off or this
    process is not root (only root's own entries are trusted)."""
    v = os.environ.get(ENV_DIR)
    if v == "off" or os.geteuid() != 0:
        return None
    return Path(v) if v else DEFAULT_DIR


def file_key(path: str, kind: str) -> str | None:
    """The entry name of ``kind`` (``sym``, ``eh``) for the file at ``path`` as it is now, or None if unreadable."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    ident = f"{FORMAT}:{kind}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    return f"{kind}-{hashlib.sha256(ident.encode()).hexdigest()[:32]}"


def load(d: Path | None, key: str | None) -> Arrays | None:
    """The arrays of entry ``key``, or None: no cache, absent, unsafe or corrupt."""
    if d is None or key is None or not dir_ok(d):
        return None
    raw = read_entry(d / f"{key}.npz", "elf cache")
    if raw is None:
        return None
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        log.warning("elf cache: %s/%s.npz is corrupt (%s): ignored", d, key, e)
        return None


def store(d: Path | None, key: str | None, arrays: Arrays) -> bool:
    """Write ``arrays`` as entry ``key`` (atomically, mode 0600); False where there is no usable directory."""
    if d is None or key is None or sum(a.nbytes for a in arrays.values()) > MAX_ENTRY_BYTES:
        return False
    if not ensure_dir(d, "elf cache"):
        return False
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".npz")  # mode 0600
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, d / f"{key}.npz")
    except (OSError, ValueError) as e:
        log.warning("elf cache: cannot write %s: %s", d, e)
        return False
    return True


def prune(d: Path | None, keep: int = KEEP) -> None:
    """Drop all but the ``keep`` newest entries (files replaced or removed leave entries nobody reads)."""
    if d is None or not dir_ok(d):
        return
    try:
        entries = sorted(d.glob("*.npz"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[keep:]:
            old.unlink()
    except OSError as e:
        log.debug("elf cache: cannot prune %s: %s", d, e)


# --- strings as arrays: a blob of UTF-8 and the offsets of each string's end -------------------------------------


def pack_bytes(items: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(blob, ends): the byte strings one after another and where each ends."""
    ends = np.cumsum([len(b) for b in items], dtype=np.int64) if items else np.zeros(0, dtype=np.int64)
    return np.frombuffer(b"".join(items), dtype=np.uint8).copy(), ends


def _check_packed(blob: np.ndarray, ends: np.ndarray) -> None:
    """Raise ValueError unless (blob, ends) is what :func:`pack_bytes` makes: ends increasing, the last the blob's
    length (a corrupt entry otherwise)."""
    if blob.dtype != np.uint8 or blob.ndim != 1 or ends.ndim != 1:
        raise ValueError("string arrays of the wrong type")
    if len(ends) and (int(ends[-1]) != len(blob) or (np.diff(ends) < 0).any() or int(ends[0]) < 0):
        raise ValueError("string offsets out of range")


def unpack_bytes(blob: np.ndarray, ends: np.ndarray) -> list[bytes]:
    """The byte strings :func:`pack_bytes` packed.

    Raises:
        ValueError: ends not increasing or past the blob (a corrupt entry).
    """
    _check_packed(blob, ends)
    raw, ends_l = blob.tobytes(), ends.tolist()
    starts = [0, *ends_l[:-1]] if ends_l else []
    return [raw[a:b] for a, b in zip(starts, ends_l, strict=True)]


def pack_strings(items: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(blob, ends): the strings' UTF-8 bytes one after another and where each ends."""
    return pack_bytes([s.encode("utf-8", "surrogatepass") for s in items])


def unpack_strings(blob: np.ndarray, ends: np.ndarray) -> list[str]:
    """The strings :func:`pack_strings` packed.

    Raises:
        ValueError: ends not increasing or past the blob (a corrupt entry).
    """
    return [b.decode("utf-8", "surrogatepass") for b in unpack_bytes(blob, ends)]


class PackedStrings(Sequence[str]):
    """The strings :func:`pack_strings` packed, each decoded when it is asked for.

    A library's symbol names run to tens of thousands (libtorch_cpu's to 342 K, 55 MB of mangled names) and a
    recording names a few dozen of them. Decoding them all as an entry was read took 16-27 ms for a library of
    35-65 K names, and 190-256 ms of the 300 that reading libtorch_cpu's entry took in a torch_loader.py recording's
    first drains (2026-11-29); now ~110 ms, nearly all of it reading the entry's 63 MB."""

    def __init__(self, blob: np.ndarray, ends: np.ndarray) -> None:
        """Raises:
        ValueError: ends not increasing or past the blob (a corrupt entry)."""
        _check_packed(blob, ends)
        self._blob, self._ends = blob, ends
        self._raw = memoryview(blob)  # not a copy: libtorch_cpu's names are 55 MB

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._ends)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        start = int(self._ends[i - 1]) if i else 0
        return str(self._raw[start : int(self._ends[i])], "utf-8", "surrogatepass")

    def packed(self) -> tuple[np.ndarray, np.ndarray]:
        """(blob, ends), as :func:`pack_strings` made them: written back without decoding a name."""
        return self._blob, self._ends


def pack_names(items: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pack_strings` of a list, or a :class:`PackedStrings`' own arrays."""
    return items.packed() if isinstance(items, PackedStrings) else pack_strings(list(items))
