"""recorder/procmaps.py: the one /proc/PID/maps parser, the event-fed process maps, and naming a file by inode."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest

from tracer.recorder import procmaps
from tracer.recorder.procmaps import FileResolver, MapCache, Mapping, ProcessMap, kernel_dev, parse_maps, read_maps

MAPS_TEXT = """\
55d0c0a00000-55d0c0a6f000 r--p 00000000 fe:01 1234    /usr/bin/python3.11
55d0c0a6f000-55d0c0d2e000 r-xp 0006f000 fe:01 1234    /usr/bin/python3.11
55d0c1000000-55d0c1100000 rw-p 00000000 00:00 0       [heap]
7f0000000000-7f0000001000 r-xp 00001000 fe:01 99      /opt/lib/libfoo.so (deleted)
7f0000002000-7f0000003000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0       [stack]
"""


def test_parse_keeps_file_mappings_with_their_inode_and_root() -> None:
    maps = ProcessMap(parse_maps(MAPS_TEXT, root="/proc/42/root"))
    assert [e.path for e in maps.entries] == ["/usr/bin/python3.11", "/usr/bin/python3.11", "/opt/lib/libfoo.so"]
    text = maps.find(0x55D0C0A70010)
    assert text is not None and text.offset == 0x6F000 and text.perms == "r-xp"
    assert text.host_path == "/proc/42/root/usr/bin/python3.11"
    assert (text.dev, text.ino) == (os.makedev(0xFE, 0x01), 1234)
    assert maps.find(0x55D0C1000010) is None  # [heap]
    assert maps.find(0x7F0000002000) is None  # anonymous
    assert maps.find(0x7F0000001000) is None  # one past the end
    assert maps.modules() == ["/usr/bin/python3.11", "/opt/lib/libfoo.so"]


def test_read_maps_of_self_finds_libc_code() -> None:
    addr = ctypes.cast(ctypes.CDLL(None).labs, ctypes.c_void_p).value
    assert addr is not None
    m = ProcessMap(read_maps(os.getpid())).find(addr)
    assert m is not None and "libc" in os.path.basename(m.path) and "x" in m.perms
    st = os.stat(m.host_path)
    assert (st.st_dev, st.st_ino) == (m.dev, m.ino)


def test_read_maps_of_a_missing_pid_raises() -> None:
    with pytest.raises(ProcessLookupError):
        read_maps(2**22 + 1)


def test_a_new_mapping_replaces_the_ranges_it_overlaps() -> None:
    pm = ProcessMap([Mapping(0x1000, 0x3000, 0, "/a", "/a"), Mapping(0x3000, 0x4000, 0, "/b", "/b")])
    pm.add(Mapping(0x2000, 0x3800, 0x10, "/c", "/c"))
    assert [(e.start, e.path) for e in pm.entries] == [(0x2000, "/c")]
    assert pm.find(0x1500) is None and pm.find(0x2100).path == "/c"  # type: ignore[union-attr]


def test_cache_keeps_an_exited_process_and_gives_a_fork_its_parent_map() -> None:
    # GIVEN a process known only from mapping events (no /proc entry: the pid does not exist)
    gone = 2**22 + 7
    cache = MapCache()
    lib = Mapping(0x7F00_0000_0000, 0x7F00_0001_0000, 0x1000, "/lib/x.so", "/lib/x.so")
    cache.add(gone, lib)
    # WHEN a child forks, then maps a file of its own; and the parent execs
    cache.on_fork(gone, gone + 1)
    own = Mapping(0x5000_0000, 0x5000_1000, 0, "/bin/y", "/bin/y")
    cache.add(gone + 1, own)
    # THEN both resolve without /proc, the child sees both mappings, and an exec forgets the old image
    assert cache.find(gone, 0x7F00_0000_0010) == lib
    assert cache.find(gone + 1, 0x7F00_0000_0010) == lib and cache.find(gone + 1, 0x5000_0010) == own
    cache.on_exec(gone)
    assert cache.find(gone, 0x7F00_0000_0010) is None
    assert cache.proc_reads == 0


def test_fork_event_after_the_childs_own_mappings_keeps_both() -> None:
    # the maps ring is drained before the lifecycle ring: a child's mmap can be seen before its fork
    cache = MapCache()
    parent, child = 2**22 + 11, 2**22 + 12
    cache.add(parent, Mapping(0x1000, 0x2000, 0, "/p", "/p"))
    cache.add(child, Mapping(0x9000, 0xA000, 0, "/c", "/c"))
    cache.on_fork(parent, child)
    assert cache.find(child, 0x1000) is not None and cache.find(child, 0x9000) is not None


def test_resolver_names_a_file_from_its_dentry_path_and_inode() -> None:
    # GIVEN this interpreter's file: its (dev, ino) and its dentry names below the filesystem root
    path = os.path.realpath(sys.executable)
    st = os.stat(path)
    names = path.strip("/").split("/")
    r = FileResolver()
    # THEN it is found and checked by inode; a wrong inode is never accepted
    assert r.resolve(st.st_dev, st.st_ino, names) == path
    assert FileResolver().resolve(st.st_dev, st.st_ino + 1, names) is None


def test_kernel_dev_converts_super_block_dev() -> None:
    assert kernel_dev((254 << 20) | 1) == os.makedev(254, 1)


def test_lost_mapping_events_make_the_next_miss_re_read_proc(tmp_path, monkeypatch) -> None:
    # GIVEN this process's map as read at attach, then a file mapped after it whose mapping event was lost
    monkeypatch.setattr(procmaps, "REFRESH_S", 0.0)  # the once-a-second limit is not under test here
    cache = MapCache()
    pid = os.getpid()
    assert cache.attach(pid) is not None and cache.proc_reads == 1
    path = tmp_path / "late.bin"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    with path.open("r+b") as f, mmap.mmap(f.fileno(), mmap.PAGESIZE) as mm:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # the view is dropped at once: mm can close
        # WHEN it is looked up before any loss is reported  THEN a miss is an anonymous address, /proc is not read
        assert cache.find(pid, addr) is None and cache.proc_reads == 1
        # WHEN the maps ring reports lost events (a running count: only growth counts)
        assert cache.note_lost(3) and not cache.note_lost(3)
        # THEN the next miss re-reads /proc/PID/maps once and finds the file
        hit = cache.find(pid, addr)
        assert hit is not None and hit.path == str(path) and cache.proc_reads == 2
        # and the process is fresh again: a miss elsewhere does not re-read
        assert cache.find(pid, 8) is None and cache.proc_reads == 2
