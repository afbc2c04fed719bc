"""Which file every executable address of a traced process belongs to, kept current from events, not from polling.

The one ``/proc/PID/maps`` parser (:func:`read_maps`) is used at attach, for processes that already run. From then
on a process's map changes only by the mapping events of probes/libload.bpf.c: the executable's text at exec and
every executable file mmap, each naming its file by (dev, ino) and dentry names (:class:`FileResolver` turns them
into a path that stats to the same inode). So an address still resolves to (file, offset) after its process has
exited, and nothing re-reads /proc per stack: the cost that made the recorder burn a core (issue 9).

A lookup miss is an address outside every file mapping (anonymous JIT code, the stack), not a stale map, unless
mapping events were lost; then :meth:`MapCache.find` re-reads /proc at most once a second per process.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # at most one /proc/PID/maps re-read per process per second, and only after lost events


@dataclass(frozen=True)
class Mapping:
    """One file mapping: [start, end) holds the file's bytes from ``offset``."""

    start: int
    end: int
    offset: int  # file offset of start
    path: str  # as the target sees it
    host_path: str  # the same file as this process can open it ("" when it could not be found)
    dev: int = 0  # st_dev (user-space encoding)
    ino: int = 0
    perms: str = "r-xp"


def parse_maps_line(line: str) -> tuple[int, int, str, int, int, int, str] | None:
    """(start, end, perms, offset, st_dev, inode, path) of one /proc/PID/maps line; None if malformed."""
    parts = line.split(None, 5)
    if len(parts) < 5:
        return None
    lo, _, hi = parts[0].partition("-")
    major, _, minor = parts[3].partition(":")
    try:
        dev = os.makedev(int(major, 16), int(minor, 16))
        return (
            int(lo, 16),
            int(hi, 16),
            parts[1],
            int(parts[2], 16),
            dev,
            int(parts[4]),
            (parts[5].rstrip("\n") if len(parts) == 6 else ""),
        )
    except ValueError:
        return None


def parse_maps(text: str, root: str = "/") -> list[Mapping]:
    """The file-backed mappings in the text of /proc/PID/maps, with paths joined under ``root`` (the target's
    root, /proc/PID/root, when it lives in another mount namespace) as ``host_path``."""
    out = []
    for line in text.splitlines():
        parsed = parse_maps_line(line)
        if parsed is None:
            continue
        start, end, perms, offset, dev, ino, path = parsed
        if not path.startswith("/"):
            continue  # [heap], [stack], [vdso], anonymous: no file
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        host = path if root == "/" else os.path.join(root, path.lstrip("/"))
        out.append(Mapping(start, end, offset, path, host, dev, ino, perms))
    return out


def read_maps(pid: int) -> list[Mapping]:
    """The file-backed mappings of a live process, from /proc/PID/maps, paths reachable from here ("" for a
    file that is not; a deleted one is read through /proc/PID/map_files).

    Raises:
        ProcessLookupError: the process is gone.
    """
    try:
        with open(f"/proc/{pid}/maps") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None
    root = f"/proc/{pid}/root"
    try:
        if os.path.realpath(root) == "/":
            root = "/"
    except OSError:
        root = "/"
    out = []
    for m in parse_maps(text, root):
        if not os.path.exists(m.host_path):
            # deleted or unreachable: the kernel still holds the file, readable through map_files (root only)
            alt = f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}"
            m = Mapping(m.start, m.end, m.offset, m.path, alt if os.path.exists(alt) else "", m.dev, m.ino, m.perms)
        out.append(m)
    return out


def kernel_dev(dev: int) -> int:
    """The user-space st_dev of a kernel dev_t (major << 20 | minor), as BPF reads it from super_block.s_dev."""
    return os.makedev(dev >> 20, dev & 0xFFFFF)


class FileResolver:
    """(dev, ino, dentry names) -> a path this process can open that stats to that inode.

    Candidates: a path already known for the inode; the dentry path under each mount point of the device
    (/proc/self/mountinfo, re-read when a device is new); the same under /proc/PID/root for a target in another
    mount namespace. Every candidate is checked with stat, so a wrong guess is never used.
    """

    def __init__(self) -> None:
        self._known: dict[tuple[int, int], str] = {}
        self._mounts: dict[int, list[tuple[str, str]]] = {}  # st_dev -> [(root within fs, mount point)]

    def remember(self, dev: int, ino: int, path: str) -> None:
        self._known[(dev, ino)] = path

    def _load_mounts(self) -> None:
        self._mounts = {}
        try:
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) < 5:
                        continue
                    major, _, minor = parts[2].partition(":")
                    dev = os.makedev(int(major), int(minor))
                    self._mounts.setdefault(dev, []).append((parts[3], parts[4]))
        except (OSError, ValueError) as e:
            log.debug("mountinfo: %s", e)

    @staticmethod
    def _same(path: str, dev: int, ino: int) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return st.st_dev == dev and st.st_ino == ino

    def resolve(self, dev: int, ino: int, names: Iterable[str], pid: int | None = None) -> str | None:
        """A path for the inode, or None. ``dev`` is st_dev (user-space encoding); ``names`` outermost first, from
        the root of the file's filesystem."""
        known = self._known.get((dev, ino))
        if known is not None:
            return known
        rel = "/".join(names)
        if not rel:
            return None
        if dev not in self._mounts:
            self._load_mounts()
        candidates = []
        for fs_root, mount_point in self._mounts.get(dev, []):
            fs_root = fs_root.rstrip("/")
            path = "/" + rel
            if fs_root and not (path + "/").startswith(fs_root + "/"):
                continue
            tail = path[len(fs_root) :]
            candidates.append(os.path.normpath(mount_point.rstrip("/") + tail))
        candidates.append("/" + rel)
        if pid is not None:
            candidates += [f"/proc/{pid}/root{c}" for c in list(candidates)]
        for c in candidates:
            if self._same(c, dev, ino):
                self._known[(dev, ino)] = c
                return c
        return None


