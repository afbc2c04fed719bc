"""recorder/elfcache.py: the parsed ELF files kept between recordings. An entry read back must answer every lookup
as the parse did, without parsing; a changed, corrupt or unsafe entry must be parsed again, never trusted."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.support.need import need, need_root
from tracer.recorder import elfcache
from tracer.recorder.symbolize import ElfCache, ElfSymbols
from tracer.recorder.unwind import UnwindTables

REPO = Path(__file__).resolve().parents[1]
LIB = REPO / "fixtures" / "build" / "libcuda.so.1"  # built with -g: symbols, .eh_frame and a .debug_line table


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    need(LIB.exists(), "needs fixtures/build (make -C fixtures)")
    out = tmp_path / "lib" / LIB.name
    out.parent.mkdir()
    shutil.copy2(LIB, out)  # a copy of our own: the tests change it
    return out


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    need_root("the ELF cache trusts only root's own entries")
    d = tmp_path / "elf"
    d.mkdir(mode=0o700)
    return d


def _probe_addrs(elf: ElfSymbols) -> list[int]:
    """Addresses over the whole text: symbol starts, their insides and the gaps between them."""
    elf._ensure_symbols()
    starts = [int(s) for s in elf._starts]
    return sorted({a + d for a in starts for d in (0, 1, 7, 40)} | {starts[0] - 1, starts[-1] + 10_000})


def _parse_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("parsed the ELF file although its entry was cached")

    monkeypatch.setattr(ElfSymbols, "__init__", boom)


def test_a_cached_file_answers_as_the_parse_did_without_parsing(
    lib: Path, disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a recording that looked up symbols and lines of a library, and saved its cache
    first = ElfCache(disk=disk)
    parsed = first.get(str(lib))
    assert parsed is not None
    addrs = _probe_addrs(parsed)
    want = [(parsed.lookup(a), parsed.line_for(a), parsed.offset_to_vaddr(a)) for a in addrs]
    assert any(w[1] for w in want), "the fixture library should have line info"
    assert first.save() == 1
    # WHEN the next recording asks for the same file, with parsing made impossible
    _parse_forbidden(monkeypatch)
    again = ElfCache(disk=disk).get(str(lib))
    # THEN it is read from the cache and answers every address the same
    assert again is not None and again is not parsed
    assert [(again.lookup(a), again.line_for(a), again.offset_to_vaddr(a)) for a in addrs] == want
    assert (again.build_id, again.text, again.loads) == (parsed.build_id, parsed.text, parsed.loads)


def test_an_entry_grows_with_what_a_later_recording_parsed(lib: Path, disk: Path) -> None:
    # GIVEN an entry saved before any symbol was looked up (headers only)
    c = ElfCache(disk=disk)
    c.get(str(lib))
    assert c.save() == 1
    c2 = ElfCache(disk=disk)
    elf = c2.get(str(lib))
    assert elf is not None and elf.cached_state() == (False, False)
    assert c2.save() == 0  # nothing new: not written again
    # WHEN a later recording looks symbols and lines up THEN its save writes them, and a third reads them
    elf.lookup(int(elf.text[1]) + 16)  # type: ignore[index]
    elf.line_for(int(elf.text[1]) + 16)  # type: ignore[index]
    assert c2.save() == 1
    third = ElfCache(disk=disk).get(str(lib))
    assert third is not None and third.cached_state() == (True, True)


def test_names_read_from_an_entry_are_written_back_whole_when_lines_are_added(lib: Path, disk: Path) -> None:
    # GIVEN an entry with the library's symbols and no line table, read back by a later recording
    c = ElfCache(disk=disk)
    parsed = c.get(str(lib))
    assert parsed is not None
    addrs = _probe_addrs(parsed)
    want = [parsed.lookup(a) for a in addrs]
    assert c.save() == 1
    elf = ElfCache(disk=disk).get(str(lib))
    assert elf is not None and elf.cached_state() == (True, False)
    # WHEN that recording decodes the line table too and saves the entry again (names never decoded one by one)
    c2 = ElfCache(disk=disk)
    elf = c2.get(str(lib))
    assert elf is not None
    elf.line_for(int(elf.text[1]) + 16)  # type: ignore[index]
    assert c2.save() == 1
    # THEN the next reads every symbol as the parse named it
    third = ElfCache(disk=disk).get(str(lib))
    assert third is not None and third.cached_state() == (True, True)
    assert [third.lookup(a) for a in addrs] == want


def test_eh_frame_index_read_back_gives_the_same_rows(lib: Path, disk: Path) -> None:
    ut = UnwindTables(ElfCache(disk=disk))
    table = ut.table(str(lib))
    assert table is not None and ut.save() == 1
    cached = UnwindTables(ElfCache(disk=disk)).table(str(lib))
    assert cached is not None and cached is not table
    assert np.array_equal(cached._pcs, table._pcs) and np.array_equal(cached._offsets, table._offsets)
    for pc in table._pcs.tolist():
        a, b = table.row_for(pc + 1), cached.row_for(pc + 1)
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert (a.cfa_reg, a.cfa_off, a.cfa_expr) == (b.cfa_reg, b.cfa_off, b.cfa_expr)


def test_a_changed_file_misses_its_old_entry(lib: Path, disk: Path) -> None:
    c = ElfCache(disk=disk)
    c.get(str(lib))
    c.save()
    before = elfcache.file_key(str(lib), "sym")
    with open(lib, "ab") as f:  # rewritten in place: same inode, new size and ctime
        f.write(b"\0")
    assert elfcache.file_key(str(lib), "sym") != before
    assert elfcache.load(disk, elfcache.file_key(str(lib), "sym")) is None


@pytest.mark.parametrize("damage", ["garbage", "wrong_shape", "other_owner", "symlink"])
def test_a_bad_entry_is_parsed_again_not_trusted(lib: Path, disk: Path, damage: str) -> None:
    c = ElfCache(disk=disk)
    want = c.get(str(lib))
    assert want is not None
    want._ensure_symbols()
    c.save()
    key = elfcache.file_key(str(lib), "sym")
    entry = disk / f"{key}.npz"
    if damage == "garbage":
        entry.write_bytes(b"PK\x03\x04 not a zip")
    elif damage == "wrong_shape":
        a = elfcache.load(disk, key)
        assert a is not None
        a["starts"] = a["starts"][:-1]  # one symbol start fewer than names
        assert elfcache.store(disk, key, a)
    elif damage == "other_owner":
        os.chown(entry, 1000, 1000)
    else:
        real = disk.parent / "elsewhere.npz"
        entry.rename(real)
        entry.symlink_to(real)
    got = ElfCache(disk=disk).get(str(lib))
    assert got is not None
    assert got.cached_state() == (False, False)  # parsed again from the file: its symbols not read yet
    a = int(want._starts[0]) + 1
    assert got.lookup(a) == want.lookup(a)


def test_directory_open_to_others_is_not_used(lib: Path, disk: Path) -> None:
    os.chmod(disk, 0o777)
    c = ElfCache(disk=disk)
    c.get(str(lib))
    assert c.save() == 0
    assert not list(disk.iterdir())


def test_env_chooses_or_disables_the_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    need_root("the cache is root's only")
    monkeypatch.delenv(elfcache.ENV_DIR, raising=False)
    assert elfcache.cache_dir() == elfcache.DEFAULT_DIR
    monkeypatch.setenv(elfcache.ENV_DIR, str(tmp_path))
    assert elfcache.cache_dir() == tmp_path
    monkeypatch.setenv(elfcache.ENV_DIR, "off")
    assert elfcache.cache_dir() is None


def test_strings_round_trip_and_bad_offsets_raise() -> None:
    items = ["", "labs", "ns::f<int>(int)", "naïve", ""]
    blob, ends = elfcache.pack_strings(items)
    assert elfcache.unpack_strings(blob, ends) == items
    assert elfcache.unpack_strings(*elfcache.pack_strings([])) == []
    with pytest.raises(ValueError):
        elfcache.unpack_strings(blob, ends + 1)
    with pytest.raises(ValueError):
        elfcache.unpack_strings(blob, ends[::-1].copy())


def test_packed_strings_decode_each_name_as_asked_and_write_back_their_own_arrays() -> None:
    items = ["", "labs", "ns::f<int>(int)", "naïve", "", "_Z3fooi"]
    blob, ends = elfcache.pack_strings(items)
    names = elfcache.PackedStrings(blob, ends)
    assert len(names) == len(items)
    assert [names[i] for i in range(len(items))] == items
    assert (names[-1], names[-6], names[1:4], list(names)) == (items[-1], items[0], items[1:4], items)
    with pytest.raises(IndexError):
        names[len(items)]
    with pytest.raises(IndexError):
        names[-len(items) - 1]
    got = elfcache.pack_names(names)
    assert got[0] is blob and got[1] is ends
    assert [a.tolist() for a in elfcache.pack_names(items)] == [blob.tolist(), ends.tolist()]
    assert len(elfcache.PackedStrings(*elfcache.pack_strings([]))) == 0
    with pytest.raises(ValueError):
        elfcache.PackedStrings(blob, ends + 1)
    with pytest.raises(ValueError):
        elfcache.PackedStrings(blob, ends[::-1].copy())


def test_an_entry_too_large_is_not_written(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elfcache, "MAX_ENTRY_BYTES", 1000)
    assert not elfcache.store(disk, "sym-x", {"a": np.zeros(200, dtype=np.int64)})
    assert elfcache.store(disk, "sym-y", {"a": np.zeros(100, dtype=np.int64)})
    assert [p.name for p in disk.iterdir()] == ["sym-y.npz"]