class ProcessMap:
    """One process's file mappings, sorted by start; a new mapping replaces the ranges it overlaps."""

    def __init__(self, entries: Iterable[Mapping] = ()) -> None:
        self.entries: list[Mapping] = sorted(entries, key=lambda e: e.start)
        self._starts = [e.start for e in self.entries]

    def copy(self) -> ProcessMap:
        return ProcessMap(self.entries)

    def add(self, m: Mapping) -> None:
        kept = [e for e in self.entries if e.end <= m.start or e.start >= m.end]
        self.entries = sorted([*kept, m], key=lambda e: e.start)
        self._starts = [e.start for e in self.entries]

    def find(self, addr: int) -> Mapping | None:
        """The mapping that holds ``addr``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self.entries[i].end:
            return self.entries[i]
        return None

    def modules(self) -> list[str]:
        """Distinct mapped file paths, in address order."""
        return list(dict.fromkeys(e.path for e in self.entries))


class MapCache:
    """Every traced process's map: read once at attach, then kept current by fork/exec/mapping events."""

    def __init__(self, resolver: FileResolver | None = None) -> None:
        self.resolver = resolver or FileResolver()
        self._maps: dict[int, ProcessMap] = {}
        self._stale: set[int] = set()  # mapping events were lost since these were read
        self._refreshed: dict[int, float] = {}
        self._lost_seen = 0  # the LOST_MAPS count already acted on
        self.proc_reads = 0  # /proc/PID/maps reads, for the recorder's own accounting
        # pid -> its image: processes forked from one another without an exec share one (see image_of)
        self._image: dict[int, int] = {}
        self._images = itertools.count(1)

    def attach(self, pid: int) -> ProcessMap | None:
        """Read the map of a process that runs already (at attach, or a child the events did not announce)."""
        self._refreshed[pid] = time.monotonic()  # a failed read counts too: no retry storm for a gone process
        try:
            entries = read_maps(pid)
        except (ProcessLookupError, PermissionError):
            return self._maps.get(pid)
        self.proc_reads += 1
        self.image_of(pid)  # a process read from /proc has an image of its own, unless it had one already
        for e in entries:
            if e.host_path:
                self.resolver.remember(e.dev, e.ino, e.host_path)
        self._maps[pid] = ProcessMap(entries)
        return self._maps[pid]

    def get(self, pid: int) -> ProcessMap | None:
        return self._maps.get(pid)

    def on_fork(self, parent: int, child: int) -> None:
        """A forked child has its parent's mappings, under the ones it made itself (the mapping events are
        drained before the lifecycle ones, so a child's own mmap may already be here)."""
        m = self._maps.get(parent)
        if m is None:
            return
        self._image[child] = self.image_of(parent)
        merged = m.copy()
        for e in self._maps[child].entries if child in self._maps else ():
            merged.add(e)
        self._maps[child] = merged

    def on_exec(self, pid: int) -> None:
        """A new image: the old mappings are gone (the exec's map event adds the executable)."""
        self._maps[pid] = ProcessMap()
        self._image[pid] = next(self._images)

    def image_of(self, pid: int) -> int:
        """The address-space image ``pid`` runs: a number shared by the processes forked from one another without
        an exec since (a DataLoader's workers and their trainer), which hold the same code at the same addresses.
        A process read from /proc at attach, or not seen before, gets its own. Never reused, unlike a pid."""
        got = self._image.get(pid)
        if got is None:
            got = self._image[pid] = next(self._images)
        return got

    def add(self, pid: int, m: Mapping) -> None:
        self._maps.setdefault(pid, ProcessMap()).add(m)

    def mark_stale(self, pids: Iterable[int] | None = None) -> None:
        """Mapping events were lost: the next miss of these processes (of every known one, by default) may re-read
        /proc."""
        self._stale.update(self._maps if pids is None else pids)

    def note_lost(self, lost_total: int) -> bool:
        """Take the maps ring's running count of lost events (LOST_MAPS); when it grew, mark every process stale,
        since a lost event does not say whose mapping it was. Returns whether it grew."""
        grew = lost_total > self._lost_seen
        if grew:
            self._lost_seen = lost_total
            self.mark_stale()
        return grew

    def find(self, pid: int, addr: int) -> Mapping | None:
        """The mapping holding ``addr`` in ``pid``, or None (an anonymous address, or an unknown process)."""
        m = self._maps.get(pid)
        hit = m.find(addr) if m is not None else None
        if hit is None and (m is None or pid in self._stale):
            if time.monotonic() - self._refreshed.get(pid, 0.0) >= REFRESH_S:
                self._stale.discard(pid)
                m = self.attach(pid)
                hit = m.find(addr) if m is not None else None
        return hit

    def forget(self, pid: int) -> None:
        self._maps.pop(pid, None)
        self._image.pop(pid, None)
        self._stale.discard(pid)
        self._refreshed.pop(pid, None)
